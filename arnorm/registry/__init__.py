"""The registry: plugins discovered, declared capabilities checked, probed, selected, explained.

Where to change selection: ``_select.py``; what a backend declares: ``_capabilities.py``."""
