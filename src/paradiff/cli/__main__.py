import sys

from paradiff.cli import main

sys.exit(main())
