"""The docs pages generated from plans/ data: writes them, or with --check says which differ.

    python tools/docs_tables.py           # write docs/cfg-rules.md
    python tools/docs_tables.py --check   # exit 1 naming every page that differs from what plans/ gives

The coverage tables have their own generators, which also run the models they record:
`python tools/verify_plans.py --readme` (docs/coverage.md) and `python tools/verify_pipelines.py --table`
(docs/pipeline-coverage.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from paradiff.plan_tools.cfg_rules import cfg_rules_page

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = {"cfg-rules.md": cfg_rules_page}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    stale = []
    for name, render in PAGES.items():
        text = render()
        if args.check:
            if not (DOCS / name).is_file() or (DOCS / name).read_text() != text:
                stale.append(name)
        else:
            (DOCS / name).write_text(text)
            print(f"wrote docs/{name}")
    for name in stale:
        print(f"docs/{name} differs from plans/: run python tools/docs_tables.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
