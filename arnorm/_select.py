"""Selection: static check, probe, cross-rank agreement, setup, in that order.

Every decision that could differ between ranks (installed plugins, environment variables,
probe results, setup failures) is gathered over the CPU group before anyone acts on it, so every
rank builds the same backends or raises the same error: a rank-divergent choice would deadlock
the first collective.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from arnorm._capabilities import check_capabilities, join_or
from arnorm._config import Config, parse_names
from arnorm._discovery import Registry
from arnorm._errors import (
    ArnormError,
    BackendBrokenError,
    BackendNotInstalledError,
    BackendSetupError,
    InvalidInputError,
    NoEligibleBackendError,
)
from arnorm._explain import Explanation, Verdict
from arnorm._problem import Problem
from arnorm._spec import priority_order

if TYPE_CHECKING:
    from arnorm._comm import Comm
    from arnorm._protocol import FusedAllReduceNorm

__all__ = ["Preference", "check_locally", "explain_locally", "select"]

logger = logging.getLogger("arnorm")


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
            names = parse_names(backend)
            if not names:
                msg = f"backend: {backend!r} (needs a backend name, a list of names, or None for auto)"
                raise InvalidInputError(msg)
            return cls(names, "argument", disabled)
        if config.backend:
            from_env = parse_names(os.environ.get("ARNORM_BACKEND", "")) == tuple(config.backend)
            return cls(tuple(config.backend), "ARNORM_BACKEND" if from_env else "Config.backend", disabled)
        return cls(None, "auto", disabled)

    @property
    def is_strict(self) -> bool:
        return self.names is not None


def _probe(info_spec: Any, problem: Problem) -> tuple[str, ...]:
    try:
        cls = info_spec.load()
    except Exception as exc:  # the backend module may raise anything on import
        return (f"import: {type(exc).__name__}: {exc} (needs a working install of {info_spec.name})",)
    try:
        return tuple(str(r) for r in cls.probe(problem))
    except Exception as exc:  # a probe must return reasons; a raising one is itself a reason
        return (f"probe: raised {type(exc).__name__}: {exc} (needs a probe that returns reasons)",)


def check_locally(problem: Problem, registry: Registry, pref: Preference) -> dict[str, Any]:
    """This rank's verdicts: ``{name: (priority, reasons)}`` for every backend in play."""
    known = [i.name for i in registry.infos() if i.spec is not None]
    names = list(pref.names) if pref.names is not None else [i.name for i in registry.infos()]
    out: dict[str, Any] = {}
    for name in names:
        info = registry.get(name)
        if info is None:
            out[name] = (None, (f"registry: no backend named {name!r} (needs one of {join_or(known)})",))
            continue
        if info.spec is None or not info.is_available:
            out[name] = (info.priority, (info.reason,))
            continue
        if not pref.is_strict and name in pref.disabled:
            out[name] = (
                info.priority,
                ("disabled: listed in ARNORM_DISABLE / Config.disable (needs it unlisted)",),
            )
            continue
        reasons = check_capabilities(info.spec.capabilities, problem)
        out[name] = (info.priority, reasons or _probe(info.spec, problem))
    return out


def _merge(per_rank: list[dict[str, Any]], pref: Preference) -> list[Verdict]:
    """One verdict per backend; reasons that hold on some ranks only carry ``rank <r>:``."""
    names: list[str] = []
    for local in per_rank:
        names.extend(n for n in local if n not in names)
    verdicts = []
    for name in names:
        entries = [local.get(name) for local in per_rank]
        priority = next((e[0] for e in entries if e is not None and e[0] is not None), None)
        per = [
            e[1]
            if e is not None
            else ("registry: not registered on this rank (needs the same plugins on every rank)",)
            for e in entries
        ]
        if all(p == per[0] for p in per):
            reasons = tuple(per[0])
        else:
            reasons = tuple(f"rank {r}: {reason}" for r, rs in enumerate(per) for reason in rs)
        verdicts.append(Verdict(name, "rejected" if reasons else "eligible", reasons, priority))
    if pref.names is None:
        verdicts.sort(key=lambda v: priority_order(v.priority, v.backend))
    return verdicts


def explain_locally(problem: Problem, registry: Registry, pref: Preference) -> Explanation:
    """What this process alone would choose (no collective, no setup): ``arnorm explain``."""
    verdicts = _merge([check_locally(problem, registry, pref)], pref)
    chain = next(((v.backend,) for v in verdicts if v.is_eligible), ())
    marked = tuple(
        Verdict(v.backend, "selected", (), v.priority) if (v.backend,) == chain else v for v in verdicts
    )
    note = "(local check only: workspace setup and cross-rank agreement happen when an op is built)"
    return Explanation(problem, pref.source, marked, chain, note=note)


