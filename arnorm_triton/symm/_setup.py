"""``triton_symm`` setup steps that every rank takes together: the probe's torch check, the
topology agreement, and running a step so that a failure on any rank fails it on every rank."""

from __future__ import annotations

import importlib.util
import socket
from typing import TYPE_CHECKING, Any

from arnorm.plugin import BackendSetupError

if TYPE_CHECKING:
    from arnorm.plugin import Comm

__all__ = ["MAX_SLOTS", "agree_topology", "collective_step", "symmetric_memory_reasons"]

#: Most programs a launch may have (and flag slots per rank and kind): one per SM is enough to
#: keep every load in flight, and it keeps the whole grid resident, so a program never waits for
#: a peer program that cannot be scheduled.
MAX_SLOTS = 1024


def symmetric_memory_reasons() -> list[str]:
    """Why this torch cannot build symmetric memory, in the reason grammar (empty: it can)."""
    import torch

    version = torch.__version__.split("+")[0]
    if not torch.distributed.is_available():
        return [f"torch.distributed: not built into torch {version} (needs a torch with distributed support)"]
    if importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
        return [
            f"torch symmetric memory: missing in torch {version} "
            "(needs torch.distributed._symmetric_memory, torch >= 2.5)"
        ]
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except Exception as exc:  # a broken build must not break selection
        return [
            f"torch symmetric memory: import failed with {type(exc).__name__}: {exc} "
            "(needs a working torch.distributed._symmetric_memory)"
        ]
    missing = [n for n in ("empty", "rendezvous") if not hasattr(symm_mem, n)]
    if missing:
        return [
            f"torch symmetric memory: no {' or '.join(missing)} in torch {version} "
            "(needs symm_mem.empty and symm_mem.rendezvous, torch >= 2.5)"
        ]
    return []


def collective_step(comm: Comm, what: str, fn: Any) -> None:
    """Run ``fn`` on every rank, then agree: if it raised anywhere, raise the same error everywhere."""
    error = ""
    try:
        fn()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    seen = comm.gather_objects(error)
    failed = [(r, e) for r, e in enumerate(seen) if e]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise BackendSetupError(f"{what}: {detail} (needs {what} to succeed on every rank)")


def agree_topology(comm: Comm) -> int:
    """Check that the ranks share one node, have distinct GPUs (unless torch is told to allow
    overlap) with peer access; return the agreed program count (slots). Raises the same
    :class:`BackendSetupError` on every rank."""
    import torch

    from arnorm_triton.symm._workspace import overlapping_devices_allowed

    dev = comm.device
    props = torch.cuda.get_device_properties(dev)
    uuid = str(getattr(props, "uuid", dev.index))
    mine = {"host": socket.gethostname(), "uuid": uuid, "sms": int(props.multi_processor_count)}
    facts = comm.gather_objects(mine)
    problems: list[str] = []
    hosts = sorted({f["host"] for f in facts})
    if len(hosts) > 1:
        problems.append(
            f"nodes: ranks on {len(hosts)} hosts (needs every rank on one node: peer memory is intra-node)"
        )
    uuids = [f["uuid"] for f in facts]
    shared = [r for r, u in enumerate(uuids) if uuids.count(u) > 1]
    if shared and not overlapping_devices_allowed():
        problems.append(
            f"devices: ranks {shared} share a GPU (needs one GPU per rank; "
            "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 allows sharing, for tests)"
        )
    # Peer access to every peer GPU this process can see (a peer hidden by CUDA_VISIBLE_DEVICES is
    # left to the rendezvous, which fails loudly without it).
    visible = {
        str(getattr(torch.cuda.get_device_properties(i), "uuid", i)): i
        for i in range(torch.cuda.device_count())
    }
    local = []
    for r, u in enumerate(uuids):
        i = visible.get(u)
        if u != uuid and i is not None and not torch.cuda.can_device_access_peer(dev.index, i):
            local.append(f"peer access: cuda:{dev.index} cannot reach rank {r}'s cuda:{i} "
                         "(needs P2P between the TP GPUs: NVLink, NVSwitch or PCIe P2P)")  # fmt: skip
    for r, reasons in enumerate(comm.gather_objects(local)):
        problems += [f"rank {r}: {reason}" for reason in reasons]
    if problems:
        raise BackendSetupError("; ".join(problems))
    sms = min(f["sms"] for f in facts)
    w = comm.world_size
    # A multiple of the world size keeps two-shot ownership balanced across programs.
    return max(w, min(sms, MAX_SLOTS) // w * w)
