"""``merak-export --merge-adapters`` of LoRA on fused expert tensors (#30 item 5).

PEFT wraps a fused experts module once per adapted tensor (``experts.base_layer.base_layer.gate_up_proj``), so
the export merges with PEFT's own wrappers rebuilt on that one module. The output equals ``save_pretrained`` of
the merged unswapped model tensor for tensor (per expert, as transformers writes Mixtral and Qwen3-MoE), from a
Lightning ``.ckpt`` and from a merak3d sharded directory (where ``lora_B`` is stored as ``[out, r, E]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lightning_merak.hf import export_checkpoint, model_record
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.testing import run_distributed

VOCAB = 128
PEFT_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]  # PEFT maps these onto the fused experts


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _adapted(family: str, targets: str = "ours", init_lora_weights: bool = True) -> Any:
    """``family``'s tiny model with LoRA on attention and its fused experts: chosen by ``moe_adapter_config``
    (``ours``), or PEFT's own rewrite of the per-expert Linear targets (``peft``, rank and alpha doubled on
    ``gate_up_proj``)."""
    from peft import LoraConfig

    from lightning_merak.adapters.moe import add_moe_adapters, moe_adapter_config
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    base = tiny_moe_model(family, hidden=32, layers=2, vocab=VOCAB, seed=0)
    base.config.use_cache = False
    config = (moe_adapter_config(base, r=4, alpha=8, init_lora_weights=init_lora_weights) if targets == "ours"
              else LoraConfig(r=4, lora_alpha=8, target_modules=list(PEFT_TARGETS),
                              init_lora_weights=init_lora_weights))
    torch.manual_seed(11)
    return add_moe_adapters(base, config)


def _train(model: Any, steps: int) -> None:
    """A few SGD steps on the adapters alone (``B`` leaves zero, each expert's factors their own values)."""
    params = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.SGD(params, lr=0.5)
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        ids = torch.randint(3, VOCAB, (4, 8), generator=generator)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()


def _checkpoint(model: Any, path: Path) -> Path:
    """What Lightning writes for a DDP run: the module's state under ``model.``, plus the model record."""
    torch.save({"state_dict": CausalLMModule(model).state_dict(), "hf_model": model_record(model)},
               path)
    return path


def _check_export(out: Path, reference: dict[str, torch.Tensor], merged: torch.nn.Module) -> None:
    """``out`` holds exactly ``reference`` (what ``save_pretrained`` writes) and loads to ``merged``'s logits."""
    exported = _stored(out)
    assert sorted(exported) == sorted(reference)
    unequal = [key for key, tensor in reference.items() if not torch.equal(exported[key], tensor)]
    assert not unequal, f"differ from save_pretrained of the merged model: {unequal[:4]}"
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        error = (reloaded(ids).logits - merged.eval()(ids).logits).abs().max().item()
    assert error <= 1e-5, error


@pytest.mark.parametrize(("family", "targets"), [("qwen3_moe", "ours"), ("mixtral", "ours"), ("qwen3_moe", "peft")])
def test_trained_expert_adapters_export_as_the_merged_model(tmp_path: Path, family: str, targets: str) -> None:
    model = _adapted(family, targets)
    _train(model, steps=3)
    experts = [name for name in model.state_dict() if ".experts.base_layer.base_layer." in name]
    assert experts, "PEFT nests one ParamWrapper per adapted expert tensor"
    checkpoint = _checkpoint(model, tmp_path / "adapted.ckpt")
    with pytest.raises(ValueError, match="adapter weights.*--merge-adapters"):
        export_checkpoint(checkpoint, tmp_path / "refused")
    export_checkpoint(checkpoint, tmp_path / "out", merge_adapters=True, max_shard_size="100KB")
    merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path / "reference")
    reference = _stored(tmp_path / "reference")
    assert any(".experts.0." in key for key in reference), "transformers writes these families per expert"
    _check_export(tmp_path / "out", reference, merged)


def test_per_layer_lambdas_export_merged(tmp_path: Path) -> None:
    """``lambda_overrides`` name some layers only: each layer's one-layer export skeleton is wrapped with the keys
    that name it (the config refuses keys matching nothing)."""
    from lightning_merak.adapters import moe
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    base = tiny_moe_model("qwen3_moe", hidden=32, layers=2, vocab=VOCAB, seed=0)
    base.config.use_cache = False
    model = moe.add_moe_adapters(base, moe.moe_adapter_config(base, "qbara", r=4, lambda_overrides={
        "down_proj": [1, 1], "q_proj": [1, 2]}))
    _train(model, steps=2)
    export_checkpoint(_checkpoint(model, tmp_path / "adapted.ckpt"), tmp_path / "out", merge_adapters=True)
    merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path / "reference")
    _check_export(tmp_path / "out", _stored(tmp_path / "reference"), merged)


