"""``Verdict`` and ``Explanation``: why each backend was or was not chosen, as data and as a table."""

from __future__ import annotations

from dataclasses import dataclass, field

from arnorm._problem import Problem

__all__ = ["Explanation", "Verdict"]


@dataclass(frozen=True)
class Verdict:
    """One backend's outcome for one problem.

    ``status``: ``"selected"``, ``"fallback"`` (built to serve token counts the selected backend
    cannot), ``"eligible"`` (passed every check, not needed), ``"rejected"``; ``reasons`` in the
    grammar ``"<aspect>: <found> (needs <required>)"``; a reason that holds on some ranks only is
    prefixed ``"rank <r>: "``.
    """

    backend: str
    status: str
    reasons: tuple[str, ...] = ()
    priority: int | None = None

    @property
    def is_eligible(self) -> bool:
        return self.status != "rejected"


@dataclass(frozen=True)
class Explanation:
    """The whole selection: the problem, where the preference came from, and every verdict.

    ``chain`` lists the backends an op calls, first match per token count wins; ``num_tokens``
    and ``token_backend`` are set when the explanation was asked for one token count, with
    ``token_reasons`` naming why earlier backends in the chain cannot serve it.
    """

    problem: Problem
    source: str
    verdicts: tuple[Verdict, ...]
    chain: tuple[str, ...] = ()
    num_tokens: int | None = None
    token_backend: str | None = None
    token_reasons: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())
    note: str = ""

    @property
    def backend(self) -> str | None:
        """The selected backend (the first of the chain), or ``None`` when nothing is eligible."""
        return self.chain[0] if self.chain else None

    def rejections(self) -> dict[str, tuple[str, ...]]:
        """Rejected backends and their reasons."""
        return {v.backend: v.reasons for v in self.verdicts if v.status == "rejected"}

    def __str__(self) -> str:
        head = f"arnorm: {self.problem.short()}  (choice: {self.source})"
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
        if self.num_tokens is not None:
            served = self.token_backend or "nothing"
            lines.append(f"tokens={self.num_tokens}: {served}")
            for name, skipped in self.token_reasons:
                lines.extend(f"  {name} skipped: {r}" for r in skipped)
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)
