"""The ``arnorm`` command line: ``backends``, ``explain``, ``doctor``, ``demo``, ``bench``."""

from arnorm.cli._main import main

__all__ = ["main"]
