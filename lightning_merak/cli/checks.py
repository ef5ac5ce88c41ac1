"""Checks of ``merak-train``'s configuration that need more than one group, made before any rank starts.

Each refuses with a :class:`~lightning_merak.cli.overrides.ConfigError` naming the key and the fix, what the ranks
would otherwise find only once they run (or what OmegaConf would report as a traceback).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from lightning_merak.checkpoint.saved_setup import (
    group_names,
    optimizer_groups_problem,
    optimizer_settings_problem,
)
from lightning_merak.cli.overrides import ConfigError
from lightning_merak.modules.config import OPTIMIZERS, DataConfig, DataError, OptimConfig, Schedule
from lightning_merak.util.optimizer_state import joined_parts

__all__ = ["DATAMODULE_MEMBERS", "HF_DATASET_TARGETS", "MODULE_MEMBERS", "batch_shape", "check_adapter_shards",
           "check_batches_before_launch", "check_callbacks_take", "check_context_calibration", "check_node_launch",
           "check_profiler_window", "check_resumed_optimizer", "check_schedule_end", "check_strategy_accelerator",
           "check_streaming_loop", "config_object", "fixed_sequence_length", "longest_sample_setting"]

MODULE_MEMBERS = ("training_step", "configure_optimizers")
"""What a ``module._target_`` LightningModule must define for Lightning to train it."""
DATAMODULE_MEMBERS = ("train_dataloader",)
"""What a ``data._target_`` LightningDataModule must define for Lightning to train on it."""

_UNSET_HINTS = {
    "data.path": "data.path is not set, and this data option reads its corpus from it: set data.path=/abs/path to "
                 "a .txt or .jsonl file (data=hf_dataset: also a parquet, csv or arrow file, a folder of them, or a "
                 "save_to_disk folder)",
}
"""The fix of each key an option leaves unset (``???``) that a user is likely to leave so."""


def config_object(config: Any) -> Any:
    """``OmegaConf.to_object(config)``; a key the chosen options leave unset (``???``) is refused, naming it."""
    try:
        return OmegaConf.to_object(config)
    except MissingMandatoryValue as error:
        key = str(error.full_key)
        raise ConfigError(_UNSET_HINTS.get(key, f"{key} is not set (the option chosen leaves it ???): set "
                                                f"{key}=...")) from None


_NODE_NUMBERING_LAUNCHERS = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE")
"""Launchers that number the nodes themselves (torchrun, SLURM, MPI): Lightning reads their variables, not
``NODE_RANK``."""
_MULTI_NODE_GUIDE = "docs/guides/multi-node.md"


def _whole_number(name: str, text: str) -> int:
    """``text`` of the environment variable ``name`` as an integer; refused, naming it, if it is none."""
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a whole number; set {name} to one, or unset it") from None


def check_node_launch(num_nodes: int, environ: Mapping[str, str]) -> None:
    """Refuse a launch whose ranks could never all join, which would hang instead: a ``RANK`` or ``NODE_RANK``
    past the world it numbers (that node's ranks die in gloo's ``rank < size`` and node 0 waits forever), or
    ``trainer.num_nodes`` > 1 with Lightning's launcher but no ``MASTER_ADDR``, ``MASTER_PORT`` or ``NODE_RANK``
    (Lightning would wait on 127.0.0.1 and a port of its own choosing for nodes that cannot find it)."""
    rank, world = environ.get("RANK"), environ.get("WORLD_SIZE")
    if rank is not None and world is not None and _whole_number("RANK", rank) >= _whole_number("WORLD_SIZE", world):
        raise ConfigError(f"RANK={rank} but WORLD_SIZE={world}: ranks are numbered 0..{int(world) - 1}; give each "
                          "process its own RANK below WORLD_SIZE")
    if any(name in environ for name in _NODE_NUMBERING_LAUNCHERS):
        return
    node_variable = "NODE_RANK" if "NODE_RANK" in environ else "GROUP_RANK"  # as Lightning's environment reads it
    node_rank = environ.get(node_variable)
    if node_rank is not None and not 0 <= _whole_number(node_variable, node_rank) < num_nodes:
        raise ConfigError(f"{node_variable}={node_rank} but trainer.num_nodes={num_nodes}: nodes are numbered "
                          f"0..{num_nodes - 1}; give each node its own {node_variable} in that range, or set "
                          f"trainer.num_nodes to the number of nodes ({_MULTI_NODE_GUIDE})")
    if num_nodes > 1 and "LOCAL_RANK" not in environ:  # Lightning's launcher is to start this node's ranks
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in environ]
        missing += [] if node_rank is not None else ["NODE_RANK"]
        if missing:
            raise ConfigError(
                f"trainer.num_nodes={num_nodes} but no launcher started this process and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set, so the nodes cannot find each other (it would "
                "wait forever): start every node with torchrun or srun, or set on each node NODE_RANK (0.."
                f"{num_nodes - 1}), MASTER_ADDR (node 0's address) and the same MASTER_PORT ({_MULTI_NODE_GUIDE})")


def batch_shape(config: Any, data: Any) -> dict[str, Any]:
    """What the strategy's checks before launch know of the batches (a datamodule's own may leave them unknown).

    Variable lengths give no sequence length: samples keep their own, and ``seq_len`` is not used. Their batch size
    is the global batch's, which merak3d's build traces a probe of (split into ``micro_batches``), as it does a
    block batch; its micro-batching then splits each global batch by its own plan."""
    variable = getattr(data, "lengths", "fixed") == "variable"
    if isinstance(config.data, DataConfig):
        batch_size, sequence_length = config.data.batch_size, config.data.seq_len
    else:
        batch_size, sequence_length = getattr(data, "batch_size", None), getattr(data, "seq_len", None)
    return {"batch_size": batch_size, "sequence_length": None if variable else sequence_length,
            "accumulate_grad_batches": config.trainer.accumulate_grad_batches}


def check_schedule_end(config: Any) -> None:
    """Refuse a built-in module's decaying learning-rate schedule in a run without an end (no max_steps, no
    max_epochs, no optim.total_steps), which its ``configure_optimizers`` would refuse only once the ranks run."""
    trainer, optim = config.trainer, config.optim
    endless = trainer.max_steps == -1 and trainer.max_epochs == -1 and not trainer.kwargs.get("fast_dev_run")
    if endless and not config.module and optim.total_steps is None and optim.lr_schedule is not Schedule.constant:
        raise ConfigError(f"optim.lr_schedule={optim.lr_schedule.value} decays until the run's last step, but the "
                          "Trainer has no end: give it max_steps or max_epochs, or use optim.lr_schedule=constant")


def check_profiler_window(config: Any) -> None:
    """Refuse ``profiler=trace`` whose window (``skip_steps`` warm-up batches, then ``steps`` traced) cannot end
    within ``trainer.max_steps`` optimizer steps (of ``accumulate_grad_batches`` batches each): the run would train to
    its end and write no trace. A run ending earlier for another reason (epochs, a stop) still gets the profiler's
    warning at its end."""
    profiler, trainer = config.profiler, config.trainer
    skip, steps = getattr(profiler, "skip_steps", None), getattr(profiler, "steps", None)
    if not isinstance(skip, int) or not isinstance(steps, int) or trainer.max_steps is None or trainer.max_steps < 0:
        return
    per_step = max(int(trainer.accumulate_grad_batches or 1), 1)
    batches = trainer.max_steps * per_step
    if batches < skip + steps:
        needed = -(-(skip + steps) // per_step)
        raise ConfigError(f"profiler=trace traces batches {skip + 1} to {skip + steps} (profiler.skip_steps={skip}, "
                          f"profiler.steps={steps}), but trainer.max_steps={trainer.max_steps} runs {batches} "
                          f"training batches; raise trainer.max_steps to {needed} or more, or lower "
                          "profiler.skip_steps / profiler.steps")


HF_DATASET_TARGETS = ("lightning_merak.modules.hf_data.HFDatasetData", "lightning_merak.modules.HFDatasetData")
"""The ``data._target_`` values of ``data=hf_dataset``'s datamodule."""


