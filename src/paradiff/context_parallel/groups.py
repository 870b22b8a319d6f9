"""Modules that compute each token on its own but reshape the sequence into equal groups aligned with another
argument (WanAnimate's face adapter: the video tokens of each latent frame attend that frame's face tokens).

A rank's chunk of the sequence rarely starts or ends on a group boundary. Since every token is computed on its own,
the rank pads its chunk with zero tokens to whole groups, takes those groups' rows of the grouped argument, runs
the module, and keeps its own tokens of the output: exact, and no communication.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from paradiff.context_parallel.attention import even_sizes
from paradiff.context_parallel.plan import TokenGroups


def token_group_hooks(module: nn.Module, groups: TokenGroups, runtime, name: str):
    positions = {arg: index for index, arg in enumerate(inspect.signature(module.forward).parameters)}
    kept: list[tuple[int, int]] = []  # (front padding, own tokens) of the call in flight

    def get(args, kwargs, arg):
        return kwargs[arg] if arg in kwargs else args[positions[arg]]

    def put(args, kwargs, arg, value):
        if arg in kwargs:
            kwargs[arg] = value
        else:
            args[positions[arg]] = value

    def widen(_module, args, kwargs):
        args = list(args)
        tokens, grouped = get(args, kwargs, groups.tokens), get(args, kwargs, groups.groups)
        full, count = runtime.full_tokens.get(groups.stream), grouped.shape[1]
        if full is None or full % count:
            raise ValueError(f"{name}: its {count} groups ({groups.groups!r} dim 1) must divide the {full} tokens of "
                             f"{groups.stream!r} (known once the plan splits {groups.stream!r}).")
        per_group = full // count
        sizes = even_sizes(full, runtime.cp_size)
        start = sum(sizes[: runtime.cp_rank])
        end = start + tokens.shape[1]
        first, last = start // per_group, -(-end // per_group)
        front, back = start - first * per_group, last * per_group - end
        padded = torch.cat([tokens.new_zeros(tokens.shape[0], front, *tokens.shape[2:]), tokens,
                            tokens.new_zeros(tokens.shape[0], back, *tokens.shape[2:])], dim=1)
        put(args, kwargs, groups.tokens, padded)
        put(args, kwargs, groups.groups, grouped[:, first:last])
        kept.append((front, tokens.shape[1]))
        return tuple(args), kwargs

    def trim(_module, _args, output):
        front, own = kept.pop()
        return output.narrow(1, front, own)

    return widen, trim
