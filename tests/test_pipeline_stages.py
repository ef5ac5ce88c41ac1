"""Tracing unmodified models and cutting them into stages: chained stages reproduce the logits."""

import copy

import pytest
import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from lightning_merak.parallel.pipeline import partition_autopipe, partition_uniform, simulate_schedule
from lightning_merak.parallel.pipeline.stage import build_stage_module, tied_parameter_names
from lightning_merak.parallel.pipeline.trace import TraceError, trace_model
from lightning_merak.util.model_outputs import logits_of


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.feed_forward = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.feed_forward(self.norm2(x))


class UserTransformer(nn.Module):
    """A causal LM written by hand, as a user would: embeddings, a ModuleList of blocks, a head."""

    def __init__(self, vocab: int = 100, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(64, width) * 0.02)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        mask = torch.triu(torch.full((length, length), float("-inf")), 1)
        x = self.embedding(ids) + self.positions[:length]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


class _CausalBlock(_Block):
    """A block that takes only the hidden state (its mask made inside), as an ``nn.Sequential`` calls it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        return super().forward(x, torch.triu(torch.full((length, length), float("-inf")), 1))


class SequentialTransformer(UserTransformer):
    """A hand-written causal LM whose blocks sit in an ``nn.Sequential`` called as one module."""

    def __init__(self, vocab: int = 100, width: int = 32, depth: int = 4) -> None:
        super().__init__(vocab, width, depth)
        self.blocks = nn.Sequential(*(_CausalBlock(width) for _ in range(depth)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embedding(ids) + self.positions[:ids.shape[1]])))


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
             "vocab_size": 100, "use_cache": False}
    return {
        "llama": LlamaForCausalLM(LlamaConfig(**small, num_key_value_heads=2)),
        "mistral": MistralForCausalLM(MistralConfig(**small, num_key_value_heads=2)),
        "gpt2": GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=4, n_head=4, vocab_size=100, use_cache=False)),
        "bert": BertForMaskedLM(BertConfig(**small)),
        "user": UserTransformer(),
        "user_sequential": SequentialTransformer(),
        # logits scaled after the LM head, outside any module
        "cohere": CohereForCausalLM(CohereConfig(**small, num_key_value_heads=2, logit_scale=0.25, pad_token_id=0,
                                                 bos_token_id=1, eos_token_id=2)),
        # sliding-window and global layers read different masks; logits soft-capped after the LM head
        "gemma2": Gemma2ForCausalLM(Gemma2Config(**small, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                                 final_logit_softcapping=2.0, pad_token_id=0, bos_token_id=1,
                                                 eos_token_id=2)),
    }


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2", "bert", "user", "user_sequential", "cohere", "gemma2"])
@pytest.mark.parametrize("boundaries", [(0, 3), (0, 1, 4, 5), (0, 5), (0, 2, 3, 4)])
def test_chained_stages_reproduce_the_logits(name, boundaries):
    model = _models()[name].eval()
    inputs = torch.randint(100, (2, 16))
    with torch.no_grad():
        expected = logits_of(model(inputs))
        trace = trace_model(model, inputs, profile=False)
        outputs: tuple = (inputs,)
        for index in range(len(boundaries)):
            stage = build_stage_module(copy.deepcopy(model), trace, boundaries, index, lambda m, x: m(x))
            result = stage(*outputs)
            outputs = result if isinstance(result, tuple) else (result,)
    torch.testing.assert_close(outputs[0], expected, rtol=0, atol=1e-6)


def test_each_stage_holds_only_its_parameters():
    model = _models()["llama"]
    trace = trace_model(model, torch.randint(100, (2, 8)), profile=False)
    stages = [build_stage_module(copy.deepcopy(model), trace, (0, 3), i, lambda m, x: m(x)) for i in range(2)]
    names = [{stage.original_name(n) for n, _ in stage.named_parameters()} for stage in stages]
    assert not names[0] & names[1]
    assert names[0] | names[1] == {n for n, _ in model.named_parameters()}
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[1]


def test_tied_embeddings_are_found_by_identity():
    assert tied_parameter_names(_models()["gpt2"]) == [("transformer.wte.weight", "lm_head.weight")]
    assert tied_parameter_names(_models()["llama"]) == []


def test_profile_counts_the_heavy_head_and_partitions_it():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                         use_cache=False))
    trace = trace_model(model, torch.randint(4096, (4, 32)))
    head = trace.costs[-1]
    assert head.name == "suffix" and head.param_bytes == 4096 * 32 * 4 + 32 * 4
    assert head.forward_s > 0 and head.backward_s > 0 and all(c.saved_bytes >= 0 for c in trace.costs)
    uniform = partition_uniform(trace.costs, 2)
    balanced = partition_autopipe(trace.costs, 2, num_microbatches=4)
    # AutoPipe minimises the simulated 1F1B iteration (forward and backward), not either alone
    iteration_s = [simulate_schedule(p.stage_forward_s, p.stage_backward_s, 4, "1f1b").iteration_s
                   for p in (balanced, uniform)]
    assert iteration_s[0] <= iteration_s[1] + 1e-12


def test_kv_cache_arguments_are_refused():
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
    with pytest.raises(TraceError, match="use_cache = False"):
        trace_model(model, torch.randint(100, (1, 4)), profile=False)


class _SkipBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + skip


class _LongSkips(nn.Module):
    """Each block also reads the previous block's input: a skip connection across blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList(_SkipBlock() for _ in range(3))
        self.head = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = skip = self.embedding(ids)
        for block in self.blocks:
            x, skip = block(x, skip), x
        return self.head(x)


