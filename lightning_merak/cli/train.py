"""``merak-train``: the Hydra application that trains a causal LM with lightning-merak.

    merak-train                                   # embedded default: tiny Llama, generated data, 2 CPU ranks
    merak-train model=gpt2_tiny trainer.max_steps=50
    merak-train data=text data.path=/abs/corpus.jsonl
    merak-train module._target_=mypkg.MyModule data._target_=mypkg.MyData logger=[csv,wandb]
    torchrun --max-restarts 3 --nproc-per-node 2 -m lightning_merak.cli.train resume=auto hydra.run.dir=runs/a
                                                  # restarts resume from the newest complete checkpoint
    python -m lightning_merak.cli.train --help        # config groups and every key

The command line is checked against the schemas before Hydra composes it
(:mod:`lightning_merak.cli.overrides`: a misspelled key or option gets "did you mean ...?" first), the
configuration while Hydra composes it (typed schemas in :mod:`lightning_merak.cli.config`), and the run by
:func:`prepare` before any process is launched: a refusal prints its reason alone, without a traceback, and
exits with status 2. The other ranks of a single-node run start at once and
import while rank 0 does, then wait until rank 0 has made every check before launch
(:mod:`lightning_merak.cli.prelaunch`); a refused run starts no rank's work.

Multi-node: start one ``merak-train`` per node with the usual launchers; Lightning
detects them through its cluster environments (``torchrun`` sets ``WORLD_SIZE`` etc.,
SLURM sets ``SLURM_*``), and ``trainer.num_nodes`` × ``trainer.devices`` must equal the
launched world size.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import hydra
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from lightning_merak.checkpoint.resume import resume_path
from lightning_merak.cli.checks import (
    DATAMODULE_MEMBERS,
    MODULE_MEMBERS,
    batch_shape,
    check_adapter_shards,
    check_batches_before_launch,
    check_callbacks_take,
    check_context_calibration,
    check_node_launch,
    check_profiler_window,
    check_resumed_optimizer,
    check_schedule_end,
    check_strategy_accelerator,
    check_streaming_loop,
    config_object,
    fixed_sequence_length,
    longest_sample_setting,
)
from lightning_merak.cli.config import StrategyConfig, TrainConfig, register_configs, reject_unknown_keys
from lightning_merak.cli.elastic import RendezvousFailed, SettingsDiffer, install_checked_rendezvous
from lightning_merak.cli.overrides import SET_BY_MERAK_TRAIN, ConfigError, check_overrides, trainer_arguments
from lightning_merak.cli.prelaunch import (
    PrelaunchedRanks,
    launched_externally,
    prelaunch_local_ranks,
    wait_at_gate,
)
from lightning_merak.cli.reference import register_help
from lightning_merak.cli.same_config import run_settings
from lightning_merak.cli.targets import instantiate_checked, refuse_unknown_keywords
from lightning_merak.distributed.host_memory import restart_with_heap_tunables, skip_final_collection
from lightning_merak.distributed.process_exit import exit_after_python_teardown, leave_process_groups
from lightning_merak.distributed.termination import install_termination_handler
from lightning_merak.modules.config import DataConfig, DataError, TrainerConfig
from lightning_merak.util.console import quiet_dependency_noise, quiet_other_ranks

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy

__all__ = ["PreparedRun", "build_strategy", "fit", "main", "prepare", "run_command_line", "train", "validate_run"]


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


def validate_run(config: TrainerConfig) -> int:
    """Refuse a world size this machine or launcher cannot provide, naming the fix; return the processes per node
    (``trainer.devices``, with ``-1`` resolved to every GPU of the node)."""
    if config.num_nodes < 1 or config.devices == 0 or config.devices < -1:
        raise ValueError(f"trainer.devices={config.devices} and trainer.num_nodes={config.num_nodes} must be at "
                         "least 1 (trainer.devices=-1: every GPU of the node)")
    devices = config.devices
    if config.accelerator in ("gpu", "cuda"):
        import torch

        available = torch.cuda.device_count()
        if devices == -1:
            devices = available
        if available == 0:
            raise ValueError(f"trainer.accelerator={config.accelerator} but this machine has no GPU that torch can use "
                             f"(torch {torch.__version__}); use trainer=cpu_ddp to train on CPU processes")
        if devices > available or devices == 0:
            raise ValueError(
                f"trainer.devices={config.devices} but this machine has {available} GPU(s); "
                f"set trainer.devices<={available}, or trainer=cpu_ddp to train on CPU processes"
            )
    elif config.accelerator != "cpu":
        raise ValueError(f"trainer.accelerator={config.accelerator!r} is not supported; use cpu or gpu")
    elif devices == -1:
        raise ValueError("trainer.devices=-1 means every GPU; with trainer.accelerator=cpu give the number of "
                         "processes (e.g. trainer.devices=2)")
    elif str(config.precision) in ("16-mixed", "16"):
        raise ValueError(f"trainer.precision={config.precision} (float16 with loss scaling) needs a GPU; on CPU "
                         "Lightning would train in bf16-mixed instead: use trainer.precision=bf16-mixed, or "
                         "trainer=gpu")
    check_node_launch(config.num_nodes, os.environ)  # a node numbered past the world, or no address: it would hang
    requested = devices * config.num_nodes
    launched = _launched_world_size()
    if launched is not None and launched != requested:
        raise ValueError(
            f"the launcher started {launched} processes but trainer.num_nodes × trainer.devices = "
            f"{config.num_nodes} × {devices} = {requested}; make them equal"
        )
    return devices


def build_strategy(config: StrategyConfig) -> Strategy:
    """Instantiate a registered strategy by name, overriding its registered defaults with ``kwargs``."""
    from lightning.pytorch.strategies import StrategyRegistry

    if config.name not in StrategyRegistry:
        raise ValueError(
            f"strategy.name={config.name!r} is not a registered strategy; available: "
            f"{', '.join(sorted(StrategyRegistry.available_strategies()))}"
        )
    entry = StrategyRegistry[config.name]
    constructor = entry["strategy"]
    refuse_unknown_keywords(constructor.load() if callable(getattr(constructor, "load", None)) else constructor,
                            config.kwargs, "strategy.kwargs")
    return entry["strategy"](**{**entry["init_params"], **config.strategy_kwargs()})


def _callbacks(config: TrainConfig, output_dir: Path) -> list[Any]:
    """merak-train's own callbacks (checkpoints, learning rate, progress), each feature's, then the user's."""
    from lightning.pytorch import Callback
    from lightning.pytorch.callbacks import LearningRateMonitor

    from lightning_merak.callbacks.agreed_stop import AgreedSigtermStop  # lazy: torch, Lightning
    from lightning_merak.callbacks.checkpoint import PeriodicCheckpoint  # lazy: Lightning
    from lightning_merak.callbacks.metrics import TrainingMetrics  # lazy: torch, Lightning, matplotlib
    from lightning_merak.callbacks.progress import StepProgressBar  # lazy: Lightning
    from lightning_merak.callbacks.summary import ModelSummary  # lazy: Lightning

    trainer_config = config.trainer
    callbacks: list[Any] = [
        PeriodicCheckpoint(
            dirpath=output_dir / "checkpoints",
            filename="step={step}",
            auto_insert_metric_name=False,
            every_n_train_steps=trainer_config.val_check_interval,
            save_last="link" if trainer_config.save_last else None,
        ),
        TrainingMetrics(),
        AgreedSigtermStop(),
    ]
    if config.logger:  # logger=[]: no logger, which Lightning's LearningRateMonitor refuses
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if trainer_config.enable_progress_bar:
        callbacks.append(StepProgressBar(log_every_n_steps=trainer_config.log_every_n_steps))
    if trainer_config.kwargs.get("enable_model_summary", True):
        callbacks.append(ModelSummary(seq_len=fixed_sequence_length(config.data)))
    callbacks += config.moe.build_callbacks()
    callbacks += config.memory.build_callbacks()
    callbacks += config.comm.build_callbacks()
    callbacks += config.faults.build_callbacks()
    callbacks += [instantiate_checked(node, f"callbacks[{index}]", Callback)
                  for index, node in enumerate(config.callbacks)]
    return callbacks


