"""merak3d's variable-length micro-batching with a planned layout (``pipeline_parallel="auto"``):

- the planner adopts only layouts of two stages or more (one would leave the micro-batches to nothing and train every
  replica on the global batch's probe block), refusing a world with no room for them before launch and before
  profiling; the setup refuses a one-stage layout before any forward;
- it prices a global batch (every replica reads it) as split over the replicas, at its longest sample's length;
- the global batch need not divide by ``micro_batches`` (the plan of each step splits it into any count);
- ``merak-train`` refuses a planner ``memory_limit`` the parameters alone exceed before launch.

Single process: nothing starts a rank (``merak-train`` runs in this process with ``Trainer.fit`` replaced).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_merak.parallel.layout import Layout
from lightning_merak.parallel.micro_batching import MicroBatching, VariableBatch
from lightning_merak.planning.planner import SearchSpace, candidate_layouts
from lightning_merak.strategies.merak3d import planning
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments, check_memory_limit, least_parameter_bytes
from lightning_merak.strategies.merak3d.build import first_micro_batch
from lightning_merak.strategies.merak3d.variable_step import check_micro_batching

from .test_train import refused

PLANNED = {"pipeline_parallel": "auto", "tensor_parallel": 1, "tp_overlap": 1, "recompute": "none"}


def _space(world_size: int, **batch: Any) -> SearchSpace:
    return SearchSpace(world_size=world_size, tp_degrees_allowed=(1,), max_pipeline_stages=world_size,
                       overlap_choices=(1,), recompute_ratios=(0.0,), **(batch or {"global_batch_size": 12,
                                                                                   "replica_batch_size": None}))


def _ranked(space: SearchSpace) -> list[Any]:
    return [SimpleNamespace(layout=layout) for layout in candidate_layouts(space, num_blocks=4)]


# 1. Two stages at least ---------------------------------------------------------------------------------------------

def test_the_planner_adopts_only_pipelined_layouts_under_micro_batching() -> None:
    ranked = _ranked(_space(4))
    assert {p.layout.pp for p in ranked} == {1, 2, 4}
    for mode in ("dynamic", "pack", "pad"):
        allowed = planning.allowed_predictions(Merak3DArguments(**PLANNED, micro_batching=mode), ranked,
                                               lambda tp: True)
        assert allowed and {p.layout.pp for p in allowed} == {2, 4}
    unbatched = planning.allowed_predictions(Merak3DArguments(**PLANNED), ranked, lambda tp: True)
    assert {p.layout.pp for p in unbatched} == {1, 2, 4}


def test_a_search_without_two_stages_is_refused_before_profiling() -> None:
    dynamic = Merak3DArguments(**PLANNED, micro_batching="dynamic")
    planning.check_pipeline_search(dynamic, candidate_layouts(_space(2), num_blocks=4))
    one_stage = candidate_layouts(_space(2), num_blocks=4)
    with pytest.raises(ValueError, match="pipeline_parallel>=2"):
        planning.check_pipeline_search(dynamic, [layout for layout in one_stage if layout.pp == 1])
    planning.check_pipeline_search(Merak3DArguments(**PLANNED), [layout for layout in one_stage if layout.pp == 1])


def test_a_world_without_room_for_two_stages_is_refused_before_launch() -> None:
    Merak3DArguments(**PLANNED, micro_batching="dynamic").validate(2)
    with pytest.raises(ValueError, match="leave no room for pipeline_parallel>=2"):
        Merak3DArguments(**PLANNED, micro_batching="dynamic").validate(1)
    with pytest.raises(ValueError, match="tensor_parallel=2 and context_parallel=1 leave no room"):
        Merak3DArguments(**{**PLANNED, "tensor_parallel": 2}, micro_batching="pad").validate(2)


def test_the_setup_refuses_micro_batching_at_one_stage_before_any_forward() -> None:
    view = SimpleNamespace(contract=True, module=object())
    check_micro_batching(MicroBatching("dynamic"), 2, view)
    check_micro_batching(MicroBatching("none"), 1, view)
    with pytest.raises(ValueError, match="the layout has pipeline_parallel=1; set strategy.pipeline_parallel>=2"):
        check_micro_batching(MicroBatching("dynamic"), 1, view)


# 2. The global batch's price ----------------------------------------------------------------------------------------

def test_a_global_batch_is_priced_split_over_the_replicas_at_its_longest_length() -> None:
    lengths = (5, 100, 3, 14, 70, 9, 33, 1, 2, 64, 80, 7)
    batch = VariableBatch.of([torch.arange(1, n + 1) for n in lengths])
    inputs, global_batch = planning.planning_batch(batch)
    assert global_batch and inputs.shape == (12, 104)  # the padded longest sample, not the 64-token probe block
    assert next(iter(batch)).shape == (12, 64)
    space = _space(4, **planning.search_batch(inputs.shape[0], global_batch))
    assert {layout.dp for layout in candidate_layouts(space, num_blocks=4)} == {1, 2, 4}
    assert all(space.replica_batch(dp) * dp == 12 for dp in (1, 2, 4))
    fixed = torch.zeros(6, 32, dtype=torch.long)
    assert planning.planning_batch(fixed) == (fixed, False)
    assert _space(4, **planning.search_batch(6, False)).replica_batch(2) == 6  # a dataloader per replica


# 3. No divisibility by micro_batches ----------------------------------------------------------------------------

def test_a_global_batch_need_not_divide_by_micro_batches() -> None:
    for mode in ("dynamic", "pack", "pad"):
        Merak3DArguments(pipeline_parallel=2, micro_batching=mode).validate(2, batch_size=6)
        Merak3DArguments(pipeline_parallel=2, micro_batches=4, micro_batching=mode).validate(2, batch_size=3)
    with pytest.raises(ValueError, match="batch size 6 is not divisible by micro_batches=4"):
        Merak3DArguments(pipeline_parallel=2).validate(2, batch_size=6)
    layout = Layout(data_parallel=1, pipeline_parallel=2, tensor_parallel=1, virtual_stages=1, schedule="1f1b",
                    micro_batches=4, micro_batches_by_default=True, tp_overlap=1, recompute="none",
                    recompute_ratio=0.0)
    probe = torch.arange(6 * 64).reshape(6, 64)
    assert torch.equal(first_micro_batch(layout, probe, "dynamic"), probe[:1])
    assert first_micro_batch(layout, probe[:3], "pad").shape == (1, 64)
    with pytest.raises(ValueError, match="not divisible by micro_batches=4"):
        first_micro_batch(layout, probe)


def test_a_user_micro_batch_count_is_kept_under_micro_batching() -> None:
    chosen = SimpleNamespace(pp=2, micro_batches=6, recompute_ratio=0.0, dp=1, cp=1, tp=1, overlap=1,
                             context_attention="ring", sharding="none")
    pad = planning._adopted_layout(Merak3DArguments(**PLANNED, micro_batches=4, micro_batching="pad"), chosen)
    assert pad.micro_batches == 4 and not pad.micro_batches_by_default
    assert planning._adopted_layout(Merak3DArguments(**PLANNED, micro_batches=4), chosen).micro_batches == 6


# 4. A memory limit below the parameters and their gradients ------------------------------------------------------

def test_a_memory_limit_below_the_parameters_and_their_gradients_is_refused() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.Embedding(10, 10))  # 10_200 floats: 20_400 bytes at 16 bits
    assert least_parameter_bytes(model, 4) == 5100
    check_memory_limit(10200, model, 4)  # the parameters and the trainable ones' gradients, spread over 4 ranks
    with pytest.raises(ValueError, match=r"memory_limit=10199 bytes per rank is below the 10200 bytes"):
        check_memory_limit(10199, model, 4)


def test_merak_train_refuses_a_tiny_memory_limit_before_launch(tmp_path: Path, monkeypatch, capsys) -> None:
    overrides = ["model.config.hidden_size=32", "model.config.intermediate_size=64",
                 "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
                 "model.config.num_key_value_heads=2", "data.num_sequences=64", "trainer.max_steps=2",
                 "strategy.pipeline_parallel=auto", "strategy.memory_limit=1000"]
    code, output = refused(overrides, tmp_path, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in output.err, output.out + output.err
    assert output.err.startswith("merak-train: error: memory_limit=1000 bytes per rank is below the "), output.err
    assert "raise strategy.memory_limit" in output.err
