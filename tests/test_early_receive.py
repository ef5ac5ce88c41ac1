"""EarlyReceiveStage on real gloo ranks: every receive of a step is posted at its start, results unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lightning_merak.parallel.pipeline.schedules import EarlyReceiveStage, early_receive_available
from lightning_merak.testing import run_distributed

MICRO_BATCHES, BATCH = 4, 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 4, generator=generator)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


class _CountingStage(EarlyReceiveStage):
    """Records how many receives were outstanding when each micro-batch started."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outstanding: list[tuple[str, int, int]] = []

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        self.outstanding.append(("forward", fwd_chunk_id, len(self._posted)))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        self.outstanding.append(("backward", bwd_chunk_id, len(self._posted)))
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


def _run_pipeline(rank: int, world_size: int, stage_kind: str, schedule_name: str) -> dict:
    model = _model()
    part = model[:2] if rank == 0 else model[2:]
    stage_class = {"early": _CountingStage, "plain": PipelineStage}[stage_kind]
    stage = stage_class(part, rank, world_size, torch.device("cpu"), group=dist.group.WORLD)
    schedule_class = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule_name]
    schedule = schedule_class(stage, MICRO_BATCHES, loss_fn=_loss, scale_grads=True)
    inputs, targets = _data()
    losses: list[torch.Tensor] = []
    schedule.step(*([inputs] if rank == 0 else []), **({"target": targets, "losses": losses} if rank == 1 else {}))
    grads = {name: param.grad.clone() for name, param in part.named_parameters()}
    outstanding = list(getattr(stage, "outstanding", []))
    with torch.no_grad():
        evaluated = schedule.eval(*([inputs] if rank == 0 else []),
                                  **({"target": targets, "losses": []} if rank == 1 else {}))
    return {"grads": grads, "losses": [loss.detach() for loss in losses], "outstanding": outstanding,
            "eval": evaluated}


def _reference() -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    model = _model()
    inputs, targets = _data()
    losses = [_loss(model(x), y) for x, y in zip(inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES))]
    torch.stack(losses).mean().backward()
    with torch.no_grad():
        output = model(inputs)
    return {name: param.grad for name, param in model.named_parameters()}, torch.stack(losses).detach(), output


pytestmark = pytest.mark.skipif(not early_receive_available(), reason="torch's pipeline stage lacks the receive hooks")


@pytest.mark.distributed
@pytest.mark.parametrize("schedule_name", ["1f1b", "gpipe"])
def test_early_receives_give_the_single_process_gradients(schedule_name):
    ranks = run_distributed(_run_pipeline, 2, args=("early", schedule_name), timeout_s=120)
    grads, losses, output = _reference()
    merged = {**ranks[0]["grads"], **ranks[1]["grads"]}  # a sliced Sequential keeps the layers' indices
    assert merged.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.stack(ranks[1]["losses"]), losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(ranks[1]["eval"], output, rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
def test_every_receive_of_a_step_is_posted_before_its_first_micro_batch():
    ranks = run_distributed(_run_pipeline, 2, args=("early", "1f1b"), timeout_s=120)
    first_stage, last_stage = ranks[0]["outstanding"], ranks[1]["outstanding"]
    # the last stage receives an activation per micro-batch: all four are in flight before the first runs
    assert last_stage[0] == ("forward", 0, MICRO_BATCHES)
    assert [entry[2] for entry in last_stage if entry[0] == "forward"] == [4, 3, 2, 1]
    # the first stage receives a gradient per micro-batch, all posted at the step's start
    backward = [entry for entry in first_stage if entry[0] == "backward"]
    assert [count for _, _, count in backward] == [4, 3, 2, 1]


@pytest.mark.distributed
def test_plain_and_early_stages_agree():
    plain = run_distributed(_run_pipeline, 2, args=("plain", "1f1b"), timeout_s=120)
    early = run_distributed(_run_pipeline, 2, args=("early", "1f1b"), timeout_s=120)
    for rank in range(2):
        for name, grad in plain[rank]["grads"].items():
            torch.testing.assert_close(early[rank]["grads"][name], grad, rtol=0, atol=0)
