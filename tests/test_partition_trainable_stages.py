"""The partitioners give every pipeline stage a node whose parameters take gradients where the model has enough of
them (a stage without one leaves its rank's optimizer an empty parameter list), fall back to the unconstrained split
where it has not, and the traced costs say which nodes (and vocabulary tables) train."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.pipeline import (
    BlockCost,
    partition_autopipe,
    partition_by_parameters,
    partition_min_max,
    partition_uniform,
    split_vocabulary_head,
)
from lightning_merak.parallel.pipeline.costs import with_trainable_nodes
from lightning_merak.parallel.pipeline.trace import trace_model


def _frozen_ends(prefix_forward_s: float = 30.0, prefix_bytes: int = 40, tables_train: bool = False,
                 trainable_layers: tuple[int, ...] = (0, 1, 2, 3)) -> list[BlockCost]:
    """A frozen embedding whose (noisy) time outweighs the four blocks, the blocks, and a head whose table is frozen
    (its final norm trains unless no layer does)."""
    layers = [BlockCost(f"model.layers.{index}", 1.0, 2.0, 10, 8, 20, trainable=index in trainable_layers)
              for index in range(4)]
    return [BlockCost("prefix", prefix_forward_s, 0.0, prefix_bytes, 8, 4, is_embedding=True, trainable=tables_train),
            *layers,
            BlockCost("suffix", 0.5, 1.0, 400, 8, 80, trainable=bool(trainable_layers), table_trainable=tables_train)]


def _all_trainable(blocks: list[BlockCost]) -> list[BlockCost]:
    return [BlockCost(b.name, b.forward_s, b.backward_s, b.param_bytes, b.output_bytes, b.saved_bytes,
                      b.is_embedding) for b in blocks]


def _stages_train(blocks: list[BlockCost], boundaries: tuple[int, ...]) -> list[bool]:
    ends = [*boundaries[1:], len(blocks)]
    return [any(block.trainable for block in blocks[start:end]) for start, end in zip(boundaries, ends)]


@pytest.mark.parametrize("partitioner, prefix_bytes", [
    (lambda blocks: partition_autopipe(blocks, 2, 4), 40),
    (lambda blocks: partition_autopipe(blocks, 2, 4, vocab_stages=True), 40),
    (lambda blocks: partition_min_max(blocks, 2), 40),
    (lambda blocks: partition_min_max(blocks, 2, vocab_stages=True), 40),
    (lambda blocks: partition_by_parameters(blocks, 2), 10_000),
], ids=["autopipe", "autopipe-vocab", "min_max", "min_max-vocab", "parameters"])
def test_a_heavy_frozen_embedding_is_not_left_alone_on_a_stage(partitioner, prefix_bytes: int) -> None:
    blocks = _frozen_ends(prefix_bytes=prefix_bytes)
    assert partitioner(_all_trainable(blocks)).boundaries == (0, 1)  # the embedding alone, were it trainable
    partition = partitioner(blocks)
    assert partition.boundaries == (0, 2)  # the first block joins it: the first stage has something to train
    assert all(_stages_train(blocks, partition.boundaries))


def test_a_slow_frozen_head_is_not_left_alone_on_the_last_stage() -> None:
    # adapters on blocks 0 and 3 only, and a slow frozen suffix: alone on the last stage, it would train nothing
    blocks = _frozen_ends(prefix_forward_s=0.1, trainable_layers=(0, 3))
    blocks[-1] = BlockCost("suffix", 20.0, 40.0, 400, 8, 80, trainable=False)
    assert partition_autopipe(_all_trainable(blocks), 2, 8).boundaries == (0, 5)
    assert partition_autopipe(blocks, 2, 8).boundaries == (0, 4)


def test_trainable_vocabulary_rows_let_any_stage_be_cut() -> None:
    blocks = _frozen_ends(tables_train=False)
    _, frozen_rows = split_vocabulary_head(blocks, 2)
    _, trained_rows = split_vocabulary_head(_frozen_ends(tables_train=True), 2)
    assert not frozen_rows.trainable and trained_rows.trainable
    # the head's table trains though the embedding and the rest do not: every stage holds rows of it
    trained_head = [*blocks[:-1], BlockCost("suffix", 0.5, 1.0, 400, 8, 80, trainable=True, table_trainable=True)]
    assert partition_autopipe(trained_head, 2, 4, vocab_stages=True).boundaries == (0, 1)
    # an embedding whose table trains but stays whole (not split) gives no stage but the first anything
    assert split_vocabulary_head(_frozen_ends(tables_train=True)[:-1] + [blocks[-1]], 2,
                                 split_embedding=False)[1].trainable is False


def test_uniform_moves_a_cut_so_that_each_stage_trains() -> None:
    blocks = _frozen_ends(prefix_forward_s=0.1, trainable_layers=(2, 3))
    blocks[-1] = BlockCost("suffix", 0.5, 1.0, 400, 8, 80, trainable=False)
    assert partition_uniform(_all_trainable(blocks), 2).boundaries == (0, 3)
    partition = partition_uniform(blocks, 2)
    assert partition.boundaries == (0, 4)
    assert all(_stages_train(blocks, partition.boundaries))


def test_without_enough_trainable_nodes_the_split_is_the_unconstrained_one() -> None:
    blocks = _frozen_ends(trainable_layers=(3,))
    blocks[-1] = BlockCost("suffix", 0.5, 1.0, 400, 8, 80, trainable=False)
    everything = _all_trainable(blocks)
    for partitioner in (lambda costs: partition_autopipe(costs, 3, 4), lambda costs: partition_min_max(costs, 3),
                        lambda costs: partition_by_parameters(costs, 3), lambda costs: partition_uniform(costs, 3)):
        assert partitioner(blocks).boundaries == partitioner(everything).boundaries


def test_the_memory_limit_wins_over_a_trainable_stage_and_its_error_is_unchanged() -> None:
    # the first block saves much for backward: the first stage holds two micro-batches of it, the last one
    blocks = _frozen_ends(prefix_bytes=0)
    blocks[1] = BlockCost("model.layers.0", 1.0, 2.0, 10, 8, 3000)
    assert partition_autopipe(blocks, 2, 4).boundaries == (0, 2)
    assert partition_autopipe(blocks, 2, 4, memory_limit_bytes=5800).boundaries == (0, 1)  # only it fits
    with pytest.raises(ValueError, match="no split into 2 stages fits memory_limit_bytes=100"):
        partition_autopipe(blocks, 2, 4, memory_limit_bytes=100)


def test_nodes_are_marked_trainable_by_the_parameters_they_hold_first() -> None:
    tied, frozen, adapter = nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(2, 2)), nn.Parameter(
        torch.zeros(2))
    frozen.requires_grad_(False)
    costs = [BlockCost(name, 1.0, 2.0, 0, 0, 0) for name in ("prefix", "layer", "suffix")]
    marked = with_trainable_nodes(costs, [[tied], [frozen, tied], [frozen, adapter]], [tied], [frozen])
    assert [cost.trainable for cost in marked] == [True, False, True]  # the tied weight counts where first held
    assert (marked[0].table_trainable, marked[1].table_trainable, marked[2].table_trainable) == (True, None, False)
    assert with_trainable_nodes(costs, [[tied], [frozen], [adapter]])[-1].table_trainable is None
    with pytest.raises(ValueError, match="2 nodes' parameters for 3 nodes"):
        with_trainable_nodes(costs, [[tied], [frozen]])


def _tiny_lm() -> nn.Module:
    model = build_causal_lm(ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "tie_word_embeddings": False}), vocab_size=64)
    model.config.use_cache = False
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("on_meta", [False, True])
def test_traced_costs_say_which_nodes_and_tables_train(on_meta: bool) -> None:
    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            model = _tiny_lm()
    else:
        model = _tiny_lm()
    costs = trace_model(model, torch.randint(64, (2, 8)), profile_repeats=1).costs
    assert [cost.trainable for cost in costs] == [False, True, True, True]  # the final norm trains
    assert (costs[0].table_trainable, costs[-1].table_trainable) == (False, False)
    assert not split_vocabulary_head(costs, 2)[1].trainable
