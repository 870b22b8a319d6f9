"""Staged execution through `paradiff generate`: with a text encoder and a transformer of a few hundred MB each, a
tp=2 staged run peaks (RssAnon, per rank) below 0.6 x the all-resident single-process run, and report.json's
per-stage figures agree with what this test measures from outside the workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from paradiff.io.checkpoint import Checkpoint
from paradiff_testkit.pipelines import save_medium_lumina2

MIB = 2**20


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _rss_anon(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), None)


def _weights(folder: Path) -> int:
    with Checkpoint(folder) as checkpoint:
        return sum(info.nbytes for info in checkpoint.tensors.values())


def test_staged_tp2_peak_is_below_the_resident_single_process_peak(tmp_path_factory):
    folder = save_medium_lumina2(tmp_path_factory.mktemp("medium") / "lumina2")
    root = tmp_path_factory.mktemp("runs")
    common = ["generate", str(folder), "--prompt", "a red fox in the snow", "--steps", "1", "--height", "64",
              "--width", "64"]
    runs = {
        "single": [*common, "--out", str(root / "single")],
        "staged": [*common, "--tp", "2", "--stages", "--out", str(root / "staged")],
    }
    # both at once: the machine has the memory, and the wall time is the longer run, not the sum
    launchers = {name: subprocess.Popen([sys.executable, "-m", "paradiff.cli", *argv], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, env=dict(os.environ))
                 for name, argv in runs.items()}
    by_pid: dict[tuple[str, int], int] = {}  # the launchers' children (the workers) by pid; report.json names ranks
    watched: dict[int, str] = {}
    deadline = time.monotonic() + 420
    next_scan = 0.0
    while any(p.poll() is None for p in launchers.values()) and time.monotonic() < deadline:
        if time.monotonic() >= next_scan:
            # new workers: a walk over every process of the host (costly on a busy one) four times a second; a
            # worker spends its first seconds importing torch, far below its peak
            for name, launcher in launchers.items():
                for pid in _children(launcher.pid):
                    watched.setdefault(pid, name)
            next_scan = time.monotonic() + 0.25
        for pid, name in watched.items():
            sample = _rss_anon(pid)
            if sample is not None:
                by_pid[(name, pid)] = max(by_pid.get((name, pid), 0), sample)
        time.sleep(0.02)
    outputs = {}
    for name, launcher in launchers.items():
        if launcher.poll() is None:
            launcher.kill()
        outputs[name] = launcher.communicate()
        assert launcher.returncode == 0, (name, outputs[name][1][-3000:])
    single = json.loads((root / "single" / "report.json").read_text())["ranks"]
    staged = json.loads((root / "staged" / "report.json").read_text())["ranks"]
    ranks = {(name, entry["pid"]): entry["rank"] for name, run in (("single", single), ("staged", staged))
             for entry in run}
    measured = {(name, ranks[(name, pid)]): peak for (name, pid), peak in by_pid.items() if (name, pid) in ranks}
    assert "per-stage figures" in outputs["staged"][0] and "text_encoders" in outputs["staged"][0]

    encoder, transformer, vae = (_weights(folder / name) for name in ("text_encoder", "transformer", "vae"))
    assert encoder > 200 * MIB and transformer > 200 * MIB  # a few hundred MB each

    single_peak = max(stage["peak_bytes"] for stage in single[0]["stages"])
    for stage in single[0]["stages"]:  # all resident: every stage holds every weight
        assert stage["parameter_bytes"] == encoder + transformer + vae, stage
    expected_share = {"text_encoders": encoder, "transformer": transformer}
    for rank in staged:
        stages = {stage["stage"]: stage for stage in rank["stages"]}
        assert list(stages) == ["text_encoders", "transformer", "vae"], rank["stages"]
        for name, full in expected_share.items():  # only this stage's weights, about half of them
            assert 0.45 <= stages[name]["parameter_bytes"] / full <= 0.55, (rank["rank"], name, stages[name])
        assert stages["vae"]["parameter_bytes"] == vae, stages["vae"]
        peak = max(stage["peak_bytes"] for stage in rank["stages"])
        assert peak < 0.6 * single_peak, (rank["rank"], peak / MIB, single_peak / MIB)

    # the reported peaks are what an outside observer of the worker processes saw
    for (name, rank), seen in measured.items():
        reported = max(stage["peak_bytes"] for stage in (single if name == "single" else staged)[rank]["stages"])
        assert abs(reported - seen) <= max(0.1 * seen, 48 * MIB), (name, rank, reported / MIB, seen / MIB)
    assert {key for key in measured} == {("single", 0), ("staged", 0), ("staged", 1)}
