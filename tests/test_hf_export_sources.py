"""Pretrained folders in and out (single process): the source folder export copies tokenizer files from, a
``model.config`` override that changes the structure, and ``vocab_stages='on'`` for heads that transform logits."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig

from lightning_merak.checkpoint.names import build_meta_model
from lightning_merak.hf import export_checkpoint, model_record, pretrained_causal_lm
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments

VOCAB = 96
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64)
SOURCE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _source_folder(path: Path) -> Path:
    """A saved tiny Llama with (stand-in) tokenizer files beside it, as a Hub download has."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES, tie_word_embeddings=False))
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_text("{}\n")
    return path


def _checkpoint(model: torch.nn.Module, path: Path) -> Path:
    """What Lightning writes for a DDP run: the module's state under ``model.``, plus the model record."""
    torch.save({"state_dict": CausalLMModule(model).state_dict(), "hf_model": model_record(model)}, path)
    return path


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def export_log():
    """The lines the export logs (the plugin's logger may not propagate to the root once merak-export ran)."""
    handler, logger = _Lines(), logging.getLogger("lightning_merak.hf.export")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


# 1. The source folder of a relative model.path -------------------------------------------------------------------

@pytest.mark.parametrize("weights", [True, False], ids=["ddp", "merak3d_meta"])
def test_a_relative_model_path_is_recorded_absolute_so_export_copies_its_files_from_elsewhere(
        tmp_path, monkeypatch, export_log, weights):
    _source_folder(tmp_path / "tok_src")
    monkeypatch.chdir(tmp_path)
    model = pretrained_causal_lm("tok_src", VOCAB, weights=weights)
    assert model.config._name_or_path == str(tmp_path / "tok_src")
    checkpoint = _checkpoint(model.to_empty(device="cpu") if not weights else model, tmp_path / "run.ckpt")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # merak-export run from another folder
    report = export_checkpoint(checkpoint, tmp_path / "out")
    assert set(SOURCE_FILES) <= set(report.files) and all((tmp_path / "out" / name).is_file() for name in SOURCE_FILES)
    assert export_log == []


def test_export_into_the_folder_the_model_was_loaded_from_replaces_its_weights_in_place(tmp_path, export_log):
    """As ``save_pretrained(same_folder)`` does: the source's own files stay, the weights are the trained ones."""
    _source_folder(tmp_path / "model")
    model = pretrained_causal_lm(str(tmp_path / "model"), VOCAB, weights=True)
    report = export_checkpoint(_checkpoint(model, tmp_path / "run.ckpt"), tmp_path / "model")
    assert set(SOURCE_FILES) <= set(report.files) and all((tmp_path / "model" / name).is_file()
                                                          for name in SOURCE_FILES)
    assert export_log == []


def test_export_warns_when_the_recorded_source_folder_is_gone(tmp_path, export_log):
    model = pretrained_causal_lm(_source_folder(tmp_path / "moved"), VOCAB)
    checkpoint = _checkpoint(model, tmp_path / "run.ckpt")
    (tmp_path / "moved").rename(tmp_path / "moved_away")
    report = export_checkpoint(checkpoint, tmp_path / "out")
    assert not set(SOURCE_FILES) & set(report.files)
    assert len(export_log) == 1
    assert f"records its model as loaded from {tmp_path / 'moved'}, which is not a folder here" in export_log[0]
    assert "no generation_config.json or tokenizer files" in export_log[0]
    random_init = AutoModelForCausalLM.from_config(LlamaConfig(**SIZES))  # no source folder: nothing to say
    export_checkpoint(_checkpoint(random_init, tmp_path / "random.ckpt"), tmp_path / "random")
    assert len(export_log) == 1


# 2. A model.config override that changes the structure --------------------------------------------------------------

@pytest.mark.parametrize("weights", [True, False], ids=["ddp", "merak3d_meta"])
def test_a_structural_override_is_named_as_the_cause_of_the_mismatch(tmp_path, weights):
    source = _source_folder(tmp_path / "source")
    expected = re.escape("the overrides model.config.num_hidden_layers=1 may change the model's structure")
    with pytest.raises(ValueError, match=rf"built from its config.json and model.config: .*{expected}.*: remove them; "
                                         r"or, if the folder is the wrong one, pass the directory save_pretrained"):
        pretrained_causal_lm(source, VOCAB, {"num_hidden_layers": 1}, weights=weights)
    with pytest.raises(ValueError, match=r"model.config.intermediate_size=128 model.config.attention_bias=true"):
        pretrained_causal_lm(source, VOCAB, {"intermediate_size": 128, "attention_bias": True}, weights=weights)
    pretrained_causal_lm(source, VOCAB, {"attention_dropout": 0.0}, weights=weights)  # same structure: loads


# 3. vocab_stages='on' for a head whose logits the model transforms --------------------------------------------------

LOGIT_TRANSFORMING = {
    "granite": (GraniteConfig(**SIZES, logits_scaling=4.0, tie_word_embeddings=False), "logits_scaling=4.0"),
    "cohere": (CohereConfig(**SIZES, logit_scale=0.0625, tie_word_embeddings=False), "logit_scale=0.0625"),
    "gemma2": (Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=30.0, tie_word_embeddings=False),
               "final_logit_softcapping=30.0"),
}


@pytest.mark.parametrize("family", sorted(LOGIT_TRANSFORMING))
def test_vocab_stages_on_is_refused_before_launch_for_logits_the_model_transforms(family):
    config, setting = LOGIT_TRANSFORMING[family]
    model = build_meta_model(config)
    with pytest.raises(ValueError, match=re.escape(f"the model transforms them (['{setting}']: logit scaling or "
                                                   "soft-capping); set vocab_stages='off' (or 'auto'")):
        Merak3DArguments(pipeline_parallel=2, vocab_stages="on").check_model(model, 2, 1)
    Merak3DArguments(pipeline_parallel=2, vocab_stages="auto").check_model(model, 2, 1)  # keeps the head, with a note
    Merak3DArguments(pipeline_parallel=1, vocab_stages="on").check_model(model, 1, 1)  # one stage: nothing to split


def test_vocab_stages_on_is_refused_before_launch_for_a_head_tied_to_a_scaled_embedding():
    model = build_meta_model(Gemma2Config(**SIZES, head_dim=8, final_logit_softcapping=None, tie_word_embeddings=True))
    with pytest.raises(ValueError, match=r"the LM head is tied to the input embedding, which cannot be split with it: "
                                         r"the input embedding is Gemma2TextScaledWordEmbedding, not an nn.Embedding"):
        Merak3DArguments(pipeline_parallel=2, vocab_stages="on").check_model(model, 2, 1)
    untied = build_meta_model(LlamaConfig(**SIZES, tie_word_embeddings=False))
    Merak3DArguments(pipeline_parallel=2, vocab_stages="on").check_model(untied, 2, 1)  # a plain head splits
