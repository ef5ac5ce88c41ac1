"""Refusals of the DeepSpeed-MoE drop-in layer, its options, the Mixtral block swap and the placement callback:
values that would fail mid-training or silently change what the layer computes, refused when built, naming the
argument, its bound and the fix; the valid boundary values next to each refusal still build and run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_merak.callbacks import MoEPlacementCallback
from lightning_merak.plugins.moe import MoE, MoEOptions, swap_sparse_moe_blocks

NAN = float("nan")


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _runs(**kwargs: Any) -> None:
    """The layer builds with ``kwargs`` and its forward returns finite values of the input's shape."""
    torch.manual_seed(0)
    output, aux_loss, _ = MoE(8, _expert(), **kwargs)(torch.randn(2, 16, 8))
    assert output.shape == (2, 16, 8) and torch.isfinite(output).all() and torch.isfinite(aux_loss)


@pytest.mark.parametrize("value", [0, -1.0, NAN, math.inf])
def test_capacity_factors_that_drop_every_token_are_refused_and_small_positive_ones_run(value: float) -> None:
    for name in ("capacity_factor", "eval_capacity_factor"):
        with pytest.raises(ValueError, match=rf"{name}={value!r} must be a finite number > 0; pass e\.g\. 1\.0"):
            MoE(8, _expert(), num_experts=4, **{name: value})
    _runs(num_experts=4, capacity_factor=0.01, eval_capacity_factor=0.01, min_capacity=0)


def test_min_capacity_below_zero_is_refused_and_zero_runs() -> None:
    with pytest.raises(ValueError, match=r"min_capacity=-3 must be an integer >= 0; pass the fewest tokens"):
        MoE(8, _expert(), num_experts=4, min_capacity=-3)
    with pytest.raises(ValueError, match=r"min_capacity=2\.5 must be an integer >= 0"):
        MoE(8, _expert(), num_experts=4, min_capacity=2.5)
    _runs(num_experts=4, min_capacity=0)


