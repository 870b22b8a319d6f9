"""ReLU linear attention over tokens split by rows (DC-AE's multiscale attention), exact.

For each head, with queries, keys and values as (dim, tokens) blocks and the values padded with a row of ones:

    out = (V_pad K^T) Q,   then   out[:-1] / (out[-1] + eps)

`V_pad K^T` is a sum over the tokens: each rank sums its own, one all-reduce adds the ranks' (dim + 1) x dim
partial sums per head, and every rank finishes its own queries. The model picks this form when its token count is
above the head size and a tokens x tokens form of the same function otherwise; it decides from the tokens it sees,
so on a rank holding a few rows it could pick the other form. Here the choice is made from the whole image's token
count, as one device makes it: the linear form as above (in float32, as the model upcasts for it), or the quadratic
form over the keys and values of every rank (gathered: it is only chosen for images of at most head-size tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paradiff.distributed.comm import all_gather_int, all_gather_uneven, all_reduce_token_sums
from paradiff.runtime.patches import set_attribute
from paradiff.vae.runtime import VaeRuntime


class SplitLinearAttention:
    """Stands in for one module's `apply_linear_attention` and `apply_quadratic_attention`."""

    def __init__(self, runtime: VaeRuntime, module) -> None:
        self.runtime = runtime
        self.module = module
        self.linear = module.apply_linear_attention
        self.quadratic = module.apply_quadratic_attention

    def install(self) -> None:
        set_attribute(self.module, "apply_linear_attention",
                      lambda query, key, value: self.attend(self.linear, query, key, value), by="vae")
        set_attribute(self.module, "apply_quadratic_attention",
                      lambda query, key, value: self.attend(self.quadratic, query, key, value), by="vae")

    def attend(self, chosen, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.runtime.active is None:
            return chosen(query, key, value)
        group, stats = self.runtime.group, self.runtime.stats
        lengths = all_gather_int(key.shape[-1], group, key.device)
        dtype = query.dtype
        if sum(lengths) <= self.module.attention_head_dim:
            keys = all_gather_uneven(key, -1, lengths, group, stats, "all_gather_kv")
            values = all_gather_uneven(value, -1, lengths, group, stats, "all_gather_kv")
            return self.quadratic(query, keys, values)
        query, key, value = query.float(), key.float(), value.float()
        value = F.pad(value, (0, 0, 0, 1), mode="constant", value=1.0)
        sums = all_reduce_token_sums(torch.matmul(value, key.transpose(-1, -2)), group, stats)
        out = torch.matmul(sums, query)
        # the model's linear form returns float32 and its caller casts back; its quadratic form keeps the dtype
        return (out[:, :, :-1] / (out[:, :, -1:] + self.module.eps)).to(dtype)
