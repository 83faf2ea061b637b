"""``python -m tests.containers build``: make the Docker test images (see ``images``)."""

from __future__ import annotations

import sys

from tests.containers.images import main

sys.exit(main())
