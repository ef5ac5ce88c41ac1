"""The recorded head replays at the batch size and length of each micro-batch, not only at the traced ones.

GPT-2-style models end their forward with ``hidden_states.view(output_shape)``, ``output_shape`` holding the traced
batch and sequence length; micro-batching (dynamic / pack / pad) hands the last stage micro-batches of other shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_merak.parallel.pipeline.trace import TraceError, find_trunk, trace_model
from lightning_merak.util.model_outputs import logits_of

transformers = pytest.importorskip("transformers")


def _tiny(family: str) -> nn.Module:
    common = {"vocab_size": 64, "use_cache": False}
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, **common))
    if family == "gpt_neo":
        return transformers.GPTNeoForCausalLM(transformers.GPTNeoConfig(
            hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8,
            **common))
    if family == "gpt_bigcode":
        return transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4,
                                                                                **common))
    return transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(n_embd=32, n_layer=2, n_head=4, **common))


def _last_hidden_and_logits(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The last block's hidden state and the model's own logits on ``ids``."""
    _, trunk = find_trunk(model)
    captured: list[torch.Tensor] = []
    handle = trunk[-1].register_forward_hook(
        lambda module, args, output: captured.append(output[0] if isinstance(output, (tuple, list)) else output))
    try:
        logits = logits_of(model(ids))
    finally:
        handle.remove()
    return captured[0], logits


@pytest.mark.parametrize("family", ["gpt2", "gpt_neo", "gpt_bigcode", "openai"])
@pytest.mark.parametrize("shape", [(3, 7), (1, 16)])
def test_head_replays_at_another_batch_and_length(family: str, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = _tiny(family).eval()
    trace = trace_model(model, torch.randint(0, 64, (2, 12)), profile=False)
    with torch.no_grad():
        hidden, expected = _last_hidden_and_logits(model, torch.randint(0, 64, shape))
        replayed = trace.run_head(model, hidden)
    assert replayed.shape == expected.shape
    torch.testing.assert_close(replayed, expected)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.linear(hidden)


class _FlatHead(nn.Module):
    """A head reshaping with sizes of its own: ``heads`` splits the hidden size, ``flatten`` folds batch and
    length into one literal size (the replay cannot re-derive it)."""

    def __init__(self, flatten: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(4, 16)
        self.flatten = flatten

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden)
        batch, length, _ = hidden.shape
        if self.flatten:
            return self.head(hidden.reshape(batch * length, 2, 4))
        return self.head(hidden.view(batch, length, 2, 4)).sum(2)


def test_split_hidden_size_follows_the_micro_batch() -> None:
    torch.manual_seed(0)
    model = _FlatHead(flatten=False).eval()
    trace = trace_model(model, torch.randint(0, 16, (2, 5)), profile=False)
    with torch.no_grad():
        hidden, expected = _last_hidden_and_logits(model, torch.randint(0, 16, (3, 9)))
        torch.testing.assert_close(trace.run_head(model, hidden), expected)


def test_size_the_replay_cannot_rederive_is_refused_at_another_length() -> None:
    torch.manual_seed(0)
    model = _FlatHead(flatten=True).eval()
    trace = trace_model(model, torch.randint(0, 16, (2, 5)), profile=False)
    with torch.no_grad():
        assert trace.run_head(model, torch.randn(2, 5, 8)).shape == (10, 2, 16)  # the traced shape replays
        with pytest.raises(TraceError, match=r"_FlatHead's head calls reshape with sizes fixed to the traced"):
            trace.run_head(model, torch.randn(2, 7, 8))

