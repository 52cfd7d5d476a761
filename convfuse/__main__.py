"""`python -m convfuse selfcheck`: the same as the `convfuse` console command."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
