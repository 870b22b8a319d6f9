"""The declared order of a model's forward wrappers and the registry of those installed (data only).

Below `state.py`, which keeps one registry per model, and `wrappers.py`, which installs and runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


BEFORE, AROUND = "before", "around"

# Outermost first. The order is the one the installers produced before the registry existed: the stage switch and the
# latent check were prepended forward pre-hooks (stage switch registered last, so first), CFG replaced the forward
# after the failure guard (so outside it), and the default cache context only picks a context, so its place between
# them changes nothing.
ORDER: tuple[tuple[str, str], ...] = (
    ("stage_switch", BEFORE),
    ("latent_check", BEFORE),
    ("cfg_exchange", AROUND),
    ("cache_decisions", AROUND),
    ("failure_guard", AROUND),
)
KINDS = dict(ORDER)


@dataclass
class WrapperRegistry:
    """The wrappers installed on one model, and what the registry put on the model to run them."""

    installed: dict[str, Callable[..., Any]] = field(default_factory=dict)
    plain_forward: Callable[..., Any] | None = None  # the instance forward found at the first install (None: class's)
    forward_patch: Any = None  # the patch (runtime.patches.Patch) putting the registry's forward on the model
    pre_hook_patch: Any = None  # the patch adding its forward pre-hook

    def names(self) -> list[str]:
        return [name for name, _kind in ORDER if name in self.installed]

    def of_kind(self, kind: str) -> list[Callable[..., Any]]:
        return [self.installed[name] for name in self.names() if KINDS[name] == kind]
