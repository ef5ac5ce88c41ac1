"""Fine-tune QA-HiRA (or Q-BaRA) on a quantized tiny Llama with Lightning, merge, and save.

    python examples/finetune_adapter.py                      # QA-HiRA on the INT4 base, exact merge
    python examples/finetune_adapter.py --method qbara       # Q-BaRA on an NF4 base, lossy merge

The model is built from its config (random weights, nothing downloaded) and learns counting
sequences; the point is the workflow: quantize -> adapt -> train -> merge -> save -> reload.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
from peft import get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_merak.adapters import QAHiRAConfig, QBaRAConfig, load_int4_model, quantize_model, save_int4_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class CausalLM(pl.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.lr)


def counting_data(count: int, length: int = 32, modulus: int = 16) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(0, modulus, (count, 1), generator=generator)
    step = torch.randint(1, 4, (count, 1), generator=generator)
    return torch.utils.data.TensorDataset((start + step * torch.arange(length)) % modulus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["qahira", "qbara"], default="qahira")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--out", type=Path, default=Path("outputs/finetune_adapter"))
    args = parser.parse_args()
    pl.seed_everything(0)

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(config)
    if args.method == "qahira":
        # INT4 groups of 32 inputs; pooling the adapter over the same 32 inputs makes the merge exact.
        quantize_model(model, "int4", group_size=32)
        adapter = QAHiRAConfig(r=8, alpha=16, lambda_in=32, lambda_out=1, target_modules=TARGETS)
    else:
        # NF4 + double quant (QLoRA's base); Q-BaRA with lambda=2 has LoRA-8's parameter count.
        quantize_model(model, "nf4", double_quant=True)
        adapter = QBaRAConfig(r=8, alpha=16, lambda_in=2, lambda_out=2, target_modules=TARGETS)
    model = get_peft_model(model, adapter)
    model.print_trainable_parameters()

    loader = torch.utils.data.DataLoader(counting_data(1024), batch_size=16, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False)
    trainer.fit(CausalLM(model, lr=1e-2), loader)

    model.save_pretrained(args.out / "adapter")  # the adapter alone, reloadable with PeftModel.from_pretrained
    probe = counting_data(4)[:][0]
    with torch.no_grad():
        adapted = model(input_ids=probe).logits
        merged = model.merge_and_unload()
        merged_logits = merged(input_ids=probe).logits
    print(
        "max |merged - adapted| / max |adapted| = "
        f"{((merged_logits - adapted).abs().max() / adapted.abs().max()):.2e}"
    )
    if args.method == "qahira":
        save_int4_model(merged, args.out / "merged_int4")
        with torch.no_grad():
            reloaded = load_int4_model(args.out / "merged_int4")(input_ids=probe).logits
        print(f"reloaded INT4 export matches: {torch.allclose(reloaded, merged_logits, rtol=0, atol=1e-5)}")
    else:
        print("NF4 merge re-quantizes the weights: close but not exact; keep the adapter separate for exact outputs")


if __name__ == "__main__":
    main()