def _raise_none_eligible(
    problem: Problem, pref: Preference, verdicts: list[Verdict], setup_failed: bool
) -> None:
    expl = Explanation(problem, pref.source, tuple(verdicts))
    if pref.is_strict:
        names = ", ".join(repr(n) for n in pref.names or ())
        head = f"backend {names} (from {pref.source}) cannot serve {problem.short()} on every rank"
        first = verdicts[0].reasons[0] if verdicts and verdicts[0].reasons else ""
        if setup_failed:
            raise BackendSetupError(f"{head}:\n{expl}")
        if first.startswith("not installed"):
            raise BackendNotInstalledError(f"{head}: {first}\n{expl}")
        if first.startswith("plugin:"):
            raise BackendBrokenError(f"{head}: {first}\n{expl}")
        msg = f"{head}:\n{expl}\nfix: address a reason above, or name another backend (or none for auto)"
        raise NoEligibleBackendError(msg)
    msg = f"no backend can serve {problem.short()} on every rank:\n{expl}"
    raise NoEligibleBackendError(msg)


def _check_agreement(comm: Comm, problem: Problem, pref: Preference, config: Config) -> None:
    """Every rank must describe the same problem, preference and backend options.

    ``disable`` may differ (the eligibility AND absorbs it); everything else decides which
    collective runs, so a difference raises the same error on every rank.
    """
    mine: dict[str, Any] = {f: getattr(problem, f) for f in Problem.__dataclass_fields__}
    mine["backend preference"] = (pref.names, pref.source)
    mine.update({f"Config.{k}": v for k, v in config.model_dump().items() if k != "disable"})
    seen = comm.gather_objects(mine)
    differ = [k for k in mine if any(s[k] != seen[0][k] for s in seen)]
    if not differ:
        return
    detail = "; ".join(f"rank {r}: " + ", ".join(f"{k}={s[k]!r}" for k in differ) for r, s in enumerate(seen))
    msg = (
        f"ranks disagree on {', '.join(differ)} ({detail}) "
        "(needs the same arguments, ARNORM_BACKEND and Config on every rank)"
    )
    raise InvalidInputError(msg)


def select(
    problem: Problem, comm: Comm, config: Config, pref: Preference, registry: Registry
) -> tuple[Explanation, list[FusedAllReduceNorm]]:
    """Choose and build the backends of one op, identically on every rank (collective)."""
    _check_agreement(comm, problem, pref, config)
    verdicts = _merge(comm.gather_objects(check_locally(problem, registry, pref)), pref)
    eligible = [v.backend for v in verdicts if v.is_eligible]
    chain: list[FusedAllReduceNorm] = []
    names: list[str] = []
    failures: dict[str, tuple[str, ...]] = {}
    for name in eligible:
        spec = registry.get(name).spec  # type: ignore[union-attr]
        instance, error = None, ""
        try:
            instance = spec.load().create(problem, comm, config)  # type: ignore[union-attr]
        except ArnormError as exc:  # the backend's own reason, already in the grammar
            error = f"setup: {exc}"
        except Exception as exc:  # setup of a third-party backend may raise anything
            error = f"setup: {type(exc).__name__}: {exc} (needs a successful workspace build on every rank)"
        errors = comm.gather_objects(error)
        if any(errors):
            # Ranks that built it release it; the others have nothing to release.
            if instance is not None:
                instance.close()
            same = len(set(errors)) == 1
            failures[name] = tuple(e if same else f"rank {r}: {e}" for r, e in enumerate(errors) if e)[
                : 1 if same else None
            ]
            continue
        assert instance is not None
        chain.append(instance)
        names.append(name)
        if not instance.check_tokens(problem.max_tokens):
            break
    final = []
    for v in verdicts:
        if v.backend in failures:
            final.append(Verdict(v.backend, "rejected", failures[v.backend], v.priority))
        elif v.backend in names:
            final.append(
                Verdict(v.backend, "selected" if v.backend == names[0] else "fallback", (), v.priority)
            )
        else:
            final.append(v)
    if not chain:
        _raise_none_eligible(problem, pref, final, setup_failed=bool(failures))
    expl = Explanation(problem, pref.source, tuple(final), tuple(names))
    if comm.rank == 0:
        logger.info(
            "arnorm: using %s for %s (choice: %s)", " then ".join(names), problem.short(), pref.source
        )
    for v in final:
        if v.status == "rejected":
            logger.debug("arnorm: %s rejected: %s", v.backend, "; ".join(v.reasons))
    return expl, chain
