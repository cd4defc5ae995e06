"""A backend module whose import raises SystemExit on the ranks in ``relia_plugins.BAD``."""

from __future__ import annotations

from typing import ClassVar

import fake_backends
import relia_plugins

if relia_plugins._bad():
    raise SystemExit("no driver on this rank")


class Backend(fake_backends.AllReduceBackend):
    name: ClassVar[str] = "badimport"
