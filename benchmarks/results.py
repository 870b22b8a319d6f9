"""Benchmark results as data: the schema of `benchmarks/results/*.json`, its validator, loader and writer.

One file per benchmark run, one JSON object (benchmarks/README.md shows an example):

- `benchmark`: the script's name without `.py` (`bench_lora`); the file is `results/<benchmark>.json`, or
  `results/<benchmark>.<label>.json` for an older run kept because it carries a figure no later run has;
- `title`: one line saying what was measured;
- `command`: the command that produced it (`python benchmarks/bench_lora.py --rounds 2`);
- `commit`: the git commit measured (7 to 40 hex digits);
- `date`: when, ISO 8601 in UTC (`2026-12-04T11:10:00Z`);
- `machine`: `{"cpu": lscpu's model name, "cores": int, "device": "cpu" or the accelerator's name}`, other keys free;
- `figures`: a non-empty list of `{"name", "value", "unit", "goal", "met", "note"}`: `name` and `unit` strings,
  `value` a number, `goal` a string or null (`"<= 0.6"`: an operator and a number is checked against `value`),
  `met` true / false (with a goal) or null (without), `note` a string (may be empty).

Raw per-run data a script also keeps (every row, profiles) goes under `results/raw/`, which nothing here reads.
"""

from __future__ import annotations

import datetime
import json
import operator
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
TOP_KEYS = ("benchmark", "title", "command", "commit", "date", "machine", "figures")
FIGURE_KEYS = ("name", "value", "unit", "goal", "met", "note")
GOAL = re.compile(r"^\s*(<=|>=|<|>|==)\s*(-?[0-9.]+(?:e-?[0-9]+)?)\s*$")
COMPARE = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq}


class ResultError(ValueError):
    """A results file that does not follow the schema; the message names the file, the field and the value."""


def problems(result: Any, where: str = "result") -> list[str]:
    """Every way `result` breaks the schema, each naming the field, its value and what would be valid."""
    if not isinstance(result, dict):
        return [f"{where}: expected one JSON object, got {type(result).__name__}"]
    found = [f"{where}: missing {key!r}" for key in TOP_KEYS if key not in result]
    for key in ("benchmark", "title", "command"):
        if key in result and (not isinstance(result[key], str) or not result[key].strip()):
            found.append(f"{where}: {key} must be a non-empty string, got {result[key]!r}")
    if isinstance(result.get("benchmark"), str) and not re.fullmatch(r"[a-z0-9_]+", result["benchmark"]):
        found.append(f"{where}: benchmark {result['benchmark']!r}: expected the script's name, e.g. 'bench_lora'")
    if isinstance(result.get("title"), str) and "\n" in result["title"]:
        found.append(f"{where}: title must be one line, got {result['title']!r}")
    if "commit" in result and not (isinstance(result["commit"], str)
                                   and re.fullmatch(r"[0-9a-f]{7,40}", result["commit"])):
        found.append(f"{where}: commit {result['commit']!r}: expected 7 to 40 lowercase hex digits")
    if "date" in result:
        try:
            date = datetime.datetime.fromisoformat(str(result["date"]).replace("Z", "+00:00"))
            if date.utcoffset() != datetime.timedelta(0):
                raise ValueError
        except ValueError:
            found.append(f"{where}: date {result['date']!r}: expected ISO 8601 in UTC, e.g. '2026-12-04T11:10:00Z'")
    machine = result.get("machine")
    if "machine" in result:
        if not isinstance(machine, dict):
            found.append(f"{where}: machine must be an object {{cpu, cores, device}}, got {machine!r}")
        else:
            for key in ("cpu", "device"):
                if not isinstance(machine.get(key), str) or not machine.get(key):
                    found.append(f"{where}: machine.{key} must be a non-empty string, got {machine.get(key)!r}")
            if not isinstance(machine.get("cores"), int) or isinstance(machine.get("cores"), bool) \
                    or machine["cores"] < 1:
                found.append(f"{where}: machine.cores must be a positive integer, got {machine.get('cores')!r}")
    figures = result.get("figures")
    if "figures" in result and (not isinstance(figures, list) or not figures):
        found.append(f"{where}: figures must be a non-empty list, got {figures!r}")
    elif isinstance(figures, list):
        for index, figure in enumerate(figures):
            found += figure_problems(figure, f"{where}: figures[{index}]")
    return found


