"""``merak_ep`` under merak3d with a planned layout (#30 item 4): the planner profiles the MoE layers and their
all-to-all, prices the exchange, and the expert groups are carved from the layout it chose. With ``moe.ep_size``
unset the search takes every ep dividing dp and the experts (ep < dp replicates the experts over dp/ep groups), and the
callback carves its groups at the planned ep. A planned run trains exactly as the fixed layout it picked (and as the
unswapped single-process model)."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed

FAMILY = "qwen3_moe"  # 16 experts, top-8


def _fit(world_size: int, strategy_kwargs: dict[str, Any], ep_size: int | None = None) -> tuple[Any, list[float], Any]:
    """The strategy, this rank's losses and what ``merak_ep`` did on it (its expert group's size and experts)."""
    import lightning.pytorch as pl

    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.strategies.merak3d import Merak3DStrategy
    from lightning_merak.testing.data import ReplicaBatches
    from tests.test_moe_merak3d import STEPS, _batches, _model, _Recorder, _SGDModule

    recorder = _Recorder()
    experts = ExpertParallelCallback(ep_size=ep_size, log_every_n_steps=1)
    strategy = Merak3DStrategy(micro_batches=2, partition="uniform", timeout_s=120, **strategy_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[experts, recorder],
    )
    trainer.fit(_SGDModule(_model(FAMILY)),
                datamodule=ReplicaBatches(_batches(), 0, STEPS))
    return strategy, recorder.losses, experts._merak3d.report


def _planned_then_fixed(rank: int, world_size: int, planned: dict[str, Any]) -> dict[str, Any]:
    from lightning_merak.strategies.merak3d import planning

    planning.PLANNER_REPEATS = 3  # a tiny model: the figures only need to exist
    strategy, planned_losses, report = _fit(world_size, planned)
    chosen = {"data_parallel": strategy.data_parallel, "pipeline_parallel": strategy.pipeline_parallel,
              "tensor_parallel": strategy.tensor_parallel}
    ranked = [(p.layout.dp, p.layout.pp, p.layout.ep, p.layout.sharding, p.components["expert_all_to_all"])
              for p in strategy.layout_plan.ranked]
    planned_ep = strategy.layout_choice.layout.ep
    _, fixed_losses, fixed_report = _fit(world_size, chosen, ep_size=planned_ep)
    return {"chosen": chosen, "ranked": ranked, "planned_ep": planned_ep, "planned": planned_losses,
            "fixed": fixed_losses, "ran_ep": (report.ep_size, len(report.local_experts)),
            "fixed_ep": (fixed_report.ep_size, len(fixed_report.local_experts))}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("planned", [
    {"pipeline_parallel": "auto", "tensor_parallel": 1},
    {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1, "data_parallel_sharding": "auto"},
], ids=["pipeline_parallel-auto", "data_parallel_sharding-auto"])
def test_a_planned_layout_prices_the_exchange_and_trains_as_the_fixed_layout_it_picked(planned: dict[str, Any]) -> None:
    from tests.test_moe_merak3d import _reference

    results = run_distributed(_planned_then_fixed, 2, args=(planned,), timeout_s=140)
    assert results[0]["chosen"] == results[1]["chosen"]
    ranked = results[0]["ranked"]
    assert ranked and all(sharding == "none" for *_, sharding, _ in ranked)  # merak_ep keeps dp unsharded
    for _, _, ep, _, exchange_s in ranked:  # an exchange only across ranks
        assert (exchange_s > 0) == (ep > 1), ranked
    if "data_parallel" in planned:  # moe.ep_size unset: both ep dividing dp=2 and the 16 experts are priced
        assert sorted((dp, pp, ep) for dp, pp, ep, *_ in ranked) == [(2, 1, 1), (2, 1, 2)]
    else:
        assert sorted((dp, pp, ep) for dp, pp, ep, *_ in ranked) == [(1, 2, 1), (2, 1, 1), (2, 1, 2)]
    want = _reference(FAMILY)["losses"]
    for result in results:  # the groups were carved at the planned ep: E/ep experts on each rank
        assert result["ran_ep"] == result["fixed_ep"] == (result["planned_ep"], 16 // result["planned_ep"]), result
        assert result["planned"] == pytest.approx(result["fixed"], rel=1e-6, abs=0.0)
        assert result["planned"] == pytest.approx(want, rel=1e-5, abs=0.0)
