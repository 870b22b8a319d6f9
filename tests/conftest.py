"""Shared fixtures: one rank pool per world size, and tiny checkpoints built once per session."""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import settings

from paradiff.testing.dist import RankPool
from paradiff.testing.models import FAMILIES, build_model, save_model
from paradiff_testkit import PRELOAD
from paradiff_testkit.pipelines import CACHE_ENV, PIPELINE_FAMILIES, References, save_pipeline

# The test kit (testkit/paradiff_testkit, on this process's path by pyproject's `pythonpath`) for every process the
# suite starts: rank pools and forked commands inherit sys.path, fresh interpreters (servers, torchrun) read PYTHONPATH.
TESTKIT = str(Path(__file__).resolve().parents[1] / "testkit")
if TESTKIT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTKIT, os.environ.get("PYTHONPATH")]))


# The test kit's learnt tokenizer vocabularies (paradiff_testkit.pipelines: _learn_bpe) are kept in one folder per
# session, which xdist workers, rank processes and forked commands inherit: each is learnt once, not once per process.
if CACHE_ENV not in os.environ:
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="paradiff-testkit-")
    atexit.register(shutil.rmtree, os.environ[CACHE_ENV], ignore_errors=True)


# Hypothesis draws the same examples on every run ("ci", the default), so a run on right code cannot fail on a case
# the last one never met; HYPOTHESIS_PROFILE=explore searches with fresh randomness while developing.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Under pytest-xdist (`make test`: two workers on this 2-core machine) each worker computes on one thread, and so do
# the processes it starts (fresh interpreters read OMP_NUM_THREADS; rank processes set one thread themselves): two
# workers of two OpenMP threads each contend for the two cores and spin-wait on each other (measured: test_families,
# test_demo and test_vae under two workers, 176-186 s with two threads each, 168-170 s with one).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The fast lane (`make test-fast`, -m "not slow") leaves out what starts processes: tests on the rank pools and the
# files that run the `paradiff` command or whole trainings as subprocesses.
SUBPROCESS_FILES = {"test_cli.py", "test_cli_video.py", "test_demo.py", "test_reliability.py", "test_stage_memory.py"}


# `make test` hands whole files to its two workers (--dist loadfile) in collection order (--no-loadscope-reorder;
# xdist's own order, by test count, put the 5-test, 2-minute test_demo.py among the last files, so one worker ran it
# alone at the end). The slowest files go first, the longest first (measured: pytest --durations=0, seconds summed
# per file), so that the files left at the end are short and the two workers finish together. A file not listed
# runs after them, in collection order; the list only orders, it decides no outcome.
SLOWEST_FIRST = ("test_families.py", "test_serve_ray.py", "test_serve.py", "test_demo.py", "test_lora.py",
                 "test_vae.py", "test_cli.py", "test_quantization.py", "test_compile.py", "test_text_encoders.py",
                 "test_demo_lora.py", "test_pipelines.py", "test_plan_toolkit.py", "test_encoder_classes.py",
                 "test_conditioning.py", "test_stage_memory.py", "test_lora_slots.py", "test_modular.py",
                 "test_doc_snippets.py", "test_cfg.py", "test_fsdp.py", "test_reliability.py", "test_serve_jobs.py",
                 "test_offload.py")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "pools" in getattr(item, "fixturenames", ()) or item.path.name in SUBPROCESS_FILES:
            item.add_marker(pytest.mark.slow)
    order = {name: position for position, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: a file's tests keep their order


class Pools:
    def __init__(self) -> None:
        self.pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self.pools.get(world_size)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.close(force=True)
            pool = self.pools[world_size] = RankPool(world_size, preload=PRELOAD)
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools():
    holder = Pools()
    yield holder
    holder.close()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(family, "single" | "sharded") -> folder of a tiny random-weight diffusers checkpoint."""
    root = tmp_path_factory.mktemp("checkpoints")
    folders = {}
    for family in FAMILIES:
        model = build_model(family)
        folders[(family, "single")] = save_model(model, root / f"{family}-single")
        folders[(family, "sharded")] = save_model(model, root / f"{family}-sharded", sharded=True)
    return folders


class TinyPipelineFolders(Mapping):
    """family -> folder of its tiny local pipeline, saved when first asked for, in the session's folder
    (PARADIFF_TESTKIT_CACHE): each family is built once per session, by whichever xdist worker needs it first (a
    worker that finds it saved reuses it; two saving at once is safe: save_pipeline renames a whole folder into
    place), and a worker whose files use three families builds three, not all of them."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __getitem__(self, family: str) -> Path:
        if family not in PIPELINE_FAMILIES:
            raise KeyError(family)
        # built inside a test now, not in a fixture's setup: its saving progress bars and warnings must not reach
        # the output a test captures and checks (capsys); shown only if the build fails
        console = io.StringIO()
        try:
            with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
                return save_pipeline(family, self.root / family)
        except BaseException:
            sys.__stderr__.write(console.getvalue())
            raise

    def __iter__(self):
        return iter(PIPELINE_FAMILIES)

    def __len__(self) -> int:
        return len(PIPELINE_FAMILIES)


@pytest.fixture(scope="session")
def tiny_pipeline_folders() -> TinyPipelineFolders:
    """family -> folder of its tiny local pipeline (tests/test_*pipelines.py, test_text_encoders.py), saved once."""
    return TinyPipelineFolders(Path(os.environ[CACHE_ENV]) / "tiny-pipelines")


@pytest.fixture(scope="session")
def references() -> References:
    """Diffusers' own single-process outputs of the tiny pipelines, made once per call in this process for the rank
    cases that compare a parallel pipeline against them (paradiff_testkit.pipelines.References)."""
    return References()
