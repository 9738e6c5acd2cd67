"""`python -m graphrunner` runs the command line."""

import sys

from graphrunner.cli import main

sys.exit(main())
