"""Declarative description of where a model's token sequence is split and where it is gathered back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Split:
    """Split a tensor along `dim` over the CP ranks; when `ndim` is set, only tensors of that rank (or of those ranks,
    a tuple) are split. A tuple, list or dict of tensors (rotary tables) has each of its tensors split.

    `parts` names the token streams `dim` concatenates, in order (e.g. ("hidden_states", "encoder_hidden_states")
    for a key mask over [image, text]): each part is split on its own and the local pieces concatenated, as joint
    attention holds them. Their full lengths are those of the streams where the plan splits them."""

    dim: int
    ndim: int | tuple[int, ...] | None = None
    # split each consecutive run of this many entries along `dim` alike, where the count is the full length of the
    # named token stream (e.g. "hidden_states" once split): for rows flattened as (batch x tokens), as Latte's
    # per-location timesteps are
    within: str | None = None
    parts: tuple[str, ...] = ()
    # split as the named stream's grid was last split (GridSplit): for per-token tensors a module without the grid's
    # size arguments reads (Sana-Video's per-token modulation at norm_out); tensors of another length pass unchanged
    like: str | None = None
    # a list / tuple argument whose items are split when the model reads them, not when the module is called: for
    # per-token tensors the model adds between its blocks, after a later module split the stream they follow (`like`)
    # -- Sana's ControlNet residuals, whose grid is known only at the blocks
    deferred: bool = False


@dataclass(frozen=True)
class GridSplit:
    """Tokens along `dim` laid out row-major over a grid whose sizes are the module's integer arguments `sizes` (e.g.
    ("height", "width"), or ("frames", "height", "width")). The grid is split by whole slices of its first axis (rows,
    or frames), so a convolution over the grid needs only its neighbours' edge slices (`halo_convs`), and the
    module's first size argument becomes this rank's slice count. A tensor (or tuple of them) whose `dim` does not
    hold the full grid (split by an earlier module already, or per sample) passes unchanged."""

    dim: int = 1
    sizes: tuple[str, ...] = ("height", "width")


@dataclass(frozen=True)
class Count:
    """An int argument counting the first (or, with `tail`, the last) tokens of the split argument `of` (e.g. the
    first frame's tokens, the current window after history tokens): each rank gets how many its chunk holds."""

    of: str = "hidden_states"
    tail: bool = False


@dataclass(frozen=True)
class TokenGroups:
    """A module that computes each token of the split argument `tokens` on its own but reshapes them into as many
    equal groups as the replicated argument `groups` has along dim 1 (context_parallel/groups.py); `stream` is the
    split stream whose full length `tokens` has."""

    tokens: str = "hidden_states"
    groups: str = "encoder_hidden_states"
    stream: str = "hidden_states"


@dataclass
class ContextParallelPlan:
    """Per-model knowledge of context parallelism, as module paths (globs with one `*` over a ModuleList).

    - `split_inputs`: module -> {forward argument name: Split or Count}; "" is the model itself. A tuple argument
      is split item by item, or only the items named by {item index: Split} (nested dicts for nested tuples).
    - `split_outputs`: module -> {output index: Split} (e.g. rotary tables computed from the full sequence).
    - `gather_outputs`: module -> dim along which its output is gathered back to the full sequence, or
      {output index: dim} for the items of a tuple output (e.g. a joint block's text stream after the last block).
    - `local_attention`: attention modules whose keys/values are replicated (cross-attention to the text): they
      run on the local queries with no communication.
    - `halo_convs`: convolutions over a GridSplit grid (its first axis is dim -2 of their input, as image rows in
      NCHW): each rank borrows its neighbours' edge slices, the kernel's reach, before convolving.
    - `gathered_attention`: cross-attention from split queries to another split but short stream (Motif-Video's
      video-to-text cross-attention): the keys, values and key mask are all-gathered, then each rank attends locally.
    - `prefix_attention`: attention module -> its forward argument holding a replicated prefix stream (Cosmos3's
      text, tokens along dim -2): keys that are that prefix alone are attended whole on every rank (any causal
      flag); keys [prefix, split stream] attend to the prefix locally and to the split stream across the ranks.
    - `linear_attention`: self-attention modules computing ReLU linear attention (Sana): their sums over the keys
      are summed over the ranks (context_parallel/linear.py).
    - `processors`: attention module -> function of the CP runtime returning the processor that replaces the
      module's own under context parallelism, for attention whose structure depends on the whole sequence in a way
      SDPA's interception cannot see (Kandinsky 6 SR's NABLA block choice: `context_parallel.nabla`).
    - `token_groups`: module -> TokenGroups, for modules that group their tokens by another argument's groups.
    - `split_token_arguments`: module -> forward arguments (tensors or tuples of tensors, e.g. rotary tables
      computed over the full sequence) split along the dimension whose length is the full token count of the
      split `hidden_states` (or text + image tokens, text first, when `encoder_hidden_states` is split too); a
      tensor without such a dimension stays whole.
    - `rewrite_inputs`: module -> function of its forward arguments (a dict of those given, by name, still whole)
      returning replacements for some of them, applied before the module's splits. For structure a model passes
      as positions in the full sequence, which a rank's chunk cannot use (Qwen-Image 2.1 slices its queries per
      prefix segment), rewritten as an equivalent whole-sequence mask the context-parallel attention takes. The
      function sees every rank's same whole arguments, so every rank rewrites alike.
    - `forwards`: module -> function of (module, runtime) returning the callable that replaces the module's forward
      under context parallelism, for hand-written attention that holds no processor (SANA-WM's recurrence over
      frames). Where the tensor-parallel plan replaces the same module's forward, this one wins and must handle the
      local heads too.
    - `expert_choice`: mixture-of-experts layers routed by expert choice over the whole sequence -> ExpertChoice
      (their attribute names): the ranks share the router scores and route alike (context_parallel/experts.py).
    """

    split_inputs: dict[str, dict[str, Split | Count | dict]] = field(default_factory=dict)
    split_outputs: dict[str, dict[int, Split]] = field(default_factory=dict)
    gather_outputs: dict[str, int | dict[int, int]] = field(default_factory=dict)
    local_attention: tuple[str, ...] = ()
    split_token_arguments: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # module -> {forward argument, or "argument.key" for one key of a dict argument: why}: inputs the model handles
    # in a way a token split would silently break; passing one (not None) under context parallelism raises that
    # reason before any collective
    unsupported_inputs: dict[str, dict[str, str]] = field(default_factory=dict)
    halo_convs: tuple[str, ...] = ()
    linear_attention: tuple[str, ...] = ()
    rewrite_inputs: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = field(default_factory=dict)
    gathered_attention: tuple[str, ...] = ()
    prefix_attention: dict[str, str] = field(default_factory=dict)
    token_groups: dict[str, TokenGroups] = field(default_factory=dict)
    processors: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    expert_choice: dict[str, Any] = field(default_factory=dict)
    forwards: dict[str, Callable[[Any, Any], Callable]] = field(default_factory=dict)
