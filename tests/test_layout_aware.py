"""The protocol features use to see a strategy, the recomputation marker, the shard-aware clipping
arithmetic and the MoE expert renumbering merak3d's checkpointer delegates (single process)."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_merak.callbacks.delta.recompute_switch import strategy_recompute, user_checkpointing
from lightning_merak.distributed.gradient_norm import ShardedGradients
from lightning_merak.plugins.moe.checkpoint import EXPERTS_KEY, ExpertNumbering
from lightning_merak.protocols.layout_aware import RecomputedForward, layout_aware
from lightning_merak.strategies.merak3d import Merak3DStrategy


def test_merak3d_is_layout_aware_without_running_its_properties_and_ddp_is_not() -> None:
    strategy = Merak3DStrategy()
    with pytest.raises(RuntimeError, match="setup_environment"):
        strategy.data_parallel_group  # noqa: B018 - the groups exist once processes have started
    assert layout_aware(strategy) is strategy
    assert layout_aware(DDPStrategy()) is None


def test_recomputed_forward_gives_the_same_gradients_and_is_recognised_by_type() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    recomputed = copy.deepcopy(block)
    recomputed.forward = RecomputedForward(recomputed.forward)
    inputs = torch.randn(4, 8)
    for module in (block, recomputed):
        torch.manual_seed(1)  # the same dropout mask in both
        module(inputs).square().sum().backward()
    for plain, checkpointed in zip(block.parameters(), recomputed.parameters()):
        torch.testing.assert_close(checkpointed.grad, plain.grad)
    strategy = Merak3DStrategy(recompute="full")
    assert strategy_recompute(recomputed, strategy) == "recomputed by the merak3d strategy (recompute='full')"
    assert strategy_recompute(block, strategy) is None and user_checkpointing(block) is None



def test_a_recomputed_forward_reads_the_state_its_forward_read() -> None:
    from lightning_merak.distributed.collectives import as_in_forward

    state = {"scale": 2.0}
    weight = nn.Parameter(torch.ones(3))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return (x * weight).sin() * as_in_forward("scale", lambda: state["scale"])

    outputs = [RecomputedForward(forward)(torch.ones(3)) for state["scale"] in (2.0, 5.0)]
    state["scale"] = 7.0  # what another forward left behind
    outputs[0].sum().backward()
    torch.testing.assert_close(weight.grad, 2.0 * torch.ones(3).cos())
    assert as_in_forward("scale", lambda: state["scale"]) == 7.0  # outside a region: read now


def test_sharded_clip_on_one_rank_is_torch_clip_grad_norm(single_rank_group) -> None:
    """With one rank the shard is the whole tensor: the norm and the clipped gradients are torch's."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
    for param in params:
        param.grad = torch.randn_like(param) * 3
    expected = [p.grad.clone() for p in params]
    reference = torch.nn.utils.clip_grad_norm_(_with_grads(expected), 1.0)
    sharded = ShardedGradients()
    sharded.register(params[:1], single_rank_group)
    assert sharded.group_index(params[0]) == 0 and sharded.group_index(params[1]) is None
    norm = sharded.clip(torch.optim.SGD(params, lr=0.1), 1.0)
    assert norm == pytest.approx(float(reference), rel=1e-6)
    for param, clipped in zip(params, expected):
        torch.testing.assert_close(param.grad, clipped)


def _with_grads(grads: list[torch.Tensor]) -> list[nn.Parameter]:
    """Parameters carrying ``grads`` (clipped in place by torch, so ``grads`` end up clipped)."""
    params = [nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    for param, grad in zip(params, grads):
        param.grad = grad
    return params


def test_expert_numbering_turns_local_numbers_global_and_back() -> None:
    """EP size 2 over data-parallel ranks [0, 1, 2, 3]: rank 3 is EP rank 1, its experts 0, 1 are 2, 3."""
    prefix = f"model.layers.0.mlp.{EXPERTS_KEY}"
    numbering = ExpertNumbering({prefix: (2, 2)}, lambda: (3, [0, 1, 2, 3]))
    assert numbering.renamed(f"{prefix}1.w1.weight", to_global=True) == f"{prefix}3.w1.weight"
    assert numbering.renamed(f"{prefix}3.w1.weight", to_global=False) == f"{prefix}1.w1.weight"
    assert numbering.renamed("model.embed_tokens.weight", to_global=True) == "model.embed_tokens.weight"
    assert ExpertNumbering.of(nn.Linear(2, 2), lambda: (0, [0])).layers == {}


def test_the_moe_plugins_layers_are_found_through_their_protocol() -> None:
    """Checkpoints renumber, and full sharding refuses, the MoE plugin's layers without importing the plugin."""
    from lightning_merak.plugins.moe import MoE
    from lightning_merak.protocols.experts import ExpertParallelLayer
    from lightning_merak.strategies.merak3d.arguments import check_fully_shardable, moe_layers

    model = nn.Sequential(nn.Linear(8, 8), MoE(hidden_size=8, expert=nn.Linear(8, 8), num_experts=4, ep_size=2, k=1))
    assert isinstance(model[1], ExpertParallelLayer) and not isinstance(model[0], ExpertParallelLayer)
    assert [name for name, _ in moe_layers(model)] == ["1"]
    assert ExpertNumbering.of(model, lambda: (0, [0, 1])).layers == {f"1.{EXPERTS_KEY}": (2, 2)}
    with pytest.raises(ValueError, match="cannot shard MoE layers"):
        check_fully_shardable(model, None)
