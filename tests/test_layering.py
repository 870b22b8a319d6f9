"""Dependencies point down: the mechanisms know no model, and the product never needs the test helpers.

The layers, lowest first, are the table in docs/architecture.md, which `test_every_import_points_down_the_layer_table`
reads. Every import counts, module-level or inside a function: a deferred import is still a dependency.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "paradiff"
ARCHITECTURE = PACKAGE.parents[1] / "docs" / "architecture.md"
MECHANISMS = ("tensor_parallel", "context_parallel", "vae", "io", "quant", "fsdp")
# What each low layer may import from paradiff: itself and the layers below it.
ALLOWED_BELOW = {
    "distributed": ("paradiff.config", "paradiff.errors", "paradiff.distributed"),
}


def imports(source: str, where: str) -> list[str]:
    """Every name the module at `where` (relative to the package) imports, absolute where it imports relatively."""
    package = ["paradiff", *Path(where).parent.parts]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


@functools.cache
def file_imports(path: Path) -> tuple[str, ...]:
    """`imports` of one file of the package, parsed once per session (every test here reads the same files)."""
    return tuple(imports(path.read_text(), str(path.relative_to(PACKAGE))))


def module_imports(files: list[Path]) -> list[tuple[str, str]]:
    return [(str(path.relative_to(PACKAGE)), name) for path in files for name in file_imports(path)]


def offenders(files: list[Path], forbidden: str) -> list[str]:
    return [f"{where}: {name}" for where, name in module_imports(files)
            if name == forbidden or name.startswith(forbidden + ".")]


def test_relative_imports_are_seen_as_what_they_name():
    assert imports("from ..plans.vae import vae_plan", "vae/apply.py") == ["paradiff.plans.vae.vae_plan"]
    assert imports("from .. import plans", "vae/apply.py") == ["paradiff.plans"]
    assert imports("from .plans import family_of", "pipeline.py") == ["paradiff.plans.family_of"]
    assert imports("import paradiff.testing.dist", "cli/worker.py") == ["paradiff.testing.dist"]


def test_the_top_level_holds_only_config_errors_and_packages():
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    # __main__.py: `python -m paradiff`, three lines handing over to cli/
    assert modules == ["__init__.py", "__main__.py", "config.py", "errors.py"]
    assert "from paradiff.cli import main" in (PACKAGE / "__main__.py").read_text()


@pytest.mark.parametrize("forbidden", ["paradiff.plans", "paradiff.plan_tools", "paradiff.api", "paradiff.cli"])
def test_mechanisms_never_import_plans_or_entry_points(forbidden):
    files = [path for mechanism in MECHANISMS for path in (PACKAGE / mechanism).rglob("*.py")]
    assert len(files) > 10
    assert offenders(files, forbidden) == []


@pytest.mark.parametrize("forbidden", ["paradiff.api", "paradiff.cli", "paradiff.plan_tools", "paradiff.demo"])
def test_runtime_and_plans_never_import_entry_points(forbidden):
    files = [*(PACKAGE / "runtime").rglob("*.py"), *(PACKAGE / "plans").rglob("*.py")]
    assert offenders(files, forbidden) == []


def test_distributed_imports_nothing_above_it():
    files = list((PACKAGE / "distributed").rglob("*.py"))
    assert len(files) >= 4
    above = [f"{where}: {name}" for where, name in module_imports(files)
             if name.startswith("paradiff") and not name.startswith(ALLOWED_BELOW["distributed"])]
    assert above == []


def test_product_never_imports_paradiff_testing():
    files = [path for path in PACKAGE.rglob("*.py") if "testing" not in path.relative_to(PACKAGE).parts]
    assert offenders(files, "paradiff.testing") == []


def test_quant_sits_on_the_tensor_parallel_layers_and_below():
    """quant/ quantizes the slices the sharded layers hold: it may use distributed/ (its one collective lives in
    comm.py) and tensor_parallel/, and nothing above; no other mechanism needs it (the load sequence calls it)."""
    files = list((PACKAGE / "quant").rglob("*.py"))
    assert len(files) >= 2
    allowed = ("paradiff.config", "paradiff.errors", "paradiff.runtime.patches", "paradiff.distributed",
               "paradiff.tensor_parallel", "paradiff.quant")
    above = [f"{where}: {name}" for where, name in module_imports(files)
             if name.startswith("paradiff") and not name.startswith(allowed)]
    assert above == []
    others = [path for mechanism in ("tensor_parallel", "context_parallel", "vae", "io", "distributed")
              for path in (PACKAGE / mechanism).rglob("*.py")]
    assert offenders(others, "paradiff.quant") == []


def test_only_the_serve_command_imports_the_server():
    """Of the command, only cli/serve.py reaches paradiff.serve, lazily."""
    files = [path for path in PACKAGE.rglob("*.py") if "serve" not in path.relative_to(PACKAGE).parts[:1]]
    assert [entry for entry in offenders(files, "paradiff.serve") if not entry.startswith("cli/serve.py")] == []


def test_the_server_imports_nothing_of_the_command():
    """serve/ sits below cli/: the call arguments, output encoding, console lines and its typed settings it uses live
    in api/, io/, runtime/ and serve/settings.py, so a library user runs a server without the command line."""
    files = list((PACKAGE / "serve").rglob("*.py"))
    assert len(files) > 10
    assert offenders(files, "paradiff.cli") == []


def test_the_server_loads_through_the_load_spec_not_the_command():
    """serve/ loads what api/'s typed LoadSpec says (api/load_spec.py: load), as `generate` does; it imports nothing
    of the command's loading (cli/worker.py's load, nor the console and memory helpers both use, now in runtime/)."""
    files = list((PACKAGE / "serve").rglob("*.py"))
    loading = ["paradiff.cli.worker." + name for name in ("load_from_args", "load_spec_of", "Loaded",
                                                           "quiet_other_ranks", "peak_memory_bytes")]
    assert [entry for name in loading for entry in offenders(files, name)] == []
    assert {"paradiff.api.load_spec.load", "paradiff.api.load_spec.LoadSpec"} <= set(
        file_imports(PACKAGE / "serve" / "ranks.py"))


def test_the_mechanisms_api_held_live_below_it():
    """Weight sources, an adapter's reads by slices, the adapter layers a staged run keeps, and offloading are
    mechanisms: io/, tensor_parallel/ and runtime/ hold them, api/ only calls them."""
    moved = {"WeightSource", "GGUFWeightSource", "free_parameters", "target_dtype", "AdapterSource", "open_adapter",
             "text_encoder_adapter", "adapter_layout", "weights_dropped", "weights_read", "rank_offload_path",
             "install_offload_support", "pipeline_group_offload", "pipeline_model_cpu_offload"}
    defined = {f"{path.relative_to(PACKAGE)}: {node.name}" for path in (PACKAGE / "api").rglob("*.py")
               for node in ast.parse(path.read_text()).body
               if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in moved}
    assert defined == set()
    assert not (PACKAGE / "api" / "offload.py").exists()


# ----------------------------------------------------------------------------------------------------------------
# The module graph: no cycle, and the layer table of docs/architecture.md


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(["paradiff", *(parts[:-1] if parts[-1] == "__init__" else parts)])


@functools.cache
def module_graph() -> dict[str, frozenset[str]]:
    """paradiff module -> the paradiff modules it imports anywhere in its file (at module level, in a function, under
    TYPE_CHECKING). `from paradiff.a import b` is an edge to module paradiff.a.b where that module exists, else to
    paradiff.a; importing a module's package (its __init__, which Python runs first) is not counted as an edge."""
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        targets = set()
        for imported in file_imports(path):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported.startswith("paradiff") and imported != name:
                targets.add(imported)
        graph[name] = frozenset(targets)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_are_found_through_deferred_imports():
    graph = {"paradiff.a": {"paradiff.b"}, "paradiff.b": {"paradiff.c"}, "paradiff.c": {"paradiff.a"},
             "paradiff.d": {"paradiff.a"}}
    assert cycles(graph) == [["paradiff.a", "paradiff.b", "paradiff.c"]]
    source = "import torch\n\ndef later():\n    from paradiff.api.model import target_dtype\n"
    assert imports(source, "api/fsdp.py") == ["torch", "paradiff.api.model.target_dtype"]


