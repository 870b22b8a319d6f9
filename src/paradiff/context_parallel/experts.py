"""Expert-choice mixture-of-experts over a token sequence split across the context-parallel ranks.

Under expert choice every expert picks its `capacity` best tokens of the whole sequence (per sample), capacity =
max(1, ceil(capacity_factor * tokens / experts)), so a rank cannot route its own chunk alone. The ranks all-gather
the router's per-token scores (tokens x experts numbers per sample, a small fraction of the hidden states) and every
rank takes the same top-k over the whole sequence, so all agree on the routing exactly as one process decides it. A
chosen token's gate is its score divided by the sum of its scores over the experts that chose it, times
`route_scale`. Each rank then runs the experts on the chosen tokens it holds and adds their gated outputs to the
shared expert's output of its own tokens: the expert work is split with the tokens.

The layer's own modules do the arithmetic (router Linear, expert bank, shared expert), so tensor parallelism inside
them (split expert weights, all-reduced outputs) composes with this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paradiff.distributed.comm import all_gather_int, all_gather_uneven
from paradiff.context_parallel.runtime import ContextParallelRuntime


@dataclass(frozen=True)
class ExpertChoice:
    """Attribute names of an expert-choice layer whose forward takes (hidden_states, hidden_states_unmodulated,
    timestep): the router reads [timestep, unmodulated hidden state] (or the unmodulated state alone without a
    timestep); `experts(rows sorted by expert, rows per expert)` is the expert bank; `shared` runs on every token."""

    gate: str = "gate"
    experts: str = "experts"
    shared: str = "shared_expert"
    num_experts: str = "num_experts"
    capacity_factor: str = "capacity_factor"
    route_scale: str = "route_scale"
    sigmoid: str = "use_sigmoid"


def check_expert_choice(module: nn.Module, spec: ExpertChoice, name: str) -> None:
    from paradiff.errors import PlanError

    missing = [attr for attr in vars(spec).values() if not hasattr(module, attr)]
    if missing:
        raise PlanError(f"Context-parallel plan lists {name!r} ({type(module).__name__}) as an expert-choice layer, "
                        f"but it has no {missing}.")


def expert_choice_forward(layer: nn.Module, spec: ExpertChoice, runtime: ContextParallelRuntime):
    experts_count = getattr(layer, spec.num_experts)

    def forward(hidden_states: torch.Tensor, hidden_states_unmodulated: torch.Tensor,
                timestep: torch.Tensor | None = None) -> torch.Tensor:
        batch, local, dim = hidden_states.shape
        router_input = hidden_states_unmodulated
        if timestep is not None:
            router_input = torch.cat([timestep[:, None].expand(-1, local, -1), hidden_states_unmodulated], dim=-1)
        logits = getattr(layer, spec.gate)(router_input)
        probabilities = torch.sigmoid(logits.float()) if getattr(layer, spec.sigmoid) else \
            F.softmax(logits.float(), dim=-1)
        scores = probabilities.to(logits.dtype)
        sizes = all_gather_int(local, runtime.cp_group, hidden_states.device)
        affinity = all_gather_uneven(scores, 1, sizes, runtime.cp_group, runtime.stats).transpose(1, 2)  # (B, E, S)
        tokens = sum(sizes)
        start = sum(sizes[: runtime.cp_rank])
        capacity = max(1, math.ceil(getattr(layer, spec.capacity_factor) * tokens / experts_count))
        chosen = torch.topk(affinity, k=capacity, dim=-1).indices  # (B, E, C): the same on every rank
        gates = affinity.gather(-1, chosen)
        samples = torch.arange(batch, device=chosen.device).view(batch, 1, 1).expand_as(chosen)
        flat = samples * tokens + chosen
        sums = torch.zeros(batch * tokens, device=gates.device, dtype=gates.dtype)
        sums.scatter_add_(0, flat.reshape(-1), gates.reshape(-1))
        gates = gates / (sums[flat] + 1e-12) * getattr(layer, spec.route_scale)

        def by_expert(tensor):  # (B, E, C) -> (E, B * C): the expert-major order the bank takes its rows in
            return tensor.transpose(0, 1).reshape(experts_count, -1)

        chosen, samples, gates = by_expert(chosen), by_expert(samples), by_expert(gates)
        mine = (chosen >= start) & (chosen < start + local)
        rows = (samples * local + chosen - start)[mine]
        routed = getattr(layer, spec.experts)(hidden_states.reshape(batch * local, dim)[rows], mine.sum(dim=1))
        routed = (routed.float() * gates[mine].unsqueeze(-1)).to(hidden_states.dtype)
        out = getattr(layer, spec.shared)(hidden_states).reshape(batch * local, dim)
        out = out.scatter_add(0, rows[:, None].expand(-1, dim), routed)
        return out.reshape(batch, local, dim)

    return forward
