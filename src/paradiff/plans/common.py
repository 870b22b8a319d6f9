"""Plan fragments shared by several model families."""


def joint_attention(prefix: str) -> dict[str, str]:
    """Dual-stream joint attention (image and text projections) as diffusers' Flux-style attention names them:
    Q/K/V colwise (each rank gets heads / tp), both output projections rowwise."""
    return {
        f"{prefix}.to_q": "colwise",
        f"{prefix}.to_k": "colwise",
        f"{prefix}.to_v": "colwise",
        f"{prefix}.to_out.0": "rowwise",
        f"{prefix}.add_q_proj": "colwise",
        f"{prefix}.add_k_proj": "colwise",
        f"{prefix}.add_v_proj": "colwise",
        f"{prefix}.to_add_out": "rowwise",
    }
