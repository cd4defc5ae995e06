"""arnorm-example: a complete third-party backend, written only against ``arnorm.plugin``.

Copy this distribution to start your own. It has the three parts every backend has:

- ``_plugin.py``: the descriptor (name, priority, declared capabilities, settings), which the
  ``arnorm.backends`` entry point in ``pyproject.toml`` names. arnorm imports it at discovery, so
  it stays cheap: no torch, no kernels.
- ``_backend.py``: the class arnorm loads only when the backend may serve an op (the
  ``arnorm.FusedAllReduceNorm`` protocol: ``probe``, ``create``, ``check_tokens``, ``__call__``,
  ``close``).
- ``pyproject.toml``: the distribution and its entry point.

docs/writing-a-backend.md explains every field and method.
"""
