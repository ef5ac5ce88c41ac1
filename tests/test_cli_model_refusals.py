"""Refusals before launch that need the built model: its position table against the sequence length, a resumed
checkpoint's tensor shapes against the model's, adapter targets against its layers; and the CLI's other early
checks (precision on CPU, a GPU asked for where there is none, the closest key to a typo)."""

import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO
from lightning_merak.checkpoint.compatible import (
    check_resume_shapes,
    resume_checkpoint_io,
    saved_tensor_shapes,
    shape_mismatches,
)
from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT, ExpertParallelCheckpointIO
from lightning_merak.cli.config import register_configs
from lightning_merak.cli.options.adapter import LoRAAdapterConfig, Quantization
from lightning_merak.cli.overrides import _closest
from lightning_merak.cli.train import prepare, validate_run
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig, TrainerConfig
from lightning_merak.modules.positions import beyond_trained_positions, sequence_length_problem

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


def _meta_model(model_type: str, **config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(model_type, vocab_size=64, **config))


@pytest.mark.parametrize("model_type, config", [
    ("gpt2", {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32}),
    ("opt", {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "ffn_dim": 64,
             "word_embed_proj_dim": 32, "max_position_embeddings": 32}),
    ("gptj", {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32, "rotary_dim": 8}),
])
def test_a_sequence_longer_than_the_position_table_is_refused(model_type, config):
    model = _meta_model(model_type, **config)
    assert sequence_length_problem(model, 32) is None
    problem = sequence_length_problem(model, 33)
    assert problem is not None and "data.seq_len=33" in problem and "<=32" in problem and "=33" in problem


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "phi"])
def test_models_that_compute_positions_run_past_max_position_embeddings(model_type):
    model = _meta_model(model_type, **TINY, max_position_embeddings=32)
    assert sequence_length_problem(model, 4096) is None
    notice = beyond_trained_positions(model, 4096, "data.max_length")
    assert notice is not None and "data.max_length=4096" in notice and "max_position_embeddings=32" in notice
    assert beyond_trained_positions(model, 32) is None


def _module(hidden: int) -> torch.nn.Module:
    model = build_causal_lm(ModelConfig(name="tiny", model_type="llama", config={**TINY, "hidden_size": hidden}),
                            vocab_size=64)
    holder = torch.nn.Module()
    holder.model = model
    return holder


def test_a_checkpoint_of_other_sizes_is_refused_before_launch(tmp_path: Path):
    saved = _module(32)
    file = tmp_path / "run.ckpt"
    torch.save({"state_dict": saved.state_dict(), "global_step": 2}, file)
    check_resume_shapes(file, _module(32))
    with pytest.raises(ValueError, match=r"resume=.*run\.ckpt: the checkpoint was saved from a model of other sizes: "
                                         r"model\.lm_head\.weight is \[64, 32\] there and \[64, 48\] here; .* "
                                         r"\(and 9 more\)"):
        check_resume_shapes(file, _module(48))


def test_a_sharded_checkpoint_is_compared_from_its_metadata(tmp_path: Path):
    directory = tmp_path / "step=2.ckpt"
    state = {"model.model.model.norm.weight": torch.ones(32), "model.model.lm_head.weight": torch.ones(64, 32),
             "model.quantized.weight": torch.zeros(8, dtype=torch.uint8)}
    dcp.save(state, checkpoint_id=directory, no_dist=True)
    torch.save({"global_step": 2}, directory / LIGHTNING_CHECKPOINT)
    assert saved_tensor_shapes(directory) == {"model.model.norm.weight": (32,), "model.lm_head.weight": (64, 32)}
    assert shape_mismatches(saved_tensor_shapes(directory), {"model.lm_head.weight": (64, 48),
                                                             "model.model.norm.weight": (32,),
                                                             "model.unsaved.weight": (3,)})[0][0] == \
        "model.lm_head.weight"
    check_resume_shapes(directory, _module(32))
    with pytest.raises(ValueError, match=r"model\.lm_head\.weight is \[64, 32\] there and \[64, 16\] here"):
        check_resume_shapes(directory, _module(16))


def test_tensors_of_another_rank_or_kind_are_left_to_the_load():
    assert shape_mismatches({"a": (8, 4), "b": (32,)}, {"a": (32,), "b": (32,)}) == []


def test_gpt2s_defaults_name_no_token_of_a_small_vocabulary(caplog):
    with caplog.at_level(logging.WARNING):
        model = build_causal_lm(ModelConfig(name="g", model_type="gpt2", config={"n_embd": 32, "n_layer": 1,
                                                                                  "n_head": 2}), vocab_size=64)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (None, None)
    assert "bos_token_id" not in caplog.text
    kept = build_causal_lm(ModelConfig(name="g", model_type="gpt2", config={"n_embd": 32, "n_layer": 1, "n_head": 2,
                                                                             "eos_token_id": 3}), vocab_size=64)
    assert kept.config.eos_token_id == 3


