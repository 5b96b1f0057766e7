"""`python -m workshop`: see workshop/cli.py."""

from workshop.cli import main

raise SystemExit(main())
