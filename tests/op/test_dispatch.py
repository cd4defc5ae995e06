"""The op's Dispatch (``arnorm/op/_dispatch.py``): the one object a call reads, replaced whole."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import arnorm
from arnorm.op import _call
from arnorm.op._faults import Poisoned, poison

H = 16


def make() -> arnorm.AllReduceNorm:
    return arnorm.AllReduceNorm(
        arnorm.LOCAL, hidden_size=H, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4,
        backend="reference",
    )  # fmt: skip


def test_the_call_reads_nothing_of_the_op_but_its_dispatch():
    """In ``op/_call.py``, ``self`` (the op) is read for ``_dispatch`` only; it is otherwise handed on
    whole (to the custom op and to call_failed), never looked into."""
    tree = ast.parse(pathlib.Path(_call.__file__).read_text())
    read = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "self"
    }
    assert read == {"_dispatch"}


def test_poisoning_replaces_the_dispatch_whole():
    with make() as op:
        x, r, w = torch.randn(2, H), torch.randn(2, H), torch.randn(H)
        op(x.clone(), r, w)
        before = op._dispatch
        poison(op, "peers: rank 1 failed")
        after = op._dispatch
        assert after is not before and before.poisoned is None and before.table[2] is not None
        assert after.poisoned == "peers: rank 1 failed" and after.accept is None
        assert isinstance(after.table[2], Poisoned) and set(after.fast_table) == {None}
        with pytest.raises(arnorm.PeerError, match="rank 1 failed"):
            op(x.clone(), r, w)
        with pytest.raises(arnorm.PeerError, match="rank 1 failed"):
            op.backend_for(2)


def test_close_replaces_the_dispatch_with_one_serving_nothing():
    op = make()
    before = op._dispatch
    op.close()
    assert op._dispatch is not before and op._dispatch.closed and set(op._dispatch.table) == {None}
    with pytest.raises(arnorm.InvalidInputError, match="op: closed"):
        op(torch.randn(2, H), torch.randn(2, H), torch.randn(H))
    poison(op, "too late")  # a closed op stays closed
    assert op._dispatch.poisoned is None
