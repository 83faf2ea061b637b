"""``python -m example_project --help``; ``--backend postgres`` / ``--backend mysql``: the SQL
demo (the record commits in the body's transaction)."""

from __future__ import annotations

import sys

if "--backend" in sys.argv[1:] and ({"postgres", "mysql"} & set(sys.argv[1:])):
    from example_project.demo.postgres import main as pg_main

    raise SystemExit(pg_main())

from example_project.demo import main

raise SystemExit(main())