def check_streaming_loop(config: Any) -> None:
    """Refuse Trainer loop settings a streamed ``data=hf_dataset`` corpus (``data.streaming=true``) would train wrongly
    with: no ``max_steps``, ``limit_train_batches``, or validation with a null ``val_check_interval`` (a stream's epoch
    never ends). Each rank's ``setup`` refuses them too, found there only once the ranks run."""
    values = config.data if hasattr(config.data, "get") else getattr(config.data, "__dict__", {})
    if values.get("_target_") not in HF_DATASET_TARGETS or values.get("streaming") is not True:
        return
    from lightning_merak.modules.hf_data import streaming_loop_problem  # lazy: torch, datasets

    trainer = config.trainer
    problem = streaming_loop_problem(trainer.max_steps, trainer.val_check_interval,
                                     trainer.kwargs.get("limit_train_batches"), trainer.limit_val_batches != 0,
                                     trainer.kwargs.get("fast_dev_run", False))
    if problem is not None:
        raise ConfigError(problem)


def fixed_sequence_length(data: Any) -> Optional[int]:
    """The data group's tokens per sample when every sample has that many (``None`` for other data)."""
    values = data if hasattr(data, "get") else getattr(data, "__dict__", {})
    seq_len = values.get("seq_len")
    return int(seq_len) if isinstance(seq_len, int) and values.get("lengths", "fixed") == "fixed" else None


