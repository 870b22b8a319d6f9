"""Move the test fixtures out of the package: src/paradiff/testing -> testkit/paradiff_testkit, and rewrite imports.

`paradiff.testing` keeps what a library user wants, on core dependencies only (KEEP: rank pools, tiny models); every
other file under src/paradiff/testing is moved (git mv) to the same place under testkit/paradiff_testkit, and every
tracked text file's references to a moved module are rewritten: `paradiff.testing.zoo` -> `paradiff_testkit.zoo`,
`from paradiff.testing import command, dist` -> `from paradiff_testkit import command` + `from paradiff.testing import
dist`, `src/paradiff/testing/families.py` -> `testkit/paradiff_testkit/families.py`. Idempotent: run it again after
merging a branch that added a file under src/paradiff/testing or a new import of a moved module.

    python tools/move_testkit.py          # from the repository root
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path("src/paradiff/testing")
KIT = Path("testkit/paradiff_testkit")
KEEP = {"__init__.py", "dist.py", "models.py"}
TEXT = {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".json"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def move_files() -> list[str]:
    moved = []
    for name in git("ls-files", str(PACKAGE)).splitlines():
        relative = Path(name).relative_to(PACKAGE)
        if len(relative.parts) == 1 and relative.name in KEEP:
            continue
        target = KIT / relative
        (ROOT / target.parent).mkdir(parents=True, exist_ok=True)
        git("mv", name, str(target))
        moved.append(name)
    return moved


def moved_modules() -> list[str]:
    names = {path.stem if path.suffix == ".py" else path.name for path in (ROOT / KIT).iterdir()
             if (path.suffix == ".py" or (path / "__init__.py").exists()) and path.name != "__init__.py"}
    return sorted(names, key=len, reverse=True)


def rewrite(text: str, modules: list[str]) -> str:
    alternatives = "|".join(map(re.escape, modules))
    text = re.sub(rf"\bparadiff\.testing\.({alternatives})\b", r"paradiff_testkit.\1", text)
    text = re.sub(rf"\bsrc/paradiff/testing/({alternatives})\b", rf"{KIT.as_posix()}/\1", text)
    text = re.sub(rf"(?<![\w/.])testing/({alternatives})(?=\.py\b|/)", r"paradiff_testkit/\1", text)

    def split_from(match: re.Match) -> str:
        indent, names, comment = match.group(1), match.group(2), match.group(3) or ""
        aliases = [alias.strip() for alias in names.split(",") if alias.strip()]
        kit = [alias for alias in aliases if alias.split(" as ")[0].strip() in modules]
        kept = [alias for alias in aliases if alias not in kit]
        lines = [f"{indent}from paradiff_testkit import {', '.join(kit)}{comment}"] if kit else []
        lines += [f"{indent}from paradiff.testing import {', '.join(kept)}{comment if not kit else ''}"] if kept else []
        return "\n".join(lines)

    return re.sub(r"^([ \t]*)from paradiff\.testing import ([\w ,]+?)([ \t]*#.*)?$", split_from, text,
                  flags=re.MULTILINE)


def main() -> None:
    moved = move_files()
    modules = moved_modules()
    changed = []
    for name in git("ls-files").splitlines():
        path = ROOT / name
        if name == "tools/move_testkit.py" or not path.is_file() or (path.suffix not in TEXT and path.name != "Makefile"):
            continue
        text = path.read_text()
        new = rewrite(text, modules)
        if new != text:
            path.write_text(new)
            changed.append(name)
    print(f"moved {len(moved)} files to {KIT}; rewrote {len(changed)} files")
    for name in changed:
        print(f"  {name}")


if __name__ == "__main__":
    main()
