"""An encoder family's causal-LM head (BERT, RoBERTa, ...) is causal only with ``is_decoder``: the builder sets it,
so no position sees the tokens after it; decoder families are built as before."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
VOCAB = 64


def _sees_later_tokens(model: torch.nn.Module) -> bool:
    """Whether changing the last token moves the first position's logits."""
    tokens = torch.randint(VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % VOCAB
    model.eval()
    with torch.no_grad():
        return not torch.equal(model(input_ids=tokens).logits[0, 0], model(input_ids=changed).logits[0, 0])


@pytest.mark.parametrize("model_type", ["bert", "roberta", "electra"])
def test_an_encoder_familys_causal_head_is_built_as_a_decoder(model_type: str) -> None:
    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name=model_type, model_type=model_type, config=dict(TINY)), vocab_size=VOCAB)
    assert model.config.is_decoder
    assert not _sees_later_tokens(model)


def test_is_decoder_false_for_an_encoder_family_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="is_decoder=False.*drop the key"):
        build_causal_lm(ModelConfig(name="bert", model_type="bert", config={**TINY, "is_decoder": False}),
                        vocab_size=VOCAB)


def test_a_decoder_family_keeps_its_config() -> None:
    model = build_causal_lm(ModelConfig(name="llama", model_type="llama", config=dict(TINY)), vocab_size=VOCAB)
    assert not getattr(model.config, "is_decoder", False) and not _sees_later_tokens(model)


@pytest.mark.parametrize("weights", [True, False], ids=["loaded", "structure"])
def test_a_pretrained_encoder_checkpoint_is_loaded_as_a_decoder(tmp_path, weights: bool) -> None:
    """A BERT checkpoint saved with is_decoder=False (as encoder checkpoints are) trains causally all the same."""
    from transformers import BertConfig, BertLMHeadModel

    from lightning_merak.hf.pretrained import pretrained_causal_lm

    torch.manual_seed(0)
    BertLMHeadModel(BertConfig(vocab_size=VOCAB, **TINY)).save_pretrained(tmp_path)
    model = pretrained_causal_lm(tmp_path, VOCAB, weights=weights)
    assert model.config.is_decoder
    if weights:
        assert not _sees_later_tokens(model)
    with pytest.raises(ValueError, match="is_decoder=False.*drop the key"):
        pretrained_causal_lm(tmp_path, VOCAB, {"is_decoder": False}, weights=weights)
