"""The `paradiff` command through its real entry point: generation, reports, data parallelism, errors, faults."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image

from paradiff.cli.embedded import embedded_default
from paradiff.cli.relay import NativeTraceFilter
from paradiff.distributed.spawn import free_port
from paradiff_testkit import command
from paradiff_testkit.beside import beside

SMALL = ["--steps", "2", "--height", "32", "--width", "32"]


def paradiff(*args: str, env: dict | None = None, timeout: float = 300,
             module: str = "paradiff.cli") -> subprocess.CompletedProcess:
    return command.run(["-m", module, *args], timeout=timeout, env=dict(os.environ, **(env or {})))


def _no_workers_left(marker: str, timeout_s: float = 30) -> bool:
    """Whether no process with `marker` in its command line is left, polled (bounded): on a loaded machine the
    kernel may take a while to reap the workers the launcher stopped."""
    deadline = time.monotonic() + timeout_s
    while subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.strip():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_generate_embedded_default_with_compare(tmp_path):
    out = tmp_path / "out"
    # The fault hooks live in paradiff_testkit.faults: the product command ignores their variable.
    result = paradiff("generate", "--tp", "2", "--prompt", "a cat", *SMALL, "--compare", "--out", str(out),
                      env={"PARADIFF_INJECT_FAULT": "1:raise"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["tp"] == 2 and report["config"]["world_size"] == 2
    assert report["resolution"] == [32, 32] and report["steps"] == 2 and report["prompts"] == ["a cat"]
    assert len(report["ranks"]) == 2
    for rank in report["ranks"]:
        assert rank["load_s"] > 0 and rank["step_s_median"] > 0 and rank["peak_memory_bytes"] > 10**7
        assert len(rank["step_s"]) == 2 and all(seconds > 0 for seconds in rank["step_s"])  # each step's time
    assert report["max_abs_diff_vs_single_process"] < 1e-5
    assert report["config"]["parallel_vae"] is True  # the VAE's rows were split over the two ranks
    assert Image.open(out / "0000.png").size == (32, 32)
    assert "max |difference| to the single-process image" in result.stdout
    # compare.png: one row (single process | parallel | difference), each panel 32 px + 2 px gap, enlarged 3x,
    # under its prompt (12 px) and the panels' titles (14 px)
    assert report["compared_outputs"] == 1 and report["compare_png"] == str(out / "compare.png")
    assert Image.open(out / "compare.png").size == (3 * 34 * 3, 34 * 3 + 12 + 14)
    assert "0000.png  a cat" in result.stdout and "compare.png" in result.stdout


@pytest.mark.parametrize("spec", ["fbc", "fbc:-1", "fbc:x", "taylorseer", "taylorseer:0", "taylorseer:2:1:1"])
def test_bad_cache_spec(spec):
    from paradiff.cli.args import CliError, cache_config

    with pytest.raises(CliError, match=f"--cache {spec}: use fbc:THRESHOLD .* or taylorseer:INTERVAL"):
        cache_config(spec)


def test_cache_spec():
    from paradiff.cli.args import cache_config

    assert cache_config("fbc:0.08").threshold == 0.08
    config = cache_config("taylorseer:3:2")
    assert (config.cache_interval, config.disable_cache_before_step) == (3, 2)
    # with the model: TaylorSeer predicts whole blocks (Wan's attention modules `attn1` escape diffusers' defaults)
    from paradiff.testing.models import build_model

    assert cache_config("taylorseer:3", build_model("wan")).cache_identifiers == [r"blocks\.\d+"]


@pytest.mark.parametrize("spec,parallel_vae", [("fbc:0.6", True), ("taylorseer:2:1", False)])
def test_generate_compiled_and_cached_lists_the_computed_steps(tmp_path, spec, parallel_vae):
    """--compile and --cache on 2 Ulysses ranks: the image equals a single-process run with the same cache, and the
    report says which steps ran every block. The second run also decodes whole on each rank (--no-parallel-vae): the
    same image. Backend "eager" (Dynamo's tracing, guards and graphs, run as traced): this checks the command's
    plumbing; what AOTAutograd and inductor do with the blocks' graphs, cache included, is tests/test_compile.py's."""
    out = tmp_path / "out"
    vae_flag = [] if parallel_vae else ["--no-parallel-vae"]
    result = paradiff("generate", "--ulysses", "2", "--steps", "4", "--height", "32", "--width", "32", "--compile",
                      "--compile-backend", "eager", "--cache", spec, *vae_flag, "--compare", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["compile"] is True
    assert report["config"]["parallel_vae"] is parallel_vae
    computed = report["cache"]["computed_steps"]["0"]["cond"]
    assert report["cache"]["spec"] == spec and computed[0] == 0 and 1 <= len(computed) < 4, report["cache"]
    assert report["max_abs_diff_vs_single_process"] < 1e-5
    assert f"output 0000 (cond) computed steps {computed}, {len(computed)} of 4" in result.stdout


def test_data_parallel_prompts_file_one_png_per_prompt(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n\na dog\na red cube\n")
    out = tmp_path / "out"
    single = tmp_path / "single"
    # the 1-process run below is started beside the data-parallel one: neither reads what the other writes
    result, alone = beside(
        lambda: paradiff("generate", "--prompt", "a cat", "--prompt", "a dog", *SMALL, "--out", str(single)),
        lambda: paradiff("generate", "--dp", "2", "--prompts-file", str(prompts), *SMALL, "--out", str(out)))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert sorted(report["images"]) == ["0", "1", "2"]
    assert sorted(p.name for p in out.glob("*.png")) == ["0000.png", "0001.png", "0002.png"]
    # prompt i uses seed + i whichever replica made it: the same image as a 1-process run of that prompt alone
    result = alone
    assert result.returncode == 0, result.stderr[-3000:]
    assert Image.open(single / "0001.png").tobytes() == Image.open(out / "0001.png").tobytes()


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "/nonexistent/model"], "model folder /nonexistent/model does not exist"),
        (["generate", "--prompts-file", "/nonexistent/prompts.txt"], "cannot read --prompts-file"),
        (["generate", "--height", "40"], "--height 40 and --width 64 must be multiples of 16"),
        (["generate", "--cfg", "3"], "--cfg 3: the embedded demo pipeline: Flux2Pipeline never runs classifier-free"),
        (["generate", "--tp", "0"], "expected a positive integer, got 0"),
        (["generate", "--cache", "teacache:0.1"], "--cache teacache:0.1: use fbc:THRESHOLD"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(tmp_path, args, message):
    result = paradiff(*args, "--out", str(tmp_path / "out"), timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_output_folder_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = paradiff("generate", "--out", str(blocker / "sub"), timeout=60)
    assert result.returncode == 2 and "is not writable" in result.stderr and "Traceback" not in result.stderr


# A rank drawing other initial latents ("1:seed") stops every rank with one named error: tests/test_pipelines.py
# checks that on the rank pool; the launcher's side of a reported failure is the "1:raise" case.
@pytest.mark.parametrize("fault", ["1:raise", "0:exit"])
def test_failing_worker_ends_the_run_non_zero_with_no_process_left(tmp_path, fault):
    """One line per failure on the console; `0:exit` kills the rank that hosts the store, so the survivor's c10d
    prints a C++ backtrace, which the launcher must hide."""
    embedded_default()  # built here, so that its saving progress bar is not part of the output checked below
    kind = fault.partition(":")[2]
    marker = f"paradiff-fault-{kind}-{os.getpid()}"
    out = tmp_path / marker
    stamp = tmp_path / "fault-time"
    result = paradiff("generate", "--ulysses", "2", *SMALL, "--timeout", "30", "--out", str(out),
                      env={"PARADIFF_INJECT_FAULT": fault, "PARADIFF_FAULT_STAMP": str(stamp)},
                      module="paradiff_testkit.faults")
    fault_to_exit = time.time() - float(stamp.read_text())
    assert result.returncode != 0
    if kind == "raise":
        assert "paradiff: rank 1 failed: RuntimeError: injected fault on rank 1" in result.stderr
        assert "exited with code 1 first; stopped the run" in result.stderr
        assert "paradiff: rank 0 failed: DistributedError: rank 1 failed with RuntimeError: injected fault" in result.stderr
    if kind == "exit":
        assert "paradiff: rank 0 exited with code 9 first; stopped the run" in result.stderr
        if "paradiff: rank 1 failed" in result.stderr:  # then it read the dead store, and c10d printed a backtrace
            assert "1 native stack trace(s) hidden; PARADIFF_DEBUG=1 shows them" in result.stderr
        assert "Exception raised from" not in result.stderr and "frame #" not in result.stderr
        # far below the collective timeout (30 s): the launcher stops the peers of a dead rank at once (~1-3 s)
        assert fault_to_exit < 10, fault_to_exit
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("paradiff: ") for line in lines), result.stderr[-3000:]
    assert fault_to_exit < 30, fault_to_exit
    assert _no_workers_left(marker)


# What a console must not show on a failing run without --debug: Python tracebacks, native (C++) frames, and the
# warnings libraries print while they are imported (runtime/import_noise.py)
NOT_ON_A_CONSOLE = ("Traceback (most recent call last)", "Exception raised from", "frame #", "Failed to load",
                    "Unable to import", "requires torchvision", "is an Enum subclass", "Warning:")


def test_failing_runs_print_only_paradiffs_lines(tmp_path):
    """Ten ways to fail, from a bad flag to a plan every rank refuses after loading: each exits non-zero and its
    console holds paradiff's one-line messages and nothing else. Run four at a time: each is a forked command."""
    from concurrent.futures import ThreadPoolExecutor

    embedded_default()  # built here, so that its saving progress bar is not part of the consoles checked below
    bad_lora = tmp_path / "style.safetensors"
    bad_lora.write_bytes(bytes(range(256)) * 2)  # not a safetensors file
    bad_plan = tmp_path / "plan.py"
    bad_plan.write_text("def tensor_parallel_plan(config):\n    return {'no_such_module.*': 'colwise'}\n")
    cases = [
        ["generate", "--steps", "-3"],
        ["generate", "--tp", "0"],
        ["generate", "--quantize", "int4"],
        ["generate", "/nonexistent/model"],
        ["generate", "--lora", str(tmp_path / "missing.safetensors")],
        ["generate", "--lora", str(bad_lora), *SMALL],  # a worker fails while loading
        ["generate", "--plan", str(bad_plan), "--tp", "2", *SMALL],  # both ranks fail while loading
        ["check-plan", "NoSuchTransformer", "--tp", "2"],
        ["plans", "NoSuchTransformer"],
        ["serve", "--port", "0"],
    ]
    env = {key: value for key, value in os.environ.items() if key != "PARADIFF_DEBUG"}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda argv: command.run(["-m", "paradiff.cli", *argv, "--out",
                                                          str(tmp_path / f"out{cases.index(argv)}")],
                                                         env=env, timeout=300), cases))
    for argv, result in zip(cases, results):
        assert result.returncode not in (0, None), (argv, result.stderr[-3000:])
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines and all(line.startswith("paradiff") for line in lines), (argv, result.stderr[-3000:])
        assert not [text for text in NOT_ON_A_CONSOLE if text in result.stderr + result.stdout], (argv, result.stderr)


