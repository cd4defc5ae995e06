"""One spawn of ranks runs every attack scenario; each scenario is bounded in time.

Spawning gloo ranks costs seconds, so the attack tests run every scenario of every table
(:data:`TABLES`) in one spawn per world size (:func:`outcomes`, cached per session) and assert on
the outcomes one parametrized test at a time. Inside the spawn (:func:`run_tables`) every scenario
starts after a barrier on WORLD (the ranks are in step) with a fresh gloo group whose collectives
time out after a few seconds, a clean registry, probe cache and ``ARNORM_*`` environment. A
scenario that leaves a rank waiting in a collective (the failure these tests exist to catch) thus
ends as a ``RuntimeError`` outcome on that rank after the group timeout, never as a stuck spawn,
and the next scenario still starts in step. The spawn itself has a timeout too: nothing here can
hang CI.
"""

from __future__ import annotations

import functools
import importlib
import os
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

#: Collective timeout of a scenario's group when every rank is expected to finish together.
SCENARIO_TIMEOUT_S = 20.0
#: Collective timeout for scenarios known to leave a rank waiting today (strict xfails): they cost
#: this much per run until the core is fixed, so it is short.
HANG_TIMEOUT_S = 3.0
#: The outcome of a scenario that was not run at this world size.
NOT_RUN = ("not run",)
#: Timeout of one spawn (all scenarios of a table on one world size).
SPAWN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Ctx:
    """What a scenario gets: this rank, the world size, and its own gloo group over every rank."""

    rank: int
    world: int
    group: Any

    @property
    def last(self) -> int:
        """The rank that misbehaves in one-rank scenarios."""
        return self.world - 1


#: The scenario modules; one spawn per world size runs all of them.
TABLES = ("relia_inputs", "relia_envs", "relia_plugins")


def run_tables(rank: int, world: int, tables: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Rank side: ``{module: {name: outcome}}`` of ``module.SCENARIOS[name](ctx)`` for every scenario.

    Names in ``module.SHORT`` (known to leave ranks waiting today) run at 2 ranks only, with
    :data:`HANG_TIMEOUT_S` as their group's collective timeout.
    """
    import torch.distributed as dist

    from arnorm.registry._discovery import reset_registry

    results: dict[str, dict[str, Any]] = {}
    for module in tables:
        mod = importlib.import_module(module)
        short = getattr(mod, "SHORT", ())
        results[module] = out = {}
        for name, scenario in mod.SCENARIOS.items():
            if name in short and world != 2:
                out[name] = NOT_RUN  # a known hang costs its timeout once, at 2 ranks
                continue
            dist.barrier()  # every rank finished (or timed out of) the previous scenario
            seconds = HANG_TIMEOUT_S if name in short else SCENARIO_TIMEOUT_S
            # Created while the ranks are in step: gloo connects every pair at construction.
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
            saved = dict(os.environ)
            for key in [k for k in os.environ if k.startswith("ARNORM_")]:
                del os.environ[key]  # scenarios set what they test; nothing leaks in from the parent
            reset_registry()  # also clears the probe cache
            try:
                out[name] = scenario(Ctx(rank, world, group))
            except BaseException as exc:  # report, and keep the other scenarios running
                tail = traceback.format_exc().strip().splitlines()[-3:]
                out[name] = ("crashed", type(exc).__name__, str(exc), tail)
            finally:
                os.environ.clear()
                os.environ.update(saved)
    dist.barrier()
    return results


_spawns: dict[int, Any] = {}


def outcomes(world: int, module: str, name: str) -> list:
    """Test side: every rank's outcome of one scenario, in rank order.

    The first call for a world size runs every table in one spawn (cached for the session).
    """
    from arnorm.testing import RankError, run_ranks

    if world not in _spawns:
        try:
            _spawns[world] = run_ranks(world, run_tables, TABLES, timeout=SPAWN_TIMEOUT_S)
        except RankError as exc:
            _spawns[world] = exc
    got = _spawns[world]
    if isinstance(got, Exception):
        raise AssertionError(f"the attack spawn on {world} ranks failed:\n{got}")
    results = [per_rank[module][name] for per_rank in got]
    if results[0] == NOT_RUN:
        import pytest

        pytest.skip("a scenario that leaves ranks waiting today runs at 2 ranks only")
    return results


def same_everywhere(outcomes: list) -> Any:
    """The one outcome every rank had (asserts they agree)."""
    assert all(o == outcomes[0] for o in outcomes), "ranks ended differently:\n" + "\n".join(
        f"  rank {r}: {o!r}" for r, o in enumerate(outcomes)
    )
    return outcomes[0]


@functools.cache
def triton_unavailable() -> str:
    """Why the triton backend cannot serve a small CPU problem here ("" when it can)."""
    import torch

    import arnorm

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        return "TRITON_INTERPRET=1 is not set"
    try:
        arnorm.AllReduceNorm(
            arnorm.LOCAL, hidden_size=32, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6),
            max_tokens=4, backend="triton", device="cpu",
        ).close()  # fmt: skip
    except arnorm.ArnormError as exc:
        return str(exc).splitlines()[0]
    return ""
