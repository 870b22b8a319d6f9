"""Dependencies point down: the mechanisms know no model, and the product never needs the test helpers."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "paradiff"
MECHANISMS = ("tensor_parallel", "context_parallel", "vae")


def imports(source: str, where: str) -> list[str]:
    """Every name the module at `where` (relative to the package) imports, absolute where it imports relatively."""
    package = ["paradiff", *Path(where).parent.parts]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def offenders(files: list[Path], forbidden: str) -> list[str]:
    return [f"{path.relative_to(PACKAGE)}: {name}" for path in files
            for name in imports(path.read_text(), str(path.relative_to(PACKAGE)))
            if name == forbidden or name.startswith(forbidden + ".")]


def test_relative_imports_are_seen_as_what_they_name():
    assert imports("from ..plans.vae import vae_plan", "vae/apply.py") == ["paradiff.plans.vae.vae_plan"]
    assert imports("from .. import plans", "vae/apply.py") == ["paradiff.plans"]
    assert imports("from .plans import family_of", "pipeline.py") == ["paradiff.plans.family_of"]
    assert imports("import paradiff.testing.dist", "cli/worker.py") == ["paradiff.testing.dist"]


def test_mechanisms_never_import_plans():
    files = [path for mechanism in MECHANISMS for path in (PACKAGE / mechanism).rglob("*.py")]
    assert len(files) > 10
    assert offenders(files, "paradiff.plans") == []


def test_product_never_imports_paradiff_testing():
    files = [path for path in PACKAGE.rglob("*.py") if "testing" not in path.relative_to(PACKAGE).parts]
    assert offenders(files, "paradiff.testing") == []