NATIVE_NOISE = b"""paradiff: rank 1 failed: DistributedError: a collective failed on rank 1
[rank1]:[W1130 13:10:34.576357025 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=3): Failed to recv
Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:784 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7ff81af79b in libc10.so)
<omitting python frames>
frame #49: _start + 0x21 (0x564a9f408081 in /work/main/.venv/bin/python)

[W1130 13:10:35.000000000 ProcessGroupGloo.cpp:12] a native warning without a backtrace
UserWarning: a Python warning
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG 0 Rank 1] Process group watchdog thread terminated with exception
Exception raised from ncclCommWatchdog at ProcessGroupNCCL.cpp:1
frame #0: c10::Error::Error + 0x1

paradiff: rank 0 failed: DistributedError: a collective failed on rank 0
"""


def test_native_backtraces_are_dropped_and_everything_else_kept():
    trace_filter = NativeTraceFilter()
    shown = [kept for line in NATIVE_NOISE.splitlines() for kept in trace_filter.feed(line)] + trace_filter.flush()
    assert shown == [
        b"paradiff: rank 1 failed: DistributedError: a collective failed on rank 1",
        b"[W1130 13:10:35.000000000 ProcessGroupGloo.cpp:12] a native warning without a backtrace",
        b"UserWarning: a Python warning",
        b"paradiff: rank 0 failed: DistributedError: a collective failed on rank 0",
    ]
    assert trace_filter.dropped_traces == 2


