"""The planner's memory model: the loss's saved logits on the stages holding the head, a recomputed block rebuilt
in the backward, frozen parameters without gradients or optimizer state, and saved bytes counted by storage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_merak.planning.measure.runs import SavedBytes
from lightning_merak.planning.planner import Layout, SearchSpace, plan, predict
from tests.test_planner_core import network
from tests.test_planner_sharding import toy_profile

LOSS_BYTES = 1000  # per sample: far more than the toy blocks' 10 (tp=1) and 5 (tp=2) bytes


def _activations(layout: Layout, space: SearchSpace, **fields: object) -> float:
    return predict(layout, toy_profile(**fields), network(2e9), space).memory_components["activations"]


def test_the_loss_keeps_its_logits_per_micro_batch_and_once_more_in_its_backward() -> None:
    """One stage, 4 samples a micro-batch: 16 blocks x 10 bytes x 4 samples, plus the loss's 1000 bytes x 4 samples
    saved and once more as the logits' gradient."""
    space = SearchSpace(world_size=2, global_batch_size=8, tp_degrees_allowed=(1,), max_pipeline_stages=1)
    layout = Layout(dp=2, pp=1, tp=1, micro_batches=1, overlap=1, recompute_ratio=0.0)
    assert _activations(layout, space) == pytest.approx(640)
    assert _activations(layout, space, loss_saved_bytes_per_sample=LOSS_BYTES) == pytest.approx(640 + 2 * 4000)


def test_a_vocabulary_parallel_head_splits_the_loss_memory_over_tensor_parallel_ranks() -> None:
    layout = Layout(dp=1, pp=1, tp=2, micro_batches=1, overlap=1, recompute_ratio=0.0)
    whole, split = (_activations(layout, SearchSpace(world_size=2, global_batch_size=8, tp_degrees_allowed=(2,),
                                                     max_pipeline_stages=1, vocab_parallel=vocab_parallel),
                                 loss_saved_bytes_per_sample=LOSS_BYTES) for vocab_parallel in (False, True))
    assert whole == pytest.approx(16 * 5 * 8 + 2 * LOSS_BYTES * 8)
    assert split == pytest.approx(16 * 5 * 8 + LOSS_BYTES * 8)


def test_only_the_stage_holding_the_head_keeps_the_logits() -> None:
    """Two stages: the last one holds the head and becomes the fullest; its in-flight count under 1F1B is one, so
    the loss adds two buffers of one micro-batch, whatever the micro-batch count."""
    space = SearchSpace(world_size=2, global_batch_size=8, tp_degrees_allowed=(1,), max_pipeline_stages=2)
    loss_bytes = 100 * LOSS_BYTES  # the last stage's loss outweighs the first stage's larger share of the blocks
    for micro_batches in (2, 4):
        layout = Layout(dp=1, pp=2, tp=1, micro_batches=micro_batches, overlap=1, recompute_ratio=0.0)
        samples = 8 // micro_batches
        with_loss = predict(layout, toy_profile(loss_saved_bytes_per_sample=loss_bytes), network(2e9), space)
        last_stage_blocks = (with_loss.memory_components["activations"] - 2 * loss_bytes * samples) / (10 * samples)
        assert last_stage_blocks == pytest.approx(round(last_stage_blocks)) and 1 <= last_stage_blocks < 16


def test_a_recomputed_block_is_rebuilt_whole_in_the_backward() -> None:
    """Full recompute keeps each block's 4-byte input; at the peak one block's 10 bytes are rebuilt, or the loss's
    gradient, whichever is larger (the logits are freed before the blocks' backward)."""
    space = SearchSpace(world_size=2, global_batch_size=8, tp_degrees_allowed=(1,), max_pipeline_stages=1)
    layout = Layout(dp=2, pp=1, tp=1, micro_batches=1, overlap=1, recompute_ratio=1.0)
    assert _activations(layout, space) == pytest.approx(16 * 4 * 4 + 10 * 4)
    assert _activations(layout, space, loss_saved_bytes_per_sample=LOSS_BYTES) == pytest.approx(
        16 * 4 * 4 + 2 * LOSS_BYTES * 4)


