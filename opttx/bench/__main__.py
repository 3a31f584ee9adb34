"""``python -m opttx.bench``: exit status 1 if any optimizer run failed."""

import sys

from .cli import main

sys.exit(1 if any("error" in r for r in main().values()) else 0)
