"""Context parallelism's pure core: load-balanced sharding, blockwise attention with log-sum-exp, the merge of
partials, and the ring schedule simulated in one process (no process group)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from lightning_merak.parallel.context import (
    AttentionKernel,
    BlockVisibility,
    LoadBalancedLayout,
    attend_block,
    attend_block_backward,
    blockwise,
    check_heads_divisible,
    check_sequence_divisible,
    document_ids_from_position_ids,
    merge_attention,
    plan_blocks,
    select_kernel,
)

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
TOLERANCE = 1e-5


def _qkv(seq: int, kv_heads: int = KV_HEADS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, HEADS, seq, HEAD_DIM, generator=generator)
    key = torch.randn(BATCH, kv_heads, seq, HEAD_DIM, generator=generator)
    value = torch.randn(BATCH, kv_heads, seq, HEAD_DIM, generator=generator)
    return query, key, value


def _visible(query_positions, key_positions, causal=True, window=None, query_documents=None, key_documents=None):
    """The reference mask, written from the definitions: (batch or 1, 1, queries, keys)."""
    queries, keys = query_positions[:, None], key_positions[None, :]
    visible = torch.ones(len(query_positions), len(key_positions), dtype=torch.bool)
    if causal:
        visible &= keys <= queries
    if window is not None:
        visible &= queries - keys < window
    visible = visible[None, None]
    if query_documents is not None:
        visible = visible & (query_documents[:, None, :, None] == key_documents[:, None, None, :])
    return visible


def _reference(query, key, value, visible):
    """float64 softmax attention ``(out, lse)``; a row that sees no key gives out 0 and lse -inf."""
    query, key, value = (each.double() for each in (query, key, value))
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (query @ key.transpose(-1, -2) * query.shape[-1] ** -0.5).masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.where(visible, torch.exp(scores - lse[..., None]), torch.zeros_like(scores))
    return probabilities @ value, lse


def _assert_close(actual, expected, tolerance=TOLERANCE):
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), "-inf rows differ"
    assert torch.where(finite, actual.double() - expected.double(), 0).abs().max().item() <= tolerance


# Sharding ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_and_unshard_are_inverse_along_any_dim(cp):
    layout = LoadBalancedLayout(32, cp)
    hidden = torch.randn(2, 32, 3)
    heads = torch.randn(2, 4, 32, 5)
    assert torch.equal(layout.unshard([layout.shard(hidden, rank) for rank in range(cp)]), hidden)
    assert torch.equal(layout.unshard([layout.shard(heads, rank, dim=2) for rank in range(cp)], dim=2), heads)
    for rank in range(cp):
        assert torch.equal(layout.positions(rank), layout.shard(torch.arange(32), rank, dim=0))
    assert torch.equal(layout.rank_positions().flatten().sort().values, torch.arange(32))


def test_rank_holds_chunks_r_and_mirror():
    layout = LoadBalancedLayout(16, 4)
    assert [layout.chunks(rank) for rank in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert layout.positions(1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_does_the_same_causal_work(cp):
    layout = LoadBalancedLayout(64, cp)
    # query at position p attends to p + 1 keys under a causal mask
    work = [int((layout.positions(rank) + 1).sum()) for rank in range(cp)]
    assert len(set(work)) == 1
    contiguous = [int((torch.arange(64).chunk(cp)[rank] + 1).sum()) for rank in range(cp)]
    assert len(set(contiguous)) == cp  # what the balance fixes


def test_indivisible_sequence_is_refused_with_the_fix():
    message = "sequence length 1002 is not divisible by 2 x context_parallel=4; pad to a multiple of 8"
    with pytest.raises(ValueError, match=message):
        LoadBalancedLayout(1002, 4)
    LoadBalancedLayout(1000, 4)  # 8 x 125: fine
    with pytest.raises(ValueError, match="pad to a multiple of 4"):
        check_sequence_divisible(6, 2)
    layout = LoadBalancedLayout(16, 2)
    with pytest.raises(ValueError, match="sequence length 16"):
        layout.shard(torch.zeros(1, 12), 0)
    with pytest.raises(ValueError, match="expected 2 shards"):
        layout.unshard([torch.zeros(1, 8)])
    with pytest.raises(ValueError, match="outside context_parallel=2"):
        layout.positions(2)


def test_document_ids_come_from_restarting_positions_before_sharding():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [3, 4, 0, 1, 2, 3, 0, 1]])
    document_ids = document_ids_from_position_ids(position_ids)
    assert document_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 2, 2]]
    layout = LoadBalancedLayout(8, 2)  # rank 1 holds tokens 2, 3, 4, 5
    shard = layout.shard_document_ids(1, position_ids=position_ids)
    assert torch.equal(shard, layout.shard(document_ids, 1))
    assert shard.tolist()[0] == [0, 1, 1, 2]  # token 4 keeps its document although it opens the shard's chunk
    assert torch.equal(layout.shard_document_ids(1, document_ids=document_ids), shard)
    with pytest.raises(ValueError, match="exactly one"):
        layout.shard_document_ids(1)


# Blockwise attention ------------------------------------------------------------------------------------------

_BLOCKS = {
    # name: (query positions, key positions, causal, sliding window)
    "diagonal": (torch.arange(32, 64), torch.arange(32, 64), True, None),
    "past": (torch.arange(32, 64), torch.arange(0, 32), True, None),
    "future": (torch.arange(0, 32), torch.arange(32, 64), True, None),
    "overlapping": (torch.arange(16, 48), torch.arange(0, 32), True, None),
    "load_balanced": (torch.cat([torch.arange(8), torch.arange(56, 64)]), torch.arange(16, 32), True, None),
    "window_cuts_block": (torch.arange(32, 64), torch.arange(0, 32), True, 20),
    "window_diagonal": (torch.arange(0, 32), torch.arange(0, 32), True, 8),
    "non_causal": (torch.arange(0, 32), torch.arange(32, 64), False, None),
}


@pytest.mark.parametrize("name", sorted(_BLOCKS))
@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS])
def test_block_matches_float64_reference(name, kv_heads):
    query_positions, key_positions, causal, window = _BLOCKS[name]
    query, key, value = _qkv(len(query_positions), kv_heads)
    key, value = key[:, :, : len(key_positions)], value[:, :, : len(key_positions)]
    out, lse = attend_block(
        query, key, value, query_positions=query_positions, key_positions=key_positions, causal=causal,
        sliding_window=window,
    )
    expected_out, expected_lse = _reference(query, key, value, _visible(query_positions, key_positions, causal, window))
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    _assert_close(lse, expected_lse)
    _assert_close(out, expected_out)


def test_document_mask_matches_reference_and_leaves_no_nan():
    positions = torch.arange(24)
    documents = torch.tensor([[0] * 10 + [1] * 14, [0] * 6 + [1] * 6 + [2] * 12])
    query, key, value = _qkv(24)
    # queries 12..23 against keys 0..11: row 1's queries of document 2 see no key of this block
    out, lse = attend_block(
        query[:, :, 12:], key[:, :, :12], value[:, :, :12], query_positions=positions[12:],
        key_positions=positions[:12], query_document_ids=documents[:, 12:], key_document_ids=documents[:, :12],
    )
    visible = _visible(positions[12:], positions[:12], query_documents=documents[:, 12:],
                       key_documents=documents[:, :12])
    expected_out, expected_lse = _reference(query[:, :, 12:], key[:, :, :12], value[:, :, :12], visible)
    assert torch.isinf(lse[1]).all() and not torch.isnan(out).any() and (out[1] == 0).all()
    _assert_close(lse, expected_lse)
    _assert_close(out, expected_out)


def test_aligned_blocks_run_on_the_cpu_flash_kernel_and_masks_on_the_explicit_path():
    query, key, value = _qkv(16)
    key, value = key.repeat_interleave(2, 1), value.repeat_interleave(2, 1)
    assert select_kernel(query, key, value, causal=True) is AttentionKernel.CPU_FLASH
    assert select_kernel(query.bfloat16(), key.bfloat16(), value.bfloat16(), causal=False) is AttentionKernel.CPU_FLASH
    plan = {name: [piece.visibility for piece in plan_blocks(queries, keys, causal=causal, sliding_window=window)]
            for name, (queries, keys, causal, window) in _BLOCKS.items()}
    assert plan["diagonal"] == [BlockVisibility.CAUSAL] and plan["past"] == [BlockVisibility.FULL]
    assert plan["future"] == [] and plan["non_causal"] == [BlockVisibility.FULL]
    assert plan["load_balanced"] == [BlockVisibility.FULL]  # the early chunk sees none of the keys: cut away
    assert plan["window_cuts_block"] == [BlockVisibility.MASKED]
    assert plan_blocks(torch.arange(8), torch.arange(8), causal=True, has_documents=True)[0].visibility is (
        BlockVisibility.MASKED
    )


@pytest.mark.parametrize("cp", [2, 4])
def test_load_balanced_causal_steps_each_take_one_kernel_call(cp):
    positions = LoadBalancedLayout(64, cp).rank_positions()
    for rank, source in itertools.product(range(cp), repeat=2):
        pieces = plan_blocks(positions[rank], positions[source], causal=True)
        assert len(pieces) == 1 and pieces[0].visibility is not BlockVisibility.MASKED


@pytest.mark.parametrize("name", ["diagonal", "past", "load_balanced", "window_cuts_block"])
def test_block_gradients_through_out_and_lse_match_reference(name):
    """``lse`` takes gradients too (the kernels' backward does not give them): merging partials needs both."""
    query_positions, key_positions, causal, window = _BLOCKS[name]
    query, key, value = _qkv(len(query_positions))
    key, value = key[:, :, : len(key_positions)], value[:, :, : len(key_positions)]
    generator = torch.Generator().manual_seed(3)
    grad_out = torch.randn(query.shape, generator=generator)
    grad_lse = torch.randn(query.shape[:3], generator=generator)

    def gradients(attention, inputs):
        inputs = [each.clone().requires_grad_() for each in inputs]
        out, lse = attention(*inputs)
        seen = torch.isfinite(lse)
        loss = (out * grad_out.to(out.dtype)).sum() + torch.where(seen, lse * grad_lse.to(lse.dtype), 0).sum()
        return torch.autograd.grad(loss, inputs)

    actual = gradients(lambda q, k, v: attend_block(
        q, k, v, query_positions=query_positions, key_positions=key_positions, causal=causal, sliding_window=window,
    ), (query, key, value))
    visible = _visible(query_positions, key_positions, causal, window)
    expected = gradients(lambda q, k, v: _reference(q, k, v, visible), (query.double(), key.double(), value.double()))
    for got, want in zip(actual, expected):
        _assert_close(got, want)


def test_cuda_kernel_calls_match_the_op_schemas_on_meta_tensors():
    """No GPU here: meta tensors check the CUDA ops' argument lists and the lse layout the code relies on."""
    query = torch.empty(2, 4, 40, 64, device="meta", dtype=torch.bfloat16)
    for kernel in (AttentionKernel.CUDA_FLASH, AttentionKernel.CUDA_EFFICIENT):
        out, lse = blockwise._kernel_forward(kernel, query, query, query, True, 0.125)
        assert out.shape == query.shape and lse.shape == (2, 4, 40) and lse.dtype == torch.float32
        grads = blockwise._kernel_backward(kernel, out, query, query, query, out, lse.contiguous(), True, 0.125)
        assert [grad.shape for grad in grads] == [query.shape] * 3


# Merging ------------------------------------------------------------------------------------------------------


def test_merging_blocks_in_any_order_gives_full_attention():
    seq = 48
    query, key, value = _qkv(seq, HEADS)
    positions = torch.arange(seq)
    expected_out, expected_lse = _reference(query, key, value, _visible(positions, positions))
    blocks = [slice(start, start + 12) for start in range(0, seq, 12)]
    partials = [
        attend_block(query, key[:, :, block], value[:, :, block], query_positions=positions,
                     key_positions=positions[block])
        for block in blocks
    ]
    assert torch.isinf(partials[-1][1][..., :36]).all()  # rows that see none of the last block
    for order in itertools.permutations(range(len(blocks))):
        out, lse = partials[order[0]]
        for index in order[1:]:
            out, lse = merge_attention(out, lse, *partials[index])
        _assert_close(lse, expected_lse)
        _assert_close(out, expected_out)


def test_merging_rows_nobody_sees_stays_finite_with_zero_gradients():
    out_a = torch.randn(1, 1, 3, 4, requires_grad=True)
    out_b = torch.randn(1, 1, 3, 4, requires_grad=True)
    lse_a = torch.tensor([[[-math.inf, 1e4, -math.inf]]], requires_grad=True)
    lse_b = torch.tensor([[[-math.inf, 1e4 - 1.0, 2.0]]], requires_grad=True)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    assert lse[0, 0, 0] == -math.inf and (out[0, 0, 0] == 0).all()
    assert torch.isfinite(out).all()
    assert math.isclose(lse[0, 0, 1].item(), 1e4 + math.log1p(math.exp(-1.0)), abs_tol=1e-3)  # float32 at 1e4
    assert torch.equal(out[0, 0, 2], out_b[0, 0, 2].detach())
    loss = out.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()
    grads = torch.autograd.grad(loss, (out_a, lse_a, out_b, lse_b))
    assert all(torch.isfinite(grad).all() for grad in grads)
    assert (grads[0][0, 0, 0] == 0).all() and grads[1][0, 0, 0] == 0


# The ring schedule, simulated ---------------------------------------------------------------------------------


def _simulate_ring(layout, query, key, value, document_ids=None, sliding_window=None):
    """Each simulated rank attends its query shard to every rank's key/value shard in ring order and merges."""
    cp = layout.context_parallel
    positions = layout.rank_positions()
    shard = lambda tensor, rank: layout.shard(tensor, rank, dim=2)
    documents = None if document_ids is None else [layout.shard(document_ids, rank) for rank in range(cp)]
    outs = []
    for rank in range(cp):
        merged = None
        for step in range(cp):
            source = (rank - step) % cp
            partial = attend_block(
                shard(query, rank), shard(key, source), shard(value, source), query_positions=positions[rank],
                key_positions=positions[source], sliding_window=sliding_window,
                query_document_ids=None if documents is None else documents[rank],
                key_document_ids=None if documents is None else documents[source],
            )
            merged = partial if merged is None else merge_attention(*merged, *partial)
        outs.append(merged[0])
    return layout.unshard(outs, dim=2)


def _leaves(*tensors):
    return [tensor.clone().requires_grad_() for tensor in tensors]


@pytest.mark.parametrize("cp", [2, 4])
def test_simulated_ring_equals_sdpa_forward_and_gradients(cp):
    seq = 64
    layout = LoadBalancedLayout(seq, cp)
    query, key, value = _leaves(*_qkv(seq))
    grad_out = torch.randn(query.shape, generator=torch.Generator().manual_seed(5))
    out = _simulate_ring(layout, query, key, value)
    grads = torch.autograd.grad(out, (query, key, value), grad_out)
    expected = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (query, key, value), grad_out)
    _assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        _assert_close(got, want)


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mask", ["documents", "sliding_window"])
def test_simulated_ring_with_documents_or_window_equals_masked_sdpa(cp, mask):
    seq = 64
    layout = LoadBalancedLayout(seq, cp)
    query, key, value = _leaves(*_qkv(seq))
    position_ids = torch.cat([torch.arange(20), torch.arange(30), torch.arange(14)]).expand(BATCH, seq)
    documents = document_ids_from_position_ids(position_ids) if mask == "documents" else None
    window = 12 if mask == "sliding_window" else None
    out = _simulate_ring(layout, query, key, value, documents, window)
    positions = torch.arange(seq)
    visible = _visible(positions, positions, window=window, query_documents=documents, key_documents=documents)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=visible, enable_gqa=True)
    grads = torch.autograd.grad(out.sum(), (query, key, value))
    expected_grads = torch.autograd.grad(expected.sum(), (query, key, value))
    _assert_close(out, expected)
    for got, want in zip(grads, expected_grads):
        _assert_close(got, want)


