"""The local launcher (`cli/launcher.py`) when a worker dies: who gets how long before the others are stopped."""

from __future__ import annotations

import time

from paradiff.cli.launcher import launch

WORKER = "paradiff_testkit.launched"


def test_a_servers_rank_0_answers_its_clients_after_another_rank_died_before_it_is_stopped(tmp_path):
    """A server (leader_grace_s): rank 1 dies; rank 0 takes longer than the dead-peer grace to answer, and still
    finishes (a loaded host once cut a server's answers off this way)."""
    code = launch(["follower-dies", str(tmp_path)], 2, WORKER, dead_grace_s=0.2, leader_grace_s=60.0)
    assert code == 1  # rank 1's exit code 9 is the run's failure
    assert (tmp_path / "died").exists() and (tmp_path / "answered").exists()


def test_when_rank_0_dies_the_others_get_only_the_dead_peer_grace(tmp_path):
    """Rank 0 is the one that answers: when it is the one that died, nobody is answering, and the others are
    stopped after the short grace, not the leader's."""
    started = time.monotonic()
    code = launch(["leader-dies", str(tmp_path)], 2, WORKER, dead_grace_s=0.2, leader_grace_s=600.0)
    assert code == 1
    assert time.monotonic() - started < 120.0  # far under the leader's grace, with room for a loaded host's start-up


def _launcher_of(folder):
    """A server's launcher (forward_signals) of the `signals` workers, a fresh interpreter in a process group of its
    own (workers started as fresh interpreters too: neither imports torch), once its rank 0 has its handlers."""
    import os
    import subprocess
    import sys

    script = (f"import sys; from paradiff.cli.launcher import launch; "
              f"sys.exit(launch(['signals', {str(folder)!r}], 2, {WORKER!r}, forward_signals=True))")
    process = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                               env=dict(os.environ, PARADIFF_START_WORKERS="exec"))
    deadline = time.monotonic() + 120
    while not (folder / "ready").exists():
        assert process.poll() is None and time.monotonic() < deadline, "rank 0 never got ready"
        time.sleep(0.02)
    return process


def test_a_sigterm_to_the_process_group_reaches_rank_0_as_one_request_to_drain(tmp_path):
    """systemd's control-group kill: SIGTERM reaches every process of the group, rank 0 itself and the launcher,
    which forwards it as the drain signal (rank 0 counts them as one request: serve/ranks.py); a SIGTERM to the
    launcher alone, twice: the drain signal, then the stop signal."""
    import os
    import signal

    from paradiff.distributed.spawn import DRAIN_SIGNAL, STOP_SIGNAL

    group = tmp_path / "group"
    group.mkdir()
    process = _launcher_of(group)
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert sorted((group / "signals").read_text().split()) == sorted(["SIGTERM", DRAIN_SIGNAL.name])
    alone = tmp_path / "alone"
    alone.mkdir()
    process = _launcher_of(alone)
    process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not (alone / "signals").exists():  # the first has reached rank 0
        assert time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert (alone / "signals").read_text().split() == [DRAIN_SIGNAL.name, STOP_SIGNAL.name]
