"""The moe_families benchmark's baseline (transformers' default experts implementation), its paired statistic and
its goals (each the worst configuration of its leg), on synthetic rows and tiny real models."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from benchmarks._moe_families_pp2 import variant_model
from benchmarks._moe_families_ranks import default_model, expert_bytes
from benchmarks._table_moe_families import moe_families
from benchmarks.moe_families import (
    EP,
    EP2_LEGS,
    EXPERT_BYTES_RATIO,
    _paired_speedup,
    compute_goals,
    leg_sizes,
)
from lightning_merak.plugins.moe.experts import (
    EXACT_FAMILIES,
    enable_expert_parallel,
    enable_grouped_experts,
    experts_modules,
    family_support,
    tiny_moe_model,
)


def test_paired_speedup_takes_each_rounds_slowest_rank_then_the_median_ratio() -> None:
    peers = [{"steps_ms": {"eager": [10.0, 40.0, 12.0], "ours": [5.0, 30.0, 6.0]}},
             {"steps_ms": {"eager": [12.0, 20.0, 9.0], "ours": [4.0, 10.0, 8.0]}}]
    # slowest rank per round: eager 12, 40, 12 and ours 5, 30, 8 → ratios 2.4, 1.33, 1.5
    assert _paired_speedup(peers, "eager") == pytest.approx(1.5)


@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_the_baselines_run_transformers_default_experts_implementation(family: str) -> None:
    size = leg_sizes(quick=True)["few_experts"]
    for model in (default_model(family, size), variant_model(family, "default", size)):
        # what transformers resolves when the user sets nothing, and not the eager loop tiny_moe_model defaults to
        assert model.config._experts_implementation == model.get_correct_experts_implementation(None)
        assert model.config._experts_implementation == "grouped_mm"


def test_ours_starts_from_the_same_weights_as_the_default_baseline() -> None:
    size = leg_sizes(quick=True)["few_experts"]
    default, eager = variant_model("mixtral", "default", size), variant_model("mixtral", "ours", size)
    assert eager.config._experts_implementation == "eager"
    for (name, a), (_, b) in zip(default.named_parameters(), eager.named_parameters(), strict=True):
        assert a.equal(b), name


def test_expert_bytes_counts_only_the_named_expert_tensors() -> None:
    model = tiny_moe_model("qwen2_moe")
    report = enable_expert_parallel(model)  # no process group: one rank holding every expert
    names = set(report.expert_parameters)
    expected = sum(p.numel() * 4 for n, p in model.named_parameters() if n in names)
    assert expert_bytes(model, names) == expected == report.expert_params_after * 4
    assert expert_bytes(model, names) < sum(p.numel() * 4 for p in model.parameters())


def test_expert_bytes_target_is_one_over_ep_plus_five_points() -> None:
    assert EP == 2
    assert EXPERT_BYTES_RATIO.target == pytest.approx(0.55)
    assert EXPERT_BYTES_RATIO.direction == "<="


def _row(family: str, **figures: float) -> dict[str, Any]:
    return {"family": family, "speedup_vs_default": 1.2, "expert_bytes_ratio": 0.5, "output_diff": 1e-7,
            "grad_diff": 1e-7, **figures}


def _legs(bad_leg: str, bad_row: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {leg: [_row("mixtral"), bad_row if leg == bad_leg else _row("olmoe")] for leg in EP2_LEGS}


def _goal(goals: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return next(goal for goal in goals if goal["key"] == key)


@pytest.mark.parametrize("bad_leg", EP2_LEGS)
def test_each_ep2_goal_is_the_worst_family_of_every_leg(bad_leg: str) -> None:
    bad = _row("olmoe", speedup_vs_default=0.7, expert_bytes_ratio=0.6, output_diff=3e-4, grad_diff=2e-3)
    goals = compute_goals(_legs(bad_leg, bad), [{"family": "mixtral", "speedup_vs_default": 1.1}])
    for key, value in (("speedup_vs_default_min", 0.7), ("expert_bytes_ratio", 0.6), ("max_output_diff", 3e-4),
                       ("max_grad_diff", 2e-3)):
        goal = _goal(goals, key)
        assert (goal["value"], goal["worst_config"], goal["met"]) == (value, f"{bad_leg}/olmoe", False), key
    assert _goal(goals, "pp2_ep2_vs_default_min")["met"] is True


def test_pp2_goal_is_the_worst_family_and_a_failed_family_leaves_no_figure() -> None:
    pp2 = [{"family": "mixtral", "speedup_vs_default": 1.3}, {"family": "olmoe", "speedup_vs_default": 0.85},
           {"family": "qwen3_moe", "speedup_vs_default": 0.95}]
    goal = _goal(compute_goals(_legs("large", _row("olmoe")), pp2), "pp2_ep2_vs_default_min")
    assert (goal["value"], goal["worst_config"], goal["met"], goal["target"]) == (0.85, "pp2_ep2/olmoe", False, 0.9)
    failed = compute_goals(_legs("large", {"family": "olmoe", "error": "RuntimeError: x"}),
                           pp2 + [{"family": "deepseek_v3", "error": "RuntimeError: y"}])
    assert all(goal["value"] is None and goal["met"] is None for goal in failed)
    assert _goal(failed, "speedup_vs_default_min")["missing"] == ["large/olmoe"]


def test_the_goals_need_every_ep2_leg() -> None:
    with pytest.raises(ValueError, match="ep=2 goals need the legs"):
        compute_goals({"family_widths": [_row("mixtral")]}, [])


def test_the_table_shows_ours_against_the_default_and_each_leg() -> None:
    row = {**_row("mixtral"), "num_experts": 8, "top_k": 2, "step_ms": {"default": 20.0, "eager": 30.0, "ours": 16.0},
           "speedup_vs_eager": 1.9, "exchange_cost": 1.1, "replicated_over_ours": 1.05, "timed_steps": 9}
    leg = {"size": {"hidden": 64, "batch": 2, "seq": 32}, "rows": [row, {"family": "olmoe", "error": "Boom. more"}]}
    data = {"rows": [row], "ep": 2, "world_size": 2, "backend": "gloo", "size": leg["size"], "steps": 9,
            "ours": "merak_ep", "baseline": "default", "default_implementations": ["grouped_mm"],
            "families_exact": ["mixtral"], "families_refused": {"dbrx": "own loop"}, "max_replicated_diff": 0.0,
            "few_experts": leg, "large": leg,
            "pp2_ep2": {"status": "measured", "world_size": 4, "steps": 9,
                        "rows": [{"family": "mixtral", "speedup_vs_default": 0.8, "speedup_vs_eager": 1.1,
                                  "loss_diff": 0.0}]}}
    table = moe_families(data)
    assert table.rows[0][3:] == ["20.0", "30.0", "16.0", "1.20× / 1.90×", "1.10×", "50.0%"]
    assert any("transformers picked: grouped_mm" in note for note in table.notes)
    assert any(note.startswith("merak3d pp=2 × ep=2") and "mixtral 0.80× / 1.10×" in note for note in table.notes)
    assert any(note.startswith("8–16 experts") and "olmoe failed: Boom" in note for note in table.notes)


def test_gpt_oss_swaps_exactly_with_its_biases_and_an_active_swiglu_clamp() -> None:
    """The tiny gpt-oss has non-zero expert biases, and a clamp low enough to cut values, so equality covers both."""
    import torch

    reference = tiny_moe_model("gpt_oss", swiglu_limit=0.05)
    experts = [module for _, module in experts_modules(reference)]
    assert experts and all(m.has_bias and m.is_transposed and m.gate_up_proj_bias.abs().sum() > 0 for m in experts)
    assert family_support(reference) == (True, "tested exact")
    unclamped = tiny_moe_model("gpt_oss")
    ours = copy.deepcopy(reference)
    enable_grouped_experts(ours)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {name: model(ids).logits for name, model in (("eager", reference), ("ours", ours),
                                                           ("unclamped", unclamped))}
    assert (logits["ours"] - logits["eager"]).abs().max() <= 1e-5
    assert (logits["unclamped"] - logits["eager"]).abs().max() > 1e-3  # the clamp cut something


def test_the_gpu_leg_times_transformers_default_beside_eager_and_ours() -> None:
    from benchmarks._moe_families_gpu import run_gpu

    rows = run_gpu(["mixtral"], True, device="cpu", size=(32, 1, 8), repeats=(0, 1))
    assert [r["dtype"] for r in rows] == ["bfloat16", "float32"]
    for row in rows:
        assert "error" not in row and set(row["step_ms"]) == {"eager", "default", "ours"}
        assert row["default_implementation"] == "grouped_mm"


def _gpt_oss_ep2_diffs(rank: int, world: int) -> dict[str, float]:
    """merak_ep's logits and gradients (local expert slices) against the unswapped eager gpt-oss on this rank."""
    import torch

    from benchmarks._moe_families_ranks import _batch, _step

    reference = tiny_moe_model("gpt_oss", hidden=64, routing="family", swiglu_limit=0.05)
    ours = copy.deepcopy(reference)
    report = enable_expert_parallel(ours)
    experts = set(report.expert_parameters)
    ids = _batch(rank, 2, 16, 128)
    ref_logits, ref_grads = _step(reference, ids, world, set())
    logits, grads = _step(ours, ids, world, experts)
    local = slice(report.local_experts.start, report.local_experts.stop)
    return {"logits": (logits - ref_logits).abs().max().item(),
            "grads": max((grad - (ref_grads[n][local] if n in experts else ref_grads[n])).abs().max().item()
                         for n, grad in grads.items()),
            "experts_per_rank": len(report.local_experts), "bias_grad": float(torch.stack(
                [grads[n].abs().sum() for n in experts if n.endswith("_bias")]).sum())}


@pytest.mark.distributed
def test_gpt_oss_at_ep2_equals_the_unswapped_model() -> None:
    from lightning_merak.testing import run_distributed

    for diffs in run_distributed(_gpt_oss_ep2_diffs, 2, timeout_s=600):
        assert diffs["logits"] <= 1e-5 and diffs["grads"] <= 1e-5, diffs
        assert diffs["experts_per_rank"] == 64 and diffs["bias_grad"] > 0
