"""Loading progress: a byte bar on rank 0 when asked (or on a terminal), nothing otherwise."""

from __future__ import annotations

import paradiff
from paradiff.testing.models import model_class


def test_progress_bar_counts_bytes_when_enabled(checkpoints, capsys):
    paradiff.from_pretrained(model_class("flux2"), checkpoints[("flux2", "sharded")], progress=True)
    err = capsys.readouterr().err
    assert "paradiff: loading" in err and "100%" in err


def test_quiet_when_not_a_terminal(checkpoints, capsys):
    paradiff.from_pretrained(model_class("flux2"), checkpoints[("flux2", "sharded")])
    assert "paradiff: loading" not in capsys.readouterr().err
