"""The layout planner prices context parallelism: 1/cp of each sequence's work and activations per rank, the
ring's or the all-to-all's attention exchange, gradients over dp x cp, and a search that splits sequences only
where memory or speed asks for it."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_merak.planning.planner import (
    BlockTimes,
    CollectiveCost,
    ContextAttention,
    Layout,
    ModelProfile,
    NetworkProfile,
    SearchSpace,
    candidate_layouts,
    plan,
    predict,
    required_profile_keys,
)

_LINK = CollectiveCost(latency_s=0.1, bandwidth_bytes_per_s=100.0)
_NETWORK = NetworkProfile(all_reduce={2: _LINK, 4: _LINK}, p2p=_LINK)
# sequence 8, hidden 4, 2 query heads of width 2 sharing one key/value head: per sample 128 bytes of queries
# and 128 of keys and values together (fp32); the kernel is 64 / (64 + 96) = 0.4 of the attention part's FLOPs
_GQA = ContextAttention(sequence_length=8, hidden_size=4, heads=2, key_value_heads=1, head_dim=2, element_bytes=4)


def _profile(context: ContextAttention | None = _GQA, samples: tuple[int, ...] = (2,)) -> ModelProfile:
    return ModelProfile(
        num_blocks=1,
        hidden_bytes_per_sample=100,
        block_times={(1, n): BlockTimes((2.0 * n, 4.0 * n), (8.0 * n, 4.0 * n)) for n in samples},
        prefix_times={n: (0.5 * n, 1.0 * n) for n in samples},
        suffix_times={n: (1.0 * n, 2.0 * n) for n in samples},
        block_parameter_bytes={1: 100},
        prefix_parameter_bytes=50,
        suffix_parameter_bytes=50,
        block_activation_bytes_per_sample={1: 500},
        optimizer_s_per_parameter_byte=0.001,
        context=context,
    )


def test_attention_shape_gives_bytes_kernel_share_and_methods():
    assert _GQA.query_bytes_per_sample == 128 and _GQA.key_value_bytes_per_sample == 128
    assert _GQA.kernel_fraction == pytest.approx(0.4)
    assert _GQA.methods(2, 1) == ("ring",)  # one key/value head cannot be scattered over two ranks
    assert dataclasses.replace(_GQA, key_value_heads=2).methods(2, 1) == ("ring", "all_to_all")
    assert _GQA.methods(8, 1) == ()  # 8 tokens do not split into 16 balanced chunks
    with pytest.raises(ValueError, match="key_value_heads=3 must divide heads=2"):
        dataclasses.replace(_GQA, key_value_heads=3)


def test_ring_prediction_matches_hand_computation():
    space = SearchSpace(world_size=2, global_batch_size=2, tp_degrees_allowed=(1,), max_pipeline_stages=1,
                        context_parallel_degrees=(2,))
    ring = predict(Layout(1, 1, 1, 1, 1, 0.0, cp=2), _profile(), _NETWORK, space)
    # Each rank does half of every part: forward 0.5 + 2 + 4 + 1 = 7.5 s, backward 2 + 8 + 4 + 1 = 15 s.
    # Ring, one step to hide: the 128-byte key/value shard takes 0.1 + 1.28 s, the step's kernel 0.4 x 2 / 2 s
    # forward; backward the shard and its gradient (256 bytes, 2.66 s) behind 0.4 x 4 / 2 s, then the last hop.
    forward_exchange = 1.38 - 0.4
    backward_exchange = (2.66 - 0.8) + 1.38
    assert ring.components["context_exchange"] == pytest.approx(forward_exchange + backward_exchange)
    assert ring.components["compute"] == pytest.approx(22.5)
    # the 200 parameter bytes are averaged over dp x cp = 2 ranks (0.1 + 200 / 100 s); the optimizer 0.2 s
    assert ring.components["dp_allreduce"] == pytest.approx(2.1)
    assert ring.step_time_s == pytest.approx(22.5 + forward_exchange + backward_exchange + 2.1 + 0.2)
    assert ring.samples_per_step == 2
    # half of each sample's 500 saved bytes, for 2 samples; parameters, gradients and Adam state whole
    assert ring.memory_components["activations"] == pytest.approx(500)
    assert ring.memory_bytes == pytest.approx(500 + 200 + 200 + 400)


def test_all_to_all_prediction_matches_hand_computation():
    heads = dataclasses.replace(_GQA, key_value_heads=2)  # 256 bytes of keys and values per sample
    space = SearchSpace(world_size=2, global_batch_size=2, tp_degrees_allowed=(1,), max_pipeline_stages=1,
                        context_parallel_degrees=(2,))
    ulysses = predict(Layout(1, 1, 1, 1, 1, 0.0, cp=2, context_attention="all_to_all"), _profile(heads), _NETWORK,
                      space)
    # per direction: queries and output (half of 128 bytes leave: 0.1 + 0.64 s each), keys and values (half of
    # 128 bytes each: 0.74 s each), never hidden
    assert ulysses.components["context_exchange"] == pytest.approx(2 * 4 * 0.74)


def test_each_sub_batch_exchanges_its_own_rows_in_its_turn():
    space = SearchSpace(world_size=4, global_batch_size=2, tp_degrees_allowed=(2,), max_pipeline_stages=1,
                        context_parallel_degrees=(2,), overlap_choices=(1, 2))
    heads = dataclasses.replace(_GQA, key_value_heads=2)  # one key/value head per tensor-parallel rank
    profile = dataclasses.replace(
        _profile(heads, samples=(1, 2)), block_parameter_bytes={2: 50}, block_activation_bytes_per_sample={2: 250},
        block_times={(2, n): BlockTimes((2.0 * n, 4.0 * n), (8.0 * n, 4.0 * n)) for n in (1, 2)})
    split = predict(Layout(1, 1, 2, 1, 2, 0.0, cp=2), profile, _NETWORK, space)
    # each sub-batch (1 sample; a quarter of it per rank, 64 bytes of keys and values) rings on its own: forward
    # 0.74 s behind the kernel's share of 2 / 2 s split over 2 steps, backward 1.38 s behind its share of 4 / 2 s,
    # then the last hop; twice
    kernel = heads.kernel_fraction
    assert split.components["context_exchange"] == pytest.approx(2 * ((0.74 - kernel / 2) + (1.38 - kernel) + 0.74))
    whole = predict(Layout(1, 1, 2, 1, 1, 0.0, cp=2), profile, _NETWORK, space)
    assert whole.components["context_exchange"] < split.components["context_exchange"]  # one latency per message


def test_recompute_runs_the_forward_exchange_again():
    space = SearchSpace(world_size=2, global_batch_size=2, tp_degrees_allowed=(1,), max_pipeline_stages=1,
                        context_parallel_degrees=(2,), recompute_ratios=(0.0, 1.0))
    plain = predict(Layout(1, 1, 1, 1, 1, 0.0, cp=2), _profile(), _NETWORK, space)
    recomputed = predict(Layout(1, 1, 1, 1, 1, 1.0, cp=2), _profile(), _NETWORK, space)
    assert recomputed.components["context_exchange"] == pytest.approx(plain.components["context_exchange"] + 0.98)


def test_a_context_rank_is_a_data_parallel_rank_for_sharding():
    space = SearchSpace(world_size=4, global_batch_size=2, tp_degrees_allowed=(1,), max_pipeline_stages=1,
                        context_parallel_degrees=(2,), sharding_modes=("optimizer",))
    sharded = predict(Layout(2, 1, 1, 1, 1, 0.0, sharding="optimizer", cp=2), _profile(samples=(1,)), _NETWORK,
                      space)
    assert sharded.memory_components["optimizer_state"] == pytest.approx(400 / 4)  # over dp x cp = 4 ranks


def test_candidates_split_sequences_with_sub_batches_and_in_stages_where_the_module_allows():
    space = SearchSpace(world_size=4, replica_batch_size=4, global_batch_size=None, tp_degrees_allowed=(1, 2),
                        max_pipeline_stages=4, context_parallel_degrees=(1, 2, 4), context_with_stages=False)
    layouts = candidate_layouts(space)
    split = [layout for layout in layouts if layout.cp > 1]
    assert {(layout.cp, layout.tp, layout.dp) for layout in split} == {(2, 1, 2), (2, 2, 1), (4, 1, 1)}
    assert all(layout.pp == 1 for layout in split)
    assert {layout.overlap for layout in split if layout.tp == 2} == {1, 2, 4}  # sub-batches take turns at both
    assert {layout.overlap for layout in split if layout.tp == 1} == {1}
    assert {layout.context_attention for layout in split} == {"ring", "all_to_all"}
    assert layouts[:len(candidate_layouts(dataclasses.replace(space, context_parallel_degrees=(1,))))] == [
        layout for layout in layouts if layout.cp == 1]  # without context parallelism the search is unchanged
    assert [layout for layout in candidate_layouts(dataclasses.replace(space, sequence_parallel=True))
            if layout.cp > 1] == split  # a context rank's tokens split over tp as well
    staged = [layout for layout in candidate_layouts(dataclasses.replace(space, context_with_stages=True))
              if layout.cp > 1]
    assert {(layout.cp, layout.pp, layout.tp, layout.dp) for layout in staged} == {
        (2, 1, 1, 2), (2, 1, 2, 1), (4, 1, 1, 1), (2, 2, 1, 1)}  # cp2 x pp2 joins them
    with pytest.raises(ValueError, match="cp=2 runs with ep=1"):
        Layout(2, 1, 1, 1, 1, 0.0, ep=2, cp=2)


def test_profile_keys_name_the_context_groups_and_the_attention_shape():
    space = SearchSpace(world_size=4, global_batch_size=4, tp_degrees_allowed=(1,), max_pipeline_stages=1,
                        context_parallel_degrees=(1, 2))
    keys = required_profile_keys(space)
    assert keys.context_parallel
    assert {2, 4} <= keys.all_reduce_group_sizes  # dp x cp = 4 in every layout; the all-to-all's 2
    assert keys.all_to_all_group_sizes == {2}
    assert not required_profile_keys(dataclasses.replace(space, context_parallel_degrees=(1,))).context_parallel
    with pytest.raises(ValueError, match="context .the attention shape"):
        plan(space, _profile(None, samples=(1, 2, 4)), _NETWORK)


def test_search_splits_sequences_only_when_memory_asks():
    """Splitting a sequence costs an exchange and, at a fixed batch per replica, throughput: data parallelism
    wins when it fits; under a cap that one whole sample's activations exceed (recompute left out of this search),
    a context degree that fits wins, and the least one that does."""
    heads = dataclasses.replace(_GQA, sequence_length=16)
    profile = dataclasses.replace(_profile(heads, samples=(1,)), block_activation_bytes_per_sample={1: 4000})
    space = SearchSpace(world_size=4, replica_batch_size=1, global_batch_size=None, tp_degrees_allowed=(1,),
                        max_pipeline_stages=1, context_parallel_degrees=(1, 2, 4), recompute_ratios=(0.0,))
    assert plan(space, profile, _NETWORK).best.layout.cp == 1
    # parameters, gradients and Adam state: 800 bytes; activations 4000 / cp
    capped = plan(dataclasses.replace(space, memory_limit_bytes=800 + 2500), profile, _NETWORK)
    assert (capped.best.layout.cp, capped.best.layout.dp) == (2, 2)
    assert all(prediction.layout.cp > 1 for prediction in capped.ranked)
    tighter = plan(dataclasses.replace(space, memory_limit_bytes=800 + 1500), profile, _NETWORK)
    assert tighter.best.layout.cp == 4 and "cp=4" in tighter.describe()


def test_context_parallelism_leaves_unsplit_layouts_priced_as_before():
    space = SearchSpace(world_size=2, global_batch_size=2, tp_degrees_allowed=(1,), max_pipeline_stages=2,
                        context_parallel_degrees=(1, 2))
    for layout in candidate_layouts(space):
        if layout.cp == 1:
            assert predict(layout, _profile(samples=(1, 2)), _NETWORK, space) == predict(
                layout, _profile(None, samples=(1, 2)), _NETWORK, space)


def test_a_measured_context_rank_kernel_replaces_its_share_of_the_block():
    """Where the profile timed one context rank's attention compute, it replaces 1/cp of the model's kernel in the
    attention part, and its 1/cp per ring step is the window the transfer hides in."""
    measured = dataclasses.replace(_profile(), attention_kernel_times={(1, 2): (4.0, 6.0)},
                                   context_kernel_times={(2, "ring", 1, 2): (3.0, 5.0)})
    space = SearchSpace(world_size=2, global_batch_size=2, tp_degrees_allowed=(1,), max_pipeline_stages=1,
                        context_parallel_degrees=(2,))
    ring = predict(Layout(1, 1, 1, 1, 1, 0.0, cp=2), measured, _NETWORK, space)
    # attention parts per rank 2 s forward, 4 s backward; the kernel's half share 2 and 3 s becomes 3 and 5 s
    assert ring.components["compute"] == pytest.approx(22.5 + 1.0 + 2.0)
    # steps hide behind 1.5 s forward (the 1.38 s transfer fully) and 2.5 s backward (of 2.66 s), then the last hop
    assert ring.components["context_exchange"] == pytest.approx((2.66 - 2.5) + 1.38)


def test_context_rank_kernels_are_timed_for_the_methods_the_heads_allow():
    import torch

    from lightning_merak.planning.measure.context import time_attention_kernels

    shape = ContextAttention(sequence_length=32, hidden_size=16, heads=4, key_value_heads=2, head_dim=4,
                             element_bytes=4)
    keys = {(2, "ring", 1, 2), (2, "all_to_all", 1, 2), (4, "all_to_all", 1, 2), (2, "ring", 2, 1)}
    whole, split = time_attention_kernels(shape, keys, torch.device("cpu"), repeats=2)
    assert set(whole) == {(1, 2), (2, 1)}
    assert set(split) == {(2, "ring", 1, 2), (2, "all_to_all", 1, 2), (2, "ring", 2, 1)}  # 2 kv heads: no cp=4
    assert all(forward > 0 and backward > 0 for forward, backward in [*whole.values(), *split.values()])
