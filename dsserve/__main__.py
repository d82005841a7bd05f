"""``python -m dsserve``."""

from .cli import main

raise SystemExit(main())
