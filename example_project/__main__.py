"""``python -m example_project --help``; ``--backend postgres``: the PostgreSQL demo."""

from __future__ import annotations

import sys

if "--backend" in sys.argv[1:] and "postgres" in sys.argv[1:]:
    from example_project.demo.postgres import main as pg_main

    raise SystemExit(pg_main())

from example_project.demo import main

raise SystemExit(main())
