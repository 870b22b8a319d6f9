"""requirements.lock is what `make` installs: it satisfies pyproject.toml's ranges, and the suite runs on exactly it."""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def locked() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        requirement = line.partition("#")[0].strip()
        if requirement:
            name, _, version = requirement.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_the_lock_pins_every_dependency_within_pyproject_ranges():
    """A range changed in pyproject.toml without `make lock` leaves a pin outside it, or a new package unpinned."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = project["dependencies"] + project["optional-dependencies"]["test"] + \
        project["optional-dependencies"]["bench"]
    pins = locked()
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{text!r} of pyproject.toml is not in requirements.lock: run `make lock`"
        # the lock holds the CPU build of torch (2.13.0+cpu): its local label does not change the release
        assert requirement.specifier.contains(pins[name].split("+")[0], prereleases=True), \
            f"requirements.lock pins {name}=={pins[name]}, outside pyproject.toml's {text!r}: run `make lock`"


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="runs in the .venv that make builds from the lock; this interpreter is another one")
def test_the_suite_runs_on_exactly_the_locked_versions():
    differ = {}
    for name, version in locked().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            differ[name] = (version, installed)
    assert not differ, f"locked -> installed: {differ}; `make clean test` installs the lock again"