def longest_sample_setting(data: Any) -> Optional[tuple[str, int]]:
    """``(setting, tokens)``: the data group's longest sample and the setting that asks for it, if known."""
    values = data if hasattr(data, "get") else getattr(data, "__dict__", {})
    fixed = fixed_sequence_length(data)
    if fixed is not None:
        return "data.seq_len", fixed
    longest = values.get("max_length")
    return ("data.max_length", int(longest)) if isinstance(longest, int) and values.get("lengths") == "variable" \
        else None


def check_context_calibration(config: Any, strategy: Any) -> None:
    """Refuse per-sample context-parallel degrees on data their first step would refuse: fixed-length blocks (they
    plan samples of their own lengths), or samples ``data.max_length`` keeps too short for the cost model the ranks
    would measure (a longest sample of 4 tokens)."""
    options = getattr(strategy, "micro_batching", None)
    if not getattr(options, "context_rounds", False):
        return
    from lightning_merak.parallel.context.rounds import short_calibration_problem  # lazy: torch
    from lightning_merak.parallel.micro_batching.samples import fixed_blocks_problem  # lazy: torch

    problem = fixed_blocks_problem(strategy) if fixed_sequence_length(config.data) is not None else None
    setting, longest = longest_sample_setting(config.data) or (None, 0)
    if problem is None and options.cost is None and setting == "data.max_length":
        degree = config.strategy.strategy_kwargs()["context_parallel"]  # a fixed integer: the strategy checked it
        problem = short_calibration_problem(degree, longest, setting)
    if problem is not None:
        raise ConfigError(problem)


def check_callbacks_take(callbacks: list[Any], module: Any, strategy: Any, world_size: int) -> None:
    """Refuse a model or layout the callbacks would refuse at their setup on every rank: EmbRace's tables it cannot
    shard (a class overriding the lookup, such as Gemma's scaled embedding), a fixed layout's sharding mode a callback
    cannot run under. The built-in module is built here already (on the meta device under merak3d); a user's module
    is checked on what it holds before launch."""
    from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication  # lazy: torch, Lightning

    if hasattr(strategy, "validate_callbacks_before_launch"):
        strategy.validate_callbacks_before_launch(callbacks, world_size)
    for callback in callbacks:
        if isinstance(callback, SparseCommunication):
            callback.check_tables(module)


