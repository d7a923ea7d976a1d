"""`python -m pilotrun ...` is the same as the `pilotrun` console script."""

import sys

from pilotrun.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
