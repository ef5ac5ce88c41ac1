"""Each family at its own routing shape (``routing="family"``): the table is the config classes' defaults, the
models are all sparse, and the swap stays exact at 60-256 experts; the route gathers' backward is autograd's."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.plugins.moe.experts import (
    EXACT_FAMILIES,
    FAMILY_CONFIGS,
    FAMILY_ROUTING,
    family_widths,
    tiny_moe_model,
)
from lightning_merak.plugins.moe.experts.grouped import gather_token_copies, restore_route_order, route_positions
from tests.test_moe_experts import assert_swap_equals_unswapped

DEPARTURES = {("deepseek_v2", "num_experts_per_tok"): (None, 6), ("deepseek_v3", "first_k_dense_replace"): (3, 0),
              ("deepseek_v2", "first_k_dense_replace"): (0, 0)}
"""(family, key) → (config class default, table value) where the table documents a departure or a choice."""


def test_family_routing_is_the_config_class_defaults() -> None:
    import transformers

    assert set(FAMILY_ROUTING) == set(FAMILY_CONFIGS) == set(EXACT_FAMILIES)
    for family, routing in FAMILY_ROUTING.items():
        defaults = getattr(transformers, FAMILY_CONFIGS[family][0])()
        assert "num_experts_per_tok" in routing
        for key, value in routing.items():
            expected = DEPARTURES.get((family, key), (value, value))
            assert (getattr(defaults, key), value) == expected, f"{family}.{key}"


@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_family_routing_models_are_all_sparse_at_the_family_shape(family: str) -> None:
    model = tiny_moe_model(family, hidden=32, vocab=64, routing="family")
    routing = FAMILY_ROUTING[family]
    num_experts = next(v for k, v in routing.items() if k in ("num_experts", "num_local_experts", "n_routed_experts"))
    assert model.config.num_experts_per_tok == routing["num_experts_per_tok"]
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert len(experts) == 2 and all(module.num_experts == num_experts for module in experts)


def test_unknown_routing_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        tiny_moe_model("mixtral", routing="real")


def test_family_widths_keep_the_config_class_proportions() -> None:
    """Mixtral's experts stay 3.5× hidden and Qwen3-MoE's 0.375×, to the nearest multiple of 16."""
    import transformers

    assert family_widths("mixtral", 128) == {"intermediate_size": 448}
    assert family_widths("qwen3_moe", 128) == {"intermediate_size": 384, "moe_intermediate_size": 48}
    for family in FAMILY_CONFIGS:
        defaults = getattr(transformers, FAMILY_CONFIGS[family][0])()
        widths = family_widths(family, 256)
        assert widths and all(value % 16 == 0 for value in widths.values())
        for key, value in widths.items():
            assert abs(value - getattr(defaults, key) * 256 / defaults.hidden_size) <= 8, f"{family}.{key}"
        model = tiny_moe_model(family, hidden=256, layers=1, vocab=64, intermediate="family")
        assert {key: getattr(model.config, key) for key in widths} == widths


def test_unknown_intermediate_names_the_choices() -> None:
    with pytest.raises(ValueError, match="give a size"):
        tiny_moe_model("mixtral", intermediate="wide")
    with pytest.raises(ValueError, match="choose one of"):
        family_widths("llama", 128)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("switch", ["merak_ep", "merak_grouped"])
def test_family_routing_swap_equals_unswapped(family: str, switch: str) -> None:
    """60 experts (not a power of two), greedy top-6 of 64, and group-limited top-8 of 256 with few rows each."""
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(5))
    assert_swap_equals_unswapped(tiny_moe_model(family, hidden=32, vocab=64, routing="family"), switch, ids)


def test_route_gathers_backward_equals_autograd_with_uncomputed_routes() -> None:
    gen = torch.Generator().manual_seed(0)
    k, hidden = 3, 4
    flat = torch.tensor([2, 9, 0, 2, 1, 9, 0, 1, 2, 0, 9, 1])  # id 9: a sentinel past 3 experts, never computed
    order = torch.sort(flat, stable=True).indices
    computed = int((flat < 3).sum())
    tokens = torch.randn(flat.numel() // k, hidden, generator=gen, requires_grad=True)
    upstream = torch.randn(flat.numel(), hidden, generator=gen)

    positions = route_positions(order, computed)
    rows = gather_token_copies(tokens, order, computed, positions, k)
    (restore_route_order(rows * 2.0, order, positions) * upstream).sum().backward()
    ours = tokens.grad.clone()

    tokens.grad = None
    reference_rows = tokens.index_select(0, order[:computed] // k)
    doubled = reference_rows * 2.0
    routes = doubled.new_zeros(flat.numel(), hidden).index_copy(0, order[:computed], doubled)
    (routes * upstream).sum().backward()
    assert torch.equal(rows, reference_rows.detach())
    torch.testing.assert_close(ours, tokens.grad, atol=1e-6, rtol=0)
    # token 1's routes are ids 2, 1 and a sentinel: the sentinel's gradient does not reach it
    torch.testing.assert_close(ours[1], 2.0 * (upstream[3] + upstream[4]), atol=1e-6, rtol=0)
