"""Adapters on a quantised base resume from a Lightning ``.ckpt`` (one process and DDP) as if never stopped,
the packed base read back byte for byte; a checkpoint of another quantisation or adapter shape is refused."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.adapters.resume import quantized_layers
from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO
from lightning_merak.checkpoint.safe_load import load_torch_file
from lightning_merak.cli.export import main as export_main
from lightning_merak.cli.options.adapter import (
    LoRAAdapterConfig,
    QAHiRAAdapterConfig,
    QBaRAAdapterConfig,
    Quantization,
)
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import DataConfig, ModelConfig, OptimConfig
from lightning_merak.modules.data import LanguageModelingData
from lightning_merak.testing import run_distributed
from tests.test_resume import checkpointing_trainer

MODEL = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2})
VOCAB = 64
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
OPTIONS = {"qbara": QBaRAAdapterConfig, "lora": LoRAAdapterConfig, "qahira": QAHiRAAdapterConfig}


def adapter_model(method: str, quantization: str, seed: int, r: int = 4) -> torch.nn.Module:
    """The tiny Llama, initialised from ``seed``, with ``method`` on its ``quantization`` base."""
    option = OPTIONS[method](r=r, target_modules=TARGETS, quantization=Quantization(quantization), group_size=32)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return option.apply(build_causal_lm(MODEL, VOCAB))


def fit(model: torch.nn.Module, max_steps: int, strategy: Any = "auto", devices: int = 1,
        resume_from: Optional[str] = None, checkpoint_dir: Optional[str] = None,
        checkpoint_every: Optional[int] = None) -> tuple[list[float], CausalLMModule]:
    """Fine-tune ``model`` on generated data (6 batches an epoch on one rank), AdamW with warm-up + cosine."""
    pl.seed_everything(0, workers=True, verbose=False)
    data = LanguageModelingData(DataConfig(name="synthetic", seq_len=16, batch_size=4, vocab_size=VOCAB,
                                           num_sequences=24))
    module = CausalLMModule(model, OptimConfig(warmup_steps=2, learning_rate=1e-2))
    trainer, losses = checkpointing_trainer(max_steps, strategy, devices, checkpoint_dir, checkpoint_every,
                                            plugins=(SafeCheckpointIO(),))
    trainer.fit(module, datamodule=data, ckpt_path=resume_from)
    return losses.losses, module


def frozen_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict but the trainable ones: packed bases and their quantisation state."""
    trainable = {name for name, param in module.named_parameters() if param.requires_grad}
    return {key: value for key, value in module.state_dict().items() if key not in trainable}


def assert_resumes(method: str, quantization: str, directory: Path, strategy: Any = "auto",
                   devices: int = 1) -> None:
    """A run stopped at step 4 and resumed (its model built from another seed) equals the straight run."""
    straight, _ = fit(adapter_model(method, quantization, seed=0), 8, strategy, devices,
                      checkpoint_dir=str(directory), checkpoint_every=4)
    checkpoint = str(directory / "step=4.ckpt")
    original = frozen_state(adapter_model(method, quantization, seed=0))
    rebuilt = adapter_model(method, quantization, seed=1)
    assert any(not torch.equal(value, original[key]) for key, value in frozen_state(rebuilt).items()), \
        "the rebuilt base differs until the checkpoint is read"
    resumed, module = fit(rebuilt, 8, strategy, devices, resume_from=checkpoint)
    assert resumed == pytest.approx(straight[4:], rel=1e-6)
    saved = load_torch_file(checkpoint)["state_dict"]
    for key, value in frozen_state(module).items():
        assert torch.equal(value, saved[key]), key


@pytest.mark.parametrize("method,quantization", [("qbara", "nf4"), ("qbara", "int8"), ("lora", "nf4"),
                                                 ("lora", "int8"), ("qbara", "fp4"), ("qahira", "int4")])
def test_a_quantised_adapter_resumes_from_a_lightning_checkpoint(tmp_path: Path, method: str,
                                                                 quantization: str) -> None:
    assert_resumes(method, quantization, tmp_path)


def _resume_rank(rank: int, world_size: int, quantization: str, directory: str) -> None:
    assert_resumes("qbara", quantization, Path(directory), "ddp", world_size)