def _loggers(config: TrainConfig) -> list[Any]:
    """The ``logger`` group's loggers (``logger=[csv,wandb]``), in the order chosen."""
    from lightning.pytorch.loggers import Logger

    loggers = []
    for name, node in (config.logger or {}).items():
        if name == "mlflow" and str(node.get("tracking_uri", "")).startswith("file:"):
            # MLflow 3 refuses its file store unless asked; it is the one local store that needs no server and no
            # database driver (mlflow-skinny has none), which logger=mlflow writes under the run directory
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        loggers.append(instantiate_checked(node, f"logger.{name}", Logger))
    return loggers


def _trainer_kwargs(config: TrainerConfig) -> dict[str, Any]:
    """``trainer.kwargs``: refused if not a ``Trainer`` argument, or one merak-train sets under another key."""
    known = trainer_arguments()
    named = {item for item in TrainerConfig.__dataclass_fields__ if item != "kwargs"}
    for key in config.kwargs:
        if key in named:
            raise ConfigError(f"trainer.kwargs.{key}: set trainer.{key} instead")
        if key in SET_BY_MERAK_TRAIN:
            raise ConfigError(f"trainer.{key}: merak-train sets Trainer's {key} itself; use {SET_BY_MERAK_TRAIN[key]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise ConfigError(f"trainer.{key} is not a lightning.Trainer argument"
                              + (f"; did you mean trainer.{close[0]}?" if close else ""))
    return dict(config.kwargs)


