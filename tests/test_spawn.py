"""free_port and the local rank spawner: results by rank, the first failing rank named, no process left behind."""

from __future__ import annotations

import os
import socket
import time

import pytest

from paradiff.distributed.spawn import RankFailed, RankTimeout, free_port, rank_env, run_ranks


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
