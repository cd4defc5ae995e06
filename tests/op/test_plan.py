"""The call's plan and state (``arnorm/op/_plan.py``): a frozen plan replaced whole, one state that only
the call changes, a straight path through ``arnorm/op``, and no stack walk anywhere."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

import pytest
import torch

import arnorm
from arnorm.op import _call
from arnorm.op._faults import Poisoned, poison
from arnorm.op._plan import CallPlan, CallState

H = 16
REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("arnorm", "arnorm_triton", "arnorm_flashinfer", "arnorm_aiter")


def make(**kw) -> arnorm.AllReduceNorm:
    base = dict(
        hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4, backend="reference"
    )
    base.update(kw)
    return arnorm.AllReduceNorm(arnorm.LOCAL, **base)


def _sources() -> list[pathlib.Path]:
    return [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]


def test_the_plan_is_frozen_and_fully_typed():
    """No field of the plan or the state is typed ``Any``; the plan's tables are tuples, and
    assigning to a plan raises."""
    for cls in (CallPlan, CallState):
        loose = [f.name for f in dataclasses.fields(cls) if "Any" in str(f.type)]
        assert loose == [], f"{cls.__name__}: fields typed Any: {loose}"
    with make() as op:
        plan = op._plan
        assert type(plan.table) is type(plan.into_table) is type(plan.fast_table) is tuple
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.closed = True  # type: ignore[misc]


def test_the_call_reads_nothing_of_the_op_but_its_plan_and_state():
    """In ``op/_call.py``, the op is read for ``_plan`` and ``_state`` only; it is otherwise handed on
    whole (to the custom op and to call_failed), never looked into."""
    tree = ast.parse(pathlib.Path(_call.__file__).read_text())
    read = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") in ("self", "op")
    }
    assert read == {"_plan", "_state"}


def test_only_the_call_module_changes_the_call_state():
    """Outside ``op/_call.py``, an op's ``_state`` is assigned once (the op builds it) and otherwise
    only read: no field of it assigned, deleted, indexed into or called a method on."""
    wrong = []
    for path in _sources():
        rel = path.relative_to(REPO).as_posix()
        if rel == "arnorm/op/_call.py":
            continue
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr == "_state"):
                continue
            up = parents[node]
            if (
                rel == "arnorm/op/_op.py"
                and isinstance(up, ast.Assign | ast.AnnAssign)
                and node is not up.value
            ):
                continue  # the construction: self._state = ...
            above = parents.get(up)
            read = isinstance(up, ast.Attribute) and isinstance(up.ctx, ast.Load)
            if read and not isinstance(above, ast.Subscript | ast.Attribute | ast.Call):
                continue  # op._state.owner: a field read
            wrong.append(f"{rel}:{node.lineno}: {ast.unparse(above or up)}")
    assert wrong == []


def test_nothing_walks_the_stack():
    """docs/architecture.md: nothing finds the op, or anything else, by walking the stack."""
    walks = ("sys._getframe", "inspect.currentframe", "inspect.stack", "inspect.getouterframes",
             "traceback.walk_stack", "traceback.extract_stack", "sys._current_frames", ".f_back")  # fmt: skip
    found = [f"{path.relative_to(REPO)}: {w}" for path in _sources() for w in walks if w in path.read_text()]
    assert found == []


def test_poisoning_replaces_the_plan_whole():
    with make() as op:
        x, r, w = torch.randn(2, H), torch.randn(2, H), torch.randn(H)
        op(x.clone(), r, w)
        before = op._plan
        poison(op, "peers: rank 1 failed")
        after = op._plan
        assert after is not before and before.poisoned is None and before.table[2] is not None
        assert after.poisoned == "peers: rank 1 failed"
        assert isinstance(after.table[2], Poisoned) and set(after.fast_table) == {None}
        with pytest.raises(arnorm.PeerError, match="rank 1 failed"):
            op(x.clone(), r, w)
        with pytest.raises(arnorm.PeerError, match="rank 1 failed"):
            op.backend_for(2)


def test_close_replaces_the_plan_with_one_serving_nothing():
    op = make()
    before = op._plan
    op.close()
    assert op._plan is not before and op._plan.closed and set(op._plan.table) == {None}
    with pytest.raises(arnorm.InvalidInputError, match="op: closed"):
        op(torch.randn(2, H), torch.randn(2, H), torch.randn(H))
    poison(op, "too late")  # a closed op stays closed
    assert op._plan.poisoned is None


def _modules_entered(fn, args: tuple) -> list[str]:
    """The modules of ``arnorm/op`` whose functions ``fn()`` enters with one of ``args`` (or one of
    ``out``'s tensors) among their arguments, in order, repeats collapsed."""
    ids = {id(a) for a in args if a is not None}
    for a in args:
        if isinstance(a, arnorm.Output):
            ids |= {id(t) for t in (a.normed, a.residual) if t is not None}
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if not name.startswith("arnorm.op.") or (seen and seen[-1] == name):
                return
            if any(id(v) in ids for v in frame.f_locals.values()):
                seen.append(name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("backend", ["reference", "fastpath"])
def test_a_call_goes_through_at_most_three_modules_and_returns_to_none(fastpath, backend, inplace):
    """The call reads the plan, checks, dispatches and hands back, each once: its arguments pass
    through at most three modules of ``arnorm/op`` (the call first) and never come back to one they
    left. Every kind of valid call: first and later calls, with and without ``out=``, a backend that
    writes into ``out`` (fast path) and one whose outputs are copied into it."""
    with make(backend=backend, inplace=inplace) as op:
        x, r, w = torch.randn(3, H), torch.randn(3, H), torch.randn(H)
        out = op.empty_output(3)
        for kwargs in ({}, {}, {"out": out}, {"out": out}, {"out": op.empty_output(3)}):
            hs = x.clone()
            args = (hs, r, w, kwargs.get("out"))
            entered = _modules_entered(lambda hs=hs, kw=kwargs: op(hs, r, w, **kw), args)
            assert entered[0] == "arnorm.op._call", entered
            assert len(entered) <= 3 and len(set(entered)) == len(entered), (kwargs, entered)
