"""Random LoRA adapters for the tiny models, saved as real safetensors files (diffusers / peft keys with diffusers'
adapter metadata, or kohya's `lora_unet_*` keys for FLUX.1), and the targets each family's tests use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

# per family: attention (joint and single stream), feed-forward, AdaLN modulation, and the top-level projection
# where context parallelism gathers the tokens
TARGETS = {
    "flux": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
             "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_k_proj",
             "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.ff.net.0.proj",
             "transformer_blocks.0.ff.net.2", "transformer_blocks.0.norm1.linear",
             "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out",
             "single_transformer_blocks.0.norm.linear", "single_transformer_blocks.0.attn.to_q", "proj_out",
             "context_embedder", "norm_out.linear"),
    "flux2": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0",
              "transformer_blocks.0.attn.add_v_proj", "transformer_blocks.0.ff.linear_in",
              "transformer_blocks.0.ff.linear_out", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
              "single_transformer_blocks.0.attn.to_out", "double_stream_modulation_img.linear", "proj_out"),
    "qwenimage": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_v",
                  "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_q_proj",
                  "transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.img_mlp.net.0.proj",
                  "transformer_blocks.0.img_mlp.net.2", "transformer_blocks.0.img_mod.1",
                  "transformer_blocks.1.txt_mod.1", "proj_out"),
    "wan": ("blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_out.0", "blocks.0.attn2.to_v",
            "blocks.0.attn2.to_out.0", "blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2",
            "condition_embedder.time_proj", "proj_out"),
}


def random_lora(model: nn.Module, targets: tuple[str, ...], rank: int, seed: int, scale: float = 0.2,
                prefix: str = "transformer") -> dict[str, torch.Tensor]:
    """peft-format factors (`{prefix}.{module}.lora_A.weight` r x in, `lora_B.weight` out x r), both non-zero."""
    generator = torch.Generator().manual_seed(seed)
    state_dict = {}
    for name in targets:
        module = model.get_submodule(name)
        state_dict[f"{prefix}.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * scale
        state_dict[f"{prefix}.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * scale
    return state_dict


def save_lora(path: Path, state_dict: dict[str, torch.Tensor], rank: int, alpha: float) -> Path:
    """A diffusers LoRA file: the factors plus the adapter metadata diffusers' save_lora_weights writes (r,
    lora_alpha and target modules, under each component's prefix: `transformer`, `text_encoder`, ...), so the
    loaders build the same LoraConfig."""
    from safetensors.torch import save_file

    metadata = {}
    for prefix in sorted({key.split(".", 1)[0] for key in state_dict}):
        targets = sorted({key[len(prefix) + 1:].split(".lora_")[0] for key in state_dict if key.startswith(f"{prefix}.")})
        config = {"r": rank, "lora_alpha": alpha, "target_modules": targets}
        metadata.update({f"{prefix}.{k}": v for k, v in config.items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(path),
              metadata={"format": "pt", "lora_adapter_metadata": json.dumps(metadata)})
    return path


def first_block_targets(model: nn.Module) -> tuple[str, ...]:
    """Every Linear of the first block of each block stack (attention, feed-forward, AdaLN modulation), and the
    model's top-level Linears (embedders, `proj_out`) and output modulation (`norm_out.linear`)."""
    return tuple(name for name, module in model.named_modules() if isinstance(module, nn.Linear) and (
        re.match(r"^[a-z_]*blocks\.0\.", name) or "." not in name or name == "norm_out.linear"))


def text_encoder_targets(encoder: nn.Module) -> tuple[str, ...]:
    """Every Linear of a text encoder's first layer (attention q / k / v / out and the MLP, for CLIP)."""
    return tuple(name for name, module in encoder.named_modules()
                 if isinstance(module, nn.Linear) and ".layers.0." in f".{name}")