def test_skip_connections_across_blocks_are_carried():
    """Block 2 reads block 0's output, block 1 the embedding output (a side tensor): chained stages with a cut
    between blocks 0 and 2 carry the skip value and reproduce the logits."""
    model = _LongSkips().eval()
    inputs = torch.randint(10, (1, 4))
    with torch.no_grad():
        trace = trace_model(model, inputs, profile=False)
        assert [(skip.producer, skip.consumers) for skip in trace.skips] == [(0, (2,))]
        outputs: tuple = (inputs,)
        for index in range(2):
            result = build_stage_module(copy.deepcopy(model), trace, (0, 2), index, lambda m, x: m(x))(*outputs)
            outputs = result if isinstance(result, tuple) else (result,)
        torch.testing.assert_close(outputs[0], model(inputs), rtol=0, atol=1e-6)


class _DerivedSkips(_LongSkips):
    """Each block also reads a value computed from the previous block's input."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = skip = self.embedding(ids)
        for block in self.blocks:
            x, skip = block(x, skip), 0.5 * x
        return self.head(x)


def test_values_derived_from_other_blocks_are_refused():
    with pytest.raises(TraceError, match="do not reproduce its logits"):
        trace_model(_DerivedSkips(), torch.randint(10, (1, 4)), profile=False)


class _HeadWeightOutsideModule(UserTransformer):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids) + self.positions[:ids.shape[1]]
        for block in self.blocks:
            x = block(x, torch.zeros(ids.shape[1], ids.shape[1]))
        return self.norm(x) @ self.embedding.weight.T


def test_head_weight_used_outside_its_module_is_refused():
    with pytest.raises(TraceError, match="outside a module call"):
        trace_model(_HeadWeightOutsideModule(), torch.randint(100, (1, 4)), profile=False)


def test_head_replays_operations_after_the_lm_head():
    model = _models()["gemma2"]
    trace = trace_model(model, torch.randint(100, (2, 8)), profile=False)
    assert trace.suffix_paths == ["model.norm", "lm_head"]
    assert [step.function.__name__ for step in trace.head if step.module is None][-3:] == ["div", "tanh", "mul"]
    assert trace.block_signatures[0] != trace.block_signatures[1]


def test_model_without_block_list_is_refused():
    with pytest.raises(TraceError, match="no nn.ModuleList or nn.Sequential of repeated blocks"):
        trace_model(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10)), torch.randint(10, (1, 4)))


def test_a_sequential_trunk_is_found_and_each_stage_keeps_its_blocks_in_one():
    model = _models()["user_sequential"]
    trace = trace_model(model, torch.randint(100, (2, 8)), profile=False)
    assert (trace.trunk_path, trace.num_blocks) == ("blocks", 4)
    stage = build_stage_module(copy.deepcopy(model), trace, (0, 3, 6), 1, lambda m, x: m(x))
    assert isinstance(stage.net.blocks, nn.Sequential)
    assert sum(p.numel() for p in stage.parameters()) < sum(p.numel() for p in model.parameters())


def test_first_stage_blocks_called_outside_its_forward_just_compute():
    """Recomputation or a profiler may call a first-stage block directly: the stage's exit stays out of it."""
    model = _models()["llama"].eval()
    with torch.no_grad():
        trace = trace_model(model, torch.randint(100, (2, 8)), profile=False)
        stage = build_stage_module(copy.deepcopy(model), trace, (0, 3), 0, lambda m, x: m(x))
        args, kwargs = trace.block_arguments(trace.sample_side_tensors, 1)
        alone = stage.net.model.layers[1](trace.sample_hidden, *args, **kwargs)
        expected = model.model.layers[1](trace.sample_hidden, *args, **kwargs)
    torch.testing.assert_close(trace.hidden_of(alone), trace.hidden_of(expected), rtol=0, atol=0)
