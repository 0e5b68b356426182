"""`python -m bench.evidence`: bench/evidence/run.py's command line."""

import sys

from bench.evidence.run import main

if __name__ == "__main__":
    sys.exit(main())