def _profiler(config: TrainConfig, output_dir: Path) -> Any:
    """The ``profiler`` option's Lightning profiler (``profiler=trace``), or None."""
    return config.profiler.build(output_dir)


@dataclass
class PreparedRun:
    """A run every check before launch has passed: what :func:`fit` needs to train it."""

    config: TrainConfig
    trainer: pl.Trainer
    module: pl.LightningModule
    data: pl.LightningDataModule
    resume_from: Optional[str]


def _data_parallel_before_launch(strategy: Strategy, world_size: int, trainer_kwargs: dict[str, Any]) -> int:
    """The ranks Lightning's sampler will split the training samples over, where known before launch: DDP's every
    rank; else 1, the fewest (merak3d may plan its data-parallel degree at setup)."""
    from lightning.pytorch.strategies import DDPStrategy

    splits = isinstance(strategy, DDPStrategy) and trainer_kwargs.get("use_distributed_sampler", True)
    return world_size if splits else 1


def _datamodule(config: TrainConfig, data_parallel: int) -> Any:
    """The ``data`` option's datamodule: merak-train's own for a ``DataConfig`` (checked against the
    ``data_parallel`` ranks sharing it), else its ``_target_``'s, whose refusals Hydra's wrapper would hide."""
    import lightning.pytorch as pl

    from lightning_merak.modules.data import LanguageModelingData  # lazy: torch, Lightning

    if isinstance(config.data, DataConfig):
        data = LanguageModelingData(config.data)
        data.check_before_launch(data_parallel)
        return data
    try:
        return instantiate_checked(config.data, "data", pl.LightningDataModule, DATAMODULE_MEMBERS)
    except InstantiationException as error:
        if isinstance(error.__cause__, (ValueError, FileNotFoundError)):  # the datamodule refused a value or path
            raise error.__cause__ from None
        raise


def _user_module(config: TrainConfig, strategy: Strategy) -> Any:
    """``module._target_``'s LightningModule; the groups that transform the built-in model are refused with it."""
    import lightning.pytorch as pl

    for group, chosen in (("adapter", config.adapter.name), ("moe", config.moe.name)):
        if chosen != "none":
            raise ConfigError(f"{group}={chosen} transforms the built-in causal LM's model; with module._target_ "
                              f"apply it in your module, or drop {group}=")
    module = instantiate_checked(config.module, "module", pl.LightningModule, MODULE_MEMBERS)
    if (getattr(strategy, "strategy_name", None) == "merak3d"
            and type(module).configure_model is not pl.LightningModule.configure_model):
        with strategy.model_sharded_context():  # so the checks before launch see the model, as merak3d builds it
            module.configure_model()
    return module


def _check_model_against_run(config: TrainConfig, module: Any, resume_from: Optional[Path]) -> None:
    """Refuse a sequence longer than the model's position table, and a checkpoint saved from a model of other
    sizes or with its experts' optimizer state at another ``moe.ep_size``; a pretrained model run past the positions
    it was trained on gets a notice."""
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_merak.checkpoint import compatible  # lazy: torch
    from lightning_merak.modules.positions import beyond_trained_positions, sequence_length_problem  # lazy: torch

    model, longest = getattr(module, "model", None), longest_sample_setting(config.data)
    if model is not None and longest is not None:
        field, length = longest
        problem = sequence_length_problem(model, length, field)
        if problem is not None:
            raise ValueError(problem)
        notice = beyond_trained_positions(model, length, field) if config.model.path else None
        if notice is not None and rank_zero_only.rank == 0:
            print(f"merak-train: note: {notice}", flush=True)
    if resume_from is not None:
        compatible.check_resume_shapes(resume_from, module)
        compatible.check_resume_expert_parallel(resume_from, module)
        check_resumed_optimizer(module, resume_from)


