"""``python -m arnorm``: the same commands as the ``arnorm`` console script."""

from arnorm.cli._main import main

raise SystemExit(main())
