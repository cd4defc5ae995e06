"""Setup agreement: every rank gathers its facts, then all decide alike before FlashInfer's collective.

FlashInfer's workspace creation is a sequence of collectives (an all-gather of socket paths, an
fd exchange, a barrier); a rank that raises part-way leaves the others waiting forever. So
``create`` runs in three steps:

1. :func:`local_facts` (no collective, never raises): the cheap facts that can fail per rank:
   importing ``flashinfer.comm``, the budget, free device memory, the GPU's identity and its peer
   access to the other GPUs of the host, multicast support, and this rank's cached workspaces.
2. One ``all_gather_object`` over the CPU group, then :func:`decide`, a pure function of the
   gathered list: every rank computes the same :class:`Plan`, so either every rank raises the same
   ``BackendSetupError`` or every rank goes on.
3. :func:`build_modules` (the slow, fallible JIT build FlashInfer would otherwise run *inside* its
   collective), gathered and agreed the same way; only then every rank enters
   ``create_allreduce_fusion_workspace`` (or reuses the same cached workspace). A rejected
   topology never pays the build.

What remains uncovered: a failure inside FlashInfer's creation on some ranks only (a driver error
while mapping a peer's memory, say). Those ranks raise; the others block in FlashInfer's barrier
until the CPU group's timeout.
"""

from __future__ import annotations

import contextlib
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arnorm_flashinfer._workspace import MIB, alloc_tokens, budget_mb, token_capacity, workspace_bytes

if TYPE_CHECKING:
    from arnorm.plugin import Comm, Problem
    from arnorm_flashinfer._api import FlashInferAPI
    from arnorm_flashinfer._plugin import FlashInferSettings

__all__ = ["MEMORY_MARGIN", "Facts", "Plan", "build_modules", "decide", "local_facts", "mnnvl_blocker"]

#: Free device memory a rank keeps beyond the workspace itself.
MEMORY_MARGIN = 64 * MIB


