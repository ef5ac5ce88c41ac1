"""``merak-train``: the Hydra application that trains a causal LM with lightning-merak.

    merak-train                                   # embedded default: tiny Llama, generated data, 2 CPU ranks
    merak-train model=gpt2_tiny trainer.max_steps=50
    merak-train data=text data.path=/abs/corpus.jsonl
    torchrun --max-restarts 3 --nproc-per-node 2 -m lightning_merak.cli.train resume=auto hydra.run.dir=runs/a
                                                  # restarts resume from the newest complete checkpoint
    python -m lightning_merak.cli.train --help        # config groups and every key

Configuration is validated while Hydra composes it (typed schemas in
:mod:`lightning_merak.cli.config`), and the run is validated by :func:`validate_run`
before any process is launched. The other ranks of a single-node run start at once and
import while rank 0 does, then wait until rank 0 has made every check before launch
(:mod:`lightning_merak.cli.prelaunch`); a refused run starts no rank's work.

Multi-node: start one ``merak-train`` per node with the usual launchers; Lightning
detects them through its cluster environments (``torchrun`` sets ``WORLD_SIZE`` etc.,
SLURM sets ``SLURM_*``), and ``trainer.num_nodes`` × ``trainer.devices`` must equal the
launched world size.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_merak.checkpoint.resume import resume_path
from lightning_merak.cli.config import (
    StrategyConfig,
    TrainConfig,
    TrainerConfig,
    register_configs,
    reject_unknown_keys,
)
from lightning_merak.cli.elastic import isolate_restart_attempts
from lightning_merak.cli.prelaunch import (
    PrelaunchedRanks,
    launched_externally,
    prelaunch_local_ranks,
    wait_at_gate,
)
from lightning_merak.cli.reference import register_help
from lightning_merak.distributed.host_memory import restart_with_heap_tunables, skip_final_collection
from lightning_merak.distributed.termination import install_termination_handler
from lightning_merak.util.console import quiet_dependency_noise, quiet_other_ranks

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy

__all__ = ["build_strategy", "main", "train", "validate_run"]


def _launched_world_size() -> int | None:
    """World size set by an external launcher (torchrun or SLURM), if one started us."""
    if not launched_externally(os.environ):
        return None
    from lightning.pytorch.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

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
    from lightning.pytorch.strategies import StrategyRegistry

    if config.name not in StrategyRegistry:
        raise ValueError(
            f"strategy.name={config.name!r} is not a registered strategy; available: "
            f"{', '.join(sorted(StrategyRegistry.available_strategies()))}"
        )
    entry = StrategyRegistry[config.name]
    return entry["strategy"](**{**entry["init_params"], **config.strategy_kwargs()})


def _callbacks(config: TrainConfig, output_dir: Path) -> list[Any]:
    """merak-train's own callbacks (checkpoints, learning rate, progress) plus each feature's."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    from lightning_merak.callbacks.checkpoint import PeriodicCheckpoint  # lazy: Lightning
    from lightning_merak.callbacks.progress import StepProgressBar  # lazy: Lightning

    trainer_config = config.trainer
    callbacks: list[Any] = [
        PeriodicCheckpoint(
            dirpath=output_dir / "checkpoints",
            filename="step={step}",
            auto_insert_metric_name=False,
            every_n_train_steps=trainer_config.val_check_interval,
            save_last="link" if trainer_config.save_last else None,
        ),
        LearningRateMonitor(logging_interval="step"),
    ]
    if trainer_config.enable_progress_bar:
        callbacks.append(StepProgressBar(log_every_n_steps=trainer_config.log_every_n_steps))
    callbacks += config.moe.build_callbacks()
    callbacks += config.memory.build_callbacks()
    callbacks += config.comm.build_callbacks()
    callbacks += config.faults.build_callbacks()
    return callbacks