def test_no_module_imports_itself_through_a_chain():
    graph = module_graph()
    assert len(graph) > 100
    assert cycles(graph) == []


def layer_table() -> dict[str, int]:
    """docs/architecture.md's layer table: entry (`io`, `runtime.state`) -> its layer."""
    layers = {}
    for line in ARCHITECTURE.read_text().splitlines():
        row = re.match(r"\| (\d+) \| ([^|]+) \|", line)
        if row:
            for entry in re.findall(r"`([^`]+)`", row.group(2)):
                layers[entry.removesuffix("/").removesuffix(".py").replace("/", ".")] = int(row.group(1))
    return layers


def layer_of(module: str, layers: dict[str, int]) -> tuple[str, int] | None:
    """The most specific entry holding `module` (paradiff.x.y) and its layer; None for the top package. A package's
    own module (paradiff.cli) is its __init__.py: an entry `cli/__init__.py` places it, else the package's entry."""
    parts = module.split(".")[1:]
    if (PACKAGE.joinpath(*parts) / "__init__.py").exists() and ".".join([*parts, "__init__"]) in layers:
        return ".".join([*parts, "__init__"]), layers[".".join([*parts, "__init__"])]
    for end in range(len(parts), 0, -1):
        entry = ".".join(parts[:end])
        if entry in layers:
            return entry, layers[entry]
    return None


def test_the_layer_table_names_every_package_once_in_order():
    layers = layer_table()
    assert list(layers.values()) == sorted(layers.values())
    packages = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert packages - {"assets"} <= set(layers), sorted(packages - set(layers))
    assert {"config", "errors"} <= set(layers)
    assert all(layer_of(name, layers) for name in module_graph() if name != "paradiff")


def test_every_import_points_down_the_layer_table():
    layers = layer_table()
    graph = module_graph()
    upward = []
    for module, targets in sorted(graph.items()):
        if module == "paradiff":
            continue
        entry, layer = layer_of(module, layers)
        for target in sorted(targets):
            if target == "paradiff":  # the public names: Python has run it before any module
                continue
            target_entry, target_layer = layer_of(target, layers)
            if target_entry != entry and target_layer >= layer:
                upward.append(f"{module} (layer {layer}) imports {target} (layer {target_layer})")
    assert upward == []


def test_the_top_package_imports_only_the_import_noise_filters():
    assert module_graph()["paradiff"] == {"paradiff.runtime.import_noise"}