@pytest.mark.parametrize("cp, mask", [(2, None), (4, None), (4, "documents")])
def test_block_backward_shares_from_the_merged_output_sum_to_sdpa_gradients(cp, mask):
    """The ring's backward: every (rank, source) block's share, taken with the merged (out, lse), summed."""
    seq = 64
    layout = LoadBalancedLayout(seq, cp)
    positions = layout.rank_positions()
    query, key, value = _qkv(seq)
    position_ids = torch.cat([torch.arange(40), torch.arange(24)]).expand(BATCH, seq)
    documents = document_ids_from_position_ids(position_ids) if mask else None
    grad_out = torch.randn(query.shape, generator=torch.Generator().manual_seed(7))
    shard = lambda tensor, rank: layout.shard(tensor, rank, dim=2)
    shard_documents = lambda rank: None if documents is None else layout.shard(documents, rank)
    grad_query = [torch.zeros_like(shard(query, rank)) for rank in range(cp)]
    grad_key = [torch.zeros_like(shard(key, rank)) for rank in range(cp)]
    grad_value = [torch.zeros_like(shard(value, rank)) for rank in range(cp)]
    for rank in range(cp):
        coordinates = lambda source: {
            "query_positions": positions[rank], "key_positions": positions[source],
            "query_document_ids": shard_documents(rank), "key_document_ids": shard_documents(source),
        }
        merged = None
        for source in range(cp):
            partial = attend_block(shard(query, rank), shard(key, source), shard(value, source), **coordinates(source))
            merged = partial if merged is None else merge_attention(*merged, *partial)
        for source in range(cp):
            shares = attend_block_backward(
                shard(grad_out, rank), shard(query, rank), shard(key, source), shard(value, source), *merged,
                **coordinates(source),
            )
            grad_query[rank] += shares[0]
            grad_key[source] += shares[1]
            grad_value[source] += shares[2]
    leaves = _leaves(query, key, value)
    full = torch.arange(seq)
    visible = _visible(full, full, query_documents=documents, key_documents=documents)
    expected = F.scaled_dot_product_attention(*leaves, attn_mask=visible, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    for got, want in zip((grad_query, grad_key, grad_value), expected_grads):
        _assert_close(layout.unshard(got, dim=2), want)


def test_ulysses_refuses_heads_it_cannot_scatter():
    check_heads_divisible(8, 4)
    with pytest.raises(ValueError, match=r"context_parallel=4 ranks, but the model has 6 key/value heads.*"
                                         r"use ring attention, or a context_parallel that divides 6"):
        check_heads_divisible(6, 4)


def test_an_attention_call_reads_its_sub_batch_rows_of_the_document_ids() -> None:
    from lightning_merak.distributed.turns import caller_state, run_in_turns
    from lightning_merak.parallel.context.model import ContextShard

    documents = torch.arange(8).reshape(4, 2)
    shard = ContextShard(torch.arange(4).reshape(2, 2), documents)
    assert shard.documents_of(4) is documents
    rows = run_in_turns([lambda: shard.documents_of(2)] * 2, caller_state(grad=False))
    assert torch.equal(rows[0], documents[:2]) and torch.equal(rows[1], documents[2:])
    with pytest.raises(ValueError, match="not as one of its tp_overlap sub-batches"):
        shard.documents_of(2)  # outside a region a batch of other rows is a mistake


def test_calibration_lengths_spread_under_the_cap_in_whole_chunks() -> None:
    from lightning_merak.parallel.context.rounds import calibration_lengths

    assert calibration_lengths(4096, 4) == [512, 1024, 2048]
    assert calibration_lengths(100, 2) == [12, 24, 48]  # multiples of 2 x cp
    assert calibration_lengths(8, 4) == [8, 16, 24]  # a cap too small to spread them
