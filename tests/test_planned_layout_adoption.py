"""The layout merak3d adopts is the one its planner priced and printed, and what it cannot plan is refused early.

1. Without pipeline stages the planner prices the user's micro-batch count (it priced one micro-batch and
   overlaps dividing the whole batch, then the run took the user's count with that overlap: another layout, or a
   crash after profiling).
2. ``tensor_parallel="auto"`` with no degree the model splits into at the fixed degrees is refused before launch,
   naming each degree left out and why (it failed after launch and profiling, without the cause).
3. ``plan_only`` prints the adopted layout, not the unfiltered ranking's best.
4. A ``memory_limit`` with nothing to plan is announced (it was ignored without a word).
Single process, no process launched.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from transformers import LlamaConfig

from lightning_merak.cli.train import PreparedRun, fit
from lightning_merak.planning.planner import SearchSpace, candidate_layouts
from lightning_merak.planning.planner.cost_model import Layout as PlannerLayout
from lightning_merak.strategies.merak3d import Merak3DStrategy, planning
from lightning_merak.strategies.merak3d import strategy as strategy_module
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments
from lightning_merak.strategies.merak3d.tensor_degrees import (
    check_tensor_parallel_search,
    left_out_tensor_parallel,
    tensor_parallel_room,
)

# 1. Micro-batches without stages ------------------------------------------------------------------------------------


@pytest.mark.parametrize("micro_batches", [None, 2, 3])
def test_a_run_without_stages_trains_the_micro_batches_and_overlap_the_planner_priced(micro_batches) -> None:
    """Batch 6 at tp=2: with micro_batches=2 (3 samples each) no overlap of 2 splits a micro-batch."""
    arguments = Merak3DArguments(data_parallel=1, pipeline_parallel=1, tensor_parallel=2, tp_overlap="auto",
                                 micro_batches=micro_batches)
    space = SearchSpace(world_size=2, global_batch_size=None, replica_batch_size=6, tp_degrees_allowed=(2,),
                        max_pipeline_stages=1, overlap_choices=(1, 2, 4), recompute_ratios=(0.0,),
                        micro_batch_choices=(micro_batches,) if micro_batches else None)
    layouts = candidate_layouts(space)
    assert layouts
    for priced in layouts:
        adopted = planning._adopted_layout(arguments, priced)
        assert (adopted.micro_batches, adopted.tp_overlap) == (priced.micro_batches, priced.overlap)
        assert adopted.micro_batches_by_default == (micro_batches is None)
        adopted.check_batch(6)  # what the build checks first: the priced layout runs
    assert {layout.micro_batches for layout in layouts} == {micro_batches or 1}
    assert {layout.overlap for layout in layouts} == ({1, 2} if micro_batches in (None, 3) else {1})


def test_a_count_that_does_not_split_the_batch_leaves_no_single_stage_layout() -> None:
    space = SearchSpace(world_size=1, global_batch_size=None, replica_batch_size=6, tp_degrees_allowed=(1,),
                        max_pipeline_stages=1, micro_batch_choices=(4,))
    assert candidate_layouts(space) == []


# 2. tensor_parallel="auto" with no degree left --------------------------------------------------------------------

THREE_KV_HEADS = LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=64,
                             num_hidden_layers=2, vocab_size=128)


def test_auto_tensor_parallel_with_no_degree_left_is_refused_naming_each_left_out_degree() -> None:
    fixed = Merak3DArguments(data_parallel=1, pipeline_parallel=1, tensor_parallel="auto")
    assert tensor_parallel_room(fixed, 2) == [2]
    with pytest.raises(ValueError) as refusal:
        check_tensor_parallel_search(fixed, THREE_KV_HEADS, 2, sequence=16)
    message = str(refusal.value)
    assert message.startswith("tensor_parallel='auto' has no degree to choose at the fixed degrees "
                              "{'dp': 1, 'pp': 1, 'tp': 'auto'}")
    assert ("tensor_parallel=2 is left out (tensor_parallel=2 neither divides nor is a multiple of the 3 key/value "
            "heads") in message
    assert message.endswith("set more of the degrees to 'auto', or fix them so that tensor_parallel can take a "
                            "degree the model splits into")
    # tp=1 at dp=2 is left to the planner; a model tp=2 splits is planned as before
    check_tensor_parallel_search(Merak3DArguments(pipeline_parallel=1, tensor_parallel="auto"), THREE_KV_HEADS, 2)
    check_tensor_parallel_search(fixed, LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                                    intermediate_size=64), 2)


def test_each_left_out_degree_names_its_own_cause() -> None:
    arguments = Merak3DArguments(data_parallel=1, pipeline_parallel="auto", tensor_parallel="auto",
                                 sequence_parallel=True, float8="mxfp8")
    config = LlamaConfig(hidden_size=48, num_attention_heads=6, num_key_value_heads=6, intermediate_size=96)
    assert tensor_parallel_room(arguments, 6) == [1, 2, 3, 6]
    left_out = left_out_tensor_parallel(arguments, config, 6, num_processes=3, sequence=9)
    assert sorted(left_out) == [2, 3, 6]
    assert "float8='mxfp8' does not run at tensor_parallel=3" in left_out[3]
    assert "sequence length 9 is not divisible" in left_out[2]
    assert left_out[6] == "tensor_parallel=6 would span more than a node's 3 processes"
    assert planning.tensor_parallel_candidates(arguments, config, 6, 3, 9) == (1,)


# 3. plan_only prints the adopted layout ----------------------------------------------------------------------------

def test_plan_only_prints_the_adopted_layout_not_the_unfiltered_best(tmp_path, capsys) -> None:
    """At data_parallel=1 the ranking's best may be dp=2; the run adopts the best at dp=1 (``layout_choice``)."""
    strategy = Merak3DStrategy(data_parallel=1, pipeline_parallel="auto", plan_only=True)
    unfiltered_best, adopted = PlannerLayout(2, 1, 1, 1, 1, 0.0), PlannerLayout(1, 2, 1, 4, 1, 0.0)
    strategy.layout_plan = SimpleNamespace(best=SimpleNamespace(layout=unfiltered_best))
    strategy.layout_choice = SimpleNamespace(layout=adopted)
    trainer = SimpleNamespace(strategy=strategy, loggers=[], is_global_zero=True, fit=lambda *args, **kwargs: None)
    fit(PreparedRun(SimpleNamespace(output_dir=str(tmp_path)), trainer, None, SimpleNamespace(), None))
    printed = capsys.readouterr().out
    assert f"plan only, nothing trained. Planned layout: {adopted.describe()}\n" in printed, printed
    assert unfiltered_best.describe() not in printed


