"""Progress: a bar of bytes while loading and of steps while denoising, on rank 0 when asked (or on a terminal),
nothing otherwise."""

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


def test_a_bar_of_steps_when_enabled_and_silence_otherwise(capsys):
    from paradiff.runtime.progress import step_progress

    with step_progress(3, "paradiff: denoising", enabled=True) as advance:
        for _ in range(3):
            advance(1)
    err = capsys.readouterr().err
    assert "paradiff: denoising" in err and "3/3" in err
    with step_progress(3, "paradiff: denoising", enabled=False) as advance:
        advance(1)
    assert capsys.readouterr().err == ""
