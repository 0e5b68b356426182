"""`python -m everyprompt.cli ...`: the `everyprompt` command (a sweep starts its cells this way)."""

import sys

from everyprompt.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
