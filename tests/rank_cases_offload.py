"""Functions run on every rank of a pool by tests/test_offload.py (gloo, CPU)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import paradiff
from paradiff.testing.models import Lengths, make_inputs, model_class, run_forward


def parallel_config(mode: str):
    if mode == "tp2":
        return paradiff.TensorParallelConfig(tp_degree=2)
    if mode == "ulysses2":
        return paradiff.ContextParallelConfig(ulysses_degree=2)
    raise ValueError(mode)


def offload_equivalence(cases: list[dict]) -> list[dict]:
    results = []
    # outputs of the single-process model per folder and of the resident split model per folder and mode, computed
    # once for every case that compares with them (the same models, the same inputs)
    singles, residents = {}, {}
    for case in cases:
        cls = model_class(case["family"])
        folder = case["folder"]
        if folder not in singles:
            single = cls.from_pretrained(folder).eval()
            singles[folder] = []
            for batch in (1, 2):
                inputs = make_inputs(case["family"], single.config, batch=batch,
                                     lengths=Lengths(height=4, width=4, text=6))
                singles[folder].append((inputs, run_forward(single, inputs)))
        if (folder, case["mode"]) not in residents:
            resident = paradiff.from_pretrained(cls, folder, parallel_config=parallel_config(case["mode"]))
            residents[folder, case["mode"]] = [run_forward(resident, inputs) for inputs, _ in singles[folder]]
        offloaded = paradiff.from_pretrained(cls, folder, parallel_config=parallel_config(case["mode"]))
        path = os.path.join(case["disk"], f"{case['mode']}-{case['offload_type']}")  # one path for every rank
        offloaded.enable_group_offload(torch.device("cpu"), offload_type=case["offload_type"], num_blocks_per_group=1,
                                       offload_to_disk_path=path)
        path = os.path.join(path, f"paradiff-rank{dist.get_rank()}")
        diffs = []
        for (inputs, expected), parallel in zip(singles[folder], residents[folder, case["mode"]]):
            actual = run_forward(offloaded, inputs)
            diffs.append(float((actual - parallel).abs().max() / parallel.abs().max()))
            diffs.append(float((actual - expected).abs().max() / expected.abs().max()))
        files = [name for name in os.listdir(path) if name.startswith("group_")]
        results.append({**case, "diffs": diffs, "files": len(files)})
    return results


def offload_before_split_refused(folder: str, family: str, disk: str) -> str:
    model = model_class(family).from_pretrained(folder).eval()
    model.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1,
                               offload_to_disk_path=os.path.join(disk, f"before-{dist.get_rank()}"))
    try:
        paradiff.enable_parallelism(model, parallel_config("tp2"))
    except Exception as exc:  # noqa: BLE001 - the error is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def pipeline_offload(folder: str, family: str, disk: str, exclude: list[str] | None = None) -> dict:
    """tp2 pipeline images with group offloading to one shared disk path, and with model CPU offload, equal the
    resident tp2 pipeline's."""
    import numpy as np

    from paradiff_testkit.pipelines import default_call_kwargs

    torch.set_num_threads(1)
    kwargs = dict(default_call_kwargs(family), num_inference_steps=1)  # offloading acts alike in every step
    config = parallel_config("tp2")
    outputs = {}
    for how in ("resident", "group", "model"):
        pipe = paradiff.load_pipeline(folder, parallel_config=config)
        pipe.set_progress_bar_config(disable=True)
        if how == "group":
            pipe.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1,
                                      offload_to_disk_path=os.path.join(disk, "pipeline"), exclude_modules=exclude)
        if how == "model":
            pipe.enable_model_cpu_offload()
        output = pipe(**kwargs, seed=0)
        outputs[how] = np.asarray(output.frames if hasattr(output, "frames") else output.images)
    own = os.path.join(disk, "pipeline", f"paradiff-rank{dist.get_rank()}")
    return {"diffs": {how: float(np.abs(out - outputs["resident"]).max()) for how, out in outputs.items()},
            "components": sorted(os.listdir(own))}


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole pages of `tensor`'s storage that are in memory (mincore(2)): an offloaded weight's
    placeholder (torch.empty_like, never written) has none."""
    import ctypes
    import mmap

    storage = tensor.untyped_storage()
    start, size, page = storage.data_ptr(), storage.nbytes(), mmap.PAGESIZE
    first, end = -(-start // page) * page, (start + size) // page * page
    if end <= first:
        return 0
    pages = (end - first) // page
    vector = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(end - first), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vector) * page


def _fresh_pages_for_large_tensors() -> None:
    """glibc serves large allocations from fresh mappings (and returns them at free) above a fixed threshold, so a
    tensor's pages are resident exactly when written: what makes the count above deterministic."""
    import ctypes

    M_MMAP_THRESHOLD = -3
    ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 64 * 1024)


def peak_parameter_bytes(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, int]:
    """The forward's output, and the most parameter bytes resident at once during it (sampled after each leaf
    module's forward, while its group is onloaded)."""
    peak = 0

    def sample(*_):
        nonlocal peak
        peak = max(peak, sum(_resident_bytes(p) for p in model.parameters()))

    handles = [m.register_forward_hook(sample) for m in model.modules() if not list(m.children())]
    try:
        output = run_forward(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return output, peak


def offload_memory_fresh(rank: int, world_size: int, folder: str, family: str, mode: str, disk: str) -> dict:
    """`offload_memory` in a freshly started rank (paradiff.distributed.spawn.run_ranks): in a pool process that had
    run the suite's other cases, the leaf-level count read 16 MB instead of one layer's share (what those cases left
    in its allocator)."""
    return offload_memory(folder, family, mode, disk)


def offload_memory(folder: str, family: str, mode: str, disk: str) -> dict:
    _fresh_pages_for_large_tensors()
    cls = model_class(family)
    inputs = None
    figures = {}
    for offload_type in (None, "block_level", "leaf_level"):
        model = paradiff.from_pretrained(cls, folder, parallel_config=parallel_config(mode))
        if offload_type is not None:
            model.enable_group_offload(torch.device("cpu"), offload_type=offload_type, num_blocks_per_group=1,
                                       offload_to_disk_path=os.path.join(disk, f"memory-{mode}-{offload_type}"))
        inputs = inputs or make_inputs(family, model.config, batch=1, lengths=Lengths(height=4, width=4, text=6))
        output, peak = peak_parameter_bytes(model, inputs)
        figures[offload_type or "resident"] = {
            "peak": peak, "total": sum(p.numel() * p.element_size() for p in model.parameters()),
            "output": output}
        del model
    reference = figures["resident"]["output"]
    for name, item in figures.items():
        output = item.pop("output")
        item["relative_diff"] = float((output - reference).abs().max() / reference.abs().max())
    return figures
