"""Wan-Animate (`WanAnimateTransformer3DModel`): Wan 2.1 I2V blocks on video + pose latents, and after every
`inject_face_latents_blocks` blocks a face adapter in which each latent frame's video tokens attend that frame's
face-motion tokens."""

from paradiff.context_parallel.plan import ContextParallelPlan, Split, TokenGroups
from paradiff.tensor_parallel.plan import TensorParallelPlan
from paradiff.plans import wan
from paradiff.plans.family import Family
from paradiff.plans.inputs import Noise, Uniform

MODEL_CLASSES = ("WanAnimateTransformer3DModel",)


def tensor_parallel_plan(config) -> TensorParallelPlan:
    return TensorParallelPlan(styles={
        **wan.block_styles("blocks.*", config),
        **face_adapter_styles("face_adapter.*"),
        **wan.condition_styles("condition_embedder"),
    })


def face_adapter_styles(prefix: str) -> dict:
    # its QK-norms normalise one head at a time: nothing to split there
    return {f"{prefix}.to_q": "colwise", f"{prefix}.to_k": "colwise", f"{prefix}.to_v": "colwise",
            f"{prefix}.to_out": "rowwise"}


def context_parallel_plan(config) -> ContextParallelPlan:
    return ContextParallelPlan(
        split_inputs={"blocks.0": {"hidden_states": Split(1)}},
        split_outputs={"rope": {0: Split(1), 1: Split(1)}},
        gather_outputs={"proj_out": 1},
        # the face adapters group the video tokens by latent frame, one group per motion frame (no communication)
        token_groups={"face_adapter.*": TokenGroups("hidden_states", "encoder_hidden_states")},
        local_attention=("blocks.*.attn2", "face_adapter.*"),
    )


EXAMPLES = {
    "wan-animate": ("WanAnimateTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, latent_channels=4, out_channels=4,
        in_channels=12, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64, image_dim=24,
        added_kv_proj_dim=64, motion_encoder_size=16, motion_encoder_channel_sizes={"4": 8, "8": 8, "16": 8},
        motion_style_dim=16, motion_dim=8, motion_encoder_dim=16, face_encoder_hidden_dim=16,
        face_encoder_num_heads=2, inject_face_latents_blocks=1, motion_encoder_batch_size=4)),
}


# 512 replicated text tokens: enough video tokens (5x the grid's height) that the split work dominates (see wan2.1-i2v)
_AREA = ("5 * height * patch_size[1]", "width * patch_size[2]")
INPUTS = dict(
    hidden_states=Noise(("batch", "in_channels", "frames * patch_size[0]", *_AREA)),
    timestep=Uniform(1000),
    encoder_hidden_states=Noise(("batch", 512, "text_dim")),
    encoder_hidden_states_image=Noise(("batch", 4, "image_dim")),
    # the reference (first) frame has no pose
    pose_hidden_states=Noise(("batch", "latent_channels", "frames * patch_size[0] - 1", *_AREA)),
    # 5 face frames: the face encoder's two stride-2 convolutions and a leading zero frame give 3 motion frames
    face_pixel_values=Noise(("batch", 3, 5, "motion_encoder_size", "motion_encoder_size")),
    return_dict=False,
)


FAMILY = Family.of(__name__)
