"""A backend module whose import never returns on rank 1 (a driver call stuck on one host only)."""

from __future__ import annotations

import time
from typing import ClassVar

import torch.distributed as dist

import fake_backends

if dist.get_rank() == 1:
    time.sleep(3600)


class Backend(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "hangs_on_one"
