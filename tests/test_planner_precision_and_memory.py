"""merak3d's layout planner: it measures in the training step's precision, and refuses a memory limit naming the
memory: before launch and before profiling where the model's state alone exceeds it, after the search where every
layout at the user's fixed degrees was rejected for memory."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch import nn

from lightning_merak.planning.planner import candidate_layouts, plan, predict
from lightning_merak.strategies.merak3d import network, planning
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments, check_memory_limit, least_state_bytes
from tests.test_merak3d import _batches, _module
from tests.test_planner_core import SLOW, space, synthetic_model


class Profiled(Exception):
    """Raised in place of the exchange that follows the profile: what it measured, and under which autocast."""

    def __init__(self, profile: object, autocast: tuple) -> None:
        super().__init__("profiled")
        self.profile, self.autocast = profile, autocast


def _plan_one_rank(monkeypatch: pytest.MonkeyPatch, precision: Precision, **options: object) -> Profiled:
    """``plan_layout`` on one process (no process group) up to its profile, which is raised as :class:`Profiled`."""
    measure = planning.profile_model

    def profiled(*args: object, **kwargs: object) -> None:
        autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                    torch.is_autocast_cache_enabled())
        raise Profiled(measure(*args, **kwargs), autocast)

    monkeypatch.setattr(planning, "profile_model", profiled)
    module = _module("llama")
    module._trainer = SimpleNamespace(precision_plugin=precision)
    view = network.module_view(module, None, None)
    with pytest.raises(Profiled) as profile:
        planning.plan_layout(Merak3DArguments(pipeline_parallel="auto", recompute="auto", **options), view,
                             _batches()[0], lambda logits, samples: logits[:samples].float().mean(), world_size=1,
                             num_processes=1, device=torch.device("cpu"), optimizer=None, clip_gradients=False,
                             broadcast=lambda value, source: value)
    assert not torch.is_autocast_enabled("cpu")  # left as it was
    return profile.value


def test_the_planner_profiles_the_blocks_under_the_training_steps_autocast(monkeypatch) -> None:
    """bf16-mixed: the blocks run under the precision plugin's bfloat16 autocast (without its cache of weight
    copies), so they save half the activation bytes they save in fp32 (the planner measured fp32 under both)."""
    full = _plan_one_rank(monkeypatch, Precision())
    mixed = _plan_one_rank(monkeypatch, MixedPrecision("bf16-mixed", "cpu"))
    assert full.autocast[0] is False
    assert mixed.autocast == (True, torch.bfloat16, False)
    full_bytes = full.profile.block_activation_bytes_per_sample[1]
    mixed_bytes = mixed.profile.block_activation_bytes_per_sample[1]
    assert mixed_bytes < 0.8 * full_bytes, (mixed_bytes, full_bytes)


def test_a_memory_limit_below_the_state_is_refused_before_launch() -> None:
    """Before launch: the parameters and the trainable ones' gradients at 16 bits, shared over every rank."""
    model = nn.Sequential(nn.Linear(100, 100), nn.Embedding(10, 10))  # 10_200 floats: 20_400 bytes at 16 bits
    model[1].weight.requires_grad_(False)  # no gradient for its 100
    assert least_state_bytes(model, 4) == {"parameters": 5100, "gradients": 5050, "optimizer state": 0}
    check_memory_limit(10150, model, 4)
    with pytest.raises(ValueError, match=r"memory_limit=10149 bytes per rank is below the 10150 bytes every layout of "
                                         r"4 processes keeps on some rank before any activation \(parameters 5100, "
                                         r"gradients 5050: .*raise strategy.memory_limit"):
        check_memory_limit(10149, model, 4)


@pytest.mark.parametrize("precision", [Precision(), MixedPrecision("bf16-mixed", "cpu"), HalfPrecision("bf16-true")])
def test_the_planner_refuses_a_limit_below_the_state_before_profiling(monkeypatch, precision) -> None:
    """In the run, with the precision and the optimizer state the planner prices (AdamW's two moments while the
    optimizer does not exist yet): fp32 parameters, gradients and moments take 16 bytes a parameter; bf16-true
    converts the parameters after planning, so they count at 2 bytes (8 a parameter)."""
    parameters = sum(p.numel() for p in _module("llama").parameters())
    least = parameters * (8 if getattr(precision, "precision", "") == "bf16-true" else 16)
    with pytest.raises(ValueError, match=rf"memory_limit={least - 1} bytes per rank is below the {least} bytes .*"
                                         r"optimizer state"):
        _plan_one_rank(monkeypatch, precision, memory_limit=least - 1)
    _plan_one_rank(monkeypatch, precision, memory_limit=least)  # profiles


def test_a_memory_rejection_at_the_fixed_degrees_names_the_memory() -> None:
    """Layouts of other degrees fit, every one at the fixed dp=2 needs more than the limit: the refusal names the
    limit and the least of their needs (it said no layout matched the degrees)."""
    profile = synthetic_model()
    needs = {}
    for layout in candidate_layouts(space(), profile.num_blocks):
        needs.setdefault(layout.dp, []).append(predict(layout, profile, SLOW, space()).memory_bytes)
    least = min(needs[2])
    assert min(needs[1]) < least
    limited = space(memory_limit_bytes=least - 1)
    result = plan(limited, profile, SLOW)
    arguments = Merak3DArguments(data_parallel=2, pipeline_parallel="auto", tensor_parallel="auto")
    assert result.ranked and not planning.allowed_predictions(arguments, result.ranked, lambda tp: True)
    rejected = [predict(layout, profile, SLOW, limited) for layout, _ in result.rejected]
    with pytest.raises(ValueError, match=rf"no planned layout at the fixed degrees \{{'dp': 2, 'pp': 'auto', 'tp': "
                                         rf"'auto'\}} fits memory_limit_bytes={least - 1:.0f}: the smallest of them "
                                         rf"needs {least:.0f} bytes \(dp=2 .*raise strategy.memory_limit"):
        planning.check_fixed_degrees_fit(arguments, rejected, lambda tp: True, least - 1)
    other = Merak3DArguments(data_parallel=1, pipeline_parallel="auto", tensor_parallel="auto")
    planning.check_fixed_degrees_fit(other, [p for p in rejected if p.layout.dp != 1], lambda tp: True, least - 1)
