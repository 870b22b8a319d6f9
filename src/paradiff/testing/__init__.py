"""What a library user needs to test parallel code on CPU, on paradiff's core dependencies only.

- `tiny_model(family)`: a random-weight diffusers transformer of a family, small enough to run anywhere;
- `RankPool(world_size)`: gloo ranks started once and reused for many cases (`pool.run(case, **kwargs)`);
- `run_ranks(target, world_size)`: one supervised run of `target` on `world_size` new ranks.

The suite's own fixtures (the tiny-pipeline zoo, tokenizers, LoRA, quantization and server helpers) are not part of
the package: they live in the repository's test kit (testkit/paradiff_testkit, docs/testing.md).
"""

from __future__ import annotations

from typing import Any

from paradiff.distributed.spawn import run_ranks
from paradiff.testing.dist import RankPool

__all__ = ["RankPool", "run_ranks", "tiny_model"]


def tiny_model(family: str, seed: int = 0, **config_overrides: Any):
    """A tiny `family` transformer with random weights (biases and norms perturbed too), in eval mode.

    `family` is one of models.FAMILIES (the suite's own tiny configs) or any plan family (`paradiff.plans.families()`:
    its first example's config). `config_overrides` replace entries of that config.
    """
    from paradiff.plan_tools.family_examples import build_example
    from paradiff.plans import families
    from paradiff.testing.models import FAMILIES, build_model

    if family in FAMILIES:
        return build_model(family, seed=seed, **config_overrides)
    for declared in families():
        if declared.name == family:
            return build_example(family, next(iter(declared.examples)), seed=seed, config_overrides=config_overrides)
    known = sorted({*FAMILIES, *(declared.name for declared in families())})
    raise ValueError(f"tiny_model: unknown family {family!r}; known families: {', '.join(known)}.")
