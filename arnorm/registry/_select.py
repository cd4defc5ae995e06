"""Selection: agree on the problem, check, probe, build, agree again, in that order.

Every fact that could differ between ranks (arguments, settings, installed plugins, probe results,
setup failures, which token counts a backend serves) is gathered over the CPU group before anyone
acts on it, so every rank builds the same backends or raises the same error: a rank-divergent
choice would deadlock the first collective. Backends are probed lazily, highest priority first:
once the chain serves every token count, the rest are reported ``unprobed``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from arnorm._config import DEFAULT_PROBE_TIMEOUT, BackendSettings, Config, parse_names
from arnorm._errors import (
    ArnormError,
    BackendBrokenError,
    BackendNotInstalledError,
    BackendSetupError,
    ConfigError,
    InvalidInputError,
    NoEligibleBackendError,
)
from arnorm._norm import NORM_OPTIONS
from arnorm._problem import Problem
from arnorm.registry._capabilities import check_capabilities, did_you_mean, join_or
from arnorm.registry._discovery import Registry
from arnorm.registry._explain import Explanation, Verdict
from arnorm.registry._failure import plugin_failure
from arnorm.registry._probe import load_class, probe
from arnorm.registry._spec import NAME_PATTERN, priority_order

if TYPE_CHECKING:
    from arnorm.comm._comm import Comm

__all__ = ["Plan", "Preference", "check_locally", "explain_locally", "select"]

logger = logging.getLogger("arnorm")

#: The explanation's note for a batch-invariant op: why the settings shown may not be the path run.
INVARIANT_NOTE = (
    "batch invariance (ARNORM_BATCH_INVARIANT): only backends declaring it are considered, one serves "
    "every token count, and it runs its invariant path (triton: its exact mode, unless ARNORM_TRITON_EXACT=0 "
    "fails its setup) (docs/numerics.md, section 10)"
)
#: How bad a status is when ranks disagree: the merged verdict takes the worst one.
_SEVERITY = ("unknown", "broken", "not_installed", "outdated", "incompatible", "disabled", "eligible")


@dataclass(frozen=True)
class Preference:
    """Which backends may be used and in what order. ``names=None`` is auto mode."""

    names: tuple[str, ...] | None
    source: str
    disabled: tuple[str, ...] = ()

    @classmethod
    def resolve(cls, backend: str | Sequence[str] | None, config: Config) -> Preference:
        """Precedence: the ``backend=`` argument, then ``Config`` set in code, then the environment."""
        disabled = tuple(config.disable)
        if backend is not None:
            try:
                names = parse_names(backend) if isinstance(backend, (str, list, tuple)) else ()
            except ValueError:
                names = ()
            if not names or not all(isinstance(n, str) for n in names):
                msg = f"backend: {backend!r} (needs a backend name, a list of names, or None for auto)"
                raise InvalidInputError(msg)
            _check_names("backend", backend, names, InvalidInputError)
            return cls(names, "argument", disabled)
        if config.backend:
            from_env = parse_names(os.environ.get("ARNORM_BACKEND", "")) == tuple(config.backend)
            source = "ARNORM_BACKEND" if from_env else "Config.backend"
            found = os.environ["ARNORM_BACKEND"] if from_env else config.backend
            _check_names(source, found, config.backend, ConfigError)
            return cls(tuple(config.backend), source, disabled)
        return cls(None, "auto", disabled)

    @property
    def is_strict(self) -> bool:
        return self.names is not None


def _check_names(where: str, found: object, names: Sequence[str], error: type[Exception]) -> None:
    """A preferred name that no backend could have (every registered name matches NAME_PATTERN) is
    refused up front: it is printed in the explanation's table, where a newline in it would forge
    a row."""
    for name in names:
        if not NAME_PATTERN.fullmatch(name):
            raise error(
                f"{where}: {found!r} (needs backend names, comma-separated: each a lower-case letter, "
                f"then a-z, 0-9 or _, 32 at most; {name!r} is not one)"
            )


def check_locally(
    problem: Problem,
    registry: Registry,
    pref: Preference,
    *,
    timeout: float = DEFAULT_PROBE_TIMEOUT,
    device: Any = None,
    probe_all: bool = True,
) -> dict[str, Verdict]:
    """This rank's verdict for every backend in play, in preference order (no collective).

    ``probe_all=False`` stops after the static checks: statically eligible backends come back
    ``"eligible"`` unprobed (selection probes them lazily).
    """
    known = [i.name for i in registry.infos() if i.spec is not None]
    names = list(pref.names) if pref.names is not None else [i.name for i in registry.infos()]
    out: dict[str, Verdict] = {}
    for name in names:
        info = registry.get(name)
        if info is None:
            valid = join_or(known) + did_you_mean(name, known)
            reason = f"registry: no backend named {name!r} (needs one of {valid})"
            out[name] = Verdict(name, "unknown", (reason,))
            continue
        if info.spec is None or info.status != "available":
            out[name] = Verdict(name, info.status, (info.reason,), info.priority)
            continue
        if not pref.is_strict and name in pref.disabled:
            reason = "disabled: listed in ARNORM_DISABLE / Config.disable (needs it unlisted)"
            out[name] = Verdict(name, "disabled", (reason,), info.priority)
            continue
        reasons = check_capabilities(info.spec.capabilities, problem)
        if reasons:
            out[name] = Verdict(name, "incompatible", reasons, info.priority)
        elif probe_all:
            status, why = probe(info.spec, problem, timeout, device)
            out[name] = Verdict(name, status, why, info.priority)
        else:
            out[name] = Verdict(name, "eligible", (), info.priority)
    return out


def _merge_one(name: str, per_rank: list[Verdict | None], who: Any = "rank {}".format) -> Verdict:
    """One verdict from every rank's; reasons that hold on some ranks only carry ``rank <r>:``."""
    missing = Verdict(
        name, "unknown", ("registry: not registered on this rank (needs the same plugins on every rank)",)
    )
    views = [v if v is not None else missing for v in per_rank]
    priority = next((v.priority for v in views if v.priority is not None), None)
    if all((v.status, v.reasons) == (views[0].status, views[0].reasons) for v in views):
        return Verdict(name, views[0].status, views[0].reasons, priority)
    status = min((v.status for v in views), key=lambda s: _SEVERITY.index(s) if s in _SEVERITY else 0)
    reasons = tuple(f"{who(r)}: {reason}" for r, v in enumerate(views) for reason in v.reasons)
    return Verdict(name, status, reasons, priority)