def test_expert_counts_and_ranks_must_be_positive_integers() -> None:
    with pytest.raises(ValueError, match=r"num_experts=0 must be an integer >= 1; pass the number of experts"):
        MoE(8, _expert(), num_experts=0)
    with pytest.raises(ValueError, match=r"num_experts=4\.0 must be an integer >= 1"):
        MoE(8, _expert(), num_experts=4.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ep_size=0 must be an integer >= 1; pass the ranks"):
        MoE(8, _expert(), num_experts=4, ep_size=0)
    with pytest.raises(ValueError, match=r"ep_size=True must be an integer >= 1"):
        MoE(8, _expert(), num_experts=4, ep_size=True)
    with pytest.raises(ValueError, match=r"hidden_size=0 must be an integer >= 1"):
        MoE(0, _expert(), num_experts=4)
    with pytest.raises(ValueError, match=r"expert=.*must be a torch\.nn\.Module"):
        MoE(8, "mlp", num_experts=4)  # type: ignore[arg-type]
    _runs(num_experts=1)


def test_top_k_above_the_experts_is_refused_and_k_equal_to_them_runs() -> None:
    with pytest.raises(ValueError, match=r"k=2 exceeds num_experts=1: .*pass k <= 1 or more experts"):
        MoE(8, _expert(), num_experts=1, k=2)
    with pytest.raises(ValueError, match=r"k=1\.0: only top-1 and top-2 gating are supported.*pass 1 or 2"):
        MoE(8, _expert(), num_experts=4, k=1.0)  # type: ignore[arg-type]
    _runs(num_experts=2, k=2)


def test_noisy_gate_policies_outside_deepspeeds_or_ignored_by_top2_are_refused() -> None:
    with pytest.raises(ValueError, match=r"noisy_gate_policy='bogus': choose None, 'Jitter' or 'RSample'"):
        MoE(8, _expert(), num_experts=4, noisy_gate_policy="bogus")
    with pytest.raises(ValueError, match=r"noisy_gate_policy='RSample' samples top-1 gating only.*pass k=1"):
        MoE(8, _expert(), num_experts=4, k=2, noisy_gate_policy="RSample")
    for policy in (None, "None", "Jitter"):
        _runs(num_experts=4, k=2, noisy_gate_policy=policy)
    _runs(num_experts=4, k=1, noisy_gate_policy="RSample")


@pytest.mark.parametrize("name", ["drop_tokens", "use_rts", "use_residual", "top2_2nd_expert_sampling"])
def test_switches_must_be_bools(name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name}='false' must be True or False; pass a bool"):
        MoE(8, _expert(), num_experts=4, **{name: "false"})
    _runs(num_experts=4, **{name: False})


def test_options_given_twice_are_refused() -> None:
    with pytest.raises(ValueError, match=r"options=MoEOptions and keywords \['lancet_chunks'\]: .*not both"):
        MoE(8, _expert(), num_experts=4, options=MoEOptions(), lancet_chunks=2)
    with pytest.raises(ValueError, match=r"options=dict and keywords \[\]: pass a MoEOptions"):
        MoE(8, _expert(), num_experts=4, options={"lancet_chunks": 2})  # type: ignore[arg-type]


@pytest.mark.parametrize(("fields", "message"), [
    (dict(alpha=-1.0), r"alpha=-1\.0 must be a finite number >= 0; pass the balance threshold"),
    (dict(alpha=NAN), r"alpha=nan must be a finite number >= 0"),
    (dict(replan_threshold=-0.5), r"replan_threshold=-0\.5 must be a finite number >= 0; .*or None"),
    (dict(replan_threshold=NAN), r"replan_threshold=nan must be a finite number >= 0"),
    (dict(explore_regret=NAN), r"explore_regret=nan must be a finite number >= 0"),
    (dict(replan_every=1.5), r"replan_every=1\.5 must be an integer >= 1; pass the calls between plans"),
    (dict(lancet_chunks=True), r"lancet_chunks=True: use 'auto' or an integer >= 1"),
    (dict(explore_every=2.0), r"explore_every=2\.0 must be an integer >= 0"),
    (dict(explore_seed=0.5), r"explore_seed=0\.5 must be an integer; pass any integer seed"),
    (dict(exclude_fewest=True), r"exclude_fewest=True must be an integer >= 0"),
    (dict(slots_per_rank=1.5), r"slots_per_rank=1\.5 must be an integer >= 1; .*or None"),
    (dict(balance_tolerance=NAN), r"balance_tolerance=nan must be a finite number >= 0"),
    (dict(online_check="no"), r"online_check='no' must be True or False"),
    (dict(overlap_transfer=1), r"overlap_transfer=1 must be True or False"),
    (dict(lancet_backward=None), r"lancet_backward=None must be True or False"),
])
def test_options_out_of_range_are_refused_by_validate(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MoEOptions(**fields).validate(drop_tokens=True)


def test_options_at_their_bounds_validate_and_just_past_them_do_not() -> None:
    bounds = dict(alpha=0.0, replan_threshold=0.0, explore_regret=0.0)
    for name, bound in bounds.items():
        with pytest.raises(ValueError, match=rf"{name}=-1e-09 must be a finite number >= 0"):
            MoEOptions(**{name: bound - 1e-9}).validate(True)
    MoEOptions(**bounds, replan_every=1, explore_every=0, explore_seed=-7, exclude_fewest=0, slots_per_rank=1,
               balance_tolerance=0.0, lancet_chunks="4").validate(True)
    MoEOptions(alpha=3, replan_threshold=None, lancet_chunks="auto", online_check=False).validate(True)
    _runs(num_experts=4, alpha=0.0, replan_threshold=0.0, replan_every=1)


def test_exclude_fewest_leaving_no_rank_to_replicate_to_is_refused_for_the_given_ep_size() -> None:
    for placement in ("pro_prophet", "auto"):
        with pytest.raises(ValueError, match=r"exclude_fewest=3 leaves Pro-Prophet no rank.*pass at most 2"):
            MoEOptions(placement=placement, exclude_fewest=3).validate(True, ep_size=4)
        MoEOptions(placement=placement, exclude_fewest=2).validate(True, ep_size=4)
    MoEOptions(placement="shadowing", exclude_fewest=3).validate(True, ep_size=4)  # shadowing does not read it
    with pytest.raises(ValueError, match=r"exclude_fewest=1 .*with ep_size=2; pass at most 0"):
        MoE(8, _expert(), num_experts=4, ep_size=2, placement="pro_prophet", exclude_fewest=1)


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_placement_callback_refuses_log_intervals_below_one_step(value: Any) -> None:
    with pytest.raises(ValueError, match=rf"log_every_n_steps={value!r} must be an integer >= 1; pass the steps"):
        MoEPlacementCallback(log_every_n_steps=value)
    assert MoEPlacementCallback(log_every_n_steps=1).log_every_n_steps == 1


def test_placement_callback_refuses_a_directory_or_non_path_heatmap_and_a_non_bool_switch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"heatmap_path='.*' must name a PNG file, not a directory"):
        MoEPlacementCallback(heatmap_path=tmp_path)
    with pytest.raises(ValueError, match=r"heatmap_path='3' must name a PNG file"):
        MoEPlacementCallback(heatmap_path=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"heatmap_in_log_dir='yes' must be True or False"):
        MoEPlacementCallback(heatmap_in_log_dir="yes")  # type: ignore[arg-type]
    assert MoEPlacementCallback(heatmap_path=tmp_path / "heat.png").heatmap_path == tmp_path / "heat.png"


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2))


