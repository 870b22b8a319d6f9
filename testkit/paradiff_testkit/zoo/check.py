"""One tiny pipeline, one parallel mode, against diffusers' single-process call: what tools/verify_pipelines.py and
tests/test_pipeline_coverage.py run.

`reference(key, folder)` runs in one process: diffusers' pipeline class from the folder, the recipe's call, seed 0
(the global generator seeded too, for pipelines that draw from it), and what the transformer's first block saw at
each call (batch and token counts). A modular key (`zoo.is_modular`) runs diffusers' modular call:
`ModularPipeline.from_pretrained(folder)`, `load_components(dtype=float32)`, `pipe(**call, output=recipe.output)`. `check_modes(jobs)` runs on every rank of a pool: for each job, the pipeline
through `paradiff.load_pipeline` in the job's mode, the same call, and the outcome:

- "verified": every image / frame / sample within TOLERANCE of the single-process output (relative to its largest
  magnitude, at least 1: pixels in [0, 1] compare absolutely), and the work was split: under TP every split
  parameter of the transformer (and ControlNet) is exactly its slice of the full tensor; under CP the first block
  saw fewer tokens than the single process; under CFG it computed half the batch rows of the single process (a
  pipeline guiding through a guider component, every modular one: it ran fewer of the guider's branches than there
  were);
- "mismatch": it ran, but the outputs differ, or the work was not split (`reason` says which);
- "refused": paradiff raised its own typed error (`reason`: its message), before or during the call;
- "failed": any other exception (`reason`: its type and message).
"""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
import torch

TOLERANCE = 1e-5
# the modes every pipeline is verified in, by pool size; the cfg modes only where the pipeline guides
MODES = {2: ("tp2", "ulysses2", "ring2", "cfg2"), 4: ("tp2xulysses2", "cfg2xtp2")}
ALL_MODES = tuple(mode for modes in MODES.values() for mode in modes)
CFG_MODES = ("cfg2", "cfg2xtp2")
_BLOCK_STACKS = ("transformer_blocks", "blocks", "layers", "joint_transformer_blocks", "double_blocks")


def output_array(output: Any) -> np.ndarray:
    """A pipeline output's images, frames or audio as one float array."""
    # Kandinsky 5's image pipelines: `image`; Cosmos 3 Omni: `video`
    for name in ("images", "frames", "image", "video", "audios", "audio"):
        value = getattr(output, name, None)
        if value is not None:
            break
    else:
        value = output[0] if isinstance(output, tuple) else output
    if torch.is_tensor(value):
        value = value.detach().float().cpu().numpy()
    if isinstance(value, list) and value and not isinstance(value[0], (float, int)):
        value = [np.asarray(item, dtype=np.float32) for item in value]
    return np.asarray(value, dtype=np.float32)


def first_block(transformer: torch.nn.Module) -> torch.nn.Module:
    """The first block of the transformer's main stack (the stack the CP plans split the tokens before)."""
    stacks = {name: child for name, child in transformer.named_children()
              if isinstance(child, torch.nn.ModuleList) and len(child)}
    for name in _BLOCK_STACKS:
        if name in stacks:
            return stacks[name][0]
    if not stacks:
        raise AttributeError(f"{type(transformer).__name__} has no stack of blocks")
    return next(iter(stacks.values()))[0]