def _merge(
    per_rank: list[dict[str, Verdict]], pref: Preference, who: Any = "rank {}".format
) -> list[Verdict]:
    names: list[str] = []
    for local in per_rank:
        names.extend(n for n in local if n not in names)
    verdicts = [_merge_one(n, [local.get(n) for local in per_rank], who) for n in names]
    if pref.names is None:
        verdicts.sort(key=lambda v: priority_order(v.priority, v.backend))
    return verdicts


def explain_locally(
    problem: Problem, registry: Registry, pref: Preference, config: Config | None = None
) -> Explanation:
    """What this process alone would choose (probes, no collective, no setup): ``arnorm explain``."""
    timeout = config.probe_timeout if config is not None else DEFAULT_PROBE_TIMEOUT
    verdicts = _merge([check_locally(problem, registry, pref, timeout=timeout)], pref)
    chain = next(((v.backend,) for v in verdicts if v.status == "eligible"), ())
    marked = tuple(replace(v, status="selected") if (v.backend,) == chain else v for v in verdicts)
    note = "(local check only: workspace setup and cross-rank agreement happen when an op is built)"
    if problem.batch_invariant:
        note = f"{INVARIANT_NOTE}\n{note}"
    return Explanation(problem, pref.source, marked, chain, note=note)


def _raise_none_usable(problem: Problem, pref: Preference, expl: Explanation) -> None:
    if not pref.is_strict:
        hint = (
            "\nfix: install a backend that declares batch invariance, or leave it off "
            "(ARNORM_BATCH_INVARIANT / Config.batch_invariant)"
            if problem.batch_invariant
            else ""
        )
        raise NoEligibleBackendError(
            f"no backend can serve {problem.short()} on every rank:\n{expl}{hint}", expl
        )
    names = ", ".join(repr(n) for n in pref.names or ())
    head = f"backend {names} (from {pref.source}) cannot serve {problem.short()} on every rank"
    first = expl.verdicts[0] if expl.verdicts else None
    status = first.status if first is not None else "incompatible"
    reason = first.reasons[0] if first is not None and first.reasons else ""
    if status in ("not_installed", "outdated", "unknown"):
        raise BackendNotInstalledError(f"{head}: {reason}\n{expl}", expl)
    if status == "broken":
        raise BackendBrokenError(f"{head}: {reason}\n{expl}", expl)
    if status == "setup_failed":
        raise BackendSetupError(f"{head}: {reason}\n{expl}", expl)
    fix = "fix: address a reason above, or name another backend (or none for auto)"
    if problem.batch_invariant:
        fix += ", or leave batch invariance off (ARNORM_BATCH_INVARIANT / Config.batch_invariant)"
    raise NoEligibleBackendError(f"{head}:\n{expl}\n{fix}", expl)


# -- agreement on what every rank asked for --------------------------------------------------------