def test_adapter_targets_that_name_no_layer_list_the_models_layers():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                                                                 n_positions=32))
    with pytest.raises(ValueError, match=r"adapter.target_modules=\['q_proj'.*names no layer of GPT2LMHeadModel; "
                                         r"its linear layers are c_attn, c_fc, c_proj"):
        LoRAAdapterConfig(quantization=Quantization.none).apply(model)
    adapted = LoRAAdapterConfig(quantization=Quantization.none, target_modules=["attn.c_attn"]).apply(model)
    assert any("lora_A" in name for name, _ in adapted.named_parameters())


def test_float16_mixed_precision_on_cpu_is_refused():
    with pytest.raises(ValueError, match="trainer.precision=16-mixed .* needs a GPU; .*bf16-mixed"):
        validate_run(TrainerConfig(accelerator="cpu", devices=1, precision="16-mixed"))
    assert validate_run(TrainerConfig(accelerator="cpu", devices=1, precision="bf16-mixed")) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_run_on_a_machine_without_one_names_the_cpu_option():
    with pytest.raises(ValueError, match="this machine has no GPU .*trainer=cpu_ddp"):
        validate_run(TrainerConfig(accelerator="gpu", devices=1))


@pytest.mark.parametrize("typo, expected", [("modle", "model"), ("stratgy", "strategy"), ("max_step", "max_steps")])
def test_a_typo_gets_the_key_it_misspells(typo, expected):
    assert _closest(typo, ["module", "model", "strategy", "max_steps", "min_steps", "data"]) == expected


def test_the_command_line_refuses_gpt2_past_its_positions_before_launch(tmp_path: Path):
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"output_dir={tmp_path}", "model=gpt2_tiny",
                                                       "data.seq_len=1024", "trainer.devices=1"])
    with pytest.raises(ValueError, match=r"data.seq_len=1024 is longer than the 512 positions GPT2LMHeadModel "
                                         r"embeds \(model.config.n_positions=512"):
        prepare(OmegaConf.to_object(cfg))


def test_a_merak3d_checkpoint_directory_is_read_under_ddp_and_refused_where_it_cannot_be(tmp_path: Path):
    directory = tmp_path / "step=2.ckpt"
    dcp.save({"model.model.other.weight": torch.ones(2)}, checkpoint_id=directory, no_dist=True)
    torch.save({"global_step": 2}, directory / LIGHTNING_CHECKPOINT)
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"output_dir={tmp_path}", "model=gpt2_tiny", "strategy=ddp",
                                                       "trainer.devices=1", f"resume='{directory}'"])
    assert isinstance(prepare(OmegaConf.to_object(cfg)).trainer.strategy.checkpoint_io, ExpertParallelCheckpointIO)
    assert isinstance(resume_checkpoint_io(directory, "merak3d", _module(32)), SafeCheckpointIO)
    assert isinstance(resume_checkpoint_io(tmp_path / "run.ckpt", "ddp", _module(32)), SafeCheckpointIO)
    for strategy, module in (("ddp", torch.nn.Linear(2, 2)), ("fsdp", _module(32))):
        with pytest.raises(ValueError, match=rf"is a merak3d checkpoint directory, which strategy={strategy} with "
                                             rf"{type(module).__name__} cannot read; resume it with strategy=merak3d"):
            resume_checkpoint_io(directory, strategy, module)


def test_a_pretrained_directory_without_weights_or_with_a_broken_config_is_refused(tmp_path: Path):
    config = transformers.LlamaConfig(**TINY, vocab_size=64)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"has a config.json but neither model.safetensors nor "
                                         r"model.safetensors.index.json; save the model with save_pretrained"):
        ModelConfig(name="hf", path=str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert ModelConfig(name="hf", path=str(tmp_path)).model_type == "llama"
    (tmp_path / "config.json").write_text("{'model_type': 'llama'}")
    with pytest.raises(ValueError, match=r"config.json is not a JSON config \(Expecting property name"):
        ModelConfig(name="hf", path=str(tmp_path))


@pytest.mark.parametrize("option, callback", [("memory=delta", "DeltaMemory"), ("comm=s2", "SparseCommunication")])
def test_a_callback_full_sharding_rules_out_is_refused_before_launch(tmp_path: Path, option: str, callback: str):
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"output_dir={tmp_path}", "model=gpt2_tiny", "trainer.devices=2",
                                                       "strategy.data_parallel_sharding=full", option])
    with pytest.raises(ValueError, match=rf"{callback} cannot run with data_parallel_sharding='full'"):
        prepare(OmegaConf.to_object(cfg))
