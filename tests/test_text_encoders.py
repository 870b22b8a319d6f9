"""Text encoders split over the mesh and staged execution: a tiny pipeline per encoder family (FLUX.1 with T5 + CLIP,
FLUX.2 with Mistral3, Qwen-Image with Qwen2.5-VL, Wan with UMT5, FLUX.2 [klein] with Qwen3, Lumina 2 with Gemma 2,
HunyuanVideo with Llama + CLIP) encodes (batch 2, padded prompts, through the pipeline's own encode_prompt) and
generates what diffusers' single-process pipeline does, with and without stages, while each rank holds about half of
every encoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rank_cases_encoders as cases
import paradiff
from paradiff.errors import ParallelConfigError
from paradiff_testkit.beside import beside

# one pipeline per encoder family (Wan 2.2 and LTX-Video reuse UMT5 and T5)
FAMILIES = ("flux", "flux2", "qwenimage", "wan", "flux2_klein", "lumina2", "hunyuanvideo")

EMBED_TOLERANCE = 1e-5  # relative
IMAGE_TOLERANCE = 1e-5  # absolute, on pixel values in [0, 1]
# vision towers (Mistral3, Qwen2.5-VL) and norms stay whole: a rank holds a little more than half
SHARE_RANGE = (0.45, 0.6)


@pytest.fixture(scope="session")
def encoder_pipelines(tiny_pipeline_folders):
    return {family: str(tiny_pipeline_folders[family]) for family in FAMILIES}


def _single_threaded(function, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank computes
    try:
        return function(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def references(encoder_pipelines):
    return {family: _single_threaded(cases.reference, family, folder) for family, folder in encoder_pipelines.items()}


def check_matches(results: list[dict], staged_only_vae: bool = True) -> None:
    for rank, by_case in enumerate(results):
        for case, figures in by_case.items():
            assert figures["embeds"] <= EMBED_TOLERANCE, (rank, case, figures)
            assert figures["image"] <= IMAGE_TOLERANCE, (rank, case, figures)
            for name, share in figures["encoder_shares"].items():
                assert SHARE_RANGE[0] <= share <= SHARE_RANGE[1], (rank, case, name, share)
            assert figures["stages"] == ["text_encoders", "transformer", "vae"], (rank, case, figures)
            if case.endswith("stages=True") and staged_only_vae:
                held = {name for name, nbytes in figures["held_after_call"].items() if nbytes}
                assert held == {"vae"}, (rank, case, figures["held_after_call"])


# Without stages, FLUX.1 / FLUX.2 / Qwen-Image with split encoders are covered at tp2 x ulysses2, tp2 x ring2,
# cfg2 x tp2 and dp2 x tp2 by test_pipelines.py; here every family runs staged, and the others unstaged too.
UNSTAGED_ELSEWHERE = {"flux", "flux2", "qwenimage"}


def _modes(unstaged_elsewhere: set[str]) -> dict[str, list[bool]]:
    return {family: [True] if family in unstaged_elsewhere else [False, True] for family in FAMILIES}


def test_tp2_every_family_with_and_without_stages(pools, encoder_pipelines, references):
    modes = _modes(UNSTAGED_ELSEWHERE)
    check_matches(pools.get(2).run(cases.pipelines_match, folders=encoder_pipelines, references=references,
                                   degrees=dict(tp=2), stage_modes=modes, timeout_s=600))


def test_fsdp2_shards_every_family_of_encoders(pools, encoder_pipelines, references):
    """--fsdp 2 alone leaves no TP split for the encoders: FSDP shards their layers (`_no_split_modules`) too, each
    rank reading and holding about half of every encoder, the vision towers included. (FLUX.1's CLIPTextModel, Lumina
    2's Gemma2Model and HunyuanVideo's LlamaModel stay whole: `test_fsdp_leaves_encoders_that_record_..._whole`.)"""
    # T5 + CLIP, Mistral3 and Qwen2.5-VL (vision towers); Wan's UMT5 is sharded in test_fsdp.py's cfg2 x fsdp2
    # pipeline, and which classes stay whole is the next test
    sharded = {family: encoder_pipelines[family] for family in ("flux", "flux2", "qwenimage")}
    results = pools.get(2).run(cases.pipelines_match, folders=sharded, references=references, degrees=dict(fsdp=2),
                               stage_modes={family: [False] for family in sharded}, timeout_s=600)
    for rank, by_case in enumerate(results):
        assert len(by_case) == len(sharded), by_case.keys()
        for case, figures in by_case.items():
            assert figures["embeds"] <= EMBED_TOLERANCE, (rank, case, figures)
            assert figures["image"] <= IMAGE_TOLERANCE, (rank, case, figures)
            for name, share in figures["encoder_shares"].items():
                if (case, name) == ("flux/stages=False", "text_encoder"):  # CLIPTextModel: see the test below
                    assert share == 1.0, (rank, case, name, share)
                else:
                    assert SHARE_RANGE[0] <= share <= SHARE_RANGE[1], (rank, case, name, share)


def test_fsdp_leaves_encoders_that_record_outputs_by_class_whole():
    """transformers 5 finds what a bare Gemma2Model / LlamaModel / CLIPTextModel records (the hidden states Lumina 2
    and HunyuanVideo take) by the model's class, which fully_shard changes: FSDP leaves them whole (TP still splits them), and says
    why; an encoder whose records live in an inner model (Qwen3ForCausalLM) is sharded."""
    import transformers

    from paradiff.api.fsdp import encoder_fsdp_blocks

    parallel = paradiff.ParallelConfig.from_degrees(fsdp=2)
    tiny = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8)
    with torch.device("meta"):
        gemma = transformers.Gemma2Model(transformers.Gemma2Config(**tiny))
        llama = transformers.LlamaModel(transformers.LlamaConfig(**tiny))
        qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**tiny))
    assert encoder_fsdp_blocks("text_encoder", gemma, parallel, (), quantized=False) is None
    assert encoder_fsdp_blocks("text_encoder", llama, parallel, (), quantized=False) is None
    blocks = encoder_fsdp_blocks("text_encoder", qwen3, parallel, (), quantized=False)
    assert [name for name, _ in blocks] == ["model.layers.0", "model.layers.1"]
    # split by TP over the FSDP ranks themselves (CP without TP): already 1/N there
    cp = paradiff.ParallelConfig.from_degrees(fsdp=2, ulysses=2)
    assert encoder_fsdp_blocks("text_encoder", qwen3, cp, ("ring", "ulysses"), quantized=False) is None
    assert encoder_fsdp_blocks("text_encoder", qwen3, parallel, (), quantized=True) is None


def test_tp2_x_ulysses2_every_family(pools, encoder_pipelines, references):
    # klein's Qwen3 and HunyuanVideo's Llama run unstaged at tp=2 (and Qwen3 at tp=4)
    modes = _modes(UNSTAGED_ELSEWHERE | {"flux2_klein", "hunyuanvideo"})
    check_matches(pools.get(4).run(cases.pipelines_match, folders=encoder_pipelines, references=references,
                                   degrees=dict(tp=2, ulysses=2), stage_modes=modes, timeout_s=600))


def test_tp_beyond_kv_heads_replicates_kv_heads(pools, encoder_pipelines, references):
    """Qwen3 and Gemma 2 with 4 query and 2 K/V heads at tp=4: each rank holds one K/V head (one group)."""
    folders = {family: encoder_pipelines[family] for family in ("flux2_klein", "lumina2")}
    for result in pools.get(4).run(cases.encoders_beyond_kv_heads, folders=folders, references=references, tp=4):
        for family, figures in result.items():
            assert figures["embeds"] <= EMBED_TOLERANCE, (family, figures)
            assert figures["kv_rows"] == figures["head_dim"], (family, figures)  # one K/V head
            assert figures["groups"] == 1, (family, figures)  # one query head per rank, one K/V head


def test_data_parallel_replicas_keep_their_prompts_under_stages(pools, encoder_pipelines):
    prompts = ["a cat", "a dog on a beach", "a red cube"]
    # diffusers' single-process images are drawn here while the ranks draw theirs
    results, expected = beside(
        lambda: cases.data_parallel_expected("flux2", encoder_pipelines["flux2"], prompts),
        lambda: pools.get(4).run(cases.data_parallel_staged, family="flux2", folder=encoder_pipelines["flux2"],
                                 prompts=prompts))
    made = set()
    for result in results:
        result["diffs"] = {index: float(np.abs(image - expected[index]).max())
                           for index, image in result.pop("made").items()}
        assert max(result["diffs"].values()) <= IMAGE_TOLERANCE, result
        made |= set(result["diffs"])
    assert made == set(range(len(prompts)))


def test_encoder_without_plan_stays_whole_by_default_and_is_refused_when_required(pools, encoder_pipelines, tmp_path):
    scratch = cases.unplanned_encoder_folder(encoder_pipelines["wan"], str(tmp_path / "mt5-wan"))
    # diffusers' single-process pipeline on the same folder runs here while the ranks load and draw theirs
    results, expected = beside(lambda: _single_threaded(cases.reference, "wan", scratch),
                               lambda: pools.get(2).run(cases.unplanned_encoder, folder=encoder_pipelines["wan"],
                                                        scratch=scratch))
    for result in results:
        for name in ("default", "default_cp"):
            image = result.pop(f"{name}_image")
            result[f"{name}_image_vs_single"] = float(np.abs(image.astype(np.float64) - expected["image"]).max())
        # one console line per load (tp2, then ulysses2), from the first rank
        assert result["default_warnings"] == (2 if result["rank"] == 0 else 0), result
        assert result["default_cp_share"] == 1.0 and result["default_cp_vs_whole"] == 0.0, result
        assert result["default_share"] == 1.0, result  # whole on each rank
        assert result["default_vs_whole"] == 0.0, result
        # the images of the tp2 and ulysses2 pipelines are diffusers' single-process ones
        assert result["default_image_vs_single"] <= IMAGE_TOLERANCE, result
        assert result["default_cp_image_vs_single"] <= IMAGE_TOLERANCE, result
        message = result["error"]
        assert message.startswith("PlanError: "), message
        for part in ("'text_encoder'", "MT5EncoderModel", "text_encoder_plans=", "shard_text_encoders=False"):
            assert part in message, (part, message)
        assert 0.45 <= result["given_share"] <= 0.6, result
        assert result["given_vs_whole"] <= EMBED_TOLERANCE, result


def test_device_map_and_max_memory_reach_unsplit_components(pools, encoder_pipelines):
    results, expected = beside(
        lambda: cases.device_map_expected("flux2", encoder_pipelines["flux2"]),
        lambda: pools.get(2).run(cases.device_map_for_whole_components, family="flux2",
                                 folder=encoder_pipelines["flux2"]))
    for result in results:
        result["encoder_whole"] = result.pop("encoder_bytes") == expected["encoder_bytes"]
        result["diff"] = float(np.abs(result.pop("image") - expected["image"]).max())
        assert result["device_map"] == "cpu", result
        assert result["encoder_whole"], result
        assert result["diff"] <= IMAGE_TOLERANCE, result


@pytest.mark.parametrize("kwargs,expected", [
    (dict(stages="yes"), "stages must be True or False, got 'yes'"),
    (dict(shard_text_encoders=1), "shard_text_encoders must be True, False or None, got 1"),
    (dict(stages=True, device_map="balanced"), "pass one or the other"),
    (dict(text_encoder_plans=["text_encoder"]), "text_encoder_plans must map component names to plans"),
    (dict(text_encoder_plans={"text_encoder_9": {}}), "names ['text_encoder_9'], which are not text encoders"),
])
def test_bad_pipeline_options_are_refused(encoder_pipelines, kwargs, expected):
    with pytest.raises(ParallelConfigError) as info:
        paradiff.load_pipeline(encoder_pipelines["flux"], **kwargs)
    assert expected in str(info.value)


def test_staged_half_precision_equals_unstaged(pools, encoder_pipelines):
    """Stages in bfloat16 / float16 (the dtypes users run): every component reports the requested dtype after the
    load and after a staged call freed it (placeholders once said float32, and FLUX.2's latents, made in the
    transformer's dtype before its stage, then met bf16 weights), and the image equals the unstaged pipeline's in the
    same dtype: in one process (bf16 and fp16) and at tp2 with split encoders (bf16)."""
    folder = encoder_pipelines["flux2"]
    # the single process runs here while the tp2 ranks run theirs
    per_rank, single = beside(
        lambda: cases.staged_matches_unstaged_in_dtypes("flux2", folder, {}, ["bfloat16", "float16"]),
        lambda: pools.get(2).run(cases.staged_matches_unstaged_in_dtypes, family="flux2", folder=folder,
                                 degrees=dict(tp=2), dtypes=["bfloat16"]))
    results = {"single": single}
    for rank, result in enumerate(per_rank):
        results[f"tp2 rank {rank}"] = result
    for where, by_dtype in results.items():
        for name, figures in by_dtype.items():
            assert figures["diff"] == 0.0, (where, name, figures)
            for when, reported in figures["dtypes"].items():
                assert set(reported.values()) == {f"torch.{name}"}, (where, name, when, reported)
