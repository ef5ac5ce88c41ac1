"""Fine-tuning Q-BaRA / QA-HiRA with Lightning, and the Hydra ``adapter`` options."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_merak.adapters import QAHiRAConfig, QBaRAConfig, quantize_model
from lightning_merak.cli.config import register_configs
from lightning_merak.cli.options.adapter import register

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128,
)


def counting_sequences(count: int, length: int, seed: int, modulus: int = 16) -> torch.Tensor:
    """Token sequences ``start, start+step, ...`` (mod 16): predictable from context, unknown to the model."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, modulus, (count, 1), generator=generator)
    step = torch.randint(1, 4, (count, 1), generator=generator)
    return (start + step * torch.arange(length)) % modulus


class TinyCausalLM(pl.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)


@pytest.mark.parametrize(
    "quantization,config",
    [
        (
            "nf4",
            QBaRAConfig(
                r=4,
                alpha=16,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            ),
        ),
        (
            "int4",
            QAHiRAConfig(
                lambda_in=16,
                lambda_out=1,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            ),
        ),
    ],
)
def test_lightning_fine_tuning_lowers_the_loss(quantization: str, config: QBaRAConfig) -> None:
    from peft import get_peft_model

    pl.seed_everything(0, verbose=False)
    model = quantize_model(LlamaForCausalLM(LlamaConfig(**TINY)), quantization, group_size=16)
    peft_model = get_peft_model(model, config)
    frozen = {n: p.detach().clone() for n, p in peft_model.named_parameters() if not p.requires_grad}
    data = torch.utils.data.TensorDataset(counting_sequences(256, 16, seed=0))
    module = TinyCausalLM(peft_model)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=60, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16, shuffle=True))
    first, last = sum(module.losses[:5]) / 5, sum(module.losses[-5:]) / 5
    assert last < first - 0.2, (first, last)
    assert all(torch.equal(p, frozen[n]) for n, p in peft_model.named_parameters() if n in frozen)


@pytest.fixture
def adapter_options():
    register_configs()
    register()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_merak.conf", version_base=None):
        yield
    GlobalHydra.instance().clear()


@pytest.mark.parametrize(
    "option,quantized_type", [("lora", "Linear4bit"), ("qbara", "Linear4bit"), ("qahira", "QuantLinearInt4")]
)
def test_hydra_adapter_options_build_a_trainable_model(adapter_options, option: str, quantized_type: str) -> None:
    cfg = compose(overrides=[f"+adapter={option}", "adapter.r=4", "adapter.group_size=16"])
    options = OmegaConf.to_object(cfg.adapter)
    assert options.name == option
    torch.manual_seed(0)
    model = options.apply(LlamaForCausalLM(LlamaConfig(**TINY)))
    assert isinstance(model, PeftModel)
    assert type(model.base_model.model.model.layers[0].mlp.down_proj.base_layer).__name__ == quantized_type
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(("lora_" in n) or ("qbara_" in n) or ("qahira_" in n) for n in trainable)
    loss = model(input_ids=counting_sequences(2, 8, 0), labels=counting_sequences(2, 8, 0)).loss
    loss.backward()


def test_hydra_rejects_unknown_quantization(adapter_options) -> None:
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    with pytest.raises((ValidationError, ConfigCompositionException), match="nf5"):
        compose(overrides=["+adapter=qbara", "adapter.quantization=nf5"])