def record_block_inputs(transformer: torch.nn.Module) -> list[tuple[int, int]]:
    """(batch, tokens) of the first block's hidden states at every call it makes from now on: the stream the
    transformer's context-parallel plan splits at that block where it names one (Cosmos 3's blocks take the text
    prefix first, kept whole, and the generation tokens, split, as `gen_seq`), else `hidden_states` or the first
    argument."""
    import inspect

    block = first_block(transformer)
    stream = _split_stream(transformer, block)
    parameters = inspect.signature(block.forward).parameters
    seen: list[tuple[int, int]] = []

    def hook(_module, args, kwargs):
        bound = dict(zip(parameters, args), **kwargs)
        value = bound.get(stream) if stream else None
        if value is None:
            value = kwargs.get("hidden_states", args[0] if args else None)
        if torch.is_tensor(value) and value.ndim >= 2:
            seen.append((int(value.shape[0]), int(value.shape[1])))

    block.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _split_stream(transformer: torch.nn.Module, block: torch.nn.Module) -> str | None:
    """The argument of `block` the transformer's built-in context-parallel plan splits there, if it names one."""
    from paradiff.context_parallel.plan import Split
    from paradiff.plans import family_of

    family = family_of(transformer)
    if family is None or family.context_parallel_plan is None:
        return None
    path = next((name for name, module in transformer.named_modules() if module is block), None)
    try:
        split_inputs = family.context_parallel_plan(transformer.config).split_inputs
    except Exception:  # noqa: BLE001 - a plan that needs more than the config: fall back to hidden_states
        return None
    return next((name for name, spec in split_inputs.get(path, {}).items() if isinstance(spec, Split)), None)


def quiet() -> None:
    """No progress bars from diffusers' and transformers' loaders; the zoo's own component classes imported (diffusers
    loads a component of a module it does not know only once the module is imported)."""
    import diffusers
    import transformers

    import paradiff_testkit.zoo.processors  # noqa: F401 - registers nothing; being imported is what counts

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def reference(key: str, folder: str) -> dict:
    """diffusers' single-process call of the recipe on the saved folder."""
    from paradiff_testkit import zoo

    quiet()
    if zoo.is_modular(key):
        return _modular_reference(key, folder)
    pipe = zoo.pipeline_class(key).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    _numerics(key, pipe)
    seen = record_block_inputs(pipe.transformer)
    torch.manual_seed(0)
    output = pipe(**zoo.call_kwargs(key), generator=torch.Generator().manual_seed(0))
    return {"output": output_array(output), "blocks": seen}


def _modular_reference(key: str, folder: str) -> dict:
    from diffusers import ModularPipeline

    from paradiff_testkit import zoo

    pipe = ModularPipeline.from_pretrained(folder)
    if type(pipe) is not zoo.pipeline_class(key):
        raise TypeError(f"{folder} loads as {type(pipe).__name__}, not {zoo.pipeline_name(key)}")
    pipe.load_components(dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    zoo.configure(pipe, key)
    kwargs = zoo.call_kwargs(key)
    ignored = sorted(set(kwargs) - set(pipe._blocks.input_names))
    if ignored:  # diffusers would warn and drop them: a recipe that passes them tests less than it says
        raise TypeError(f"{zoo.pipeline_name(key)}'s blocks take no {ignored} (drop them from recipe {key!r})")
    seen = record_block_inputs(pipe.transformer)
    torch.manual_seed(0)
    output = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output=zoo.recipe(key).output)
    return {"output": output_array(output), "blocks": seen}


def _call(pipe, key: str) -> Any:
    """paradiff's pipeline called with the recipe's arguments, seed 0 (a modular one asked for the recipe's output)."""
    from paradiff_testkit import zoo

    extra = {"output": zoo.recipe(key).output} if zoo.is_modular(key) else {}
    return pipe(**zoo.call_kwargs(key), seed=0, **extra)


def _numerics(key: str, pipe) -> None:
    """The recipe's float32 numerics (zoo.Recipe.numerics), on both sides alike."""
    from paradiff_testkit import zoo

    numerics = getattr(zoo.recipe(key), "numerics", None)  # a ModularRecipe has none
    if numerics is not None:
        numerics(pipe)


def _parallel_config(mode: str):
    import paradiff

    return paradiff.ParallelConfig.from_mode(mode)


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 400:
        text = text[:397] + "..."
    return f"{type(exc).__name__}: {text}"


def check_modes(jobs: list[dict]) -> list[dict]:
    """Run on every rank: each job {"key", "folder", "mode", "expected" (reference()'s result)} -> its outcome on
    this rank."""
    torch.set_num_threads(1)
    quiet()
    return [_check(**job) for job in jobs]


