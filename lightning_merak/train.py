"""``merak-train``: the Hydra application that trains a causal LM with lightning-merak.

    merak-train                                   # embedded default: tiny Llama, generated data, 2 CPU ranks
    merak-train model=gpt2_tiny trainer.max_steps=50
    merak-train data=text data.path=/abs/corpus.jsonl
    python -m lightning_merak.train --help        # config groups and every key

Configuration is validated while Hydra composes it (typed schemas in
:mod:`lightning_merak.config`), and the run is validated by :func:`validate_run`
before any process is launched.

Multi-node: start one ``merak-train`` per node with the usual launchers; Lightning
detects them through its cluster environments (``torchrun`` sets ``WORLD_SIZE`` etc.,
SLURM sets ``SLURM_*``), and ``trainer.num_nodes`` × ``trainer.devices`` must equal the
launched world size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch.strategies import Strategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

import lightning_merak  # noqa: F401 - importing registers the plugin's strategies
from lightning_merak.config import StrategyConfig, TrainConfig, TrainerConfig, register_configs
from lightning_merak.data import LanguageModelingData
from lightning_merak.models import CausalLMModule, build_causal_lm

__all__ = ["build_strategy", "main", "train", "validate_run"]


def _launched_world_size() -> int | None:
    """World size set by an external launcher (torchrun or SLURM), if one started us."""
    if TorchElasticEnvironment.detect():
        return int(os.environ["WORLD_SIZE"])
    if SLURMEnvironment.detect():
        return int(os.environ["SLURM_NTASKS"])
    return None


def validate_run(config: TrainerConfig) -> None:
    """Refuse a world size this machine or launcher cannot provide, naming the fix."""
    if config.devices < 1 or config.num_nodes < 1:
        raise ValueError(
            f"trainer.devices={config.devices} and trainer.num_nodes={config.num_nodes} must be at least 1"
        )
    requested = config.devices * config.num_nodes
    if config.accelerator in ("gpu", "cuda"):
        import torch

        available = torch.cuda.device_count()
        if config.devices > available:
            raise ValueError(
                f"trainer.devices={config.devices} but this machine has {available} GPU(s); "
                f"set trainer.devices<={available}, or trainer=cpu_ddp to train on CPU processes"
            )
    elif config.accelerator != "cpu":
        raise ValueError(f"trainer.accelerator={config.accelerator!r} is not supported; use cpu or gpu")
    launched = _launched_world_size()
    if launched is not None and launched != requested:
        raise ValueError(
            f"the launcher started {launched} processes but trainer.num_nodes × trainer.devices = "
            f"{config.num_nodes} × {config.devices} = {requested}; make them equal"
        )


def build_strategy(config: StrategyConfig) -> Strategy:
    """Instantiate a registered strategy by name, overriding its registered defaults with ``kwargs``."""
    if config.name not in StrategyRegistry:
        raise ValueError(
            f"strategy.name={config.name!r} is not a registered strategy; available: "
            f"{', '.join(sorted(StrategyRegistry.available_strategies()))}"
        )
    entry = StrategyRegistry[config.name]
    return entry["strategy"](**{**entry["init_params"], **config.strategy_kwargs()})


def train(config: TrainConfig) -> Path:
    """Train as configured and return the output directory."""
    validate_run(config.trainer)
    pl.seed_everything(config.trainer.seed, workers=True)
    data = LanguageModelingData(config.data)
    model = build_causal_lm(config.model, vocab_size=data.vocab_size)
    model = config.moe.apply(model)
    model = config.adapter.apply(model)
    module = CausalLMModule(model, config.trainer)
    strategy = build_strategy(config.strategy)
    if hasattr(strategy, "validate_before_launch"):
        strategy.validate_before_launch(module, config.trainer.devices * config.trainer.num_nodes)

    output_dir = Path(config.output_dir)
    checkpoint = ModelCheckpoint(
        dirpath=output_dir / "checkpoints", save_last=True, every_n_train_steps=config.trainer.val_check_interval
    )
    callbacks: list[pl.Callback] = [checkpoint, LearningRateMonitor(logging_interval="step")]
    callbacks += config.moe.build_callbacks()
    callbacks += config.memory.build_callbacks()
    callbacks += config.comm.build_callbacks()
    loggers = [
        CSVLogger(output_dir, name="csv", version=""),
        TensorBoardLogger(output_dir, name="tensorboard", version=""),
    ]
    trainer_config = config.trainer
    trainer = pl.Trainer(
        accelerator=trainer_config.accelerator,
        devices=trainer_config.devices,
        num_nodes=trainer_config.num_nodes,
        strategy=strategy,
        precision=trainer_config.precision,
        max_steps=trainer_config.max_steps,
        max_epochs=trainer_config.max_epochs,
        gradient_clip_val=trainer_config.gradient_clip_val,
        accumulate_grad_batches=trainer_config.accumulate_grad_batches,
        log_every_n_steps=trainer_config.log_every_n_steps,
        val_check_interval=trainer_config.val_check_interval,
        check_val_every_n_epoch=None if trainer_config.val_check_interval else 1,
        limit_val_batches=trainer_config.limit_val_batches,
        enable_progress_bar=trainer_config.enable_progress_bar,
        callbacks=callbacks,
        logger=loggers,
        default_root_dir=output_dir,
    )
    if rank_zero_only.rank == 0 and data.language is not None:
        print(
            f"merak-train: generated language with vocab {data.vocab_size}; "
            f"loss floor (entropy rate) {data.language.entropy_rate:.3f} nats"
        )
    trainer.fit(module, datamodule=data)
    if getattr(strategy, "plan_only", False):
        if trainer.is_global_zero:
            print(f"merak-train: plan only, nothing trained. Planned layout: {strategy.layout_plan.best.layout.describe()}")
        return output_dir
    final_checkpoint = output_dir / "checkpoints" / "final.ckpt"
    trainer.save_checkpoint(final_checkpoint)
    if trainer.is_global_zero:
        print(
            f"merak-train: done. Outputs in {output_dir.resolve()} — checkpoint: "
            f"{final_checkpoint}, metrics: {output_dir / 'csv' / 'metrics.csv'}, "
            f"tensorboard: {output_dir / 'tensorboard'}"
        )
    return output_dir


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
    config: Any = OmegaConf.to_object(cfg)
    train(config)


def main() -> None:
    """Console entry point of ``merak-train``."""
    register_configs()
    _hydra_entry()


if __name__ == "__main__":
    main()