def _builtin_module(config: TrainConfig, strategy: Strategy, vocab_size: int) -> Any:
    """The causal LM of the ``model``, ``optim``, ``adapter`` and ``moe`` groups."""
    from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm  # lazy: torch, Lightning

    # merak3d builds the model in configure_model(), inside its sharded context: on the meta device, each rank
    # materialising only its part later (and reading only its part of a pretrained checkpoint). Adapters attach
    # on meta too; each rank quantises its own frozen base once it is real. DDP builds it whole, and so do MoE
    # plugins, which regroup weights that must exist, and EmbRace, which shards tables that must exist.
    on_meta = (getattr(strategy, "strategy_name", None) == "merak3d" and config.moe.name == "none"
               and getattr(config.comm, "name", None) != "embrace")
    pretrained = config.model.path

    def build_model() -> Any:
        if pretrained:
            from lightning_merak.hf import pretrained_causal_lm  # lazy: torch, transformers

            base = pretrained_causal_lm(pretrained, vocab_size, config.model.config, weights=not on_meta)
        else:
            base = build_causal_lm(config.model, vocab_size=vocab_size)
        if on_meta and config.adapter.name != "none":
            from lightning_merak.adapters.meta import attach_on_meta  # lazy: torch, PEFT

            return attach_on_meta(config.adapter, base)
        return config.adapter.apply(config.moe.apply(base))

    module = CausalLMModule(None if on_meta else build_model(), config.optim, model_factory=build_model,
                            pretrained_path=pretrained if on_meta else None)
    if on_meta:  # now, so the launch checks see the (meta) model; Lightning's own call then finds it built
        with strategy.model_sharded_context():
            module.configure_model()
    return module


def _check_merak3d_options(config: TrainConfig, strategy: Strategy, world_size: int) -> None:
    """The combinations of ``moe`` and merak3d options that are refused before anything is built."""
    if getattr(strategy, "strategy_name", None) != "merak3d" or config.module:
        return
    from lightning_merak.parallel.pipeline.router_aux import router_aux_loss_problem  # lazy: torch

    problem = router_aux_loss_problem(config.model.config.get("output_router_logits", False),
                                      getattr(config.strategy, "pipeline_parallel", 1),
                                      micro_batching=getattr(config.strategy, "micro_batching", "none"),
                                      sequence_parallel=getattr(config.strategy, "sequence_parallel", False),
                                      tensor_parallel=getattr(config.strategy, "tensor_parallel", 1),
                                      tp_overlap=getattr(config.strategy, "tp_overlap", 1),
                                      context_parallel=getattr(config.strategy, "context_parallel", 1))
    if problem is not None:
        raise ValueError(problem)
    from lightning_merak.callbacks.sparse_comm.arguments import check_merak3d_layout  # lazy: callbacks load on use
    check_merak3d_layout(getattr(config.comm, "name", None), config.strategy)  # S2's tensor_parallel, EmbRace's stages
    if getattr(config.moe, "experts", None) == "merak_ep":
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


