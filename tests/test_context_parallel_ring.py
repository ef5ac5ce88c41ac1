"""Ring and Ulysses attention on real gloo ranks equal single-process SDPA on the whole sequence, forward and
gradients: each rank attends its load-balanced shard, the shards are gathered back here and compared."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_merak.parallel.context import (
    LoadBalancedLayout,
    document_ids_from_position_ids,
    ring_attention,
    ulysses_attention,
)
from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed

BATCH, HEADS, KV_HEADS, HEAD_DIM, SEQ = 2, 8, 4, 16, 128  # Ulysses on 4 ranks needs 4 | key/value heads
TOLERANCE = 1e-5
ATTENTION = {"ring": ring_attention, "ulysses": ulysses_attention}
CASES = {
    # name: (attention, packed documents, sliding window, ranks of each context-parallel group or None for all)
    "ring": ("ring", False, None, None),
    "ulysses": ("ulysses", False, None, None),
    "ring_documents": ("ring", True, None, None),
    "ulysses_documents": ("ulysses", True, None, None),
    "ring_sliding_window": ("ring", False, 40, None),
    "ring_strided_groups": ("ring", False, None, ((0, 2), (1, 3))),  # group ranks are not global ranks
}


def _inputs() -> dict[str, torch.Tensor]:
    """The whole sequence's tensors, the same on every rank and in the test process."""
    generator = torch.Generator().manual_seed(0)
    position_ids = torch.cat([torch.arange(50), torch.arange(30), torch.arange(48)]).expand(BATCH, SEQ)
    return {
        "query": torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator),
        "key": torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=generator),
        "value": torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, generator=generator),
        "grad_out": torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator),
        "document_ids": document_ids_from_position_ids(position_ids),
    }


def _case_group(world_size: int, groups) -> tuple[dist.ProcessGroup, int]:
    """This rank's context-parallel group and its size; every rank creates every group (gloo needs that)."""
    if groups is None:
        return dist.group.WORLD, world_size
    created = [dist.new_group(list(ranks)) for ranks in groups]
    mine = next(index for index, ranks in enumerate(groups) if dist.get_rank() in ranks)
    return created[mine], len(groups[mine])


def _attention_rank(rank: int, world_size: int, case_names: list[str]) -> dict[str, list[torch.Tensor]]:
    """Run each case on this rank's shard; return its output and q/k/v gradient shards."""
    torch.manual_seed(0)
    inputs = _inputs()
    results = {}
    for name in case_names:
        attention, documents, window, groups = CASES[name]
        group, size = _case_group(world_size, groups)
        group_rank = dist.get_rank(group)
        layout = LoadBalancedLayout(SEQ, size)
        shards = {key: layout.shard(inputs[key], group_rank, dim=2) for key in ("query", "key", "value", "grad_out")}
        query, key, value = (shards[each].requires_grad_() for each in ("query", "key", "value"))
        out = ATTENTION[attention](
            query, key, value, group, positions=layout.rank_positions(),
            document_ids=layout.shard(inputs["document_ids"], group_rank) if documents else None,
            sliding_window=window,
        )
        out.backward(shards["grad_out"])
        results[name] = [out.detach(), query.grad, key.grad, value.grad]
    return results


def _expected(documents: bool, window: int | None) -> list[torch.Tensor]:
    """Single-process SDPA on the whole sequence: output and q/k/v gradients."""
    inputs = _inputs()
    query, key, value = (inputs[each].clone().requires_grad_() for each in ("query", "key", "value"))
    positions = torch.arange(SEQ)
    visible = (positions[None, :] <= positions[:, None])[None, None]
    if window is not None:
        visible = visible & (positions[:, None] - positions[None, :] < window)
    if documents:
        document_ids = inputs["document_ids"]
        visible = visible & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, enable_gqa=True)
    out.backward(inputs["grad_out"])
    return [out.detach(), query.grad, key.grad, value.grad]


def _cases(world_size: int) -> list[str]:
    return [name for name, (*_, groups) in CASES.items() if groups is None or sum(map(len, groups)) == world_size]


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def rank_results(request):
    """One run per world size for all its cases: starting ranks costs more than the cases."""
    world_size = request.param
    cases = _cases(world_size)
    return world_size, cases, run_distributed(_attention_rank, world_size, args=(cases,), timeout_s=180)


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_attention_equals_sdpa_on_the_whole_sequence(rank_results, name):
    world_size, cases, results = rank_results
    if name not in cases:
        pytest.skip(f"{name} needs another world size")
    attention, documents, window, groups = CASES[name]
    members = [list(range(world_size))] if groups is None else [list(ranks) for ranks in groups]
    expected = _expected(documents, window)
    for ranks in members:
        layout = LoadBalancedLayout(SEQ, len(ranks))
        for index, (label, want) in enumerate(zip(("out", "grad query", "grad key", "grad value"), expected)):
            got = layout.unshard([results[rank][name][index] for rank in ranks], dim=2)
            error = (got - want).abs().max().item()
            assert error <= TOLERANCE, f"{name} on ranks {ranks}: {label} differs by {error:.2e}"
