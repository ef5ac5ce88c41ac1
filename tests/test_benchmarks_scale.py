"""The scale benchmark's arithmetic: a rank's ideal memory, measured activations, and its results table."""

from __future__ import annotations

import pytest

from benchmarks._scale_ranks import MIB, Workload, measure_activations
from benchmarks.results_table import scale
from benchmarks.scale import LEGS, _ideal_mb, select_legs

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


def test_results_table_shows_each_leg_and_the_refused_baseline():
    memory = {"section": "memory", "layers": 4, "max_used_mb": 90.0, "peak_over_ideal": 1.2, "error": None}
    data = {
        "ladder_layers": [2, 4], "workload": "llama", "cap_mb": 100.0, "steps": 3, "peak_over_ideal": 1.2,
        "peak_over_ideal_layout": "merak3d pp2xtp2", "peak_over_ideal_goal": 1.3, "logits_max_rel_err": 1e-7,
        "export_roundtrip_max_abs": 0.0,
        "rows": [
            {**memory, "leg": "merak3d pp2xtp2"},
            {"section": "largest", "leg": "merak3d pp2xtp2", "layers": 4, "params_m": 1.0,
             "full_state_exceeds_cap": True, "refused": False, "error": None},
            {"section": "largest", "leg": "DeepSpeed ZeRO-3", "layers": None, "refused": True,
             "error": "RuntimeError: no accelerator. More text"},
            {"section": "load", "leg": "merak3d pp2xtp2", "load_s": 0.5, "gb_per_s": 0.2},
        ],
    }
    table = scale(data)
    assert table.rows[0] == ["merak3d pp2xtp2", "4 layers, 1.0 M params (weights + AdamW exceed the cap)", "90",
                             "1.20×", "0.50", "0.20"]
    assert table.rows[1][1] == "refused: RuntimeError: no accelerator"
    assert any("goal ≤ 1.3 met" in note for note in table.notes)


def test_legs_are_picked_by_name_with_or_without_the_merak3d_prefix():
    picked = select_legs(["DDP", "pp2xtp2", "merak3d tp2 (compact host memory)"])
    assert [leg.name for leg in picked] == ["merak3d pp2xtp2", "merak3d tp2 (compact host memory)", "DDP"]
    assert select_legs(None) == LEGS
    with pytest.raises(SystemExit, match="no leg named"):
        select_legs(["pp3"])