def prepare(config: TrainConfig) -> PreparedRun:
    """Build the run and make every check before launch: a refused run raises here, before any rank works."""
    import lightning.pytorch as pl

    from lightning_merak.checkpoint.compatible import resume_checkpoint_io  # lazy: torch, Lightning
    from lightning_merak.parallel.micro_batching.samples import check_consumer  # lazy: torch

    quiet_other_ranks()
    devices = validate_run(config.trainer)
    output_dir = Path(config.output_dir)
    resume_from = resume_path(config.resume, output_dir / "checkpoints")
    # every rank meets the others before the process group: one attempt's ranks, the same settings, or a message
    install_checked_rendezvous(run_settings(config), ranks_per_node=devices)
    strategy = build_strategy(config.strategy)
    check_strategy_accelerator(strategy, config.trainer.accelerator)  # DeepSpeed runs on CUDA only
    world_size = devices * config.trainer.num_nodes
    trainer_kwargs = _trainer_kwargs(config.trainer)
    _check_merak3d_options(config, strategy, world_size)
    check_schedule_end(config)
    check_profiler_window(config)
    check_streaming_loop(config)
    if hasattr(config.moe, "check_layout"):  # before the model is built: the experts' layout refusals
        config.moe.check_layout(strategy, world_size)
    pl.seed_everything(config.trainer.seed, workers=True, verbose=False)
    data = _datamodule(config, _data_parallel_before_launch(strategy, world_size, trainer_kwargs))
    if getattr(data, "lengths", None) == "variable":  # each rank's datamodule checks again in its setup
        check_consumer(strategy)
    shape = batch_shape(config, data)
    if hasattr(strategy, "validate_arguments"):
        strategy.validate_arguments(world_size, **shape)
    check_context_calibration(config, strategy)
    if config.module:
        module = _user_module(config, strategy)
    else:
        vocab_size = getattr(data, "vocab_size", None)
        if not isinstance(vocab_size, int):
            raise ConfigError(f"data._target_={type(data).__qualname__} has no integer vocab_size, which the built-in "
                              "causal LM takes its vocabulary from; give the datamodule one, or set module._target_")
        module = _builtin_module(config, strategy, vocab_size)
    if hasattr(strategy, "validate_before_launch"):
        check_adapter_shards(strategy, module, world_size)
        strategy.validate_before_launch(module, world_size, **shape)
        strategy.validate_precision_before_launch(config.trainer.precision, world_size)
    _check_model_against_run(config, module, resume_from)
    check_batches_before_launch(config, strategy, module, world_size, resume_from)
    callbacks = _callbacks(config, output_dir)
    check_callbacks_take(callbacks, module, strategy, world_size)

    trainer_config = config.trainer
    loggers = [] if getattr(strategy, "plan_only", False) else _loggers(config)  # a plan logs no training
    trainer = pl.Trainer(
        accelerator=trainer_config.accelerator,
        devices=devices,
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
        logger=loggers or False,
        default_root_dir=output_dir,
        plugins=[resume_checkpoint_io(resume_from, config.strategy.name, module)],
        profiler=_profiler(config, output_dir),
        **trainer_kwargs,
    )
    return PreparedRun(config, trainer, module, data, resume_from)


def _hyperparameters(config: TrainConfig) -> dict[str, Any]:
    """The resolved configuration as plain values, which the loggers record as the run's hyperparameters."""
    container = OmegaConf.to_container(OmegaConf.structured(config), resolve=True, enum_to_str=True)
    assert isinstance(container, dict)
    return {str(key): value for key, value in container.items()}


def fit(run: PreparedRun, prelaunched: PrelaunchedRanks | None = None) -> Path:
    """Train a prepared run and return its output directory.

    ``prelaunched``: this node's other ranks, started early by ``merak-train`` and waiting until every check
    before launch has passed (:mod:`lightning_merak.cli.prelaunch`); None lets Lightning launch them."""
    from lightning.pytorch.utilities import rank_zero_only

    from lightning_merak.cli.outputs import finish_run_loggers, outputs, save_final_checkpoint  # lazy: Lightning
    from lightning_merak.cli.stopped import exit_failing_on_sigterm  # lazy: Lightning

    config, trainer = run.config, run.trainer
    output_dir = Path(config.output_dir)
    strategy = trainer.strategy
    language = getattr(run.data, "language", None)
    if rank_zero_only.rank == 0 and language is not None:  # before fit, as the launcher numbered this process
        print(
            f"merak-train: generated language with vocab {run.data.vocab_size}; "
            f"loss floor (entropy rate) {language.entropy_rate:.3f} nats"
        )
    if rank_zero_only.rank == 0 and run.resume_from is not None:
        print(f"merak-train: resuming from {run.resume_from}")
    for logger in trainer.loggers:
        logger.log_hyperparams(_hyperparameters(config))
    if prelaunched is not None:
        prelaunched.start()
    try:
        with exit_failing_on_sigterm(trainer):
            trainer.fit(run.module, datamodule=run.data, ckpt_path=run.resume_from)
    except DataError as error:  # found as the ranks read the data: a refusal naming the fix, not a traceback
        print(f"merak-train: error: {error}", file=sys.stderr, flush=True)
        if prelaunched is not None:
            prelaunched.refused()  # the ranks it started read the same data and refuse it too
        sys.exit(2)
    except (SettingsDiffer, RendezvousFailed) as error:  # found at the rendezvous on every rank; names the fix
        print(f"merak-train: error: {error}", file=sys.stderr, flush=True)
        if prelaunched is not None:
            prelaunched.refused()
        sys.exit(2)
    if getattr(strategy, "plan_only", False):
        if trainer.is_global_zero:
            choice = strategy.layout_choice  # the layout adopted at the fixed degrees, not the unfiltered best
            planned = choice.layout.describe() if choice else strategy.layout.describe(strategy.sequence_parallel)
            print(f"merak-train: plan only, nothing trained. Planned layout: {planned}")
        leave_process_groups()
        if prelaunched is not None:
            prelaunched.finish()
        return output_dir
    final_checkpoint = save_final_checkpoint(trainer, link_last=config.trainer.save_last)  # beside step=N.ckpt
    if trainer.is_global_zero:
        listed = outputs(trainer, final_checkpoint)
        finish_run_loggers(trainer)
        print(f"merak-train: done. Outputs in {output_dir.resolve()} — {', '.join(listed)}")
    leave_process_groups()
    if prelaunched is not None:
        prelaunched.finish()
    return output_dir


