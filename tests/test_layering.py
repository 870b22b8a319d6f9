"""Dependencies point down: the mechanisms know no model, and the product never needs the test helpers.

The layers, lowest first: config / errors; distributed/; io/, tensor_parallel/, context_parallel/, vae/, quant/,
fsdp/ (mechanisms);
runtime/; plans/ (per-model and per-pipeline knowledge); plan_tools/; api/; cli/, demo/. testing/ sits beside the
product and is never imported by it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "paradiff"
MECHANISMS = ("tensor_parallel", "context_parallel", "vae", "io", "quant", "fsdp")
# What each low layer may import from paradiff: itself and the layers below it.
ALLOWED_BELOW = {
    "distributed": ("paradiff.config", "paradiff.errors", "paradiff.distributed"),
}


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


def module_imports(files: list[Path]) -> list[tuple[str, str]]:
    return [(str(path.relative_to(PACKAGE)), name) for path in files
            for name in imports(path.read_text(), str(path.relative_to(PACKAGE)))]


def offenders(files: list[Path], forbidden: str) -> list[str]:
    return [f"{where}: {name}" for where, name in module_imports(files)
            if name == forbidden or name.startswith(forbidden + ".")]


def test_relative_imports_are_seen_as_what_they_name():
    assert imports("from ..plans.vae import vae_plan", "vae/apply.py") == ["paradiff.plans.vae.vae_plan"]
    assert imports("from .. import plans", "vae/apply.py") == ["paradiff.plans"]
    assert imports("from .plans import family_of", "pipeline.py") == ["paradiff.plans.family_of"]
    assert imports("import paradiff.testing.dist", "cli/worker.py") == ["paradiff.testing.dist"]


def test_the_top_level_holds_only_config_errors_and_packages():
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert modules == ["__init__.py", "config.py", "errors.py"]


@pytest.mark.parametrize("forbidden", ["paradiff.plans", "paradiff.plan_tools", "paradiff.api", "paradiff.cli"])
def test_mechanisms_never_import_plans_or_entry_points(forbidden):
    files = [path for mechanism in MECHANISMS for path in (PACKAGE / mechanism).rglob("*.py")]
    assert len(files) > 10
    assert offenders(files, forbidden) == []


@pytest.mark.parametrize("forbidden", ["paradiff.api", "paradiff.cli", "paradiff.plan_tools", "paradiff.demo"])
def test_runtime_and_plans_never_import_entry_points(forbidden):
    files = [*(PACKAGE / "runtime").rglob("*.py"), *(PACKAGE / "plans").rglob("*.py")]
    assert offenders(files, forbidden) == []


def test_distributed_imports_nothing_above_it():
    files = list((PACKAGE / "distributed").rglob("*.py"))
    assert len(files) >= 4
    above = [f"{where}: {name}" for where, name in module_imports(files)
             if name.startswith("paradiff") and not name.startswith(ALLOWED_BELOW["distributed"])]
    assert above == []


def test_product_never_imports_paradiff_testing():
    files = [path for path in PACKAGE.rglob("*.py") if "testing" not in path.relative_to(PACKAGE).parts]
    assert offenders(files, "paradiff.testing") == []


def test_quant_sits_on_the_tensor_parallel_layers_and_below():
    """quant/ quantizes the slices the sharded layers hold: it may use distributed/ (its one collective lives in
    comm.py) and tensor_parallel/, and nothing above; no other mechanism needs it (the load sequence calls it)."""
    files = list((PACKAGE / "quant").rglob("*.py"))
    assert len(files) >= 2
    allowed = ("paradiff.config", "paradiff.errors", "paradiff.distributed", "paradiff.tensor_parallel", "paradiff.quant")
    above = [f"{where}: {name}" for where, name in module_imports(files)
             if name.startswith("paradiff") and not name.startswith(allowed)]
    assert above == []
    others = [path for mechanism in ("tensor_parallel", "context_parallel", "vae", "io", "distributed")
              for path in (PACKAGE / mechanism).rglob("*.py")]
    assert offenders(others, "paradiff.quant") == []


def test_only_the_serve_command_imports_the_server():
    """paradiff.serve sits on top (it uses the command's loading); below it only cli/serve.py reaches it, lazily."""
    files = [path for path in PACKAGE.rglob("*.py") if "serve" not in path.relative_to(PACKAGE).parts[:1]]
    assert [entry for entry in offenders(files, "paradiff.serve") if not entry.startswith("cli/serve.py")] == []
