"""SANA-WM's attention as paradiff runs it, ported from diffusers' `transformer_sana_wm` so that it splits: the
self-attention (bidirectional gated delta rule, or softmax every `softmax_every_n`-th block) over this rank's heads
and, under context parallelism, this rank's frames, its D x D states entering from the other ranks' frames
(context_parallel/scan.py); the cross-attention by the local heads; and the whole-video inputs the CP plan puts in
before the frames are split. plans/sana_wm.py says where they go."""

import torch
import torch.nn.functional as F

from paradiff.runtime.patches import wrap_forward

CAMERA_REFUSAL = ("the camera branch's UCPE ray transforms are built per frame for the whole video and are not split "
                  "by paradiff; run camera-conditioned SANA-WM without tensor or context parallelism")


class WholeInputs:
    """Before the frames are split: the frame mask as (batch, 1, frames), and the rotary table of the whole video
    (the model would build each rank's from position 0), built as the model builds it."""

    def __init__(self, config) -> None:
        self.config = config
        self.rope = None

    def __call__(self, arguments: dict) -> dict:
        out = {}
        mask = arguments.get("frame_valid_mask")
        if mask is not None:
            if mask.ndim == 5:
                mask = mask[:, 0, :, 0, 0]
            out["frame_valid_mask"] = mask[:, None] if mask.ndim == 2 else mask
        hidden_states = arguments.get("hidden_states")
        if self.config.use_pe and arguments.get("pos_embeds") is None and hidden_states is not None:
            if self.rope is None:
                from diffusers.models.transformers.transformer_sana_wm import SanaWMRotaryPosEmbed

                self.rope = SanaWMRotaryPosEmbed(attention_head_dim=self.config.linear_head_dim,
                                                 patch_size=tuple(self.config.patch_size), max_seq_len=1024)
            sizes = [n // p for n, p in zip(hidden_states.shape[-3:], self.config.patch_size)]
            out["pos_embeds"] = self.rope(tuple(sizes), device=hidden_states.device)
        return out


class SelfAttention:
    """The block's self-attention (GDN or softmax) over this rank's heads and, with a CP runtime, this rank's frames:
    the recurrence split over the ranks (split_recurrence), softmax attention over all-gathered Q/K/V."""

    def __init__(self, module, runtime=None) -> None:
        from diffusers.models.transformers.transformer_sana_wm import BidirectionalGDNUCPESinglePathLiteLA

        self.module, self.runtime = module, runtime
        self.recurrent = isinstance(module, BidirectionalGDNUCPESinglePathLiteLA)

    def whole(self, tensor: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
        return (tensor, 0) if self.runtime is None else self.runtime.gathered(tensor, dim)

    def __call__(self, x, mask=None, HW=None, rotary_emb=None, block_mask=None, camera_conditions=None,
                 chunk_size=None, *, frame_valid_mask=None, ucpe_ray_transforms=None):
        from diffusers.models.transformers.transformer_sana_wm import _prepare_frame_valid_masks

        if camera_conditions is not None:
            raise ValueError(f"camera_conditions: {CAMERA_REFUSAL}.")
        m = self.module
        batch, tokens, channels = x.shape
        frames, height, width = HW
        spatial, heads, head_dim = height * width, m.heads, m.dim

        def masks(frame_mask, count):
            return _prepare_frame_valid_masks(frame_mask, batch_size=batch, num_frames=count, spatial_size=spatial,
                                              device=x.device, dtype=x.dtype)

        token_mask = masks(frame_valid_mask, frames)[0]
        hidden = x if token_mask is None else x * token_mask.view(batch, tokens, 1)
        qkv = m.qkv(hidden).reshape(batch, tokens, 3, heads, head_dim)
        if token_mask is not None:
            qkv = qkv * token_mask.view(batch, tokens, 1, 1, 1)
        if self.recurrent and self.runtime is not None:
            return self.split_recurrence(x, qkv, frames, spatial, frame_valid_mask, rotary_emb, masks)
        qkv, start = self.whole(qkv, 1)
        query, key, value = qkv.unbind(2)
        if frame_valid_mask is not None and self.runtime is not None:
            frame_valid_mask = self.whole(frame_valid_mask, -1)[0]
        total = qkv.shape[1]
        all_frames = total // spatial
        token_mask, beta_mask, decay_mask = masks(frame_valid_mask, all_frames)

        def heads_norm(norm, tensor):  # over the (local) heads' channels, as diffusers' over all of them
            return norm(tensor.reshape(batch, total, heads * head_dim)).reshape(batch, total, heads, head_dim)

        if self.recurrent:
            beta, decay = self.gates(x, frames, spatial)
            for name, i in (("conv_q", 0), ("conv_k", 1), ("conv_v", 2)):
                conv = getattr(m, name)
                if conv is not None:
                    streams = [query, key, value]
                    streams[i] = conv(streams[i].reshape(batch, total, -1), all_frames).reshape(streams[i].shape)
                    query, key, value = streams
            query, key = m.kernel_func(heads_norm(m.q_norm, query)), m.kernel_func(heads_norm(m.k_norm, key))
            out = m.attn(query, key, value, beta, decay, m.recall_gate, all_frames, rotary_emb=rotary_emb,
                         token_valid_mask=token_mask, beta_valid_mask=beta_mask, decay_valid_mask=decay_mask)
        else:
            query, key = heads_norm(m.q_norm, query), heads_norm(m.k_norm, key)
            out = m.attn(query, key, value, rotary_emb=rotary_emb, token_valid_mask=token_mask)
        return self.project(x, out[:, start:start + tokens])

    def project(self, x, out):
        m = self.module
        if m.use_output_gate and m.output_gate is not None:
            out = out * F.silu(m.output_gate(x).to(torch.float32))
        return m.proj(out.to(x.dtype))

    def gates(self, x, frames, spatial):
        """diffusers' per-frame delta-rule gate (per token) and decay (per frame), (batch, heads, frames[, tokens])."""
        m = self.module
        batch, _, channels = x.shape
        beta = m.beta_proj(x).sigmoid().reshape(batch, frames, spatial, m.heads).permute(0, 3, 1, 2)
        gate = m.gate_proj(x.reshape(batch, frames, spatial, channels).mean(dim=2)).float()
        decay = -m.A_log.float().exp().view(1, 1, -1) * F.softplus(gate + m.dt_bias.float().view(1, 1, -1))
        return beta, decay.exp().transpose(1, 2)

    def frame_conv(self, conv, x, frames):
        """A short convolution over frames on this rank's frames, reading up to kernel - 1 frames past each end
        from the ranks around it (all-gathered edges: a rank may hold fewer frames than the kernel's reach)."""
        batch, tokens, heads, head_dim = x.shape
        reach = conv.kernel_size - 1
        grid = x.reshape(batch, frames, tokens // frames, heads * head_dim)
        edge = min(reach, frames)
        tails, tail_start = self.runtime.gathered(grid[:, frames - edge:], 1)
        heads_, head_start = self.runtime.gathered(grid[:, :edge], 1)
        before = tails[:, :tail_start][:, max(tail_start - reach, 0):]
        after = heads_[:, head_start + edge:][:, :reach]
        wide = torch.cat([before, grid, after], dim=1)
        out = conv(wide.flatten(1, 2), wide.shape[1]).unflatten(1, (wide.shape[1], -1))
        return out[:, before.shape[1]:before.shape[1] + frames].reshape(x.shape)

    def split_recurrence(self, x, qkv, frames, spatial, frame_valid_mask, rotary_emb, masks):
        """diffusers' bidirectional gated delta rule (SanaWMBidirectionalGDNAttention) over this rank's frames, its
        D x D states entering from the other ranks' frames (context_parallel.scan): per head, forwards
        F_t = F_(t-1) W_t + U_t over frames <= t and backwards over frames > t, with W_t = decay_t (I - k_t beta_t
        k_t^T), U_t = v_t beta_t k_t^T on rotated keys for the numerator and unrotated ones (U = sum of k beta) for
        the denominator's row state."""
        from diffusers.models.transformers.transformer_sana_wm import _apply_rotary_emb

        from paradiff.context_parallel.attention import even_sizes
        from paradiff.context_parallel.scan import compose, incoming_state

        m = self.module
        batch, tokens, _, heads, head_dim = qkv.shape
        token_mask, beta_mask, decay_mask = masks(frame_valid_mask, frames)
        beta, decay = self.gates(x, frames, spatial)
        query, key, value = qkv.unbind(2)
        streams = [query, key, value]
        for i, name in enumerate(("conv_q", "conv_k", "conv_v")):
            if getattr(m, name) is not None:
                streams[i] = self.frame_conv(getattr(m, name), streams[i], frames)
        query, key, value = streams

        def heads_norm(norm, tensor):
            return norm(tensor.reshape(batch, tokens, -1)).reshape(batch, tokens, heads, head_dim)

        query, key = m.kernel_func(heads_norm(m.q_norm, query)), m.kernel_func(heads_norm(m.k_norm, key))
        key = key * (head_dim ** -0.5 * spatial ** -0.5)
        query, key, value = (t.permute(0, 2, 3, 1) for t in (query, key, value))  # (batch, heads, dim, tokens)
        if token_mask is not None:
            query, key, value = (t * token_mask.view(batch, 1, 1, tokens) for t in (query, key, value))
        query_rot, key_rot = query, key
        if rotary_emb is not None:  # the whole video's table: this rank's frames' rows
            first = sum(even_sizes(rotary_emb.shape[-2] // spatial, self.runtime.cp_size)[: self.runtime.cp_rank])
            table = rotary_emb.narrow(-2, first * spatial, tokens)
            query_rot, key_rot = _apply_rotary_emb(query, table), _apply_rotary_emb(key, table)
        if token_mask is not None:
            query_rot, key_rot = (t * token_mask.view(batch, 1, 1, tokens) for t in (query_rot, key_rot))
        if beta_mask is not None:
            beta = beta * beta_mask.to(beta.dtype)
        if decay_mask is not None:
            decay = decay * decay_mask.to(decay.dtype) + (1.0 - decay_mask.to(decay.dtype))

        def by_frame(t):  # (batch, heads, frames, dim, spatial), in fp32 for the recurrence
            return t.float().view(batch, heads, head_dim, frames, spatial).permute(0, 1, 3, 2, 4)

        query, key, value, query_rot, key_rot = (by_frame(t) for t in (query, key, value, query_rot, key_rot))
        beta, decay = beta.float().unsqueeze(3), decay.float().view(batch, heads, frames, 1, 1)
        eye = torch.eye(head_dim, dtype=torch.float32)
        weights = decay * (eye - (key_rot * beta) @ key_rot.transpose(-1, -2))
        updates = (value * beta) @ key_rot.transpose(-1, -2)
        # the denominator's state is a column; as a row it steps like the numerator's (its weights are symmetric)
        weights_z = (decay * (eye - (key * beta) @ key.transpose(-1, -2))).transpose(-1, -2)
        updates_z = (key * beta).sum(dim=-1).unsqueeze(-2)
        numerator, denominator = torch.zeros_like(query), torch.zeros_like(query[:, :, :, :1])
        for reverse in (False, True):
            order = range(frames - 1, -1, -1) if reverse else range(frames)
            pick = (lambda t: t.flip(2)) if reverse else (lambda t: t)
            state = incoming_state(*compose(pick(weights), pick(updates), 2), self.runtime, reverse)
            state_z = incoming_state(*compose(pick(weights_z), pick(updates_z), 2), self.runtime, reverse)
            for t in order:  # forwards the state includes frame t; backwards only the frames after it
                if not reverse:
                    state = state @ weights[:, :, t] + updates[:, :, t]
                    state_z = state_z @ weights_z[:, :, t] + updates_z[:, :, t]
                numerator[:, :, t] += state @ query_rot[:, :, t]
                denominator[:, :, t] += state_z @ query[:, :, t]
                if reverse:
                    state = state @ weights[:, :, t] + updates[:, :, t]
                    state_z = state_z @ weights_z[:, :, t] + updates_z[:, :, t]
        out = (numerator / (denominator + m.attn.eps)).to(qkv.dtype)
        out = out.permute(0, 2, 4, 1, 3).reshape(batch, tokens, heads * head_dim)
        if token_mask is not None:
            out = out * token_mask.view(batch, tokens, 1).to(out.dtype)
        return self.project(x, out)


class CrossAttention:
    """SanaWMCrossAttnProcessor's attention to the text, reshaped by this rank's heads (its K/V split needs them);
    under CP its SDPA call is intercepted as local attention, the text being whole on every rank."""

    def __init__(self, module, runtime=None) -> None:
        self.module = module

    def __call__(self, x, cond, mask=None):
        m = self.module
        batch, width = x.shape[0], m.heads * m.head_dim
        key, value = m.kv_linear(cond).view(batch, -1, 2, width).unbind(2)
        query, key = m.q_norm(m.q_linear(x)), m.k_norm(key)
        query, key, value = (t.reshape(batch, -1, m.heads, m.head_dim).transpose(1, 2) for t in (query, key, value))
        if mask is not None and mask.ndim == 2:
            mask = mask.bool()[:, None, None, :]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        return m.proj(out.transpose(1, 2).reshape(batch, -1, width).type_as(query))


class Fp32SoftmaxAttention:
    """SanaWMSoftmaxAttention's kernel on SDPA in fp32 (diffusers casts its inputs to bf16): the examples' run, which
    compares split runs to a single process's without bf16 steps (run_example, below)."""

    def __init__(self, module) -> None:
        self.module = module

    def __call__(self, query, key, value, rotary_emb=None, token_valid_mask=None):
        from diffusers.models.transformers.transformer_sana_wm import _apply_rotary_emb

        batch, tokens, heads, head_dim = query.shape
        if rotary_emb is not None:  # (batch, heads, head_dim, tokens) is the layout the rotation takes
            query, key = (_apply_rotary_emb(t.permute(0, 2, 3, 1), rotary_emb).permute(0, 3, 1, 2)
                          for t in (query, key))
        if token_valid_mask is not None:
            query, key, value = (t * token_valid_mask.view(batch, tokens, 1, 1) for t in (query, key, value))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value)))
        return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim).to(value.dtype)


def run_example(model, inputs: dict):
    """The example's forward with the softmax blocks' attention kernel run in fp32. diffusers casts its fp32 Q/K/V
    to bf16 for SDPA, so a split run's last-bit differences in Q/K (the norms across heads sum over the TP ranks)
    become bf16 steps (1.6e-5 at tp2). The check is of the split around that kernel, which every run (the single
    process's too) then computes alike; the product keeps diffusers' kernel."""
    from diffusers.models.transformers.transformer_sana_wm import SanaWMSoftmaxAttention

    for module in model.modules():
        if isinstance(module, SanaWMSoftmaxAttention):
            wrap_forward(module, Fp32SoftmaxAttention(module), by="example")
    return model(**inputs)
