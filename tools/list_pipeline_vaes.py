"""List the VAE class of every DiT pipeline of the installed diffusers (Modular ones too) and rewrite docs/vae.md's
table with whether paradiff splits each (from src/paradiff/plans/vae.py).

    .venv/bin/python tools/list_pipeline_vaes.py            # ~15 s of CPU: imports every pipeline
"""

from __future__ import annotations

import sys
from pathlib import Path

from paradiff.plan_tools.vae_coverage import MARKERS, pipeline_vaes, unclassified, vae_table


def main() -> int:
    found = pipeline_vaes()
    table = vae_table(found)
    print(table)
    docs = Path(__file__).resolve().parents[1] / "docs" / "vae.md"
    text = docs.read_text()
    start, end = text.index(MARKERS[0]) + len(MARKERS[0]), text.index(MARKERS[1])
    docs.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    missing = unclassified(found)
    if missing:
        print(f"neither split nor refused with a reason in plans/vae.py: {missing}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