@pytest.mark.parametrize(("arguments", "message"), [
    (dict(ep_size=0), r"ep_size=0 must be an integer >= 1; pass the ranks"),
    (dict(ep_size=3), r"model\.layers\.0\.mlp: ep_size=3 does not divide num_experts=4; pick a divisor"),
    (dict(ep_size=1, capacity_factor=0.0, drop_tokens=True), r"capacity_factor=0\.0 must be a finite number > 0"),
    (dict(ep_size=1, min_capacity=-1), r"min_capacity=-1 must be an integer >= 0"),
    (dict(ep_size=1, drop_tokens="no"), r"drop_tokens='no' must be True or False"),
    (dict(ep_size=1, aux_loss_coef=NAN), r"aux_loss_coef=nan must be a finite number >= 0"),
    (dict(ep_size=1, options=None), r"options=None must be a MoEOptions"),
    (dict(ep_size=2, options=MoEOptions(placement="auto", exclude_fewest=1)), r"exclude_fewest=1 .*at most 0"),
])
def test_swap_refuses_bad_arguments_before_replacing_any_block(arguments: dict[str, Any], message: str) -> None:
    model = _mixtral()
    before = [type(layer.mlp) for layer in model.model.layers]
    with pytest.raises(ValueError, match=message):
        swap_sparse_moe_blocks(model, **{"options": MoEOptions(), **arguments})
    assert [type(layer.mlp) for layer in model.model.layers] == before


def test_swap_refuses_a_negative_floor_and_with_a_zero_one_computes_the_original_function() -> None:
    model = _mixtral()
    ids = torch.randint(0, 64, (2, 8))
    reference = model(ids).logits
    with pytest.raises(ValueError, match=r"min_capacity=-1 must be an integer >= 0"):
        swap_sparse_moe_blocks(model, 1, MoEOptions(), min_capacity=-1)
    swapped = swap_sparse_moe_blocks(model, 1, MoEOptions(), min_capacity=0, aux_loss_coef=0.0)
    assert len(swapped) == 2
    torch.testing.assert_close(model(ids).logits, reference, rtol=1e-4, atol=1e-5)
