"""Every Python snippet of README.md and docs/*.md that calls paradiff's parallel API either runs under torchrun as
written, with the Hub ids swapped for tiny local pipelines and the calls made small, and exits 0 on every rank; or
is marked, on the line before its fence, `<!-- snippet-skip: REASON -->` (a fragment continuing another snippet, a
file or GPU the suite does not have), and the test prints what it skipped and why.

A runnable snippet is a program: its first line is `# torchrun --nproc-per-node N ...`. The snippets of one world
size run in one torchrun launch (tests/torchrun_node.py: torchrun's agent, workers forked from the preloaded node),
each snippet in its own child of every worker (tests/doc_snippet_runner.py), so each makes its own process group."""

from __future__ import annotations

import re
from pathlib import Path

from paradiff.distributed.spawn import free_port
from paradiff_testkit import command
from paradiff_testkit.pipelines import default_call_kwargs, save_pipeline

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"(?:<!-- snippet-skip: (?P<skip>.*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
PARALLEL_API = re.compile(r"paradiff\.(from_pretrained|from_single_file|enable_parallelism|load_pipeline|"
                          r"parallelize_vae)\(")
PROGRAM = re.compile(r"# torchrun --nproc-per-node (\d+)")
# Hub id -> the tiny pipeline family that stands in for it
TINY = {"black-forest-labs/FLUX.2-dev": "flux2", "Qwen/Qwen-Image": "qwenimage"}
# pipeline calls made small, one step (the tiny pipelines' own defaults draw 1024 x 1024 in 50 steps)
SMALL_CALL = ("height", "width", "num_inference_steps", "max_sequence_length")

PREAMBLE = '''
import paradiff as _paradiff

_load_pipeline = _paradiff.load_pipeline


class _SmallCalls:
    """The loaded pipeline, its calls given the tiny pipeline's small sizes unless the snippet sets them."""

    def __init__(self, pipeline, small):
        self._pipeline, self._small = pipeline, small

    def __getattr__(self, name):
        return getattr(self._pipeline, name)

    def __call__(self, *args, **kwargs):
        return self._pipeline(*args, **{**self._small, **kwargs})


def _small_load_pipeline(path, *args, **kwargs):
    return _SmallCalls(_load_pipeline(path, *args, **kwargs), SMALL.get(str(path), {}))


_paradiff.load_pipeline = _small_load_pipeline
'''


def doc_snippets() -> list[tuple[str, str | None, str]]:
    """(where, skip reason or None, code) of every Python snippet calling the parallel API."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if PARALLEL_API.search(match["code"]):
                line = text[:match.start("code")].count("\n")
                found.append((f"{path.relative_to(ROOT)}:{line}", match["skip"], match["code"]))
    return found


def test_doc_snippets_run_under_torchrun(tmp_path):
    snippets = doc_snippets()
    skipped = [(where, reason) for where, reason, _ in snippets if reason]
    programs = [(where, code) for where, reason, code in snippets if not reason]
    unmarked = [where for where, code in programs if not PROGRAM.match(code)]
    assert not unmarked, f"snippets neither a torchrun program nor marked <!-- snippet-skip: reason -->: {unmarked}"
    folders = {family: save_pipeline(family, tmp_path / "tiny" / family) for family in set(TINY.values())}
    small = {str(folders[family]): {**{key: value for key, value in default_call_kwargs(family).items()
                                       if key in SMALL_CALL}, "num_inference_steps": 1} for family in folders}
    by_world: dict[int, dict[str, str]] = {}
    for index, (where, code) in enumerate(programs):
        for hub_id, family in TINY.items():
            code = code.replace(f'"{hub_id}"', repr(str(folders[family])))
        header, _, body = code.partition("\n")
        script = f"{header}\nSMALL = {small!r}\n{PREAMBLE}\n{body}"
        world = int(PROGRAM.match(code)[1])
        name = f"{index:02d}_{re.sub(r'[^A-Za-z0-9]+', '_', where)}.py"
        folder = tmp_path / f"world{world}"
        folder.mkdir(exist_ok=True)
        (folder / name).write_text(script)
        by_world.setdefault(world, {})[name] = where
    node = str(Path(__file__).with_name("torchrun_node.py"))
    for world, names in by_world.items():  # one launch at a time: 2 + 4 ranks at once overloaded 2 cores under xdist
        launch = command.start([node, "--nnodes", "1", "--nproc-per-node", str(world), "--rdzv-backend", "c10d",
                                "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0",
                                "-m", "doc_snippet_runner", str(tmp_path / f"world{world}")])
        out, err = launch.communicate(timeout=480)
        exits = [line for line in out.splitlines() if line.startswith("doc snippet ")]
        assert launch.returncode == 0, f"world {world}: {exits}\n{names}\n{err[-6000:]}"
        for name in names:
            for rank in range(world):
                assert f"doc snippet {name} rank {rank}: exit 0 (" in out, (names[name], rank, out[-3000:])
    print(f"ran {len(programs)} snippets ({', '.join(where for where, _ in programs)}); skipped {len(skipped)}:")
    for where, reason in skipped:
        print(f"  {where}: {reason}")
