"""A worker for tests/test_spawn.py: says who it is on stderr, then ends as its arguments ask."""

import os
import sys
import time

rank = os.environ["PROBE_RANK"]
print(f"rank {rank} argv {' '.join(sys.argv[1:])} preloaded {'xml.dom.minidom' in sys.modules}", file=sys.stderr)
if sys.argv[1] == "sleep":
    time.sleep(600)
sys.exit(int(sys.argv[1]) + int(rank))