def test_plan_only_with_every_degree_given_stops_before_training() -> None:
    """Nothing left to plan: the given layout is the plan, and the run still trains nothing."""
    strategy = Merak3DStrategy(data_parallel=1, pipeline_parallel=1, tensor_parallel=1, plan_only=True)
    assert not strategy.needs_planning
    trainer = SimpleNamespace(should_stop=False, num_sanity_val_steps=2)
    strategy.adopt_planned_layout(trainer)
    assert trainer.should_stop and trainer.num_sanity_val_steps == 0


# 4. memory_limit with nothing to plan ------------------------------------------------------------------------------

@pytest.fixture
def started_without_processes(monkeypatch):
    """``setup_environment`` of a one-device merak3d run, with no process group, handler or mesh made."""
    monkeypatch.setattr(strategy_module, "install_termination_handler", lambda: None)
    monkeypatch.setattr(strategy_module.host_memory, "prepare_heap", lambda **kwargs: None)
    monkeypatch.setattr(strategy_module.process_groups, "process_group_setup", lambda backend, device: ("gloo", {}))
    monkeypatch.setattr(strategy_module, "_init_dist_connection", lambda *args, **kwargs: None)
    adopted = []
    monkeypatch.setattr(Merak3DStrategy, "_adopt", lambda self, layout: adopted.append(layout))

    def start(**options) -> list:
        strategy = Merak3DStrategy(**options)
        pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False)
        strategy.setup_environment()
        return adopted
    return start


def test_a_memory_limit_with_nothing_to_plan_is_announced(started_without_processes) -> None:
    with pytest.warns(UserWarning, match=r"memory_limit=1e\+09 bounds the layout planner's search, and no part of "
                                         r"this layout is 'auto'.*leave memory_limit unset"):
        assert len(started_without_processes(memory_limit=1e9)) == 1
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*memory_limit")
        started_without_processes()