def check_batches_before_launch(config: Any, strategy: Any, module: Any, world_size: int,
                                resume_from: Optional[Path]) -> None:
    """Refuse batches the ranks would refuse or fail on once they run: a checkpoint whose training loader stopped
    part-way through a pass at another batch shape, and variable-length batches padded past the model's position
    table."""
    if resume_from is not None:
        _check_resumed_batches(config, strategy, world_size, resume_from)
    from lightning_merak.modules.positions import padded_length_problem  # lazy: torch

    model, options = getattr(module, "model", None), getattr(strategy, "micro_batching", None)
    merak3d = getattr(strategy, "strategy_name", None) == "merak3d"
    context = _known_context_parallel(config, world_size) if merak3d else 1
    setting, longest = longest_sample_setting(config.data) or (None, 0)
    if model is not None and setting == "data.max_length":
        multiple = 2 * context if context > 1 and getattr(options, "enabled", False) else 1  # a split row's chunks
        problem = padded_length_problem(model, longest, multiple, setting)
        if problem is not None:
            raise ConfigError(problem)


def _known_context_parallel(config: Any, world_size: int) -> int:
    """merak3d's context-parallel degree where known before launch, else 1 (a planner may choose it)."""
    from lightning_merak.strategies.merak3d.context_degree import known_context_parallel  # lazy: torch, Lightning

    options = config.strategy.strategy_kwargs()
    degrees = {name: options[f"{name}_parallel"] for name in ("data", "pipeline", "tensor")}
    return known_context_parallel(options["context_parallel"], degrees, world_size)


def _check_resumed_batches(config: Any, strategy: Any, world_size: int, resume_from: Path) -> None:
    """Refuse a checkpoint whose training loader stopped part-way through a pass at another batch shape than this run
    reads (each rank's loader would refuse it restoring the checkpoint): merak-train's own data, where the ranks
    each pass is split over are known before launch."""
    if not isinstance(config.data, DataConfig):
        return
    replicas = _loader_replicas(config, strategy, world_size)
    if replicas is None:
        return
    from lightning_merak.checkpoint.compatible import saved_loader_states  # lazy: torch
    from lightning_merak.modules.resumable import check_resumed_batch_shape  # lazy: torch

    seed = getattr(config.trainer, "seed", None)  # a distributed sampler's, as seed_everything sets it
    for state in saved_loader_states(resume_from):
        try:
            check_resumed_batch_shape(state, replicas, config.data.batch_size, seed,
                                      _synthetic_pass_length(config, replicas))
        except DataError as error:
            raise ConfigError(f"resume={resume_from}: {error}") from None


def _synthetic_pass_length(config: Any, replicas: int) -> Optional[int]:
    """The training batches of a pass over generated blocks (``data.num_sequences`` split over ``replicas``, each
    rank's partial batch dropped, ``limit_train_batches`` applied as Lightning applies it), or None for other data,
    whose size the ranks know."""
    data, limit = config.data, config.trainer.kwargs.get("limit_train_batches")
    if data.name != "synthetic" or data.lengths != "fixed" or isinstance(limit, bool) \
            or config.trainer.kwargs.get("fast_dev_run"):
        return None
    batches = math.ceil(data.num_sequences / replicas) // data.batch_size
    if limit is None:
        return batches
    return min(batches, limit) if isinstance(limit, int) else int(batches * limit)


def check_resumed_optimizer(module: Any, resume_from: Optional[Path]) -> None:
    """Refuse to resume the built-in module with another ``optim.name`` than the checkpoint's optimizer (its
    parameter groups' names, or, where those agree, their settings tell), whose state would fail on every rank
    paired with this optimizer's groups."""
    optim = getattr(module, "optim", None)
    if resume_from is None or not isinstance(optim, OptimConfig):
        return
    from lightning_merak.checkpoint.compatible import saved_optimizer_groups  # lazy: torch

    saved = saved_optimizer_groups(resume_from)
    if not saved:
        return
    groups_of = {name: _optimizer_groups(name) for name in {*OPTIMIZERS, optim.name}}
    saved_names = group_names(saved[0])
    trained_with = " or ".join(f"optim={name}" for name in OPTIMIZERS if group_names(groups_of[name]) == saved_names
                               and optimizer_settings_problem(saved[0], groups_of[name], "") is None)
    fix = (f"resume with {trained_with or 'the optimizer it was trained with'}, or start afresh from its weights "
           "(merak-export, then model.path)")
    problem = optimizer_groups_problem(saved_names, group_names(groups_of[optim.name]), fix)
    if problem is None:
        problem = optimizer_settings_problem(saved[0], groups_of[optim.name], fix)
    if problem is not None:
        raise ConfigError(f"resume={resume_from}: optim.name={optim.name}: {problem}")


