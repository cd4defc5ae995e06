"""``Verdict`` and ``Explanation``: why each backend was or was not chosen, as data and as a table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from arnorm._problem import Problem

__all__ = ["STATUSES", "Explanation", "Verdict"]

#: Every verdict status, and what it means. Code reads ``Verdict.status``, never the reasons' text.
STATUSES: Mapping[str, str] = MappingProxyType(
    {
        "selected": "built and used for every token count it serves",
        "fallback": "built to serve the token counts the backends before it cannot",
        "eligible": "passed every check; not built because an earlier backend serves everything",
        "unprobed": "not probed: an earlier backend serves every token count",
        "incompatible": "its capabilities or its probe rule this problem out on some rank",
        "disabled": "removed from auto mode by ARNORM_DISABLE / Config.disable",
        "not_installed": "its extra is not installed",
        "outdated": "its dependency is installed but older than it accepts",
        "unknown": "no backend of that name is registered",
        "broken": "its plugin raised, hung or broke the protocol",
        "setup_failed": "passed every check but failed to build on some rank",
    }
)
#: Statuses of backends an op runs or could run.
USABLE = frozenset({"selected", "fallback", "eligible"})


@dataclass(frozen=True)
class Verdict:
    """One backend's outcome for one problem.

    ``status`` is one of :data:`STATUSES`; ``reasons`` are in the grammar
    ``"<aspect>: <found> (needs <required>)"``; a reason that holds on some ranks only is prefixed
    ``"rank <r>: "``.
    """

    backend: str
    status: str
    reasons: tuple[str, ...] = ()
    priority: int | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            msg = f"status: {self.status!r} (needs one of {', '.join(STATUSES)})"
            raise ValueError(msg)

    @property
    def is_usable(self) -> bool:
        """Selected, fallback or eligible: the backend can serve the problem on every rank."""
        return self.status in USABLE


@dataclass(frozen=True)
class Explanation:
    """The whole selection: the problem, where the preference came from, and every verdict.

    ``chain`` lists the backends an op calls, first match per token count wins; ``num_tokens``
    and ``token_backend`` are set when the explanation was asked for one token count, with
    ``token_reasons`` naming why earlier backends in the chain cannot serve it. ``settings`` holds
    the backend settings in force (``{backend: {field: value}}``); ``closed`` is set by an op
    that was closed.
    """

    problem: Problem
    source: str
    verdicts: tuple[Verdict, ...]
    chain: tuple[str, ...] = ()
    num_tokens: int | None = None
    token_backend: str | None = None
    token_reasons: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())
    note: str = ""
    settings: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    closed: bool = False

    @property
    def backend(self) -> str | None:
        """The selected backend (the first of the chain), or ``None`` when nothing is usable."""
        return self.chain[0] if self.chain else None

    def verdict(self, backend: str) -> Verdict | None:
        """The verdict of ``backend``, or ``None`` when it was not considered."""
        return next((v for v in self.verdicts if v.backend == backend), None)

    def rejections(self) -> dict[str, tuple[str, ...]]:
        """Backends that cannot serve the problem, and their reasons."""
        return {v.backend: v.reasons for v in self.verdicts if not v.is_usable and v.status != "unprobed"}

    def __str__(self) -> str:
        state = "  [closed]" if self.closed else ""
        head = f"arnorm: {self.problem.short()}  (choice: {self.source}){state}"
        rows = [("backend", "priority", "verdict", "reasons")]
        for v in self.verdicts:
            prio = "" if v.priority is None else str(v.priority)
            reasons = list(v.reasons) or ["-"]
            rows.append((v.backend, prio, v.status, reasons[0]))
            rows.extend(("", "", "", r) for r in reasons[1:])
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [head]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
        for name, values in self.settings:
            if values:
                lines.append(f"settings of {name}: " + ", ".join(f"{k}={v!r}" for k, v in values))
        if self.num_tokens is not None:
            served = self.token_backend or "nothing"
            lines.append(f"tokens={self.num_tokens}: {served}")
            for name, skipped in self.token_reasons:
                lines.extend(f"  {name} skipped: {r}" for r in skipped)
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)
