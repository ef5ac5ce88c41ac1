"""The scale benchmark's arithmetic: a rank's ideal memory, measured activations, and its results table."""

from __future__ import annotations

import pytest

from benchmarks._scale_ranks import MIB, Workload, measure_activations, trainer_for, zero3_config
from benchmarks._table_scale import scale
from benchmarks.scale import (
    LEGS,
    PEAK_OVER_IDEAL,
    PEAK_OVER_IDEAL_WITHOUT_LAUNCHER_ENV,
    _ideal_mb,
    goal_records,
    ratio_table,
    select_legs,
    without_heap_tunables,
)
from lightning_merak.distributed.host_memory import with_heap_tunables

ACTIVATIONS = {"1": {"per_layer": 1.0 * MIB, "head": 3.0 * MIB}, "2": {"per_layer": 0.75 * MIB, "head": 1.5 * MIB}}


def _rank(**fields: object) -> dict:
    return {"param_bytes": 10 * MIB, "layers_held": [0, 1], "has_head": True, "pipeline_rank": 0,
            "pipeline_parallel": 1, "tensor_parallel": 1, "micro_batch": 2, "micro_batches": 1, **fields}


def test_ideal_is_four_parameter_copies_plus_activations_in_flight():
    assert _ideal_mb(_rank(), ACTIVATIONS) == pytest.approx(40 + 2 * (2 * 1 + 3))
    # first of two stages, four micro-batches: two in flight under 1F1B, no head
    first = _rank(has_head=False, pipeline_parallel=2, micro_batches=4, micro_batch=1)
    assert _ideal_mb(first, ACTIVATIONS) == pytest.approx(40 + 2 * 2)
    # a tensor-parallel rank holds what was measured on its part of the model
    assert _ideal_mb(_rank(tensor_parallel=2), ACTIVATIONS) == pytest.approx(40 + 2 * (2 * 0.75 + 1.5))


def test_activations_grow_with_layers_and_the_head_holds_the_rest():
    measured = measure_activations(Workload(hidden=32, layers=4, vocab=64, seq=8))
    assert measured["per_layer"] > 0 and measured["head"] > 0


def test_a_tensor_parallel_rank_holds_more_than_its_share_of_activations():
    """Norm inputs and the residual stream stay whole under tensor parallelism without sequence parallelism."""
    workload = Workload(hidden=128, layers=4, vocab=256, seq=16)
    whole, part = measure_activations(workload), measure_activations(workload, tensor_parallel=2)
    assert whole["per_layer"] / 2 < part["per_layer"] < whole["per_layer"]


def _memory(leg: str, layers: int, peak_over_ideal: float | None, used: float = 90.0) -> dict:
    return {"section": "memory", "leg": leg, "layers": layers, "ranks": 4 if "pp2xtp2" in leg or "4 ranks" in leg
            else 2, "max_used_mb": used, "peak_over_ideal": peak_over_ideal,
            "error": None if peak_over_ideal is not None else "RuntimeError: boom"}


def test_results_table_shows_each_leg_its_worst_rung_and_the_ranks_without_the_launchers_heap():
    data = {
        "ladder_layers": [2, 4], "workload": "llama", "cap_mb": 100.0, "steps": 3, "logits_max_rel_err": 1e-7,
        "export_roundtrip_max_abs": 0.0,
        "without_launcher_env": [_memory("merak3d pp2xtp2", 4, 1.5), _memory("merak3d pp2xtp2", 2, 1.7)],
        "rows": [
            _memory("merak3d pp2xtp2", 4, 1.2), _memory("merak3d pp2xtp2", 2, 1.9, used=40.0),
            {"section": "largest", "leg": "merak3d pp2xtp2", "ranks": 4, "layers": 4, "params_m": 1.0,
             "full_state_exceeds_cap": True, "refused": False, "error": None},
            {"section": "largest", "leg": "DeepSpeed ZeRO-3 (2 ranks)", "ranks": 2, "layers": None, "refused": True,
             "error": "RuntimeError: no accelerator. More text"},
            {"section": "load", "leg": "merak3d pp2xtp2", "load_s": 0.5, "gb_per_s": 0.2},
        ],
    }
    table = scale(data)
    assert table.rows[0] == ["merak3d pp2xtp2", 4, "4 layers, 1.0 M params (weights + AdamW exceed the cap)", "90",
                             "1.20×", "1.90× at 2 layers", "0.50", "0.20"]
    assert table.rows[1][2] == "refused: RuntimeError: no accelerator"
    assert table.rows[2][0] == "merak3d pp2xtp2 (without the launcher's heap settings)"
    assert table.rows[2][4:6] == ["1.50×", "1.70× at 2 layers"]


