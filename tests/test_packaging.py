"""What a plain `pip install paradiff` gets: the package on its core dependencies, without the suite's fixtures.

`paradiff.testing` keeps only what library users want (rank pools, `run_ranks`, `tiny_model`), on core dependencies
(pyproject's [project] dependencies); the suite's fixtures live in testkit/paradiff_testkit, outside the wheel.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "paradiff"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Modules of an optional feature, which a plain install cannot import, and the extra that brings what they need.
EXTRA_MODULES = {"paradiff.serve.app": "serve", "paradiff.serve.jobs": "serve", "paradiff.serve.jobstore": "serve",
                 "paradiff.serve.ray": "ray"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def installed() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    """The installed distributions providing top-level module `module` (normalized names)."""
    return {normalized(dist) for dist in installed().get(module, [])}


def core_closure() -> dict[str, importlib.metadata.Distribution]:
    """Every distribution a plain install of paradiff brings: its core dependencies and theirs, no extras."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = list(PROJECT["dependencies"])
    while pending:
        requirement = Requirement(pending.pop())
        if normalized(requirement.name) in found:
            continue
        dist = found[normalized(requirement.name)] = importlib.metadata.distribution(requirement.name)
        pending += [text for text in dist.requires or []
                    if Requirement(text).marker is None or Requirement(text).marker.evaluate({"extra": ""})]
    return found


def imported(path: Path) -> list[str]:
    """The absolute modules a file imports, anywhere in it (relative imports are the package's own)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.append(node.module)
    return names


def test_paradiff_testing_imports_only_core_dependencies():
    """Every import of every module of paradiff.testing, deferred ones too: the standard library, paradiff, or a
    package of pyproject's [project] dependencies."""
    core = {normalized(Requirement(text).name) for text in PROJECT["dependencies"]}
    files = sorted((PACKAGE / "testing").rglob("*.py"))
    assert {path.name for path in files} >= {"__init__.py", "dist.py", "models.py"}
    outside = []
    for path in files:
        for name in imported(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "paradiff":
                continue
            if not distributions_of(top) or not distributions_of(top) <= core:
                outside.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert outside == [], f"paradiff.testing imports beyond the core dependencies {sorted(core)}: {outside}"


def test_the_package_never_imports_the_test_kit():
    """Not even in a function: paradiff_testkit is absent from a plain install."""
    found = [f"{path.relative_to(PACKAGE)}: {name}" for path in PACKAGE.rglob("*.py") for name in imported(path)
             if name.split(".")[0] == "paradiff_testkit"]
    assert found == []


def test_tiny_model_builds_the_suites_families_and_every_plan_family():
    import torch

    from paradiff import testing
    from paradiff.distributed.spawn import run_ranks
    from paradiff.testing.dist import RankPool
    from paradiff.testing.models import build_model

    assert (testing.RankPool, testing.run_ranks) == (RankPool, run_ranks)
    flux = testing.tiny_model("flux", seed=3)
    reference = build_model("flux", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(flux.state_dict().values(), reference.state_dict().values()))
    sd3 = testing.tiny_model("sd3")
    assert type(sd3).__name__ == "SD3Transformer2DModel" and not sd3.training
    with pytest.raises(ValueError, match=r"unknown family 'fluxx'; known families: .*flux2.*wan"):
        testing.tiny_model("fluxx")


# A fresh interpreter with no site-packages: the wheel, unpacked, and the core closure's distributions linked in
# (their packages and metadata), as `pip install paradiff` would lay them out. It imports every module of the
# package and prints those that failed, with the top-level name of the module missing.
IMPORT_EVERY_MODULE = r"""
import importlib, json, pkgutil, sys
sys.path.insert(0, SITE)
import paradiff
assert paradiff.__file__.startswith(SITE), paradiff.__file__
failed, count = {}, 0
for module in pkgutil.walk_packages(paradiff.__path__, "paradiff."):
    if module.name.rpartition(".")[2] == "__main__":  # runs the command
        continue
    count += 1
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as error:
        failed[module.name] = (error.name or "?").split(".")[0]
    except Exception as error:
        failed[module.name] = f"{type(error).__name__}: {error}"
print(json.dumps({"count": count, "failed": failed}))
"""


@pytest.mark.slow  # builds the wheel and imports every module in a fresh interpreter
def test_a_plain_install_holds_no_test_kit_and_imports_every_module(tmp_path):
    tree = tmp_path / "tree"  # what the build reads, and the test kit beside it (to be left out)
    for name in ("src", "testkit"):
        shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    built = subprocess.run([sys.executable, "-c", "from setuptools import build_meta; "
                            f"print(build_meta.build_wheel({str(tmp_path / 'wheel')!r}))"],
                           cwd=tree, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = tmp_path / "wheel" / built.stdout.split()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    assert [name for name in names if not name.startswith(("paradiff/", "paradiff-"))] == []
    assert sorted(name for name in names if name.startswith("paradiff/testing/")) == [
        "paradiff/testing/__init__.py", "paradiff/testing/dist.py", "paradiff/testing/models.py"]
    tracked = {path.relative_to(PACKAGE.parent).as_posix() for path in PACKAGE.rglob("*.py")}
    assert tracked <= set(names), sorted(tracked - set(names))

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    for dist in core_closure().values():
        base = Path(dist.locate_file(""))
        for top in {Path(file).parts[0] for file in dist.files or [] if not str(file).startswith("..")}:
            if top != "__pycache__" and not top.endswith(".pth") and not (site / top).exists():
                (site / top).symlink_to(base / top)
    # -I: no PYTHON* variables (the suite's PYTHONPATH), no user site; -S: no site-packages
    done = subprocess.run([sys.executable, "-I", "-S", "-c", IMPORT_EVERY_MODULE.replace("SITE", repr(str(site)))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["count"] > 150
    extras = PROJECT["optional-dependencies"]
    needs = {module: sorted(normalized(Requirement(text).name) for text in extras[extra])
             for module, extra in EXTRA_MODULES.items()}
    assert set(result["failed"]) <= set(EXTRA_MODULES), result["failed"]
    for module, missing in result["failed"].items():
        assert distributions_of(missing) & set(needs[module]), (module, missing, needs[module])