def test_untrained_expert_adapters_export_the_base_bit_exact(tmp_path: Path) -> None:
    """``B = 0`` (PEFT's initialisation, no step): the merged export is the base model's ``save_pretrained``."""
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = _adapted("qwen3_moe")
    tiny_moe_model("qwen3_moe", hidden=32, layers=2, vocab=VOCAB, seed=0).save_pretrained(tmp_path / "base")
    base = _stored(tmp_path / "base")
    export_checkpoint(_checkpoint(model, tmp_path / "fresh.ckpt"), tmp_path / "out", merge_adapters=True)
    _check_export(tmp_path / "out", base, model.merge_and_unload())


def test_adapter_config_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    model = _adapted("qwen3_moe")
    checkpoint = torch.load(_checkpoint(model, tmp_path / "a.ckpt"), weights_only=False)
    checkpoint["hf_model"]["adapters"]["default"]["target_parameters"] = ["experts.down_proj"]
    torch.save(checkpoint, tmp_path / "b.ckpt")
    with pytest.raises(ValueError, match="recorded adapter config wraps .*experts as"):
        export_checkpoint(tmp_path / "b.ckpt", tmp_path / "out", merge_adapters=True)


def _save_sharded(rank: int, world_size: int, path: str) -> None:
    """One step at merak3d dp=2 with ``merak_ep`` over both ranks (each holds 8 of 16 experts and their
    adapters), then the sharded checkpoint."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    class Module(CausalLMModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.5)

    module = Module(_adapted("qwen3_moe", init_lora_weights=False))
    data = TensorDataset(torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(rank)))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
        strategy=Merak3DStrategy(pipeline_parallel=1, tensor_parallel=1, data_parallel=2, micro_batches=1,
                                 partition="uniform", timeout_s=60),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False, callbacks=[ExpertParallelCallback(log_every_n_steps=1)])
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=4))
    trainer.save_checkpoint(path)


def _read_whole(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a merak3d checkpoint directory under the model's names, as stored."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype) for key, entry in metadata.items()
             if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {key[len("model."):]: value for key, value in state.items()}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_sharded_checkpoint_exports_merged(tmp_path: Path) -> None:
    """A merak3d dp=2 × ep=2 directory: each expert factor was written by slices (``lora_B`` as ``[out, r, E]``);
    the export equals ``save_pretrained`` of the single-process model holding the checkpoint's factors, merged."""
    path = tmp_path / "sharded"
    run_distributed(_save_sharded, 2, args=(str(path),), timeout_s=100)
    stored = _read_whole(path)
    views = [key for key, value in stored.items() if ".experts.lora_B." in key and value.ndim == 3]
    assert views, "merak3d stores the expert lora_B factors as [out, r, E]"
    model = _adapted("qwen3_moe", init_lora_weights=False)
    state = model.state_dict()
    loaded = {name: stored[f"model.{name}"].reshape(value.shape) for name, value in state.items()}
    model.load_state_dict(loaded)
    export_checkpoint(path, tmp_path / "out", merge_adapters=True)
    merged = model.merge_and_unload()
    merged.save_pretrained(tmp_path / "reference")
    _check_export(tmp_path / "out", _stored(tmp_path / "reference"), merged)


def test_qahira_on_int4_experts_exports_the_dequantised_experts_merged(tmp_path: Path) -> None:
    """QA-HiRA trained on experts stored in INT4 (and attention on INT4 layers): the merged export writes each
    expert's dequantised weight plus its adapter's update in float, so the reloaded model computes what the trained
    quantised model computes (fp32, within 1e-5); without --merge-adapters the INT4 experts are refused."""
    from lightning_merak.adapters import moe, quantize_model
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    base = tiny_moe_model("qwen3_moe", hidden=32, layers=2, vocab=VOCAB, seed=0)
    base.config.use_cache = False
    quantize_model(base, "int4", 16, experts=True)
    model = moe.add_moe_adapters(base, moe.moe_adapter_config(base, "qahira", r=4, alpha=8, lambda_in=16,
                                                              lambda_out=2))
    assert any(".parametrizations.gate_up_proj.original" in name for name in model.state_dict())
    _train(model, steps=3)
    checkpoint = _checkpoint(model, tmp_path / "int4.ckpt")
    with pytest.raises(ValueError, match="quantised base.*--merge-adapters"):
        export_checkpoint(checkpoint, tmp_path / "refused")
    export_checkpoint(checkpoint, tmp_path / "out", merge_adapters=True)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        error = (reloaded(ids).logits - model.eval()(ids).logits).abs().max().item()
    assert error <= 1e-5, error