def figure_problems(figure: Any, where: str) -> list[str]:
    if not isinstance(figure, dict):
        return [f"{where}: expected an object {{{', '.join(FIGURE_KEYS)}}}, got {figure!r}"]
    found = [f"{where}: missing {key!r}" for key in FIGURE_KEYS if key not in figure]
    unknown = sorted(set(figure) - set(FIGURE_KEYS))
    if unknown:
        found.append(f"{where}: unknown keys {unknown}; a figure has {list(FIGURE_KEYS)}")
    for key in ("name", "unit"):
        if key in figure and (not isinstance(figure[key], str) or not figure[key].strip()):
            found.append(f"{where}: {key} must be a non-empty string, got {figure[key]!r}")
    value = figure.get("value")
    if "value" in figure and (not isinstance(value, (int, float)) or isinstance(value, bool) or value != value):
        found.append(f"{where}: value must be a number, got {value!r}")
    if "note" in figure and not isinstance(figure["note"], str):
        found.append(f"{where}: note must be a string, got {figure['note']!r}")
    goal, met = figure.get("goal"), figure.get("met")
    if goal is None:
        if met is not None:
            found.append(f"{where}: met is {met!r} but there is no goal; give a goal or met: null")
    elif not isinstance(goal, str) or not goal.strip():
        found.append(f"{where}: goal must be a string or null, got {goal!r}")
    elif not isinstance(met, bool):
        found.append(f"{where}: goal {goal!r} needs met true or false, got {met!r}")
    else:
        parsed = GOAL.match(goal)
        if parsed and isinstance(value, (int, float)) and not isinstance(value, bool):
            holds = COMPARE[parsed.group(1)](value, float(parsed.group(2)))
            if holds != met:
                found.append(f"{where}: value {value!r} {'meets' if holds else 'misses'} goal {goal!r}, "
                             f"but met is {met!r}")
    return found


def load(path: Path) -> dict:
    """One results file, validated: ResultError naming the file and every problem otherwise."""
    try:
        result = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResultError(f"{path.name}: not JSON ({exc})") from None
    found = problems(result, path.name)
    if not found and not path.name.startswith(result["benchmark"] + "."):
        found.append(f"{path.name}: benchmark is {result['benchmark']!r}; the file must be named "
                     f"{result['benchmark']}.json (or {result['benchmark']}.<label>.json)")
    if found:
        raise ResultError("\n".join(found))
    return result


def load_files(folder: Path = RESULTS) -> list[tuple[str, dict]]:
    """Every results file of `folder` (not `raw/`) as (file name, result), validated, by benchmark then date."""
    named = [(path.name, load(path)) for path in sorted(folder.glob("*.json"))]
    return sorted(named, key=lambda item: (item[1]["benchmark"], item[1]["date"]))


def load_all(folder: Path = RESULTS) -> list[dict]:
    """Every results file of `folder` (not `raw/`), validated, by benchmark then date."""
    return [result for _, result in load_files(folder)]


def figure(name: str, value: float, unit: str, goal: str | None = None, met: bool | None = None,
           note: str = "") -> dict:
    """One figure; with a goal of the form "<= 0.6" and no `met`, `met` is worked out from the value."""
    if goal is not None and met is None:
        parsed = GOAL.match(goal)
        if parsed is None:
            raise ResultError(f"figure {name!r}: goal {goal!r} is not 'OP NUMBER' (OP: <=, >=, <, >, ==); "
                              "say whether it was met with met=True / False")
        met = bool(COMPARE[parsed.group(1)](value, float(parsed.group(2))))
    return {"name": name, "value": value, "unit": unit, "goal": goal, "met": met, "note": note}


def machine(device: str = "cpu") -> dict:
    """This machine: lscpu's model name, the cores this process may use, the device."""
    cpu = "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
                break
    except (OSError, subprocess.SubprocessError):
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "device": device}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "0000000"


def this_command() -> str:
    """The command line that runs this script, as a user would type it from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join(["python", str(script), *sys.argv[1:]])


def write_result(benchmark: str, title: str, figures: list[dict], *, command: str | None = None,
                 device: str = "cpu", folder: Path = RESULTS, timed: bool = True, **extra: Any) -> Path:
    """Write `results/<benchmark>.json` for this run (this machine, HEAD, now, this command), validated first. When
    the machine's load average exceeded its cores, each figure's note of a `timed` run says it was measured under
    load."""
    here = machine(device)
    load = os.getloadavg()[1]  # over the last 5 minutes: more runnable processes than cores means others ran too
    if timed and load > here["cores"]:
        said = f"measured under load (load average {load:.0f} on {here['cores']} cores)"
        figures = [item if "under load" in item["note"]
                   else dict(item, note="; ".join(filter(None, [item["note"], said]))) for item in figures]
    result = {"benchmark": benchmark, "title": title, "command": command or this_command(), "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "machine": here, "figures": figures, **extra}
    found = problems(result, f"{benchmark}.json")
    if found:
        raise ResultError("\n".join(found))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{benchmark}.json"
    path.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"# result: {path}", flush=True)
    return path
