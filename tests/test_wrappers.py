"""The forward wrappers of a model: one registry, a declared order whatever order they are installed in."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from paradiff.runtime.state import ModelState, model_state
from paradiff.runtime.wrappers import ORDER, install_wrapper, remove_wrapper, wrappers


class Doubler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def _recording(name: str, log: list[str]):
    if dict(ORDER)[name] == "before":
        return lambda args, kwargs: log.append(name)

    def around(call, args, kwargs):
        log.append(name)
        return call(*args, **kwargs)

    return around


NAMES = [name for name, _kind in ORDER]


@pytest.mark.parametrize("installed", [NAMES, NAMES[::-1], [NAMES[2], NAMES[0], NAMES[4], NAMES[1], NAMES[3]]],
                         ids=["declared", "reversed", "shuffled"])
def test_wrappers_run_in_the_declared_order_whatever_the_install_order(installed):
    model, log = Doubler(), []
    for name in installed:
        install_wrapper(model, name, _recording(name, log))
    assert wrappers(model) == NAMES
    assert torch.equal(model(torch.ones(2)), torch.full((2,), 2.0))
    assert log == NAMES


def test_two_install_orders_give_the_same_list():
    lists = []
    for order in itertools.islice(itertools.permutations(NAMES), 0, None, 37):
        model = Doubler()
        for name in order:
            install_wrapper(model, name, _recording(name, []))
        lists.append(wrappers(model))
    assert len(lists) > 1 and all(names == NAMES for names in lists)


def test_installing_a_name_again_replaces_it():
    model, log = Doubler(), []
    install_wrapper(model, "cfg_exchange", _recording("cfg_exchange", []))
    install_wrapper(model, "cfg_exchange", _recording("cfg_exchange", log))
    model(torch.ones(1))
    assert wrappers(model) == ["cfg_exchange"] and log == ["cfg_exchange"]


def test_removing_every_wrapper_restores_the_plain_forward():
    model = Doubler()
    for name in NAMES:
        install_wrapper(model, name, _recording(name, []))
    assert "forward" in model.__dict__ and model._forward_pre_hooks
    for name in NAMES:
        remove_wrapper(model, name)
    assert wrappers(model) == []
    assert "forward" not in model.__dict__ and not model._forward_pre_hooks
    assert torch.equal(model(torch.ones(1)), torch.full((1,), 2.0))


def test_removing_keeps_an_instance_forward_found_at_install():
    model = Doubler()
    own = lambda x: 3 * x  # noqa: E731 - e.g. a context-parallel plan's replaced forward
    model.forward = own
    install_wrapper(model, "failure_guard", _recording("failure_guard", []))
    assert torch.equal(model(torch.ones(1)), torch.full((1,), 3.0))
    remove_wrapper(model, "failure_guard")
    assert model.forward is own


def test_before_wrappers_see_the_arguments_ahead_of_other_pre_hooks():
    model, seen = Doubler(), []
    model.register_forward_pre_hook(lambda _module, args: (args[0][:1],))  # as CP's input splitter
    install_wrapper(model, "latent_check", lambda args, kwargs: seen.append(args[0].shape[0]))
    model(torch.ones(4))
    assert seen == [4]


def test_unknown_wrapper_names_are_refused():
    with pytest.raises(ValueError, match="declared"):
        install_wrapper(Doubler(), "lora", lambda call, args, kwargs: call(*args, **kwargs))


def test_models_hold_their_own_state():
    first, second = Doubler(), Doubler()
    install_wrapper(first, "failure_guard", _recording("failure_guard", []))
    assert isinstance(model_state(first), ModelState)
    assert wrappers(first) == ["failure_guard"] and wrappers(second) == []


def test_enable_cache_puts_its_default_context_in_the_registry_once():
    from diffusers import FirstBlockCacheConfig

    import paradiff
    from paradiff.testing.models import build_model, make_inputs, run_forward

    model = build_model("flux2", layers=2, single_layers=2)
    inputs = make_inputs("flux2", model.config, batch=2)
    monitor = paradiff.enable_cache(model, FirstBlockCacheConfig(threshold=0.5))
    assert wrappers(model) == ["cache_decisions"]
    run_forward(model, inputs)  # outside any cache context: the wrapper gives it "cond"
    assert [(d.context, d.computed) for d in monitor.decisions] == [("cond", True)]
    assert paradiff.cache_monitor(model) is monitor is model_state(model).cache_monitor
