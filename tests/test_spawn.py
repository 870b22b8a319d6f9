"""free_port and the local rank spawner: results by rank, the first failing rank named, no process left behind."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from paradiff.distributed import spawn
from paradiff.distributed.spawn import RankFailed, RankTimeout, can_fork_workers, free_port, rank_env, run_ranks

TESTS = os.path.dirname(os.path.abspath(__file__))


def report_env(rank: int, world_size: int) -> tuple:
    return rank, world_size, os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"], os.getpid()


def fail_on_rank_one(rank: int, world_size: int, pid_file: str) -> int:
    with open(f"{pid_file}.{rank}.part", "w") as handle:
        handle.write(str(os.getpid()))
    os.rename(f"{pid_file}.{rank}.part", f"{pid_file}.{rank}")  # whole or absent, whenever the rank is stopped
    if rank == 1:
        # only once rank 0 has written its pid (on a loaded machine it may not have started yet): the test must
        # see which process the spawner had to stop
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{pid_file}.0") and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ValueError("rank one breaks")
    time.sleep(600)  # a peer stuck waiting: the spawner must kill it
    return rank


def sleep_forever(rank: int, world_size: int) -> None:
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def world_sum(rank: int | None = None, world_size: int | None = None, init: bool = False) -> float:
    """The sum over the world of rank + 1, after an env:// init of its own where `init` (as run_ranks' targets
    without gloo_timeout_s do)."""
    import torch
    import torch.distributed as dist

    if init:
        dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    if init:
        dist.destroy_process_group()
    return float(total)


def test_ranks_meet_though_another_process_took_the_port_free_port_picked(monkeypatch):
    """free_port's race, forced: the port it picks is bound and listened on by someone else before any rank starts.
    run_ranks (with its gloo group, and with the target's own env:// init) and a RankPool still meet, on a store the
    parent serves on a port it bound and kept (host_store)."""
    from paradiff.testing import dist as pool_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(spawn, "free_port", lambda: taken.getsockname()[1])
        monkeypatch.setattr(pool_module, "free_port", lambda: taken.getsockname()[1], raising=False)
        assert run_ranks(world_sum, 2, timeout_s=120, grace_s=1.0, gloo_timeout_s=60) == [3.0, 3.0]
        assert run_ranks(world_sum, 2, kwargs=dict(init=True), timeout_s=120, grace_s=1.0) == [3.0, 3.0]
        pool = pool_module.RankPool(2)
        try:
            assert pool.run(world_sum, timeout_s=120) == [3.0, 3.0]
        finally:
            pool.close()


def test_rank_env_names_the_rank_and_world():
    assert rank_env(1, 2, 1234) == dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="1234", RANK="1", WORLD_SIZE="2",
                                        LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")


def test_results_come_back_by_rank_with_each_rank_env():
    results = run_ranks(report_env, 2, timeout_s=120)
    assert [r[:4] for r in results] == [(0, 2, "0", "2"), (1, 2, "1", "2")]
    assert results[0][4] == results[1][4]  # one port for the world
    assert not any(_alive(r[5]) for r in results)


def test_a_failing_rank_is_named_and_no_process_is_left_behind(tmp_path):
    pid_file = str(tmp_path / "pid")
    with pytest.raises(RankFailed) as failure:
        run_ranks(fail_on_rank_one, 2, kwargs=dict(pid_file=pid_file), timeout_s=120, grace_s=1.0)
    assert failure.value.rank == 1
    assert failure.value.summary == "ValueError: rank one breaks"
    assert "rank one breaks" in str(failure.value)
    pids = [int(open(f"{pid_file}.{rank}").read()) for rank in range(2)]
    assert not any(_alive(pid) for pid in pids)


def test_a_hang_times_out_naming_the_ranks():
    with pytest.raises(RankTimeout) as timeout:
        run_ranks(sleep_forever, 2, timeout_s=3)
    assert timeout.value.missing == [0, 1]


STARTER = """
import json, os, sys
from paradiff.distributed import spawn
spawn.WORKER_PRELOAD = ("xml.dom.minidom",)  # light, and absent from a fresh interpreter
envs = [dict(os.environ, PROBE_RANK=str(rank)) for rank in range(2)]
workers = spawn.start_commands("spawn_probe", sys.argv[1:], envs)
kinds = [type(worker).__name__ for worker in workers]
if sys.argv[1] == "sleep":
    for worker in workers:
        assert worker.poll() is None
        worker.kill()
print(json.dumps({"kinds": kinds, "codes": [worker.wait(timeout=120) for worker in workers],
                  "said": [worker.stderr.read().decode() for worker in workers]}))
"""


@pytest.mark.parametrize("how", ["fork", "exec"])
def test_started_commands_run_the_module_with_their_environment_and_stderr_pipe(how):
    """The launcher's workers (in a fresh process, as the launcher is): forked from it after its preload (no
    accelerator here) or fresh interpreters, the same module, arguments, environment, stderr pipe and exit codes."""
    env = dict(os.environ, PARADIFF_START_WORKERS=how, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    done = subprocess.run([sys.executable, "-c", STARTER, "3", "x"], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["kinds"] == ["ForkedCommand" if how == "fork" else "Popen"] * 2
    assert result["codes"] == [3, 4]
    for rank, said in enumerate(result["said"]):
        assert said.startswith(f"rank {rank} argv 3 x preloaded {how == 'fork'}"), said


def test_a_forked_command_killed_reports_the_signal():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, *sys.path]))
    done = subprocess.run([sys.executable, "-c", STARTER, "sleep"], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["codes"] == [-9, -9]


def test_workers_start_fresh_where_an_accelerator_device_exists(monkeypatch):
    monkeypatch.delenv("PARADIFF_START_WORKERS", raising=False)
    assert can_fork_workers()  # this machine has none
    monkeypatch.setattr(spawn, "ACCELERATOR_NODES", (os.devnull,))
    assert not can_fork_workers()
