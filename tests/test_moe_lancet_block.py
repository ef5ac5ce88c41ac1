"""Block-scope Lancet: a block stack run as sub-batches equals the unsplit run (outputs, l_aux, gradients).

Pure parts first (route renumbering, l_aux shares against DeepSpeed's gate, the block
simulator, sub-batch meetings), then 2 gloo ranks: attention + our MoE blocks under
``lancet_overlap(k=2)`` against the same blocks unsplit, with the same RNG state, on the
capacity path with tokens dropped, top-1 with random token selection, and dropless with
Pro-Prophet replicas.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_merak.distributed.deepspeed_comm import init_deepspeed_comm
from lightning_merak.distributed.sub_batches import mark_sub_batch_share, run_sub_batches
from lightning_merak.distributed.turns import meet_in_turn
from lightning_merak.plugins.moe import CommCurve, CostModel, PlacementPlan
from lightning_merak.plugins.moe.core.joint_gate import compact_routes, first_choice_fraction, sub_batch_gates
from lightning_merak.plugins.moe.core.lancet import block_pipelined_time, choose_block_chunks
from lightning_merak.testing import run_distributed

HIDDEN, HEADS, BATCH, SEQ = 16, 2, 4, 6
TOLERANCE = 1e-5


# Pure parts ----------------------------------------------------------------------------------


def test_compact_routes_number_each_experts_kept_routes_from_zero_in_location_order() -> None:
    indices = torch.tensor([[0, 2, -1, 0, 2], [1, 0, 2, -1, 0]])
    locations = torch.tensor([[3, 5, 0, 4, 6], [9, 7, 8, 0, 9]])
    compact, counts = compact_routes(indices, locations, 3)
    assert counts.tolist() == [4, 1, 3]
    assert compact.tolist() == [[0, 0, 0, 1, 1], [0, 2, 2, 0, 3]]


@pytest.mark.parametrize("k", [1, 2])
def test_sub_batch_gates_and_l_aux_shares_equal_deepspeeds_gate(k: int) -> None:
    from deepspeed.moe.sharded_moe import top1gating, top2gating

    torch.manual_seed(3)
    experts, tokens = 4, 30
    logits = (torch.randn(tokens, experts) + torch.tensor([2.0, 0.0, 0.0, 0.0])).requires_grad_(True)
    if k == 1:
        l_aux, _, _, indices, _, gates, counts = top1gating(logits, 0.5, 2, use_rts=False, sparse_routes=True)
        fraction = counts.float() / tokens
    else:
        l_aux, _, _, indices, _, gates, _ = top2gating(logits.clone(), 0.5, 2, top2_2nd_expert_sampling=False,
                                                       sparse_routes=True)
        fraction = first_choice_fraction(logits.detach())
    assert (indices < 0).any(), "the case must drop routes"
    probe = torch.randn(gates.shape)
    (expected_grad,) = torch.autograd.grad((gates * probe).sum() + 3 * l_aux, logits)
    pieces, shares = [], []
    leaves = [piece.detach().requires_grad_(True) for piece in logits.split([12, 11, 7])]
    for leaf, slice_indices in zip(leaves, indices.split([12, 11, 7], dim=1)):
        piece_gates, share = sub_batch_gates(leaf, slice_indices, fraction, tokens)
        pieces.append(piece_gates)
        shares.append(share)
    torch.testing.assert_close(torch.cat(pieces, dim=1), gates.detach(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sum(shares), l_aux.detach(), rtol=1e-6, atol=1e-7)
    split_grad = torch.cat(torch.autograd.grad((torch.cat(pieces, 1) * probe).sum() + 3 * sum(shares), leaves))
    torch.testing.assert_close(split_grad, expected_grad, rtol=1e-5, atol=1e-7)


def _cost(a2a_bytes_per_s: float, latency_s: float = 0.0, tokens_per_s: float = 1e6) -> CostModel:
    return CostModel(CommCurve.from_bandwidth(a2a_bytes_per_s, latency_s), CommCurve.from_bandwidth(1e12),
                     tokens_per_s, 64, 4096, 1)


def test_block_simulator_hides_all_to_alls_behind_dense_and_expert_compute() -> None:
    assert block_pipelined_time(3.0, 2.0, 1.0, chunks=1, blocks=2) == pytest.approx(2 * (3 + 2 + 1 + 2))
    # Two sub-batches: the second's combine runs under the first's next-block dense part.
    one = block_pipelined_time(4.0, 2.0, 2.0, chunks=1, blocks=3)
    two = block_pipelined_time(2.0, 1.0, 1.0, chunks=2, blocks=3)
    assert two < one
    # Without communication, splitting gains nothing.
    assert block_pipelined_time(2.0, 0.0, 1.0, 4, 2) == pytest.approx(block_pipelined_time(8.0, 0.0, 4.0, 1, 2))
    with pytest.raises(ValueError, match="at least 1"):
        block_pipelined_time(1.0, 1.0, 1.0, chunks=0)


def test_block_chunk_choice_follows_dense_time_latency_and_batch() -> None:
    counts = [[0, 2000], [2000, 0]]
    plan = PlacementPlan(2, 2)
    assert choose_block_chunks(_cost(1e8), counts, plan, dense_s=0.002, batch=8) > 1
    assert choose_block_chunks(_cost(1e8, latency_s=1.0), counts, plan, dense_s=0.002, batch=8) == 1
    assert choose_block_chunks(_cost(1e8), counts, plan, dense_s=0.002, batch=3) == 1
    assert choose_block_chunks(_cost(1e8), counts, plan, dense_s=0.002, batch=6) in (1, 2)
    with pytest.raises(ValueError, match="dense_s"):
        choose_block_chunks(_cost(1e8), counts, plan, dense_s=-1.0, batch=8)


def test_measured_sub_batch_overhead_limits_the_chunk_count() -> None:
    from lightning_merak.plugins.moe.core.lancet import simulated_block_time

    counts = [[0, 2000], [2000, 0]]
    plan = PlacementPlan(2, 2)
    free = choose_block_chunks(_cost(1e8), counts, plan, dense_s=0.002, batch=8)
    assert free > 1
    # each sub-batch adds its overhead once per block: k sub-batches of one block pay it k times
    for chunks in (1, 2, 4):
        extra = (simulated_block_time(_cost(1e8), counts, plan, 0.002, chunks, blocks=1, sub_batch_overhead_s=0.01)
                 - simulated_block_time(_cost(1e8), counts, plan, 0.002, chunks, blocks=1))
        assert extra == pytest.approx(0.01 * chunks, rel=1e-6)
    assert choose_block_chunks(_cost(1e8), counts, plan, dense_s=0.002, batch=8, sub_batch_overhead_s=1.0) == 1
    with pytest.raises(ValueError, match="sub_batch_overhead_s"):
        simulated_block_time(_cost(1e8), counts, plan, 0.002, 2, sub_batch_overhead_s=-1.0)


def _normalise_by_batch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = meet_in_turn("norm", x.detach().abs().sum(), lambda parts: [sum(parts)] * len(parts))
    return x / total, mark_sub_batch_share((x ** 2).sum())


def test_meetings_join_the_sub_batches_and_shares_sum_with_full_gradients() -> None:
    x = torch.randn(6, 3)
    whole_x, split_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    whole = _normalise_by_batch(whole_x)
    split = run_sub_batches(_normalise_by_batch, 3, (split_x,))
    torch.testing.assert_close(split[0], whole[0])
    torch.testing.assert_close(split[1], whole[1])
    probe = torch.randn(6, 3)
    ((whole[0] * probe).sum() + whole[1]).backward()
    ((split[0] * probe).sum() + split[1]).backward()
    torch.testing.assert_close(split_x.grad, whole_x.grad)
    with torch.no_grad():
        torch.testing.assert_close(run_sub_batches(_normalise_by_batch, 2, (x,))[1], (x ** 2).sum())


def test_a_sub_batch_that_skips_a_meeting_fails_instead_of_hanging() -> None:
    def skewed(x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 0:
            return x * 2
        return x * meet_in_turn("scale", 2.0, lambda parts: parts)

    x = torch.tensor([[1.0], [-1.0]])
    with pytest.raises(RuntimeError, match="finished without reaching meeting"):
        run_sub_batches(skewed, 2, (x,))
    with pytest.raises(RuntimeError, match=r"meeting \(.a., "):
        run_sub_batches(lambda t: meet_in_turn(("a", float(t[0, 0])), 1.0, lambda p: p) * t, 2, (x,))


# A small transformer stack -------------------------------------------------------------------


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 24), nn.GELU(), nn.Linear(24, HIDDEN))


def _cheap_transfers(experts_per_rank: int) -> CostModel:
    return CostModel(CommCurve.from_bandwidth(1e5), CommCurve.from_bandwidth(1e12), 1e6, HIDDEN * 4,
                     sum(p.numel() for p in _expert().parameters()) * 4, experts_per_rank)


class Block(nn.Module):
    """Pre-norm attention, then our MoE: returns the hidden states and the MoE's l_aux."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attention = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.norm1(x)
        h = x + self.attention(normed, normed, normed, need_weights=False)[0]
        out, l_aux, _ = self.moe(self.norm2(h))
        return h + out, l_aux


