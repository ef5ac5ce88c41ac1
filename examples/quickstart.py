"""The README's Python quickstart: a tiny Llama on the generated language with Lightning's DDP.

    python examples/quickstart.py                  # 2 CPU processes, 300 steps
    python examples/quickstart.py --devices 1 --max-steps 20
"""

import argparse

import lightning.pytorch as pl

import lightning_merak  # noqa: F401 - registers the plugin's strategies with Lightning
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import DataConfig, ModelConfig
from lightning_merak.modules.data import LanguageModelingData


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=300)
    args = parser.parse_args()

    pl.seed_everything(1234)
    data = LanguageModelingData(DataConfig(name="synthetic", seq_len=64, batch_size=16))
    model = build_causal_lm(
        ModelConfig(
            name="llama",
            model_type="llama",
            config={"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4,
                    "num_attention_heads": 4, "num_key_value_heads": 2},
        ),
        vocab_size=data.vocab_size,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(CausalLMModule(model), datamodule=data)
    if trainer.is_global_zero:
        print(f"final train loss {trainer.callback_metrics['train/loss'].item():.3f}")


if __name__ == "__main__":
    main()