def agree(comm: Comm, facts: dict[str, Any], error: BaseException | None) -> None:
    """Gather ``facts`` and this rank's local error; raise the same error on every rank when any rank
    failed locally or the ranks disagree. ``disable`` may differ: the eligibility AND absorbs it."""
    mine = {"facts": facts, "error": None if error is None else (type(error).__name__, str(error))}
    seen = comm.gather_objects(mine)
    failed = [(r, s["error"]) for r, s in enumerate(seen) if s["error"] is not None]
    if failed:
        same = all(e == failed[0][1] for _, e in failed) and len(failed) == len(seen)
        text = failed[0][1][1] if same else "; ".join(f"{comm.who(r)}: {msg}" for r, (_, msg) in failed)
        cls = ConfigError if failed[0][1][0] == "ConfigError" else InvalidInputError
        if error is not None and same:
            raise error
        raise cls(text)
    keys: list[str] = []
    for s in seen:
        keys.extend(k for k in s["facts"] if k not in keys)
    # A key some ranks lack is a backend installed on some ranks only: its settings are compared
    # where it exists, and selection's merged verdict rules it out everywhere ("not registered on
    # this rank"), so auto mode still agrees on a choice and a strict request fails the same way.
    differ = [k for k in keys if _differ([s["facts"][k] for s in seen if k in s["facts"]])]
    if differ:
        detail = "; ".join(
            f"{comm.who(r)}: " + ", ".join(f"{k}={s['facts'][k]!r}" for k in differ if k in s["facts"])
            for r, s in enumerate(seen)
        )
        needs = "the same arguments, ARNORM_* settings and Config on every rank"
        if "tp_group" in differ or "cpu_group" in differ:
            needs += (
                "; the same group object on every rank: WORLD on one rank and a new_group of the same "
                "ranks on another are different communicators that never meet"
            )
        msg = f"ranks disagree on {', '.join(differ)} ({detail}) (needs {needs})"
        raise InvalidInputError(msg)


def _differ(values: list[Any]) -> bool:
    return any(v != values[0] for v in values)


def agreement_facts(
    problem: Problem, pref: Preference, config: Config, settings: dict[str, BackendSettings]
) -> dict[str, Any]:
    """What every rank must have identically (``Config.disable`` excepted)."""
    facts: dict[str, Any] = {f: getattr(problem, f) for f in Problem.__dataclass_fields__}
    # One fact per option, as the ranks' norms spell it: "round_before_weight=True" in a message.
    del facts["norm_options"]
    facts.update({name: name in problem.norm_options for name in NORM_OPTIONS})
    facts["backend preference"] = (pref.names, pref.source)
    facts.update(
        {f"Config.{k}": v for k, v in config.model_dump().items() if k not in ("disable", "settings")}
    )
    facts.update({f"settings of {n}": s.model_dump() for n, s in settings.items()})
    return facts


# -- building the chain ----------------------------------------------------------------------------


@dataclass
class Plan:
    """What :func:`select` returns: the explanation, the built backends, and the dispatch table."""

    explanation: Explanation
    chain: list[Any]
    #: ``table[t]`` is the index in ``chain`` serving ``t`` tokens (``-1``: none); ``table[0]`` unused.
    table: list[int]


def _served(impl: Any, max_tokens: int) -> tuple[list[bool], str]:
    """Which token counts ``impl`` serves, 1..max_tokens (index 0 unused), or an error."""
    try:
        return [False] + [not impl.check_tokens(t) for t in range(1, max_tokens + 1)], ""
    except BaseException as exc:  # plugin code
        return [], f"check_tokens: raised {plugin_failure(exc)} (needs a check_tokens that returns reasons)"


def _runs(served: list[bool]) -> tuple[tuple[int, int], ...]:
    """``[F, T, T, F, T]`` -> ``((1, 2), (4, 4))``: compact, comparable across ranks."""
    runs, start = [], None
    for t, ok in enumerate(served):
        if ok and start is None:
            start = t
        elif not ok and start is not None:
            runs.append((start, t - 1))
            start = None
    if start is not None:
        runs.append((start, len(served) - 1))
    return tuple(runs)