# kohya (sd-scripts) names of FLUX.1 modules in BFL's layout, for block 0; qkv is one fused projection there, split
# in three by the converter. (The single blocks' fused linear1 is left out: diffusers' converter splits it by
# FLUX.1-dev's fixed widths, 3 x 3072 + 12288, which a tiny model does not have.)
def save_kohya_flux_lora(path: Path, config, rank: int, alpha: float, seed: int, scale: float = 0.2,
                         clip_width: int | None = None) -> Path:
    """A kohya-format FLUX.1 LoRA (`lora_unet_*.lora_down/lora_up.weight` and `.alpha`), for diffusers' converter;
    with `clip_width`, also `lora_te1_*` tensors on the first layer of a CLIP text encoder that wide (its MLP 2x)."""
    from safetensors.torch import save_file

    dim = config.num_attention_heads * config.attention_head_dim
    shapes = {  # (in, out) in BFL's layout
        "unet_double_blocks_0_img_attn_qkv": (dim, 3 * dim), "unet_double_blocks_0_img_attn_proj": (dim, dim),
        "unet_double_blocks_0_img_mlp_0": (dim, 4 * dim), "unet_double_blocks_0_img_mlp_2": (4 * dim, dim),
        "unet_double_blocks_0_img_mod_lin": (dim, 6 * dim), "unet_double_blocks_0_txt_attn_proj": (dim, dim),
        "unet_double_blocks_0_txt_attn_qkv": (dim, 3 * dim), "unet_single_blocks_0_linear2": (dim + 4 * dim, dim),
        "unet_single_blocks_0_modulation_lin": (dim, 3 * dim),
    }
    if clip_width is not None:
        layer = "te1_text_model_encoder_layers_0"
        shapes.update({f"{layer}_self_attn_{name}": (clip_width, clip_width)
                       for name in ("q_proj", "k_proj", "v_proj", "out_proj")})
        shapes.update({f"{layer}_mlp_fc1": (clip_width, 2 * clip_width), f"{layer}_mlp_fc2": (2 * clip_width, clip_width)})
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in shapes.items():
        tensors[f"lora_{name}.lora_down.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
        tensors[f"lora_{name}.lora_up.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
        tensors[f"lora_{name}.alpha"] = torch.tensor(float(alpha))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def save_original_hunyuan_video_lora(path: Path, config, rank: int, seed: int, scale: float = 0.2) -> Path:
    """A HunyuanVideo LoRA in the original repository's layout (`diffusion_model.double_blocks.0.img_attn_qkv...`,
    q / k / v fused), for diffusers' converter: block 0's attention, MLP and modulation, and the single block's
    output projection, which reads [attention, MLP] (paradiff splits it as two packed blocks). (The single blocks'
    fused linear1 is left out: diffusers' converter splits it by HunyuanVideo's fixed width, 3072.)"""
    from safetensors.torch import save_file

    dim = config.num_attention_heads * config.attention_head_dim
    mlp = int(dim * config.mlp_ratio)
    shapes = {  # (in, out)
        "double_blocks.0.img_attn_qkv": (dim, 3 * dim), "double_blocks.0.img_attn_proj": (dim, dim),
        "double_blocks.0.txt_attn_qkv": (dim, 3 * dim), "double_blocks.0.txt_attn_proj": (dim, dim),
        "double_blocks.0.img_mlp.fc1": (dim, mlp), "double_blocks.0.img_mlp.fc2": (mlp, dim),
        "double_blocks.0.img_mod.linear": (dim, 6 * dim), "single_blocks.0.linear2": (dim + mlp, dim),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in shapes.items():
        tensors[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
        tensors[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def save_pipeline_loras(family: str, folder: Path, root: Path) -> dict[str, Path]:
    """Adapter name -> file for a tiny pipeline (paradiff_testkit.pipelines) in diffusers' format with its metadata:
    'style' (rank 4, alpha 8) on the first blocks' and the top-level Linears of the transformer and on the first
    layer of every text encoder diffusers' loader adapts, 'detail' (rank 8, alpha 4) on every other one of those;
    and in the formats diffusers converts: 'kohya' (FLUX.1, with CLIP tensors), 'original' (HunyuanVideo's layout)."""
    import json

    import transformers

    from paradiff_testkit.pipelines import pipeline_class, transformer_class

    folder, root = Path(folder), Path(root)
    index = json.loads((folder / "model_index.json").read_text())
    models = [("transformer", transformer_class(family).from_pretrained(folder / "transformer"))]
    for name in pipeline_class(family)._lora_loadable_modules:
        if name.startswith("text_encoder") and isinstance(index.get(name), list):
            models.append((name, getattr(transformers, index[name][1]).from_pretrained(folder / name)))
    parts: dict[str, dict[str, torch.Tensor]] = {"style": {}, "detail": {}}
    for seed, (prefix, model) in enumerate(models):
        targets = first_block_targets(model) if prefix == "transformer" else text_encoder_targets(model)
        parts["style"].update(random_lora(model, targets, 4, seed=10 + seed, prefix=prefix))
        parts["detail"].update(random_lora(model, targets[1::2], 8, seed=20 + seed, prefix=prefix))
    files = {"style": save_lora(root / "style.safetensors", parts["style"], rank=4, alpha=8),
             "detail": save_lora(root / "detail.safetensors", parts["detail"], rank=8, alpha=4)}
    config = models[0][1].config
    if family == "flux":
        files["kohya"] = save_kohya_flux_lora(root / "kohya.safetensors", config, rank=4, alpha=2.0, seed=6,
                                              clip_width=models[1][1].config.hidden_size)
    if family == "hunyuanvideo":
        files["original"] = save_original_hunyuan_video_lora(root / "original.safetensors", config, rank=4, seed=7)
    return files


# --- checks run on every rank (tests/rank_cases_lora.py, tools/verify_lora.py) ---

def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return float((actual - expected).abs().max() / expected.abs().max())


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)}


def check_factor_slices(model, reference) -> int:
    """Each rank's LoRA factors equal the slices of the full factors its base weight's ShardSpec names."""
    from paradiff.runtime.state import get_state
    from paradiff.tensor_parallel.shard import slice_tensor
    from paradiff.tensor_parallel.styles import ShardSpec

    state = get_state(model)
    plan = state.tp_plan if state is not None else None  # None: a component paradiff keeps whole
    full_layers = lora_layers(reference)
    checked = 0
    for name, layer in lora_layers(model).items():
        full = full_layers[name]
        planned = plan.linears.get(name) if plan is not None else None
        for adapter in layer.lora_A:
            a, b = full.lora_A[adapter].weight, full.lora_B[adapter].weight
            if planned is not None:
                pieces = planned.specs["weight"].pieces
                if planned.style.kind == "colwise":
                    b = slice_tensor(b, ShardSpec(dim=0, pieces=pieces))
                else:
                    a = slice_tensor(a, ShardSpec(dim=1, pieces=pieces))
                checked += 1
            assert torch.equal(layer.lora_A[adapter].weight, a), (name, adapter, "lora_A")
            assert torch.equal(layer.lora_B[adapter].weight, b), (name, adapter, "lora_B")
    return checked


def lora_components(pipe) -> dict:
    """The pipeline's components that diffusers' loaders put adapters into (transformer, text encoders)."""
    return {name: getattr(pipe, name) for name in pipe._lora_loadable_modules if getattr(pipe, name, None) is not None}


def resident_shards(pipe) -> dict[tuple[str, str], torch.Tensor]:
    """Every adapted layer's base weight (this rank's shard) whose stage holds it now (staged pipelines free them)."""
    return {(component, name): layer.get_base_layer().weight.detach().clone()
            for component, model in lora_components(pipe).items() for name, layer in lora_layers(model).items()
            if layer.get_base_layer().weight.numel()}


def pipeline_lora(family: str, folder: str, mode: str, loras: dict[str, str], weights: dict[str, float],
                  stages: bool = False, steps: int = 2, bad_text_encoder: bool = False,
                  references: dict | None = None) -> dict:
    """`pipe.load_lora_weights` on a paradiff pipeline (diffusers' format conversions included; adapters with
    text-encoder parts go into split encoders too) against diffusers' single-process pipeline: the denoised latents
    after loading every adapter, mixed by `set_adapters(weights)`, fused into every component (then each rank's
    shards against the originals after unfusing), unfused, unloaded; each rank's factors against the slices of the
    full ones. Data parallel: each replica draws its own prompt. `bad_text_encoder`: an adapter whose text-encoder
    part does not fit, refused on every rank with its transformer part taken out again. `references`: what
    diffusers' pipeline gave (latents per step, active adapters, full factors), kept by the first case of the same
    folder, adapters, steps and prompt and replayed for the next ones (diffusers' pipeline not loaded or run again)."""
    import copy

    import torch.distributed as dist
    from diffusers import DiffusionPipeline

    import paradiff
    from paradiff.config import ParallelConfig, parse_mode
    from paradiff.tensor_parallel.layers import ShardedLinear
    from paradiff.tensor_parallel.styles import ShardSpec
    from paradiff_testkit.pipelines import default_call_kwargs

    kwargs = dict(default_call_kwargs(family), num_inference_steps=steps, output_type="latent")
    config = ParallelConfig.from_degrees(**parse_mode(mode))
    pipeline = paradiff.load_pipeline(folder, parallel_config=config, stages=stages)
    pipeline.set_progress_bar_config(disable=True)
    if config.data_degree > 1:
        prompts = [kwargs["prompt"], "a blue bird on a branch"]
        with paradiff.split_between_processes(prompts, pipeline) as share:
            kwargs["prompt"] = share[0]
    reference_key = (family, folder, tuple(loras.items()), tuple(weights.items()), steps, kwargs["prompt"])
    recorded = (references or {}).get(reference_key)
    replay = recorded is not None
    if not replay:
        reference = DiffusionPipeline.from_pretrained(folder)
        reference.set_progress_bar_config(disable=True)
        recorded = {"latents": {}}

    def on_reference(action) -> None:  # diffusers' side of a step: skipped when its latents are replayed
        if not replay:
            action(reference)

    def latents(pipe) -> torch.Tensor:
        call = dict(kwargs, generator=torch.Generator().manual_seed(0)) if pipe is not pipeline else dict(kwargs, seed=0)
        output = pipe(**call)
        return torch.as_tensor(output.frames if hasattr(output, "frames") else output.images)

    diffs = {}

    def compare(step: str) -> torch.Tensor:
        actual = latents(pipeline)
        if not replay:
            recorded["latents"][step] = latents(reference)
        diffs[step] = relative_difference(actual, recorded["latents"][step])
        return actual

    base = latents(pipeline)
    names = list(loras)
    for name in names:
        on_reference(lambda ref: ref.load_lora_weights(loras[name], adapter_name=name))
        pipeline.load_lora_weights(loras[name], adapter_name=name)
    changed = float((compare("loaded") - base).abs().max())
    if not replay:
        recorded["active"] = reference.get_active_adapters()
    active = (pipeline.get_active_adapters(), recorded["active"])
    on_reference(lambda ref: ref.set_adapters(names, [weights[n] for n in names]))
    pipeline.set_adapters(names, [weights[n] for n in names])
    compare("mixed")
    components = lora_components(pipeline)
    if not replay:  # the full factors as they are now
        recorded["factors"] = {name: copy.deepcopy(getattr(reference, name)) for name in components}
    adapters = {name: sorted(getattr(model, "peft_config", None) or {}) for name, model in components.items()}
    sliced = {name: check_factor_slices(model, recorded["factors"][name]) for name, model in components.items()
              if lora_layers(model)}
    split_layers = {name: sum(isinstance(layer.get_base_layer(), ShardedLinear) for layer in lora_layers(model).values())
                    for name, model in components.items()}
    packed = sorted(name for name, layer in lora_layers(pipeline.transformer).items()
                    if len(getattr(layer.get_base_layer(), "weight_spec", ShardSpec(0, ())).pieces) > 1)
    originals = resident_shards(pipeline)
    fuse = [name for name, model in components.items() if lora_layers(model)]
    on_reference(lambda ref: ref.fuse_lora(components=fuse, lora_scale=0.8))
    pipeline.fuse_lora(components=fuse, lora_scale=0.8)
    compare("fused")
    fused = resident_shards(pipeline)
    fused_changed = sum(not torch.equal(tensor, originals[key]) for key, tensor in fused.items() if key in originals)
    on_reference(lambda ref: ref.unfuse_lora(components=fuse))
    pipeline.unfuse_lora(components=fuse)
    compare("unfused")
    unfused = resident_shards(pipeline)
    unfused_exact = all(torch.equal(tensor, originals[key]) for key, tensor in unfused.items() if key in originals)
    checked_shards = sum(key in originals for key in unfused)
    on_reference(lambda ref: ref.unload_lora_weights())
    pipeline.unload_lora_weights()
    back_to_base = bool(torch.equal(compare("unloaded"), base))
    if references is not None:
        references[reference_key] = recorded
    result = {"rank": dist.get_rank(), "diffs": diffs, "changed": changed, "active": active, "adapters": adapters,
              "sliced": sliced, "split_layers": split_layers, "packed": packed, "fused_changed": fused_changed,
              "shards": len(originals), "checked_shards": checked_shards, "unfused_exact": unfused_exact,
              "back_to_base": back_to_base,
              "stage_entries": {item["stage"]: item["entries"] for item in pipeline.stage_report()}}
    if bad_text_encoder:
        result.update(_bad_text_encoder_part(pipeline, loras[names[0]], latents, base))
    return result


def _bad_text_encoder_part(pipeline, good: str, latents, base: torch.Tensor) -> dict:
    """The first adapter with its text encoder's first lora_A one column too wide."""
    from safetensors.torch import load_file

    from paradiff.errors import AdapterError

    tensors = load_file(good)
    key = next(k for k in tensors if k.startswith("text_encoder.") and k.endswith("lora_A.weight"))
    tensors[key] = torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 1)
    try:
        pipeline.load_lora_weights(tensors, adapter_name="bad")
        error = None
    except AdapterError as exc:
        error = str(exc)
    return {"bad_key": key, "bad_error": error,
            "adapters_after_bad": sorted(name for model in lora_components(pipeline).values()
                                         for name in (getattr(model, "peft_config", None) or {})),
            "still_base": bool(torch.equal(latents(pipeline), base))}