def _check(key: str, folder: str, mode: str, expected: dict) -> dict:
    import paradiff
    from paradiff.errors import ParadiffError
    from paradiff_testkit import zoo

    try:
        pipe = paradiff.load_pipeline(folder, pipeline_cls=zoo.pipeline_class(key),
                                      parallel_config=_parallel_config(mode))
        pipe.set_progress_bar_config(disable=True)
        zoo.configure(pipe, key)
        _numerics(key, pipe)
        seen = record_block_inputs(pipe.transformer)
        torch.manual_seed(0)
        actual = output_array(_call(pipe, key))
    except ParadiffError as exc:
        return {"status": "refused", "reason": _reason(exc)}
    except Exception as exc:  # noqa: BLE001 - recorded with where it came from
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return {"status": "failed", "reason": f"{_reason(exc)} ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"}
    want = expected["output"]
    if actual.shape != want.shape:
        return {"status": "mismatch", "reason": f"output shape {actual.shape}, single process {want.shape}"}
    diff = float(np.abs(actual - want).max() / max(float(np.abs(want).max()), 1.0))
    problems = _split_problems(pipe, mode, seen, expected["blocks"], folder)
    if not np.isfinite(want).all():  # NaN compares as no difference: a recipe whose output is not finite proves nothing
        problems.insert(0, "the single-process output is not finite (NaN or inf): the recipe proves nothing")
    elif not diff <= TOLERANCE:
        problems.insert(0, f"outputs differ by {diff:.2e} (relative)")
    outcome = {"status": "mismatch" if problems else "verified", "diff": diff}
    if problems:
        outcome["reason"] = "; ".join(problems)
    return outcome


def _split_problems(pipe, mode: str, seen: list, reference_blocks: list, folder: str) -> list[str]:
    """What says the work was not split as the mode promises (empty when it was)."""
    from paradiff.config import parse_mode

    degrees = parse_mode(mode)
    problems = []
    if not seen:
        return ["the transformer's first block never ran"]
    # batch x tokens, whichever comes first (ERNIE-Image's blocks take the sequence first)
    cp_split = seen[0][0] * seen[0][1] < reference_blocks[0][0] * reference_blocks[0][1]
    if degrees["ring"] * degrees["ulysses"] > 1 and not cp_split:
        problems.append(f"the first block saw {seen[0][1]} tokens, as many as the single process")
    if degrees["cfg"] > 1:
        # its share of the rows; a model whose forward cannot run on the meta device computes one first call more
        # per input shape (Helios' pyramid: one per stage's resolution)
        branches = pipe._paradiff_pipeline.cfgs
        if pipe._paradiff_pipeline.guided and branches:  # the guider's branches: this rank ran only its share
            # (counted by the branches, not the block's rows: calls outside the guider's steps, such as Wan-Animate
            # 2's reference pass, run on every rank, and a first call of each signature runs on both)
            computed, total = branches[0].computed, sum(branches[0].branch_counts)
            if not 0 < computed < total:
                problems.append(f"the rank computed {computed} of the guider's {total} branch calls")
        else:  # its share of the rows; a model whose forward cannot run on the meta device computes one first call
            # more per input shape
            rows, whole = sum(batch for batch, _ in seen), sum(batch for batch, _ in reference_blocks)
            if rows > whole // degrees["cfg"] + sum(batch for batch, _ in set(reference_blocks)):
                problems.append(f"the transformer computed {rows} batch rows, the single process {whole}")
    if degrees["tp"] > 1:
        for name in ("transformer", "controlnet"):
            module = getattr(pipe, name, None)
            if isinstance(module, torch.nn.Module):
                problems += [f"{name}: {problem}" for problem in _shard_problems(module, folder, name)]
    return problems


def _shard_problems(model: torch.nn.Module, folder: str, subfolder: str) -> list[str]:
    from paradiff.runtime.state import get_state
    from paradiff_testkit.families import wrong_slices

    state = get_state(model)
    if state is None or state.tp_plan is None or not state.tp_plan.linears:
        return ["not split by a tensor-parallel plan"]
    full = type(model).from_pretrained(folder, subfolder=subfolder)
    wrong = wrong_slices(model, full)
    return [f"{len(wrong)} split parameters are not their slice (e.g. {wrong[0]})"] if wrong else []
