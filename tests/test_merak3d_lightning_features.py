"""Lightning's own features under merak3d, their pure parts: optimizers a callback changed before the first batch's
build (kept, with their hyperparameters), a replayed step's logging (``reduce_fx``, values logged before the network
call), and the Trainer's options refused or warned about (accumulation, micro-batches, Stochastic Weight Averaging).
The same end to end, over ranks: ``tests/test_merak3d_lightning_features_distributed.py``."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn

from lightning_merak.modules.muon import MuonWithAdamW
from lightning_merak.parallel.layout import Layout
from lightning_merak.strategies.merak3d.rebuilt_optimizers import (
    adopt_rebuilt,
    group_counts_match,
    hyperparameters,
    refuse_changes,
)
from lightning_merak.strategies.merak3d.step_replay import LoggedValues, StepReplay, names_logged
from lightning_merak.strategies.merak3d.trainer_checks import (
    accumulation_refusal,
    check_weight_averaging,
    unsplit_micro_batches_warning,
)


def _layout(**degrees: Any) -> Layout:
    base = Layout(data_parallel=1, pipeline_parallel=1, tensor_parallel=1, virtual_stages=1, schedule="1f1b",
                  micro_batches=4, micro_batches_by_default=True, tp_overlap=1, recompute="none", recompute_ratio=0.5)
    return replace(base, **degrees)


# Optimizers re-created by the build --------------------------------------------------------------------------------


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "muon":
        return MuonWithAdamW([{"params": list(model.parameters())}], lr=0.5, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.5)


@pytest.mark.parametrize("kind", ["sgd", "muon"])
def test_rebuilt_optimizer_keeps_the_object_and_what_a_callback_set(kind: str) -> None:
    whole, built = nn.Linear(4, 4), nn.Linear(4, 4)
    first = _optimizer(whole, kind)
    scheduler = torch.optim.lr_scheduler.LambdaLR(first, lambda step: 1.0)
    for group in first.param_groups:  # a callback's on_train_start freezing the weights
        group["lr"] = 0.0
    rebuilt = _optimizer(built, kind)
    assert group_counts_match([first], [rebuilt])
    adopt_rebuilt([first], [rebuilt])
    stepped = {id(param) for group in first.param_groups for param in group["params"]}
    assert stepped == {id(param) for param in built.parameters()}
    assert all(group["lr"] == 0.0 and "initial_lr" in group for group in first.param_groups)
    before = [param.detach().clone() for param in built.parameters()]
    built(torch.randn(3, 4)).square().sum().backward()
    first.step()  # the schedulers' wrapped step, on the object they hold
    scheduler.step()
    for old, param in zip(before, built.parameters()):
        torch.testing.assert_close(param.detach(), old)  # lr 0 kept: nothing moved


def test_changed_groups_that_do_not_correspond_are_refused() -> None:
    whole = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    first = torch.optim.SGD([{"params": layer.parameters()} for layer in whole], lr=0.5)
    configured = hyperparameters([first])
    rebuilt = torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.5)  # this stage holds one layer: one group
    assert not group_counts_match([first], [rebuilt])
    refuse_changes(configured, [first], (0, 0))  # nothing changed: the rebuilt ones are taken as they are
    first.add_param_group({"params": nn.Linear(2, 2).parameters()})  # BaseFinetuning unfreezing at epoch 0
    with pytest.raises(RuntimeError, match="added group.*configure_optimizers"):
        refuse_changes(configured, [first], (0, 0))
    with pytest.raises(RuntimeError, match="schedulers \\(2 held, 1 from configure_optimizers\\)"):
        refuse_changes(hyperparameters([first]), [first], (2, 1))


# A replayed step's logging -------------------------------------------------------------------------------------------


class _Logging(pl.LightningModule):
    """Logs before its network call (the batch's rows) and after it (a max, a sum and a mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(3, 5)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.log("rows", float(batch.shape[0]))
        logits = self.net(batch)
        self.log("max_logit", logits.max(), reduce_fx="max")
        self.log("min_logit", logits.min(), reduce_fx=torch.min)
        self.log("elements", float(logits.numel()), reduce_fx="sum")
        self.log("mean_logit", logits.mean())
        return logits.square().mean()


def test_replayed_logging_reduces_as_the_unsplit_step() -> None:
    torch.manual_seed(0)
    module, batch = _Logging(), torch.randn(5, 3)
    replay = StepReplay(module, module.net, lambda logits: logits, ((0,), {}), "net")
    for samples in torch.tensor_split(batch, 2):  # unequal micro-batches: 3 and 2 samples
        replay.score(module.net(samples), samples)
    assert replay.error is None
    logged: dict[str, float] = {}
    module.log = lambda name, value, *args, **kwargs: logged.__setitem__(name, float(value))  # type: ignore
    with names_logged(module) as outside:
        module.log("rows", 5.0)  # the step the trainer called, before its network call: kept, not the replays' 2.6
    assert outside == {"rows"}
    replay.logged.log_means(module, 2, logged_outside=outside)
    logits = module.net(batch).detach()
    assert logged == pytest.approx({"rows": 5.0, "max_logit": float(logits.max()), "min_logit": float(logits.min()),
                                    "elements": float(logits.numel()), "mean_logit": float(logits.mean())},
                                   rel=1e-5)  # fp32 means of 3 and 2 rows against one of 5: summed in other orders


def test_logged_values_of_equal_micro_batches_keep_the_plain_mean() -> None:
    logged = LoggedValues()
    for value in (1.0, 2.0, 6.0):
        logged.record("loss", torch.tensor(value))
    seen: list[float] = []

    class _Module:
        device = torch.device("cpu")

        def log(self, name: str, value: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            seen.append(float(value))

    logged.log_means(_Module(), 2)  # the last two: the first step's shape inference scored one more
    assert seen == [4.0]


def test_names_logged_restores_the_module_log() -> None:
    module = _Logging()
    with names_logged(module):
        assert "log" in vars(module)
    assert "log" not in vars(module)
    with names_logged(module, watched=False) as names:
        assert "log" not in vars(module) and names == set()


# The Trainer's options -------------------------------------------------------------------------------------------


def test_accumulation_advice_follows_the_layout() -> None:
    assert accumulation_refusal(1, 1, 1) is None
    assert "raise micro_batches" in accumulation_refusal(2, 2, 1)
    assert "raise micro_batches" in accumulation_refusal(2, 1, 2)
    whole = accumulation_refusal(2, 1, 1)
    assert "raise the batch size" in whole and "raise micro_batches" not in whole
    unknown = accumulation_refusal(4)
    assert "raise micro_batches" in unknown and "raise the batch size" in unknown


def test_micro_batches_that_split_nothing_are_warned_about() -> None:
    useless = _layout(data_parallel=2, micro_batches=4, micro_batches_by_default=False)
    assert "splits nothing" in unsplit_micro_batches_warning(useless, False, "fixed")
    assert unsplit_micro_batches_warning(replace(useless, tp_overlap=2, tensor_parallel=2), False, "fixed") is None
    assert unsplit_micro_batches_warning(replace(useless, pipeline_parallel=2), False, "fixed") is None
    assert unsplit_micro_batches_warning(useless, True, "fixed") is None  # variable micro-batches
    assert unsplit_micro_batches_warning(_layout(), False, "fixed") is None  # the default


@pytest.mark.parametrize(("degrees", "named"), [({"pipeline_parallel": 2}, "pipeline_parallel=2"),
                                                ({"tensor_parallel": 2}, "tensor_parallel=2"),
                                                ({"data_parallel": 2, "data_parallel_sharding": "full"}, "'full'")])
def test_weight_averaging_is_refused_where_ranks_hold_parts(degrees: dict[str, Any], named: str) -> None:
    callbacks = [StochasticWeightAveraging(swa_lrs=0.1)]
    with pytest.raises(ValueError, match=f"StochasticWeightAveraging.*{named}"):
        check_weight_averaging(_layout(**degrees), callbacks)
    check_weight_averaging(_layout(**degrees), [])
    check_weight_averaging(_layout(data_parallel=2, data_parallel_sharding="optimizer"), callbacks)