def test_two_nodes_on_loopback(tmp_path):
    """Two torchrun 'nodes' (--nnodes 2), one process each, form one tp=2 mesh (torchrun's launch code, its workers
    forked: tests/torchrun_node.py)."""
    port = free_port()
    out = tmp_path / "out"
    nodes = [command.start([str(Path(__file__).with_name("torchrun_node.py")), "--nnodes", "2", "--nproc-per-node",
                            "1", "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                            f"127.0.0.1:{port}", "--max-restarts", "0", "-m", "paradiff.cli", "generate", "--tp", "2",
                            *SMALL, "--prompt", "a red circle on a blue background", "--out", str(out)])
             for rank in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), [o[1][-2000:] for o in outputs]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["world_size"] == 2 and len(report["ranks"]) == 2
    assert (out / "0000.png").is_file()


def test_bench_prints_a_table_for_each_configuration(tmp_path):
    result = paradiff("bench", "--configs", "single,tp=2", "--steps", "2", "--height", "32", "--width", "32",
                      "--out", str(tmp_path / "bench"))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert lines[0].startswith("| mode | time / image")
    rows = {line.split("|")[1].strip(): line for line in lines[2:]}
    assert set(rows) == {"single", "tp=2"}
    for row in rows.values():
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and float(cells[3]) > 0 and cells[4] == "32x32"


def test_python_dash_m_paradiff_is_the_command():
    """`python -m paradiff` runs what the `paradiff` script does (a user's first guess without the script on PATH)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "paradiff", "--version"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("paradiff "), (result.stdout, result.stderr)