def train(config: TrainConfig, prelaunched: PrelaunchedRanks | None = None) -> Path:
    """Train as configured and return the output directory (:func:`prepare`, then :func:`fit`)."""
    return fit(prepare(config), prelaunched)


@contextmanager
def _refusals() -> Iterator[None]:
    """A run refused before launch prints the reason alone on stderr (no traceback: the reason names the fix) and
    ends with status 2; the ranks started early see rank 0 end and leave."""
    try:
        yield
    except (ValueError, TypeError, FileNotFoundError) as error:  # the checks' refusals: of values (ConfigError,
        # OmegaConf's validation errors included), of a module or datamodule that is not what the strategy can train,
        # and of a path given that does not exist
        print(f"merak-train: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


@hydra.main(version_base="1.3", config_path="pkg://lightning_merak.conf", config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
    prelaunched: PrelaunchedRanks | None = None
    try:
        with _refusals():
            reject_unknown_keys(cfg)
            trainer_config: Any = config_object(cfg.trainer)
            devices = validate_run(trainer_config)  # before any rank starts; prepare() checks the rest before they work
            # The other ranks start now, to import while this one builds the whole configuration (its model types
            # import transformers' registry: 2.5 s on two cores) and prepares the run.
            prelaunched = prelaunch_local_ranks(devices, trainer_config.num_nodes)
            config: Any = config_object(cfg)
            run = prepare(config)
    except BaseException:
        if prelaunched is not None:
            prelaunched.abandon()  # refused or failed before launch: the waiting ranks end now, without a word
        raise
    fit(run, prelaunched)


def run_command_line(checked: bool = False) -> None:
    """Check the command line's overrides (:mod:`lightning_merak.cli.overrides`), then compose and run it.

    ``checked``: the overrides are already checked and put as Hydra takes them (a rank started early gets rank 0's
    checked command line); checking them again would compose the configuration twice more on the path to the
    rendezvous, where rank 0 waits for this rank."""
    if not checked:
        with _refusals():
            sys.argv[1:] = check_overrides(sys.argv[1:])
    _hydra_entry()


_PRINTS_ONLY = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i"}
"""Hydra's flags that print something and exit."""


def main() -> None:
    """Console entry point of ``merak-train``."""
    restart_with_heap_tunables()
    # a rank started early by rank 0 (below): imports, then waits until rank 0 has checked the run
    started_early = wait_at_gate()
    install_termination_handler()
    quiet_dependency_noise()
    register_configs()
    register_help()
    try:
        run_command_line(checked=started_early)
    except BrokenPipeError:
        if not _PRINTS_ONLY.intersection(sys.argv[1:]):
            raise
        # `merak-train --help | head`: the reader left early; stop quietly, as a closed pipe ends other tools
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    finally:
        skip_final_collection()
    exit_after_python_teardown(0)  # the run ended well: no C++ teardown under gloo's threads (process_exit)


if __name__ == "__main__":
    main()
