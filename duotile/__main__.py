"""``python3 -m duotile``: the ``duotile`` command, where the package is importable but not installed."""

from .cli import main

raise SystemExit(main())