class Stack(nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = x.new_zeros(())
        for layer in self.layers:
            x, l_aux = layer(x)
            total = total + l_aux
        return x, total


def _stack(world_size: int, case: dict[str, Any]) -> Stack:
    from lightning_merak.plugins.moe import MoE, TransferScheduler

    torch.manual_seed(0)
    scheduler = TransferScheduler()
    num_experts = case["num_experts"]
    blocks = [Block(MoE(
        HIDDEN, _expert(), num_experts=num_experts, ep_size=world_size, k=case["k"],
        capacity_factor=case.get("capacity_factor", 1.0), min_capacity=2, drop_tokens=case.get("drop_tokens", True),
        use_rts=case.get("use_rts", False), top2_2nd_expert_sampling=case.get("sampling", False),
        cost_model=_cheap_transfers(num_experts // world_size), scheduler=scheduler,
        **{"online_check": False, **case["options"]},  # sub-batches run the model's plan; so must the unsplit stack
    )) for _ in range(2)]
    return Stack(blocks)


def _inputs(rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=generator)
    return x + torch.linspace(0.0, 1.5, HIDDEN)


def _separate_gating_drops(layer: Any, tokens: torch.Tensor) -> tuple[int, int]:
    """Dropped routes when the whole batch gates at once, and when each half gates alone."""
    torch.manual_seed(5)
    whole = layer._route(torch.nn.functional.linear(tokens.float(), layer.gate.wg.weight.float()), None)[1]
    halves = 0
    for half in tokens.chunk(2):
        torch.manual_seed(5)
        halves += int((layer._route(torch.nn.functional.linear(half.float(), layer.gate.wg.weight.float()),
                                    None)[1] < 0).sum())
    return int((whole < 0).sum()), halves


def _compare(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    from lightning_merak.callbacks.moe.placement import balance_metrics
    from lightning_merak.plugins.moe.lancet_block import lancet_overlap

    reference, split = _stack(world_size, case), _stack(world_size, case)
    wrapped = lancet_overlap(split, chunks=2)
    moe_inputs: list[torch.Tensor] = []
    hook = reference.layers[0].moe.deepspeed_moe.register_forward_pre_hook(
        lambda _, args: moe_inputs.append(args[0].detach().reshape(-1, HIDDEN)))
    out: dict[str, Any] = {"diffs": [], "dropped": [], "sub_batches": [], "plans": [], "logged_aux": [],
                           "last_share": [], "wrapped": len(wrapped)}
    for step in range(3):
        x = _inputs(rank, step)
        results = []
        for model in (reference, split):
            model.zero_grad(set_to_none=True)
            inputs = x.clone().requires_grad_(True)
            torch.manual_seed(77 + step)
            output, l_aux = model(inputs)
            probe = torch.randn(output.shape, generator=torch.Generator().manual_seed(step))
            ((output * probe).sum() + l_aux).backward()
            grads = {name: p.grad for name, p in model.named_parameters()}
            stats = [layer.moe.deepspeed_moe.stats for layer in model.layers]
            results.append((output.detach(), l_aux.detach(), inputs.grad, grads, stats))
        (ref_out, ref_aux, ref_dx, ref_grads, ref_stats), (out_, aux, dx, grads, stats) = results
        diffs = {"output": (ref_out - out_).abs().max().item(), "l_aux": (ref_aux - aux).abs().item(),
                 "input_grad": (ref_dx - dx).abs().max().item()}
        for name, grad in ref_grads.items():
            other = grads.get(name)
            diffs[name] = float("inf") if (other is None) != (grad is None) else \
                0.0 if grad is None else (grad - other).abs().max().item()
        out["diffs"].append(diffs)
        out["dropped"].append([(r["dropped_routes"], s["dropped_routes"]) for r, s in zip(ref_stats, stats)])
        out["sub_batches"].append([s.get("sub_batches") for s in stats])
        logged = [balance_metrics(layer.moe.deepspeed_moe)["aux_loss"] for layer in split.layers]
        out["logged_aux"].append([(float(layer.moe.deepspeed_moe.l_aux), value)
                                  for layer, value in zip(reference.layers, logged)])
        out["last_share"].append([float(layer.moe.deepspeed_moe.l_aux) for layer in split.layers])
        out["plans"].append([[(r.expert, r.owner, r.replicas) for r in s["plan"].replications] for s in stats]
                            + [[(r.expert, r.owner, r.replicas) for r in s["plan"].replications] for s in ref_stats])
    hook.remove()
    out["separate_gating"] = _separate_gating_drops(reference.layers[0].moe.deepspeed_moe, moe_inputs[0])
    return out


def run_cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    init_deepspeed_comm("gloo")
    return {name: _compare(rank, world_size, case) for name, case in cases.items()}


CASES = {
    "capacity_top2_drops": dict(num_experts=4, k=2, capacity_factor=0.5, options=dict()),
    "capacity_top1_rts_lancet2": dict(num_experts=4, k=1, capacity_factor=0.5, use_rts=True,
                                      options=dict(lancet_chunks=2)),
    "dropless_top2_sampling_prophet": dict(num_experts=4, k=2, drop_tokens=False, sampling=True,
                                           options=dict(dispatch="dropless", placement="pro_prophet", alpha=0.0)),
}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_block_scope_lancet_equals_the_unsplit_stack_on_two_ranks() -> None:
    results = run_distributed(run_cases, 2, args=(CASES,), timeout_s=240)
    for rank, per_case in enumerate(results):
        for name, result in per_case.items():
            assert result["wrapped"] == 2
            for step, diffs in enumerate(result["diffs"]):
                worst = max(diffs, key=diffs.get)
                assert diffs[worst] <= TOLERANCE, (
                    f"{name} rank {rank} step {step}: {worst} differs by {diffs[worst]:.3g}"
                )
            assert all(counts == [2, 2] for counts in result["sub_batches"]), f"{name}: not run as 2 sub-batches"
            for step_aux, shares in zip(result["logged_aux"], result["last_share"]):  # the callback logs the total
                assert all(abs(ref - logged) <= TOLERANCE for ref, logged in step_aux), f"{name}: logged {step_aux}"
                assert any(abs(ref - share) > TOLERANCE for (ref, _), share in zip(step_aux, shares)), (
                    f"{name}: the last sub-batch's share equals the total, so the check above proves nothing")
            for step_drops in result["dropped"]:
                assert all(ref == ours for ref, ours in step_drops), f"{name} rank {rank}: dropped {step_drops}"
            plans = result["plans"]
            assert all(p[:2] == p[2:] for p in plans), f"{name}: plans differ from the unsplit layer's"
            if CASES[name].get("drop_tokens", True):
                assert sum(ref for step in result["dropped"] for ref, _ in step) > 0, f"{name}: nothing dropped"
                joint, separate = result["separate_gating"]
                assert joint != separate, f"{name}: gating each half alone drops the same routes; weak case"
            else:
                assert any(any(p) for p in plans[1:]), f"{name}: no expert was ever replicated"
    for name in CASES:
        assert all(r[name]["plans"] == results[0][name]["plans"] for r in results), f"{name}: ranks disagree"


FOUR_RANK_CASES = {
    "capacity_top2_drops_8_experts": dict(num_experts=8, k=2, capacity_factor=0.5, options=dict()),
}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_block_scope_lancet_equals_the_unsplit_stack_on_four_ranks() -> None:
    results = run_distributed(run_cases, 4, args=(FOUR_RANK_CASES,), timeout_s=240)
    for rank, per_case in enumerate(results):
        result = per_case["capacity_top2_drops_8_experts"]
        for step, diffs in enumerate(result["diffs"]):
            worst = max(diffs, key=diffs.get)
            assert diffs[worst] <= TOLERANCE, f"rank {rank} step {step}: {worst} differs by {diffs[worst]:.3g}"
        assert all(ref == ours for step in result["dropped"] for ref, ours in step)
        assert sum(ref for step in result["dropped"] for ref, _ in step) > 0, "nothing dropped"


# Switching it on: helper and Hydra -----------------------------------------------------------


def _mixtral(lancet_scope: str, block_chunks: str = "2") -> nn.Module:
    from lightning_merak.cli.options.moe import ProphetMoEConfig
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig

    config = ModelConfig(name="m", model_type="mixtral", config=dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2))
    torch.manual_seed(0)
    options = ProphetMoEConfig(ep_size=1, placement="none", lancet_chunks="1", lancet_scope=lancet_scope,
                               lancet_block_chunks=block_chunks)
    return options.apply(build_causal_lm(config, 50))


def test_mixtral_decoder_layers_as_sub_batches_equal_the_unsplit_model() -> None:
    from lightning_merak.plugins.moe.lancet_block import LancetBlockForward

    unsplit, split = _mixtral("layer"), _mixtral("block")
    assert sum(isinstance(layer.forward, LancetBlockForward) for layer in split.model.layers) == 2
    ids = torch.randint(0, 50, (4, 10))
    losses = []
    for model in (unsplit, split):
        model.train()
        output = model(input_ids=ids, labels=ids)
        output.loss.backward()
        losses.append((output.logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (ref_logits, ref_grads), (logits, grads) = losses
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=TOLERANCE)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=TOLERANCE, msg=name)
    # Library detail a minor release may change: how transformers hands the decoder layer its KV cache
    # (keyword `past_key_values` before, `cache` in 5.24). Sub-batches sharing it give wrong logits silently.
    with pytest.raises(ValueError, match="use_cache=False"):
        split(input_ids=ids, use_cache=True)


def test_block_scope_lancet_refuses_a_cache_object_under_any_name() -> None:
    from transformers.cache_utils import DynamicCache

    from lightning_merak.plugins.moe.lancet_block import lancet_overlap

    stack = _stack(1, dict(num_experts=2, k=1, options=dict()))
    block = lancet_overlap(stack, 2)[0]
    hidden = torch.randn(BATCH, SEQ, HIDDEN)
    with pytest.raises(ValueError, match=r"key/value cache \(kv_state\).*use_cache=False"):
        block.forward(hidden, kv_state=DynamicCache())
    with pytest.raises(ValueError, match=r"key/value cache \(positional argument 1\)"):
        block.forward(hidden, DynamicCache())


def test_block_scope_options_and_helper_refuse_bad_input_with_the_fix() -> None:
    from lightning_merak.plugins.moe.lancet_block import lancet_overlap

    with pytest.raises(ValueError, match="lancet_scope"):
        _mixtral("everywhere")
    with pytest.raises(ValueError, match="lancet_block_chunks"):
        _mixtral("block", "two")
    with pytest.raises(ValueError, match="no lightning_merak MoE layer"):
        lancet_overlap(nn.Sequential(nn.Linear(2, 2)), 2)
    stack = _stack(1, dict(num_experts=2, k=1, options=dict()))
    with pytest.raises(ValueError, match="'auto' or an integer"):
        lancet_overlap(stack, 0)
    lancet_overlap(stack, 4)
    with pytest.raises(ValueError, match="call lancet_overlap once"):
        lancet_overlap(stack, 2)
    with pytest.raises(ValueError, match="cannot be split into 4 Lancet sub-batches"):
        stack(torch.randn(6, SEQ, HIDDEN))
    bare = nn.ModuleDict({"moe": _stack(1, dict(num_experts=2, k=1, options=dict())).layers[0].moe})
    with pytest.raises(ValueError, match="pass the decoder blocks explicitly"):
        lancet_overlap(bare, 2)


def test_auto_chunks_measure_the_dense_time_once_then_split() -> None:
    from lightning_merak.plugins.moe.lancet_block import lancet_overlap

    stack = _stack(1, dict(num_experts=2, k=1, options=dict()))
    blocks = lancet_overlap(stack, "auto")
    stack(torch.randn(BATCH, SEQ, HIDDEN))
    for block in blocks:
        assert block.forward.dense_s is not None and block.forward.dense_s > 0
        assert block.forward.chunks == 1, "one rank has no all-to-all to hide"


def _auto_rank(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_merak.plugins.moe.lancet_block import lancet_overlap

    init_deepspeed_comm("gloo")
    case = dict(num_experts=4, k=2, capacity_factor=0.5, options=dict())
    reference, split = _stack(world_size, case), _stack(world_size, case)
    blocks = lancet_overlap(split, "auto")
    worst = 0.0
    for step in range(3):
        x = _inputs(rank, step)
        outputs = []
        for model in (reference, split):
            torch.manual_seed(77 + step)
            outputs.append(model(x)[0].detach())
        worst = max(worst, (outputs[0] - outputs[1]).abs().max().item())
    return {"chunks": [b.forward.chunks for b in blocks], "overhead": [b.forward.sub_batch_overhead_s for b in blocks],
            "worst": worst}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_auto_chunks_calibrate_the_sub_batch_overhead_on_two_ranks() -> None:
    """Call 1 unsplit, call 2 as two sub-batches (the overhead is measured), then the chosen count;
    same on every rank.
    """
    results = run_distributed(_auto_rank, 2, timeout_s=240)
    for result in results:
        assert all(chunks in (1, 2, 4, 8) for chunks in result["chunks"])
        assert all(overhead is not None and overhead >= 0 for overhead in result["overhead"])
        assert result["worst"] <= TOLERANCE
    assert results[0]["chunks"] == results[1]["chunks"], "ranks chose different sub-batch counts"


def test_hydra_composes_block_scope_lancet() -> None:
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from lightning_merak.cli.config import register_configs
    from lightning_merak.cli.options.moe import register

    register_configs()
    register()
    with initialize_config_module("lightning_merak.conf", version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=[
            "moe=prophet", "moe.lancet_scope=block", "moe.lancet_block_chunks=2", "model=mixtral_tiny",
            "output_dir=/tmp/unused"]))
    assert cfg.moe.lancet_scope == "block" and cfg.moe._block_chunks() == 2