@dataclass(frozen=True)
class Facts:
    """One rank's view, gathered by every rank (picklable, small)."""

    host: str
    gpu: str | None
    error: str | None
    tokens: int
    budget: float
    budget_source: str
    free_bytes: int | None = None
    multicast: bool = False
    peers: dict[str, bool] = field(default_factory=dict)
    cached: dict[str, tuple[int, str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """What every rank does next; identical on every rank."""

    error: str | None
    kind: str = "trtllm"
    tokens: int = 0
    budget: float = 0.0
    budget_source: str = ""
    reuse: bool = False
    gpus_per_node: int = 1


def mnnvl_blocker(problem: Problem, api: FlashInferAPI | None) -> str | None:
    """Why this problem must use the TRT-LLM workspace even when MNNVL is enabled (``None``: it may not)."""
    if problem.quant in ("fp8_per_token", "mxfp8"):
        # MNNVL two-shot takes the per-token amax over the unrounded norm; MNNVL's MXFP8 (new in
        # 0.7.4) has not been checked against arnorm's rule.
        return f"quant {problem.quant} runs on the trtllm workspace only"
    if problem.arch is not None and problem.arch[0] not in (9, 10):
        return "MNNVL kernels build for SM9x/SM10x only"
    if problem.dtype == "float16" and (api is None or not api.has_mxfp8):
        # Before 0.7.4 the MNNVL one-shot norm squared in fp16: |x| > 255.9 overflowed to inf.
        return "float16 needs FlashInfer >= 0.7.4 on MNNVL"
    return None


def _on(device: Any) -> Any:
    """``torch.cuda.device(device)`` for a CUDA device, else a no-op context."""
    if getattr(device, "type", None) != "cuda":
        return contextlib.nullcontext()
    import torch

    return torch.cuda.device(device)


def _gpu_id(raw: object) -> str:
    text = str(raw).strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text


def _device_facts(device: Any, want_multicast: bool, api: FlashInferAPI | None) -> dict[str, Any]:
    """GPU identity, free memory, peer access and multicast of this rank's device (best effort)."""
    import torch

    out: dict[str, Any] = {}
    props = torch.cuda.get_device_properties(device)
    gpu = getattr(props, "uuid", None)
    out["gpu"] = _gpu_id(gpu) if gpu is not None else f"{socket.gethostname()}:cuda{device.index}"
    out["free_bytes"] = int(torch.cuda.mem_get_info(device)[0])
    out["peers"] = _peer_access(device, out["gpu"])
    if want_multicast and api is not None:
        out["multicast"] = api.multicast_supported(device.index) and not api.confidential_compute()
    return out


def _peer_access(device: Any, mine: str) -> dict[str, bool]:
    """Can this GPU read and write each other GPU of the host? NVML sees all; CUDA only the visible ones."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            ids = [_gpu_id(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
            if mine not in ids:
                raise LookupError(mine)
            me = handles[ids.index(mine)]
            peers: dict[str, bool] = {}
            caps = (pynvml.NVML_P2P_CAPS_INDEX_READ, pynvml.NVML_P2P_CAPS_INDEX_WRITE)
            for handle, gpu in zip(handles, ids, strict=True):
                if gpu == mine:
                    continue
                try:
                    status = [pynvml.nvmlDeviceGetP2PStatus(me, handle, c) for c in caps]
                except pynvml.NVMLError:
                    continue  # unknown: FlashInfer's own setup decides
                peers[gpu] = all(s == pynvml.NVML_P2P_STATUS_OK for s in status)
            return peers
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML (or an old one): fall back to what CUDA shows this process
        import torch

        peers = {}
        for j in range(torch.cuda.device_count()):
            if j == device.index:
                continue
            raw = getattr(torch.cuda.get_device_properties(j), "uuid", None)
            if raw is not None:
                peers[_gpu_id(raw)] = bool(torch.cuda.can_device_access_peer(device.index, j))
        return peers


def local_facts(
    problem: Problem,
    comm: Comm,
    settings: FlashInferSettings,
    api: FlashInferAPI | None,
    reasons: tuple[str, ...],
    cached: dict[str, tuple[int, str, int]],
) -> Facts:
    """This rank's facts; ``reasons`` (static or import problems) become the error. Never raises."""
    host = socket.gethostname()
    error = "; ".join(reasons) or None
    elem = 4 if problem.dtype == "float32" else 2
    # The settings model guarantees a positive, finite budget when one is set.
    budget, source = budget_mb(problem.arch or (9, 0), problem.world_size, settings.max_size_mb)
    tokens = token_capacity(budget, problem.hidden_size, elem, problem.max_tokens)
    want_mnnvl = settings.mnnvl and mnnvl_blocker(problem, api) is None
    device = comm.device
    dev: dict[str, Any] = {}
    if error is None and api is not None:
        try:
            with _on(device):
                if getattr(device, "type", None) == "cuda":
                    dev = _device_facts(device, want_mnnvl, api)
                elif want_mnnvl:  # no CUDA device (the CPU tests with a fake flashinfer)
                    dev = {"multicast": api.multicast_supported(0) and not api.confidential_compute()}
        except Exception as exc:  # driver or NVML failure: reported, agreed on, raised everywhere
            error = _setup_error(exc)
    return Facts(
        host=host,
        gpu=dev.get("gpu"),
        error=error,
        tokens=tokens,
        budget=budget,
        budget_source=source,
        free_bytes=dev.get("free_bytes"),
        multicast=bool(dev.get("multicast", False)),
        peers=dev.get("peers", {}),
        cached=cached,
    )


def build_modules(api: FlashInferAPI, kind: str, device: Any) -> str | None:
    """Build (or load) the JIT modules ``kind`` needs here; the error text, or ``None``. Never raises."""
    try:
        with _on(device):
            api.build_module("trtllm")
            if kind == "mnnvl":
                api.build_module("mnnvl")
    except Exception as exc:  # JIT or driver failure: gathered and raised on every rank
        return _setup_error(exc)
    return None


def _setup_error(exc: BaseException) -> str:
    text = str(exc).strip().replace("\n", " ")[:300]
    return f"setup: {type(exc).__name__}: {text} (needs FlashInfer's JIT build to succeed)"


def _join(per_rank: list[str | None]) -> str:
    found = [(r, e) for r, e in enumerate(per_rank) if e]
    if len({e for _, e in found}) == 1 and len(found) == len(per_rank):
        return str(found[0][1])
    return "; ".join(f"rank {r}: {e}" for r, e in found)


def decide(facts: list[Facts], problem: Problem, want_mnnvl: bool, shared_gpu: bool = False) -> Plan:
    """The plan every rank follows, from every rank's facts (pure: same input, same plan)."""
    if any(f.error for f in facts):
        return Plan(_join([f.error for f in facts]))
    world = len(facts)
    kind = "mnnvl" if want_mnnvl and all(f.multicast for f in facts) else "trtllm"
    hosts = Counter(f.host for f in facts)
    if kind == "trtllm" and len(hosts) > 1:
        return Plan(
            f"hosts: {len(hosts)} (needs every rank on one host: the trtllm workspace maps peers' memory "
            "through POSIX file descriptors)"
        )
    if len(set(hosts.values())) > 1:
        return Plan(f"hosts: ranks per host {sorted(hosts.values())} (needs the same number on every host)")
    owner: dict[str, int] = {}
    for r, f in enumerate(facts):
        if f.gpu is None:
            continue
        if f.gpu in owner and not shared_gpu:
            return Plan(f"devices: ranks {owner[f.gpu]} and {r} share GPU {f.gpu} (needs one GPU per rank)")
        owner[f.gpu] = r
    blocked = [
        (r, s)
        for r, f in enumerate(facts)
        for s, g in enumerate(facts)
        if r != s and f.host == g.host and g.gpu is not None and f.peers.get(g.gpu) is False
    ]
    if blocked:
        pairs = ", ".join(f"{r}->{s}" for r, s in blocked[:4]) + (" ..." if len(blocked) > 4 else "")
        return Plan(
            f"peer access: none between ranks {pairs} (needs P2P over NVLink or PCIe between every pair)"
        )
    low = min(range(world), key=lambda r: facts[r].tokens)
    tokens, budget, source = facts[low].tokens, facts[low].budget, facts[low].budget_source
    elem = 4 if problem.dtype == "float32" else 2
    if tokens < 1:
        return Plan(
            f"workspace budget: {budget:g} MiB ({source}) "
            f"(needs >= {problem.hidden_size * elem} bytes, one token)"
        )
    states = [f.cached.get(kind) for f in facts]
    reuse = states[0] is not None and all(s == states[0] for s in states) and states[0][2] >= tokens
    if not reuse:
        need = (
            workspace_bytes(kind, alloc_tokens(tokens, elem, world), problem.hidden_size, elem, world)
            + MEMORY_MARGIN
        )
        short = [
            (r, f.free_bytes) for r, f in enumerate(facts) if f.free_bytes is not None and f.free_bytes < need
        ]
        if short:
            r, free = short[0]
            return Plan(
                f"device memory: {free / MIB:.0f} MiB free on rank {r} (needs {need / MIB:.0f} MiB for a "
                f"{budget:g} MiB/rank workspace; lower ARNORM_FLASHINFER_MAX_SIZE_MB)"
            )
    return Plan(None, kind, tokens, budget, source, reuse, world // len(hosts))
