"""`python -m trainguard ...` is the `trainguard` command."""

import sys

from trainguard.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
