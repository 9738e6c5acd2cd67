"""`python -m graphrunner` runs the command line."""

import sys

from graphrunner.cli import main

if __name__ == "__main__":  # a spawn'd child (engine-core process, tensor-parallel worker) imports this module too
    sys.exit(main())
