"""What the `paradiff` command shows a user, in process: --help and --version, argument errors in one line, no
traceback when its output is cut off or an unexpected error occurs, and the pictures of --compare."""

from __future__ import annotations

import io
import os
import re

import numpy as np
import pytest

from paradiff.cli import main
from paradiff.cli.args import build_parser
from paradiff.cli.compare import picture_rows, write_compare_png
from paradiff.io.outputs import Output


def _help(capsys, command: str) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([command, "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width


def _option_help(text: str, option: str) -> str:
    """The description of `option` in a --help text flattened to one line: from the option to the next one."""
    match = re.search(rf" {re.escape(option)} [A-Z_]+ (.*?)(?= --[a-z]| -h,|$)", text)
    assert match, option
    return match.group(1)


@pytest.mark.parametrize("option,default", [
    ("--tp", "1"), ("--ulysses", "1"), ("--ring", "1"), ("--cfg", "1"), ("--dp", "1"), ("--height", "64"),
    ("--width", "64"), ("--seed", "0"), ("--negative-prompt", None), ("--guidance-scale", "the pipeline's own"),
])
def test_generate_help_describes_each_option_with_its_default(capsys, option, default):
    text = _option_help(_help(capsys, "generate"), option)
    assert len(text) > 20, text  # a description, not only the default
    if default is not None:
        assert f"(default: {default})" in text, text


def test_serve_help_shows_the_defaults(capsys):
    text = _help(capsys, "serve")
    for option, default in (("--port", "8000"), ("--max-queue", "64"), ("--max-n", "4"),
                            ("--request-timeout", "600.0"), ("--out", "out/serve")):
        assert f"(default: {default})" in _option_help(text, option), option
    for option in ("--max-steps", "--max-side", "--max-frames"):  # from what the server was started with
        assert "(default: twice" in _option_help(text, option), option


def test_version(capsys):
    from paradiff import __version__

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"paradiff {__version__}\n"


@pytest.mark.parametrize("argv,line", [
    (["generate", "--steps", "-3"], "paradiff generate: error: --steps: expected a positive integer, got -3"),
    (["generate", "--tp", "0"], "paradiff generate: error: --tp: expected a positive integer, got 0"),
    (["generate", "--quantize", "int4"], "paradiff generate: error: --quantize: invalid choice: 'int4'"),
    (["serve", "--port", "70000"], "paradiff serve: error: --port: expected a TCP port from 1 to 65535"),
    (["nonsense"], "paradiff: error: command: invalid choice: 'nonsense'"),
])
def test_an_argument_error_is_one_line_without_the_usage(capsys, argv, line):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.count("\n") == 1 and err.startswith(line), err
    assert err.rstrip().endswith(f"see {line.split(': error')[0]} --help"), err


def test_debug_is_taken_before_or_after_the_command():
    parser = build_parser()
    assert [parser.parse_args(argv).debug for argv in (["plans"], ["--debug", "plans"], ["plans", "--debug"])] == \
        [False, True, True]


class _ClosedPipe(io.TextIOBase):
    """A stdout whose reader went away (`paradiff plans | head` once head has its lines), on file descriptor `fd`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        return self.fd


def test_a_reader_that_went_away_ends_the_command_quietly(capsys, monkeypatch, tmp_path):
    import paradiff.cli.plans

    # the coverage table, without the seconds of building it
    monkeypatch.setattr(paradiff.cli.plans, "plans_command", lambda _args: print("class  plan file ...") or 0)
    with open(tmp_path / "stdout", "w") as handle:
        monkeypatch.setattr("sys.stdout", _ClosedPipe(handle.fileno()))
        assert main(["plans"]) == 141  # 128 + SIGPIPE, as `yes | head` ends
        # the descriptor now writes to /dev/null, so the interpreter's last flush has nothing to complain about
        assert os.path.samestat(os.fstat(handle.fileno()), os.stat(os.devnull))
    assert capsys.readouterr().err == ""


def test_an_unexpected_error_is_one_line_unless_debugging(capsys, monkeypatch):
    import paradiff.cli.plans

    def broken(_args):
        raise TypeError("'function' object is not iterable\nsecond line")

    monkeypatch.setattr(paradiff.cli.plans, "plans_command", broken)
    monkeypatch.delenv("PARADIFF_DEBUG", raising=False)
    assert main(["plans", "SomeModel"]) == 1
    assert capsys.readouterr().err == ("paradiff: error: TypeError: 'function' object is not iterable "
                                       "(paradiff --debug shows the traceback)\n")
    with pytest.raises(TypeError):
        main(["plans", "SomeModel", "--debug"])
    assert os.environ.pop("PARADIFF_DEBUG") == "1"  # what the workers it would start inherit


def test_compare_png_writes_each_rows_prompt_cut_to_its_width(tmp_path):
    from PIL import Image

    pairs = [(np.full((16, 16, 3), 0.5), np.full((16, 16, 3), 0.5))] * 2
    long_prompt = "a very long prompt " * 20
    write_compare_png(tmp_path / "compare.png", pairs, scale=1, captions=["a cat", long_prompt])
    page = np.asarray(Image.open(tmp_path / "compare.png").convert("L"))
    row = 18 + 12  # 16 px + 2 px gap, under a 12 px caption
    assert page.shape == (14 + 2 * row, 3 * 18)
    for number in range(2):
        caption = page[14 + number * row: 14 + number * row + 12]
        assert (caption < 128).any()  # text drawn there
        image = page[14 + number * row + 12: 14 + number * row + 12 + 16, :16]
        assert (image == 128).all()  # and not over the pictures
    # the long prompt filled its row's width and was cut, the short one stayed short
    assert (page[14 + row: 14 + row + 12, -8:] < 128).any() and not (page[14:26, 30:] < 128).any()


def test_a_video_is_compared_on_its_first_middle_and_last_frames():
    frames = np.random.default_rng(0).random((5, 8, 8, 3))
    video, reference = Output("video", frames), Output("video", frames * 0.5)
    sound = Output("audio", np.zeros((1, 100)))
    pairs, captions = picture_rows([reference, Output("audio", np.zeros((1, 100)))],
                                   [(0, "a red fox", video), (1, "rain", sound)])
    assert captions == ["frame 0/4: a red fox", "frame 2/4: a red fox", "frame 4/4: a red fox"]
    for (single, parallel), frame in zip(pairs, (0, 2, 4)):
        assert (single == frames[frame] * 0.5).all() and (parallel == frames[frame]).all()
    image = Output("image", frames[0])
    assert picture_rows([image], [(0, "a cat", image)])[1] == ["a cat"]


def test_attention_backend_flag_is_checked_before_any_process_or_weight():
    """--attention-backend: an unknown name, or one without the LSE under --ring, stops the launcher; each worker
    checks its own device and dtype before reading a weight (here a CUDA rank in float32, refused by sdpa-flash)."""
    import torch

    from paradiff.cli.args import CliError, check_args
    from paradiff.cli.worker import load_from_args
    from paradiff.errors import ParallelConfigError

    for argv, message in ((["--attention-backend", "nope"], "--attention-backend nope: Unknown attention backend 'nope'"),
                          (["--attention-backend", "sdpa", "--ring", "2"],
                           "--attention-backend sdpa: Attention backend 'sdpa' cannot run here: it returns no log-sum-exp")):
        with pytest.raises(CliError, match=re.escape(message)):
            check_args(build_parser().parse_args(["generate", *argv]))
    args = build_parser().parse_args(["generate", "--attention-backend", "sdpa-flash", "--dtype", "float32"])
    check_args(args)
    with pytest.raises(ParallelConfigError, match="'sdpa-flash' cannot run here: it takes float16, bfloat16 "
                                                           "on CUDA, not float32; backends that can: \\['native'"):
        load_from_args(args, torch.device("cuda"))
