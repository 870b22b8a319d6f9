"""Allegro's rotary input as its pipeline builds it, for the example inputs plans/allegro.py declares."""

import torch


def rotary_embedding(head_dim: int, frames: int, height: int, width: int,
                     interpolation_scale: tuple[float, float, float]) -> tuple:
    """(the three axes' cos / sin tables, the (frame, row, column) position of every token): `image_rotary_emb`."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    tables_and_axes = get_3d_rotary_pos_embed_allegro(head_dim, ((0, 0), (height, width)), (height, width), frames,
                                                      interpolation_scale=interpolation_scale)
    axes = [axis.to(torch.long) for axis in tables_and_axes[3:]]
    positions = torch.cartesian_prod(*axes).transpose(0, 1).reshape(3, 1, -1)  # as the pipeline lays them out
    return tables_and_axes[:3], tuple(positions)
