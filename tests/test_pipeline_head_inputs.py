"""The pipeline's last stage replays the head without the model's inputs: a head that reads a tensor computed from
them (a decoder sequence classifier pools each row's last non-pad token) is refused when traced, not replayed with
the traced batch's rows at every micro-batch."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

from lightning_merak.parallel.pipeline.trace import TraceError, trace_model

_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "vocab_size": 64, "pad_token_id": 0, "use_cache": False}


@pytest.mark.parametrize("build", [
    lambda: GPT2ForSequenceClassification(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, pad_token_id=0,
                                                     num_labels=3, use_cache=False)),
    lambda: LlamaForSequenceClassification(LlamaConfig(**_LLAMA, num_labels=3)),
], ids=["gpt2", "llama"])
def test_a_head_pooling_rows_by_the_inputs_is_refused_when_traced(build) -> None:
    torch.manual_seed(0)
    with pytest.raises(TraceError, match=r"the head reads a tensor of shape \(2,\) computed from the model's inputs "
                                         r".*last non-pad token.*use pipeline_parallel=1"):
        trace_model(build(), torch.randint(1, 64, (2, 8)))


@pytest.mark.parametrize("build", [
    lambda: LlamaForCausalLM(LlamaConfig(**_LLAMA)),
    lambda: BertForSequenceClassification(BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                     num_attention_heads=2, vocab_size=64, num_labels=3)),
], ids=["llama_causal_lm", "bert_first_token"])
def test_heads_of_the_hidden_state_alone_still_trace(build) -> None:
    torch.manual_seed(0)
    assert trace_model(build(), torch.randint(1, 64, (2, 8))).head