FROZEN = {"block_trainable_bytes": {1: 0, 2: 0}, "prefix_trainable_bytes": 0, "suffix_trainable_bytes": 100}
"""A frozen base: only 100 bytes of the head's 200 (its final norm, say) train."""


def test_frozen_parameters_take_no_gradient_optimizer_state_sync_or_update() -> None:
    space = SearchSpace(world_size=2, global_batch_size=8, tp_degrees_allowed=(1,), max_pipeline_stages=1)
    layout = Layout(dp=2, pp=1, tp=1, micro_batches=1, overlap=1, recompute_ratio=0.0)
    trained = predict(layout, toy_profile(), network(2e9), space)
    frozen = predict(layout, toy_profile(**FROZEN), network(2e9), space)
    assert trained.memory_components["gradients"] == pytest.approx(16 * 1000 + 400)
    # nothing before the frozen blocks needs a gradient: they save nothing (a trainable embedding makes them save)
    assert frozen.memory_components == pytest.approx({"parameters": 16 * 1000 + 400, "gradients": 100,
                                                      "optimizer_state": 200, "activations": 0})
    embedding_trains = predict(layout, toy_profile(**(FROZEN | {"prefix_trainable_bytes": 200})), network(2e9), space)
    assert embedding_trains.memory_components["activations"] == pytest.approx(640)
    assert frozen.components["optimizer"] == pytest.approx(100 * 1e-9)
    assert frozen.components["dp_allreduce"] < trained.components["dp_allreduce"]


def test_a_frozen_base_keeps_whole_replicas_where_its_state_would_not_fit() -> None:
    """Everything trained, two replicas need 4 x 16_400 bytes of state; frozen, 16_700: they fit the limit
    and win over splitting the blocks with tensor parallelism."""
    space = SearchSpace(world_size=2, global_batch_size=8, tp_degrees_allowed=(1, 2), max_pipeline_stages=1,
                        recompute_ratios=(0.0,), memory_limit_bytes=20_000)
    best = plan(space, toy_profile(**FROZEN), network(2e9)).best.layout
    assert (best.dp, best.tp) == (2, 1)
    with pytest.raises(ValueError, match="memory"):
        plan(space, toy_profile(), network(2e9))


def test_the_profile_refuses_more_trainable_bytes_than_parameter_bytes() -> None:
    with pytest.raises(ValueError, match=r"suffix_trainable_bytes=300 must be within \[0, 200\]"):
        toy_profile(suffix_trainable_bytes=300)
    with pytest.raises(ValueError, match=r"block_trainable_bytes\[2\]=600 must be within \[0, 500\]"):
        toy_profile(block_trainable_bytes={1: 1000, 2: 600})


def test_saved_bytes_count_each_storage_once_and_no_view_of_a_parameter() -> None:
    """Per-expert slices of a fused weight are views with their own data pointers: no activation. Two saved
    slices of one activation keep its whole storage, counted once."""
    experts = nn.Parameter(torch.randn(4, 8, 8))
    inputs = torch.randn(6, 8, requires_grad=True)
    with SavedBytes([experts]) as saved:
        hidden = inputs.exp()  # saves its output: 6 x 8 floats
        routed = [hidden[2 * e:2 * e + 2] @ experts[e] for e in range(3)]  # saves views of hidden and of experts
        sum(part.sum() for part in routed).backward()
    assert saved.total == 6 * 8 * 4


