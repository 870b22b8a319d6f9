"""`python -m paradiff ...`: the `paradiff` command (cli/__init__.py: main), as `python -m paradiff.cli` runs it."""

import sys

from paradiff.cli import main

sys.exit(main())
