"""The published transformer configs of a few checkpoints, and the pipeline class each ships with: what `paradiff
plan NAME` and tools/gpu_bench.py read when no model folder is at hand (the values of each Hub repo's
transformer/config.json; keys the cost model and diffusers' classes read, defaults left out)."""

from __future__ import annotations

REFERENCE_CONFIGS: dict[str, tuple[str, dict]] = {
    "flux.1-dev": ("FluxPipeline", {
        "_class_name": "FluxTransformer2DModel", "attention_head_dim": 128, "guidance_embeds": True,
        "in_channels": 64, "joint_attention_dim": 4096, "num_attention_heads": 24, "num_layers": 19,
        "num_single_layers": 38, "patch_size": 1, "pooled_projection_dim": 768, "axes_dims_rope": [16, 56, 56]}),
    "flux.2-dev": ("Flux2Pipeline", {
        "_class_name": "Flux2Transformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [32, 32, 32, 32],
        "in_channels": 128, "joint_attention_dim": 15360, "mlp_ratio": 3.0, "num_attention_heads": 48,
        "num_layers": 8, "num_single_layers": 48, "patch_size": 1, "timestep_guidance_channels": 256}),
    "qwen-image": ("QwenImagePipeline", {
        "_class_name": "QwenImageTransformer2DModel", "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56],
        "guidance_embeds": False, "in_channels": 64, "joint_attention_dim": 3584, "num_attention_heads": 24,
        "num_layers": 60, "out_channels": 16, "patch_size": 2}),
    "wan2.1-t2v-14b": ("WanPipeline", {
        "_class_name": "WanTransformer3DModel", "attention_head_dim": 128, "cross_attn_norm": True, "eps": 1e-06,
        "ffn_dim": 13824, "freq_dim": 256, "in_channels": 16, "num_attention_heads": 40, "num_layers": 40,
        "out_channels": 16, "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024,
        "text_dim": 4096}),
    "wan2.1-i2v-14b": ("WanImageToVideoPipeline", {
        "_class_name": "WanTransformer3DModel", "added_kv_proj_dim": 5120, "attention_head_dim": 128,
        "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": 13824, "freq_dim": 256, "image_dim": 1280,
        "in_channels": 36, "num_attention_heads": 40, "num_layers": 40, "out_channels": 16, "patch_size": [1, 2, 2],
        "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024, "text_dim": 4096}),
    "hunyuan-video": ("HunyuanVideoPipeline", {
        "_class_name": "HunyuanVideoTransformer3DModel", "attention_head_dim": 128, "guidance_embeds": True,
        "in_channels": 16, "mlp_ratio": 4.0, "num_attention_heads": 24, "num_layers": 20, "num_refiner_layers": 2,
        "num_single_layers": 40, "out_channels": 16, "patch_size": 2, "patch_size_t": 1, "pooled_projection_dim": 768,
        "qk_norm": "rms_norm", "rope_axes_dim": [16, 56, 56], "rope_theta": 256.0, "text_embed_dim": 4096}),
    "ltx-video": ("LTXPipeline", {
        "_class_name": "LTXVideoTransformer3DModel", "activation_fn": "gelu-approximate", "attention_bias": True,
        "attention_head_dim": 64, "caption_channels": 4096, "cross_attention_dim": 2048, "in_channels": 128,
        "norm_elementwise_affine": False, "norm_eps": 1e-06, "num_attention_heads": 32, "num_layers": 28,
        "out_channels": 128, "patch_size": 1, "patch_size_t": 1, "qk_norm": "rms_norm_across_heads"}),
}