@pytest.mark.parametrize("trainable", [True, False])
def test_saved_bytes_leave_out_autocasts_copies_of_the_weights(trainable: bool) -> None:
    """Under bf16 autocast a linear layer saves a 16-bit copy of its weight (a transposed view of the cast, or, for
    a frozen weight, a cast with no autograd node) and, to give the weight its gradient, its input: the copy is the
    weight's, one per step whatever the batch, so only the input counts, at half its fp32 bytes."""
    layer = nn.Linear(64, 256).requires_grad_(trainable)
    inputs = torch.randn(8, 64, requires_grad=True)
    counted = {}
    for autocast in (False, True):
        with SavedBytes(layer.parameters()) as saved:
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast, cache_enabled=False):
                layer(inputs)
        counted[autocast] = saved.total
    assert counted == ({False: 8 * 64 * 4, True: 8 * 64 * 2} if trainable else {False: 0, True: 0})


def _tiny_llama(vocab: int) -> nn.Module:
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig

    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}), vocab_size=vocab)
    model.config.use_cache = False
    return model


def _profile(model: nn.Module, tokens: torch.Tensor, **options: object):
    from lightning_merak.planning.measure.layout import profile_model
    from lightning_merak.planning.planner import required_profile_keys
    from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
    from lightning_merak.strategies.merak3d.build import call_model

    space = SearchSpace(world_size=1, global_batch_size=None, replica_batch_size=tokens.shape[0],
                        tp_degrees_allowed=(1,), max_pipeline_stages=1, overlap_choices=(1,))
    return profile_model(model, tokens, call_model, tensor_parallel_plan, required_profile_keys(space, 2),
                         lambda params: torch.optim.AdamW(params), repeats=1, **options)


def test_the_profile_measures_the_loss_memory_and_what_trains() -> None:
    """The next-token loss saves fp32 log-probabilities of every position but the last; a frozen base with
    LoRA adapters trains only the adapters, which the local shards' plain layers leave out and the profile adds."""
    from peft import LoraConfig, get_peft_model

    from lightning_merak.planning.measure.probe import next_token_loss

    vocab, seq = 96, 16
    tokens = torch.randint(vocab, (4, seq), generator=torch.Generator().manual_seed(1))
    model = _tiny_llama(vocab)
    profile = _profile(model, tokens, loss_of=lambda logits, samples: next_token_loss(logits, tokens[:samples]))
    assert profile.loss_saved_bytes_per_sample == pytest.approx((seq - 1) * vocab * 4, rel=0.05)  # and the targets
    block_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    assert profile.block_trainable_bytes == profile.block_parameter_bytes == {1: block_bytes}

    adapted = get_peft_model(_tiny_llama(vocab), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    layer = adapted.base_model.model.model.layers[0]
    adapters = sum(p.numel() * 4 for p in layer.parameters() if p.requires_grad)
    profile = _profile(adapted, tokens)
    assert profile.block_parameter_bytes == {1: block_bytes + adapters}
    assert profile.block_trainable_bytes == {1: adapters}
    assert (profile.prefix_trainable_bytes, profile.suffix_trainable_bytes) == (0, 0)


def test_moe_blocks_saved_bytes_leave_out_views_of_their_fused_experts() -> None:
    """The model's own expert loop multiplies by one expert's slice of a fused weight at a time: views with other
    data pointers than the parameter. The profile counts the block's saved bytes as the memory they hold (by storage,
    parameters' storages left out), as the block saves them inside the whole model (by data pointer: 15% more)."""
    from lightning_merak.plugins.moe.experts.families import tiny_moe_model

    model = tiny_moe_model("qwen3_moe", hidden=32, layers=2, vocab=128, seed=0)
    model.config.use_cache = False
    tokens = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(5))
    block = model.model.layers[0]
    profile = _profile(model, tokens)
    inside = [False]
    hooks = [block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
             block.register_forward_hook(lambda *_: inside.__setitem__(0, False))]
    counted = SavedBytes(model.parameters())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if inside[0]:
            counted.add(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens)
    for hook in hooks:
        hook.remove()
    assert profile.block_activation_bytes_per_sample[1] == pytest.approx(counted.total / 4, rel=0.02)