def test_peak_over_ideal_is_the_worst_layout_and_rung_and_a_failed_one_leaves_no_figure():
    launcher = [_memory(f"merak3d {name}", layers, 1.1) for name in ("dp2", "pp2", "tp2", "pp2xtp2")
                for layers in (2, 24)]
    launcher[2]["peak_over_ideal"] = 1.6  # pp2 on the smallest rung
    launcher.append(_memory("merak3d tp2 (compact host memory)", 2, 9.0))  # not a default: not in the goal
    launcher.append(_memory("DDP (2 ranks)", 2, 9.0))
    external = [dict(row, peak_over_ideal=1.2) for row in launcher]
    external[7]["peak_over_ideal"] = None  # pp2xtp2 on the largest rung failed
    goals = {goal["key"]: goal for goal in goal_records(launcher, external, LEGS)}
    assert goals[PEAK_OVER_IDEAL.key]["value"] == 1.6
    assert goals[PEAK_OVER_IDEAL.key]["worst_config"] == "merak3d pp2, 2 layers"
    assert goals[PEAK_OVER_IDEAL.key]["met"] is False
    assert len(goals[PEAK_OVER_IDEAL.key]["by_config"]) == 8
    assert goals[PEAK_OVER_IDEAL_WITHOUT_LAUNCHER_ENV.key]["value"] is None
    assert goals[PEAK_OVER_IDEAL_WITHOUT_LAUNCHER_ENV.key]["missing"] == ["merak3d pp2xtp2, 24 layers"]
    assert [goal["key"] for goal in goal_records(launcher, None, LEGS)] == [PEAK_OVER_IDEAL.key]
    assert PEAK_OVER_IDEAL.target == PEAK_OVER_IDEAL_WITHOUT_LAUNCHER_ENV.target == 1.3


def test_every_merak3d_layout_meets_each_baseline_on_as_many_ranks():
    for leg in (leg for leg in LEGS if leg.strategy == "merak3d"):
        peers = {other.strategy for other in LEGS if other.strategy != "merak3d"
                 and other.world_size == leg.world_size}
        assert peers == {"fsdp2", "zero3", "ddp"}, leg.name
    runs = [_memory("merak3d pp2xtp2", 24, 1.2, used=100.0), _memory("DDP (2 ranks)", 24, 1.2, used=400.0),
            _memory("DDP (4 ranks)", 24, 1.2, used=200.0)]
    (pp_tp,) = [row for row in ratio_table(runs, [], 24) if row["layout"] == "merak3d pp2xtp2"]
    assert pp_tp["ranks"] == 4 and pp_tp["vs DDP"] == pytest.approx(0.5)


def test_baselines_run_at_their_libraries_defaults():
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    ddp = trainer_for(next(leg for leg in LEGS if leg.strategy == "ddp"), 1, []).strategy
    assert type(ddp) is DDPStrategy and ddp._ddp_kwargs == {}
    fsdp = trainer_for(next(leg for leg in LEGS if leg.strategy == "fsdp2"), 1, []).strategy
    assert type(fsdp) is ModelParallelStrategy
    assert (fsdp._data_parallel_size, fsdp._tensor_parallel_size) == (2, 1)
    config = zero3_config(Workload(hidden=32, layers=2, vocab=64), 4)
    assert config["zero_optimization"] == {"stage": 3} and config["train_micro_batch_size_per_gpu"] == 1


def test_ranks_without_the_launchers_heap_keep_other_glibc_tunables():
    ours = with_heap_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert without_heap_tunables({"GLIBC_TUNABLES": ours, "PATH": "/bin"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}
    assert without_heap_tunables({"GLIBC_TUNABLES": with_heap_tunables({})}) == {}


def test_legs_are_picked_by_name_with_or_without_the_merak3d_prefix():
    picked = select_legs(["DDP (4 ranks)", "pp2xtp2", "merak3d tp2 (compact host memory)"])
    assert [leg.name for leg in picked] == ["merak3d pp2xtp2", "merak3d tp2 (compact host memory)", "DDP (4 ranks)"]
    assert select_legs(None) == LEGS
    with pytest.raises(SystemExit, match="no leg named"):
        select_legs(["pp3"])
