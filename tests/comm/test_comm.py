"""Comm.resolve: what a wrong tp_group says (the cause and the fix, not only "None")."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import arnorm

KW = dict(hidden_size=8, dtype=torch.float32, norm=arnorm.RMSNorm(1e-6), max_tokens=4, device="cpu")


def test_world_before_init_process_group_says_torch_distributed_is_not_initialized(clean_env):
    """dist.group.WORLD is None until init_process_group: the message names that, and the fix."""
    assert not dist.is_initialized()
    with pytest.raises(arnorm.InvalidInputError) as info:
        arnorm.AllReduceNorm(dist.group.WORLD, **KW)
    msg = str(info.value)
    assert msg.startswith("tp_group: None, and torch.distributed is not initialized"), msg
    assert "(needs torch.distributed.init_process_group()" in msg and "arnorm.LOCAL" in msg


class GroupCoordinator:
    """The shape of vLLM's coordinator: the two process groups as attributes."""

    device_group = object()
    cpu_group = object()


def test_a_group_coordinator_is_told_to_pass_its_device_group_and_cpu_group(clean_env):
    with pytest.raises(arnorm.InvalidInputError) as info:
        arnorm.AllReduceNorm(GroupCoordinator(), **KW)
    assert str(info.value) == (
        "tp_group: GroupCoordinator, a group coordinator, not a ProcessGroup (needs its two groups: "
        "tp_group=<it>.device_group, cpu_group=<it>.cpu_group)"
    )