def _build(
    name: str,
    spec: Any,
    problem: Problem,
    comm: Comm,
    settings: BackendSettings,
    timeout: float = DEFAULT_PROBE_TIMEOUT,
) -> tuple[Any, list[bool], tuple[str, ...]]:
    """Create one backend on every rank and agree on its served token counts; ``(impl, served, failure)``."""
    instance, error = None, ""
    served: list[bool] = []
    cls, why = load_class(spec, timeout)  # loaded by the probe already: no import waits here
    try:
        if cls is None:
            error = why
        else:
            instance = cls.create(problem, comm, settings)
            if instance is None:
                error = "setup: create() returned None (needs the backend instance)"
    except ArnormError as exc:  # the backend's own reason, already in the grammar
        error = f"setup: {exc}"
    except BaseException as exc:  # setup of a third-party backend may raise anything
        error = f"setup: {plugin_failure(exc)} (needs a successful workspace build on every rank)"
    if instance is not None:
        served, error = _served(instance, problem.max_tokens)
    seen = comm.gather_objects((error, _runs(served) if not error else ()))
    errors = [e for e, _ in seen]
    failure: tuple[str, ...] = ()
    if any(errors):
        same = len(set(errors)) == 1
        failure = tuple(e if same else f"{comm.who(r)}: {e}" for r, e in enumerate(errors) if e)[
            : 1 if same else None
        ]
    elif any(runs != seen[0][1] for _, runs in seen):
        # Budgets may differ by rank (free memory): serve a count only where every rank serves it.
        served = [False] * (problem.max_tokens + 1)
        for t in range(1, problem.max_tokens + 1):
            served[t] = all(any(a <= t <= b for a, b in runs) for _, runs in seen)
        if not any(served):
            detail = "; ".join(f"{comm.who(r)}: {list(runs)}" for r, (_, runs) in enumerate(seen))
            failure = (f"tokens: no count served by every rank ({detail}) (needs a count every rank serves)",)
    if failure:
        if instance is not None:  # ranks that built it release it; close() is local
            try:
                instance.close()
            except BaseException as exc:
                plugin_failure(exc)
        return None, [], failure
    return instance, served, ()


def _partial_table(served: list[bool]) -> str:
    """Why a declaring backend that serves only some token counts is not used in batch-invariant mode."""
    runs = ", ".join(f"{a}" if a == b else f"{a} to {b}" for a, b in _runs(served))
    return (
        f"tokens: serves {runs} of 1 to {len(served) - 1} (needs every count: batch invariance "
        "serves an op's whole token-count table with one backend, whose arithmetic alone is proved "
        "invariant; raise its budget or lower max_tokens)"
    )


def select(
    problem: Problem,
    comm: Comm,
    config: Config,
    pref: Preference,
    registry: Registry,
    settings: dict[str, BackendSettings],
) -> Plan:
    """Choose and build the backends of one op, identically on every rank (collective).

    The caller has already agreed the problem, preference and settings (:func:`agree`).
    """
    static = _merge(
        comm.gather_objects(check_locally(problem, registry, pref, probe_all=False)), pref, comm.who
    )
    final: dict[str, Verdict] = {v.backend: v for v in static}
    chain: list[Any] = []
    names: list[str] = []
    table = [-1] * (problem.max_tokens + 1)
    for v in static:
        if v.status != "eligible":
            continue
        if chain and all(i >= 0 for i in table[1:]):
            served_by = f"{names[0]} serves" if len(names) == 1 else f"{' + '.join(names)} serve"
            final[v.backend] = replace(
                v, status="unprobed", reasons=(f"not probed: {served_by} every token count",)
            )
            continue
        spec = registry.get(v.backend).spec  # type: ignore[union-attr]
        assert spec is not None  # only registered, installed backends reach the probe
        local = probe(spec, problem, config.probe_timeout, comm.device)
        merged = _merge_one(
            v.backend, [Verdict(v.backend, s, r, v.priority) for s, r in comm.gather_objects(local)], comm.who
        )
        if merged.status != "eligible":
            final[v.backend] = merged
            continue
        impl, served, failure = _build(
            v.backend, spec, problem, comm, settings[v.backend], config.probe_timeout
        )
        if failure:
            final[v.backend] = Verdict(v.backend, "setup_failed", failure, v.priority)
            continue
        index = len(chain)
        if not any(served[1:]):
            impl.close()
            reason = f"tokens: none of 1 to {problem.max_tokens} (needs a workspace for some token count)"
            final[v.backend] = Verdict(v.backend, "setup_failed", (reason,), v.priority)
            continue
        if problem.batch_invariant and not all(served[1:]):
            impl.close()
            final[v.backend] = Verdict(v.backend, "setup_failed", (_partial_table(served),), v.priority)
            continue
        chain.append(impl)
        names.append(v.backend)
        for t in range(1, problem.max_tokens + 1):
            if table[t] < 0 and served[t]:
                table[t] = index
        final[v.backend] = replace(v, status="selected" if index == 0 else "fallback")
    verdicts = tuple(final[v.backend] for v in static)
    used = {n: tuple(settings[n].model_dump().items()) for n in names if n in settings}
    expl = Explanation(problem, pref.source, verdicts, tuple(names), settings=tuple(used.items()),
                       note=INVARIANT_NOTE if problem.batch_invariant else "")  # fmt: skip
    if not chain:
        _raise_none_usable(problem, pref, expl)
    if comm.rank == 0:
        logger.info(
            "arnorm: using %s for %s (choice: %s)", " then ".join(names), problem.short(), pref.source
        )
    for v in verdicts:
        if not v.is_usable:
            logger.debug("arnorm: %s %s: %s", v.backend, v.status, "; ".join(v.reasons))
    return Plan(expl, chain, table)
