"""`python -m pilotrun ...` is the same as the `pilotrun` console script."""

import sys

from pilotrun.common import stop_signals

if __name__ == "__main__":
    # Before the command line's modules load: a stop signal at launch is kept for the command
    # (stop_signals.py).
    stop_signals.held_early()
    from pilotrun.commands.cli import main

    sys.exit(main())