def _profiler(config: TrainConfig, output_dir: Path) -> Any:
    """The ``profiler`` option's Lightning profiler (``profiler=trace``), or None."""
    return config.profiler.build(output_dir)


def _link_last_to_final(checkpoints: Path, final_checkpoint: Path) -> None:
    """Point ``last.ckpt`` at the final checkpoint (a link, not a copy)."""
    last = checkpoints / "last.ckpt"
    if last.is_symlink() or last.exists():
        last.unlink()
    last.symlink_to(final_checkpoint.name)


def train(config: TrainConfig, prelaunched: PrelaunchedRanks | None = None) -> Path:
    """Train as configured and return the output directory.

    ``prelaunched``: this node's other ranks, started early by ``merak-train`` and waiting until every check
    before launch has passed (:mod:`lightning_merak.cli.prelaunch`); None lets Lightning launch them."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO  # lazy: torch, Lightning

    quiet_other_ranks()
    validate_run(config.trainer)
    output_dir = Path(config.output_dir)
    resume_from = resume_path(config.resume, output_dir / "checkpoints")
    isolate_restart_attempts()  # a torchrun restart's ranks must not find the failed attempt's addresses
    strategy = build_strategy(config.strategy)
    world_size = config.trainer.devices * config.trainer.num_nodes
    batch_shape = {"batch_size": config.data.batch_size, "sequence_length": config.data.seq_len,
                   "accumulate_grad_batches": config.trainer.accumulate_grad_batches}
    if hasattr(strategy, "validate_arguments"):
        strategy.validate_arguments(world_size, **batch_shape)
    if getattr(strategy, "strategy_name", None) == "merak3d":
        from lightning_merak.parallel.pipeline.router_aux import router_aux_loss_problem  # lazy: torch

        problem = router_aux_loss_problem(config.model.config.get("output_router_logits", False),
                                          getattr(config.strategy, "pipeline_parallel", 1),
                                          micro_batching=getattr(config.strategy, "micro_batching", "none"),
                                          sequence_parallel=getattr(config.strategy, "sequence_parallel", False),
                                          tensor_parallel=getattr(config.strategy, "tensor_parallel", 1))
        if problem is not None:
            raise ValueError(problem)
    if getattr(strategy, "strategy_name", None) == "merak3d" and getattr(config.moe, "experts", None) == "merak_ep":
        from lightning_merak.parallel.experts import check_merak3d_experts  # lazy: torch

        check_merak3d_experts(strategy, world_size, getattr(config.moe, "ep_size", None))
        if getattr(config.moe, "placement", "none") in ("pro_prophet", "shadowing"):
            raise ValueError(f"moe.placement={config.moe.placement} with moe.experts=merak_ep re-plans replicas under "
                             "DDP; under merak3d it is not built (each stage's experts have their own group): use "
                             "strategy=ddp or moe.placement=none")
        if getattr(config.moe, "lancet_scope", "layer") == "block":
            raise ValueError("moe.lancet_scope=block with moe.experts=merak_ep under merak3d is not built (merak3d "
                             "splits a stage's micro-batch itself); use strategy=ddp for block-scope Lancet, or "
                             "moe.lancet_scope=layer")

    from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm  # lazy: torch, Lightning
    from lightning_merak.modules.data import LanguageModelingData  # lazy: torch, Lightning

    pl.seed_everything(config.trainer.seed, workers=True, verbose=rank_zero_only.rank == 0)
    data = LanguageModelingData(config.data)

    # merak3d builds the model in configure_model(), inside its sharded context: on the meta device, each rank
    # materialising only its part later (and reading only its part of a pretrained checkpoint). Adapters attach
    # on meta too; each rank quantises its own frozen base once it is real. DDP builds it whole, and so do MoE
    # plugins, which regroup weights that must exist.
    on_meta = getattr(strategy, "strategy_name", None) == "merak3d" and config.moe.name == "none"
    pretrained = config.model.path

    def build_model() -> Any:
        if pretrained:
            from lightning_merak.hf import pretrained_causal_lm  # lazy: torch, transformers

            base = pretrained_causal_lm(pretrained, data.vocab_size, config.model.config, weights=not on_meta)
        else:
            base = build_causal_lm(config.model, vocab_size=data.vocab_size)
        if on_meta and config.adapter.name != "none":
            from lightning_merak.adapters.meta import attach_on_meta  # lazy: torch, PEFT

            return attach_on_meta(config.adapter, base)
        return config.adapter.apply(config.moe.apply(base))

    module = CausalLMModule(None if on_meta else build_model(), config.trainer, model_factory=build_model,
                            pretrained_path=pretrained if on_meta else None)
    if on_meta:  # now, so the launch checks see the (meta) model; Lightning's own call then finds it built
        with strategy.model_sharded_context():
            module.configure_model()
    if hasattr(strategy, "validate_before_launch"):
        strategy.validate_before_launch(module, world_size, **batch_shape)

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
        callbacks=_callbacks(config, output_dir),
        logger=[
            CSVLogger(output_dir, name="csv", version=""),
            TensorBoardLogger(output_dir, name="tensorboard", version=""),
        ],
        default_root_dir=output_dir,
        plugins=[SafeCheckpointIO()],
        profiler=_profiler(config, output_dir),
    )
    if rank_zero_only.rank == 0 and data.language is not None:
        print(
            f"merak-train: generated language with vocab {data.vocab_size}; "
            f"loss floor (entropy rate) {data.language.entropy_rate:.3f} nats"
        )
    if rank_zero_only.rank == 0 and resume_from is not None:
        print(f"merak-train: resuming from {resume_from}")
    if prelaunched is not None:
        prelaunched.start()
    trainer.fit(module, datamodule=data, ckpt_path=resume_from)
    if getattr(strategy, "plan_only", False):
        if trainer.is_global_zero:
            print(
                "merak-train: plan only, nothing trained. Planned layout: "
                f"{strategy.layout_plan.best.layout.describe() if strategy.layout_plan else strategy.layout}"
            )
        if prelaunched is not None:
            prelaunched.finish()
        return output_dir
    checkpoints = output_dir / "checkpoints"
    final_checkpoint = checkpoints / "final.ckpt"
    trainer.save_checkpoint(final_checkpoint, weights_only=False)
    if trainer.is_global_zero:
        if trainer_config.save_last:
            _link_last_to_final(checkpoints, final_checkpoint)
        print(
            f"merak-train: done. Outputs in {output_dir.resolve()} — checkpoint: "
            f"{final_checkpoint}, metrics: {output_dir / 'csv' / 'metrics.csv'}, "
            f"tensorboard: {output_dir / 'tensorboard'}"
        )
    if prelaunched is not None:
        prelaunched.finish()
    return output_dir


@hydra.main(version_base="1.3", config_path="pkg://lightning_merak.conf", config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
    reject_unknown_keys(cfg)
    config: Any = OmegaConf.to_object(cfg)
    validate_run(config.trainer)  # before any rank starts; train() checks the rest before the ranks begin work
    train(config, prelaunch_local_ranks(config.trainer.devices, config.trainer.num_nodes))


_PRINTS_ONLY = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i"}
"""Hydra's flags that print something and exit."""


def main() -> None:
    """Console entry point of ``merak-train``."""
    restart_with_heap_tunables()
    wait_at_gate()  # a rank started early by rank 0 (below): imports, then waits until rank 0 has checked the run
    install_termination_handler()
    quiet_dependency_noise()
    register_configs()
    register_help()
    try:
        _hydra_entry()
    except BrokenPipeError:
        if not _PRINTS_ONLY.intersection(sys.argv[1:]):
            raise
        # `merak-train --help | head`: the reader left early; stop quietly, as a closed pipe ends other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    finally:
        skip_final_collection()


if __name__ == "__main__":
    main()
