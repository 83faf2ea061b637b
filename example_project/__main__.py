"""``python -m example_project --help``."""

from __future__ import annotations

from example_project.demo import main

raise SystemExit(main())