@pytest.mark.distributed
@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_data_parallel_ranks_resume_a_quantised_adapter(tmp_path: Path, quantization: str) -> None:
    run_distributed(_resume_rank, 2, args=(quantization, str(tmp_path)), timeout_s=300)


@pytest.mark.parametrize("saved,resumed,message", [
    (("qbara", "nf4", 4), ("qbara", "int8", 4), "base nf4 in the checkpoint, int8 here"),
    (("qbara", "int8", 4), ("qbara", "nf4", 4), "base int8 in the checkpoint, nf4 here"),
    (("lora", "nf4", 4), ("lora", "none", 4), "base nf4 in the checkpoint, none here"),
    (("qahira", "int4", 4), ("qbara", "fp4", 4), "base int4 in the checkpoint, fp4 here"),
    (("qbara", "nf4", 4), ("qbara", "nf4", 8), r"shape \(8, 32\) in the checkpoint, \(16, 32\) here"),
    (("lora", "int8", 4), ("lora", "int8", 2), r"lora_A.default.weight: shape \(4, 64\) in the checkpoint"),
])
def test_a_checkpoint_of_another_quantisation_or_rank_is_refused(saved: tuple[str, str, int],
                                                                 resumed: tuple[str, str, int], message: str) -> None:
    method, quantization, r = saved
    state = adapter_model(method, quantization, seed=0, r=r).state_dict()
    method, quantization, r = resumed
    model = adapter_model(method, quantization, seed=0, r=r)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(ValueError, match=message) as refusal:
        model.load_state_dict(state)
    assert "adapter.quantization" in str(refusal.value)
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items()), "nothing copied"


@pytest.mark.parametrize("method,quantization", [("qbara", "nf4"), ("qahira", "int4"), ("lora", "int8")])
def test_a_quantised_adapter_exports_merged_into_its_dequantised_base(tmp_path: Path, method: str,
                                                                      quantization: str, capsys) -> None:
    """``--merge-adapters`` writes float weights, the dequantised base plus the delta: the exported model computes
    the trained quantised model's logits (nf4, INT4; int8's forward quantises its inputs too, so there an unadapted
    layer's weight is checked within half a quantisation step of the float weight it was quantised from). Resuming
    with another quantisation, or exporting without ``--merge-adapters``, is refused before anything is written."""
    from transformers import AutoModelForCausalLM

    _, module = fit(adapter_model(method, quantization, seed=0), 2, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    checkpoint, out = str(tmp_path / "step=2.ckpt"), tmp_path / "out"
    if quantization == "nf4":
        with pytest.raises(ValueError, match="base nf4 in the checkpoint, int8 here"):
            fit(adapter_model(method, "int8", seed=0), 4, resume_from=checkpoint)
    with pytest.raises(SystemExit) as refused:
        export_main([checkpoint, str(out)])
    assert refused.value.code == 2
    assert re.search(rf"holds a quantised base \({quantization}: .*--merge-adapters", capsys.readouterr().err)
    assert not out.exists()
    export_main([checkpoint, str(out), "--merge-adapters"])
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert all(param.dtype == torch.float32 for param in exported.parameters())
    if quantization != "int8":
        tokens = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        module.model.train()  # bitsandbytes' dequantise-and-matmul path (its CPU eval path repacks the codes)
        torch.testing.assert_close(exported(input_ids=tokens).logits, module.model(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
        return
    original = adapter_model(method, "none", seed=0).get_base_model().state_dict()
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        weight, float_weight = exported.get_parameter(name).detach(), original[name]
        step = float_weight.abs().amax(dim=1, keepdim=True) / 127  # LLM.int8's per-row step (absmax / 127)
        assert not torch.equal(weight, float_weight) and ((weight - float_weight).abs() <= step / 2 + 1e-4).all()


@pytest.mark.parametrize("method,quantization", [("qbara", "nf4"), ("qbara", "fp4"), ("lora", "int8"),
                                                 ("qahira", "int4"), ("lora", "none")])
def test_the_quantised_layers_of_a_checkpoint_are_named_by_their_keys(method: str, quantization: str) -> None:
    state = adapter_model(method, quantization, seed=0).state_dict()
    expected = 14 if quantization != "none" else 0  # 7 projections in each of 2 blocks; lm_head stays float
    layers = quantized_layers(state)
    assert len(layers) == expected and set(layers.values()) <= {quantization}
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer" in layers or not expected
