"""``python -m arnorm``: the same commands as the ``arnorm`` console script."""

from arnorm._cli import main

raise SystemExit(main())
