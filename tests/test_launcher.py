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
