"""Inputs a hostile sweep found accepted without a word: each is now trained correctly, refused before work starts
naming the value and the fix, or (legitimate but slow) announced. Single process, no process launched."""

from __future__ import annotations

import dataclasses
import math
import os

import lightning.pytorch as pl
import pytest
import torch
from peft import PeftModel, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_merak.adapters import QAHiRAConfig, QBaRAConfig, quantize_model
from lightning_merak.callbacks.delta import DeltaMemory
from lightning_merak.callbacks.profiler import MerakTraceProfiler
from lightning_merak.callbacks.sparse_comm import SparseCommunication
from lightning_merak.callbacks.sparse_comm import arguments as sparse_arguments
from lightning_merak.cli import prelaunch
from lightning_merak.distributed import watchdog
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d import arguments as merak3d_arguments
from lightning_merak.testing.delta_models import CausalLMModule, tiny_llama
from lightning_merak.util import values


def llama(layers: int = 2, tied: bool = False, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        tie_word_embeddings=tied))


def randomize_adapters(model: nn.Module) -> None:
    """Non-zero adapter weights (``B`` starts at zero), so a merge that drops or misplaces the update shows."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


# 1. lm_head in target_modules -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("config", "quantization"), [
    (QBaRAConfig(target_modules=["q_proj", "lm_head"]), "nf4"),
    (QAHiRAConfig(target_modules=["lm_head"], lambda_in=32, lambda_out=1), "int4"),
])
def test_an_adapter_on_the_float_lm_head_trains_and_merges_exactly_and_a_tied_one_is_refused(config, quantization):
    """quantize_model leaves lm_head in float (QLoRA's choice); the pooled adapter wraps that float layer as asked:
    adapted (not skipped), its gradient flows, the merge into its float weight is exact. A tied lm_head is refused
    before training: merged, the update would land in the shared input embedding too."""
    with pytest.raises(ValueError, match=r"'lm_head' shares its weight with 'model\.embed_tokens'.*Remove 'lm_head'"):
        get_peft_model(quantize_model(llama(tied=True), quantization), config)

    only_head = dataclasses.replace(config, target_modules=["lm_head"])  # the lossy 4-bit merges of q_proj aside
    model = get_peft_model(quantize_model(llama(), quantization), only_head)
    head = model.base_model.model.lm_head
    assert type(head.get_base_layer()) is nn.Linear and head.get_base_layer().weight.dtype == torch.float32
    tokens = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    randomize_adapters(model)
    model(tokens).logits.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        adapted = model(tokens).logits
        merged = model.merge_and_unload()(tokens).logits
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)


# 2. DeltaMemory(blocks=...) that cannot apply ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def delta_fit() -> tuple[pl.Trainer, pl.LightningModule]:
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, max_steps=1, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    return trainer, CausalLMModule(tiny_llama())


@pytest.mark.parametrize(("blocks", "match"), [
    (5, r"blocks=5 is a count, but blocks chooses which blocks.*has 2 repeated blocks \(model\.model\.layers\.0 …"),
    (nn.Conv2d, r"blocks=<class .*Conv2d'> selects no block: CausalLMModule has 2 repeated blocks"),
    (["model.model.layers.5"], r"\['model\.model\.layers\.5'\] are not submodules: CausalLMModule has 2 repeated"),
])
def test_delta_memory_blocks_that_cannot_apply_are_refused_at_setup_naming_the_block_count(delta_fit, blocks, match):
    trainer, module = delta_fit
    callback = DeltaMemory(blocks=blocks)
    with pytest.raises(ValueError, match=match):
        callback.setup(trainer, module, "fit")
    assert callback.manager is None


def test_delta_memory_blocks_count_is_refused_before_a_merak3d_layout_too(delta_fit):
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=Merak3DStrategy(), logger=False)
    with pytest.raises(ValueError, match="blocks=5 is a count.*2 repeated blocks"):
        DeltaMemory(blocks=5).setup(trainer, delta_fit[1], "fit")


# 3. MerakTraceProfiler(dirpath=<a file>) ---------------------------------------------------------------------------

def test_trace_profiler_refuses_a_dirpath_that_is_a_file(tmp_path):
    file = tmp_path / "trace.json"
    file.write_text("{}")
    with pytest.raises(ValueError, match=f"dirpath='{file}' is an existing file, not a directory.*pass a directory"):
        MerakTraceProfiler(dirpath=file)
    with pytest.raises(ValueError, match=f"dirpath='{file}/run' lies under '{file}', which is an existing file"):
        MerakTraceProfiler(dirpath=str(file / "run"))
    assert MerakTraceProfiler(dirpath=tmp_path / "missing" / "run").dirpath == tmp_path / "missing" / "run"
    assert MerakTraceProfiler(dirpath=str(tmp_path)).dirpath == str(tmp_path)


# 4. A saved adapter loaded into a model of other layers ------------------------------------------------------------

@pytest.mark.parametrize(("saved_layers", "model_layers", "match"), [
    (4, 2, r"4 saved adapter weights match no module of this model \(e\.g\. model\.layers\.2\.self_attn\.q_proj"),
    (2, 4, r"4 adapter weights of this model are not in it \(e\.g\. model\.layers\.2\.self_attn\.q_proj"),
])
def test_peft_loading_an_adapter_of_other_layers_is_refused(tmp_path, saved_layers, model_layers, match):
    """Before, PEFT dropped the extra layers' weights (or left the missing ones at their initial value) silently.
    Into the model it was trained on it still loads, as a second adapter too (then "default" is not missing)."""
    trained = get_peft_model(llama(saved_layers), QBaRAConfig(target_modules=["q_proj"]))
    randomize_adapters(trained)
    trained.save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=match + ".*load it into the model it was trained on"):
        PeftModel.from_pretrained(llama(model_layers), str(tmp_path))

    loaded = PeftModel.from_pretrained(llama(saved_layers), str(tmp_path))
    loaded.load_adapter(str(tmp_path), adapter_name="second")
    tokens = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, trained(tokens).logits)


def test_a_whole_model_checkpoint_of_more_layers_is_refused_by_name_not_by_torch(tmp_path):
    """Lightning's resume loads the whole state dict: the adapter's extra layers are named, as a ValueError."""
    config = QAHiRAConfig(target_modules=["q_proj"], lambda_in=32, lambda_out=1)
    state = get_peft_model(quantize_model(llama(4), "int4"), config).state_dict()
    smaller = get_peft_model(quantize_model(llama(2), "int4"), config)
    with pytest.raises(ValueError, match=r"saved adapter weights match no module.*layers\.2\.self_attn\.q_proj"):
        smaller.load_state_dict(state, strict=False)


# 5. More CPU ranks than cores --------------------------------------------------------------------------------------

def test_more_ranks_than_cores_prints_one_notice_and_is_not_refused(monkeypatch, capsys):
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29555")  # restored after the test; the function only sets a missing one
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert prelaunch.prelaunch_local_ranks(64, 1) is None  # Lightning's launcher starts them: not refused
    out = capsys.readouterr().out
    assert out.count("merak-train: note:") == 1
    assert "trainer.devices=64 starts 64 ranks on this machine's 2 cores" in out and "will be slow" in out
    assert prelaunch.prelaunch_local_ranks(2, 1) is None  # no Hydra run here; as many ranks as cores: no note
    assert capsys.readouterr().out == ""


# 6. One finite-number check -----------------------------------------------------------------------------------------

def test_argument_checks_use_the_shared_finite_number_check_with_their_messages():
    for module in (sparse_arguments, watchdog, merak3d_arguments):
        assert module.is_finite_number is values.is_finite_number, module.__name__
    with pytest.raises(ValueError, match="timeout_s=nan must be a finite number of seconds > 0"):
        watchdog.StallClock(math.nan)
    with pytest.raises(ValueError, match="latency_us=inf must be a finite number of microseconds >= 0"):
        SparseCommunication("s2", latency_us=math.inf)
    with pytest.raises(ValueError, match=r"recompute_ratio=True must lie in \[0, 1\]"):
        Merak3DStrategy(recompute_ratio=True)


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_config_naming_bfloat16_is_built_in_float32_with_a_notice(key, caplog):
    """A config copied from a pretrained model names its checkpoint's dtype; transformers' from_config would build
    bfloat16 parameters, which a 32-true run would then train. Built in float32 (as from_pretrained loads it), with
    one line naming what sets the training dtype."""
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig

    config = ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, key: "bfloat16"})
    with caplog.at_level("INFO"):
        model = build_causal_lm(config, vocab_size=64)
    assert {param.dtype for param in model.parameters()} == {torch.float32}
    assert "model.config names dtype torch.bfloat16: the model is built in float32" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        build_causal_lm(dataclasses.replace(config, config={**config.config, key: "float32"}), vocab_size=64)
    assert "names dtype" not in caplog.text