def _optimizer_groups(name: str) -> list[dict[str, Any]]:
    """The parameter groups (names and settings) of the built-in module's ``name`` optimizer, built over two
    placeholder parameters on the meta device (the optimizer names its groups, whatever the model)."""
    import torch  # lazy: torch

    from lightning_merak.modules.causal_lm import build_optimizer  # lazy: torch, Lightning

    matrix, vector = (torch.nn.Parameter(torch.empty(shape, device="meta")) for shape in ((2, 2), (2,)))
    return joined_parts(build_optimizer(OptimConfig(name=name), [matrix], [vector], set()).state_dict())["param_groups"]


def _loader_replicas(config: Any, strategy: Any, world_size: int) -> Optional[int]:
    """The ranks each training pass is split over, as the loaders' states count them, where known before launch: 1
    for global batches of variable lengths (every rank reads each) or without Lightning's distributed sampler, DDP's
    every rank, merak3d's batch replicas at fixed degrees; None where a planner chooses them, or another strategy."""
    if config.data.lengths == "variable" or not config.trainer.kwargs.get("use_distributed_sampler", True):
        return 1
    if getattr(strategy, "strategy_name", None) == "merak3d":
        if strategy.needs_planning:
            return None
        return strategy.resolve_layout(world_size)[0] // config.strategy.strategy_kwargs()["context_parallel"]
    from lightning.pytorch.strategies import DDPStrategy  # lazy: Lightning

    return world_size if isinstance(strategy, DDPStrategy) else None


def check_strategy_accelerator(strategy: Any, accelerator: str) -> None:
    """Refuse a DeepSpeed strategy (``strategy.name=deepspeed*``) without CUDA GPUs: Lightning's DeepSpeed
    strategy runs on CUDA only and would fail in every rank after launch."""
    from lightning.pytorch.strategies import DeepSpeedStrategy  # lazy: Lightning

    if not isinstance(strategy, DeepSpeedStrategy) or accelerator in ("gpu", "cuda"):
        return
    import torch  # lazy: torch

    if accelerator != "auto" or not torch.cuda.is_available():
        raise ConfigError(
            f"strategy {type(strategy).__name__} (strategy.name=deepspeed*) runs on CUDA GPUs only, but "
            f"trainer.accelerator={accelerator}; on CPU use strategy=merak3d (ZeRO-style sharding: "
            "strategy.data_parallel_sharding=optimizer, gradients or full), or train on a GPU machine with trainer=gpu")


def check_adapter_shards(strategy: Any, module: Any, world_size: int) -> None:
    """Refuse an adapter model whose quantised base or pooled adapters do not split at merak3d's fixed
    ``tensor_parallel``, naming every problem and its fix at once (double quantisation, quantisation blocks and
    pooled groups across shards), on the meta model before any rank starts; the ranks would refuse the first of
    them only once they build the model."""
    if getattr(strategy, "strategy_name", None) != "merak3d" or strategy.needs_planning:  # the planner checks its
        return  # choice of degrees
    tensor_parallel = strategy.resolve_layout(world_size)[2]
    model = getattr(module, "model", None)
    if tensor_parallel <= 1 or not getattr(model, "peft_config", None):
        return
    from lightning_merak.adapters import tp_shards  # lazy: torch, PEFT
    from lightning_merak.adapters.meta import AFTER_MATERIALIZE  # lazy: torch, PEFT
    from lightning_merak.parallel.pipeline.recording import TraceError, find_trunk  # lazy: torch

    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    try:
        trunk = find_trunk(model)[1]
    except TraceError:
        return  # no blocks to split: merak3d's own checks name it
    if not isinstance(hidden_size, int):
        return
    layers = [layer for block in trunk for layer in tp_shards.block_split_layers(block, hidden_size)]
    base = getattr(model, AFTER_MATERIALIZE, None)  # the deferred quantisation of a meta model's base
    problem = tp_shards.shard_refusal(tp_shards.adapter_shard_problems(layers, tensor_parallel, base))
    if problem is not None:
        raise ConfigError(problem)
