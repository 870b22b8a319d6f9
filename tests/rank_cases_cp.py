"""Functions run on every rank of a pool by tests/test_context_parallel.py (gloo, CPU)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import paradiff
from paradiff.distributed.comm import CommStats
from paradiff.runtime.state import get_state
from paradiff.testing.models import Lengths, build_model, make_inputs, run_forward


def cp_equivalence(family: str, ring: int, ulysses: int, shapes: list, heads: int = 4, backend: str = "native",
                   tp: int = 1, batch: int = 1) -> dict:
    """Every (height, width, text) in `shapes`: CP output equals the single-process diffusers output."""
    reference = build_model(family, heads=heads)
    model = build_model(family, heads=heads)
    cp = paradiff.ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    config = cp if tp == 1 else paradiff.ParallelConfig(
        tensor_parallel_config=paradiff.TensorParallelConfig(tp), context_parallel_config=cp)
    paradiff.enable_parallelism(model, config)
    if backend != "native":
        paradiff.set_attention_backend(model, backend)
    runtime = get_state(model).context
    runtime.stats = CommStats()
    diffs = {}
    for height, width, text in shapes:
        inputs = make_inputs(family, reference.config, batch=batch, lengths=Lengths(height=height, width=width, text=text))
        expected = run_forward(reference, inputs)
        actual = run_forward(model, inputs)
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
        diffs[f"{height}x{width}+{text}"] = float((actual - expected).abs().max())
    return {"rank": dist.get_rank(), "diffs": diffs, "mode": runtime.mode, "calls": dict(runtime.stats.calls)}


def cp_every_backend(family: str) -> dict:
    """Every attention backend this machine runs, against the single-process diffusers output: routed on a model
    without CP and at ulysses2 and ring2 (those the mode can use), each one recorded patch; the refusal of one that
    cannot run here, before any collective; a backend chosen before CP carried over to it."""
    from paradiff.attention.backends import able_backends

    backends = able_backends(device="cpu")
    plain = build_model(family)
    inputs = make_inputs(family, plain.config, lengths=Lengths(height=3, width=5, text=7))
    expected = run_forward(plain, inputs)
    result = {"without_cp": {}, "calls_routed": {}}
    for backend in backends:
        paradiff.set_attention_backend(plain, backend)
        route = paradiff.patches(plain)[0][1].subject  # the route's mode: count the calls its backend runs
        calls, kernel = [], route.backend.kernel
        route.backend = dataclasses.replace(route.backend, kernel=lambda *args, k=kernel, c=calls: c.append(1) or k(*args))
        result["without_cp"][backend] = float((run_forward(plain, inputs) - expected).abs().max())
        result["calls_routed"][backend] = len(calls)
    result["plain_listed"] = [str(patch) for _, patch in paradiff.patches(plain)]
    result["removed"] = paradiff.remove_patches(plain)
    result["unrouted"] = bool(torch.equal(run_forward(plain, inputs), expected))
    for mode, (ring, ulysses) in {"ulysses": (1, 2), "ring": (2, 1)}.items():
        model = build_model(family)
        paradiff.enable_parallelism(model, paradiff.ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses))
        runtime = get_state(model).context
        runtime.stats = CommStats()
        diffs = {}
        for backend in backends:
            if backend == "sdpa" and ring > 1:
                continue  # no LSE: refused for ring (cp_errors)
            paradiff.set_attention_backend(model, backend)
            diffs[backend] = float((run_forward(model, inputs) - expected).abs().max())
        calls = sum(runtime.stats.calls.values())
        try:
            paradiff.set_attention_backend(model, "sdpa-cudnn")  # CUDA only, and the model is on the CPU
            refused = "no error"
        except paradiff.ParallelConfigError as exc:
            refused = str(exc)
        result[mode] = {"diffs": diffs, "refused": refused,
                        "listed": [str(patch) for _, patch in paradiff.patches(model) if patch.by == "attention"],
                        "collectives_during_refusal": sum(runtime.stats.calls.values()) - calls}
    paradiff.set_attention_backend(plain, "math")  # chosen before CP: CP's attention takes it over
    paradiff.enable_parallelism(plain, paradiff.ContextParallelConfig(ring_degree=2))
    result["carried"] = {"backend": get_state(plain).context.backend,
                         "listed": [str(patch) for _, patch in paradiff.patches(plain) if patch.by == "attention"],
                         "diff": float((run_forward(plain, inputs) - expected).abs().max())}
    return result


def cp_errors(family: str = "flux2") -> dict:
    """Bad CP inputs on a live world: each returns its message (raised before any collective)."""
    model = build_model(family)
    world = dist.get_world_size()
    messages = {}
    for label, call in {
        "too_many_ranks": lambda: paradiff.enable_parallelism(model, paradiff.ContextParallelConfig(ring_degree=2 * world)),
        "not_dividing": lambda: paradiff.enable_parallelism(
            model, paradiff.ContextParallelConfig(ring_degree=3)) if world == 4 else (_ for _ in ()).throw(
            paradiff.ParallelConfigError("n/a")),
        "backend_without_lse": lambda: _ring_with_backend(family, "sdpa"),
        "unknown_backend": lambda: _ring_with_backend(family, "cudnn-magic"),
        "not_cp": lambda: paradiff.set_attention_backend(build_model(family), "sdpa-efficient"),
    }.items():
        try:
            call()
            messages[label] = "no error"
        except Exception as exc:  # noqa: BLE001
            messages[label] = f"{type(exc).__name__}: {exc}"
    return messages


def _ring_with_backend(family: str, backend: str) -> None:
    model = build_model(family)
    paradiff.enable_parallelism(model, paradiff.ContextParallelConfig(ring_degree=dist.get_world_size()))
    paradiff.set_attention_backend(model, backend)



def cp_too_short() -> str:
    model = build_model("qwenimage")
    paradiff.enable_parallelism(model, paradiff.ContextParallelConfig(ulysses_degree=dist.get_world_size()))
    inputs = make_inputs("qwenimage", model.config, lengths=Lengths(height=3, width=3, text=1))
    try:
        run_forward(model, inputs)
    except ValueError as exc:
        return str(exc)
    return "no error"


def cp_from_pretrained(family: str, folder: str, ring: int, ulysses: int, tp: int = 1) -> dict:
    """Load with parallel_config=ContextParallelConfig (and TP) straight from a checkpoint."""
    from paradiff.testing.models import model_class

    cls = model_class(family)
    reference = cls.from_pretrained(folder).eval()
    cp = paradiff.ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    config = cp if tp == 1 else paradiff.ParallelConfig(
        tensor_parallel_config=paradiff.TensorParallelConfig(tp), context_parallel_config=cp)
    model = paradiff.from_pretrained(cls, folder, parallel_config=config)
    inputs = make_inputs(family, reference.config, lengths=Lengths(height=3, width=5, text=7))
    return {"diff": float((run_forward(model, inputs) - run_forward(reference, inputs)).abs().max())}


def _masks(batch: int, heads: int, tokens: int, generator: torch.Generator) -> dict:
    """Masks over a whole sequence, as a model passes them to SDPA: OmniGen-like causal text with a bidirectional
    image block (bool and additive min-value bias), a per-head additive bias with -inf entries, and a float
    key-padding bias per head."""
    text = tokens // 2
    causal = torch.ones(tokens, tokens).tril().bool()
    causal[text:, :] = True  # image rows see everything
    causal = causal[None, None].repeat(batch, 1, 1, 1)
    causal[-1, :, :, :2] = False  # the last sample's first two tokens are padding (left-padded text)
    causal[-1, :, :2, :] = True   # padding rows attend to all, as OmniGen's processor makes them
    bias = torch.randn(batch, heads, tokens, tokens, generator=generator)
    bias[torch.rand(batch, heads, tokens, tokens, generator=generator) < 0.3] = float("-inf")
    bias[..., 0] = 0.0  # no row fully masked
    key_bias = torch.zeros(batch, heads, 1, tokens)
    key_bias[-1, ..., -3:] = -10000.0  # PixArt-style finite padding bias, repeated per head
    return {"causal_bool": causal, "causal_min_bias": (~causal).float() * torch.finfo(torch.float32).min,
            "per_head_bias": bias, "per_head_key_bias": key_bias}


def cp_general_masks(ring: int, ulysses: int, tokens: int = 11, heads: int = 4, batch: int = 2) -> dict:
    """Each mask kind through the CP runtime against SDPA on the whole sequence: relative max difference per kind
    (query-dependent masks whole on every rank, key masks split with the keys)."""
    import torch.nn.functional as F

    from paradiff.context_parallel.attention import local_chunk
    from paradiff.context_parallel.runtime import ContextParallelRuntime
    from paradiff.distributed.mesh import build_mesh

    cp = paradiff.ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    mesh = build_mesh(paradiff.ParallelConfig(context_parallel_config=cp))
    runtime = ContextParallelRuntime(
        mode=cp.mode, cp_group=mesh.flat_group(("ring", "ulysses")),
        ring_group=mesh.group("ring") if ring > 1 else None, ulysses_group=mesh.group("ulysses") if ulysses > 1 else None,
        stats=CommStats())
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(batch, heads, tokens, 16, generator=generator) for _ in range(3))
    rank, size = runtime.cp_rank, runtime.cp_size
    local = lambda t, dim=2: local_chunk(t, dim, rank, size)  # noqa: E731
    diffs = {}
    for name, mask in _masks(batch, heads, tokens, generator).items():
        expected = local(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        given = local(mask, 3) if mask.shape[2] == 1 else mask
        actual = runtime.attention(local(q), local(k), local(v), attn_mask=given)
        diffs[name] = float((actual - expected).abs().max() / expected.abs().max())
    try:  # a query-dependent mask split with the queries cannot be used: every rank says so
        runtime.attention(local(q), local(k), local(v), attn_mask=local(_masks(batch, heads, tokens, generator)
                                                                         ["causal_bool"]))
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    return {"diffs": diffs, "calls": dict(runtime.stats.calls), "split_mask_error": error}


def cp_refused_argument() -> str:
    """Lumina-Next's proportional attention (a scale from the sequence length its processor sees) under CP: every
    rank refuses the call with the reason before the forward issues a collective."""
    from paradiff.plan_tools import family_examples as examples

    model = paradiff.enable_parallelism(examples.build_example("lumina_next", "lumina-next"),
                                        paradiff.ContextParallelConfig(ring_degree=dist.get_world_size()))
    inputs = examples.example_inputs("lumina_next", "lumina-next", model.config)
    inputs["cross_attention_kwargs"] = {"base_sequence_length": 64}
    stats = get_state(model).context.stats = CommStats()
    try:
        model(**inputs)
    except ValueError as exc:
        return f"{exc} | collectives: {sum(stats.calls.values())}"
    return "no error"


def cp_queries_and_keys_of_different_lengths(ring: int, ulysses: int, heads: int = 4, batch: int = 2) -> dict:
    """Image queries attending [text, image] keys (PRX's attention), both streams split over the ranks, with a text
    padding mask: relative max difference to SDPA on the whole streams."""
    import torch.nn.functional as F

    from paradiff.context_parallel.attention import local_chunk
    from paradiff.context_parallel.runtime import ContextParallelRuntime
    from paradiff.distributed.mesh import build_mesh

    cp = paradiff.ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    mesh = build_mesh(paradiff.ParallelConfig(context_parallel_config=cp))
    runtime = ContextParallelRuntime(
        mode=cp.mode, cp_group=mesh.flat_group(("ring", "ulysses")),
        ring_group=mesh.group("ring") if ring > 1 else None, ulysses_group=mesh.group("ulysses") if ulysses > 1 else None,
        stats=CommStats())
    generator = torch.Generator().manual_seed(4)
    text, image = 7, 11
    q = torch.randn(batch, heads, image, 16, generator=generator)
    k, v = (torch.randn(batch, heads, text + image, 16, generator=generator) for _ in range(2))
    mask = torch.ones(batch, 1, 1, text + image, dtype=torch.bool)
    mask[-1, ..., 4:text] = False  # the last prompt is padded
    rank, size = runtime.cp_rank, runtime.cp_size

    def joint(t):  # this rank's [text chunk, image chunk] along the last-but-one or last dim
        dim = 3 if t.dim() == 4 and t.shape[2] == 1 else 2
        return torch.cat([local_chunk(t.narrow(dim, 0, text), dim, rank, size),
                          local_chunk(t.narrow(dim, text, image), dim, rank, size)], dim=dim)

    expected = local_chunk(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), 2, rank, size)
    actual = runtime.attention(local_chunk(q, 2, rank, size), joint(k), joint(v), attn_mask=joint(mask))
    return {"diff": float((actual - expected).abs().max() / expected.abs().max()), "calls": dict(runtime.stats.calls)}
