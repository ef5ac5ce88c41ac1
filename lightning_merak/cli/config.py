"""Structured configuration of ``merak-train``.

Every Hydra config group has a schema dataclass registered in Hydra's ConfigStore
under ``schema/<group>/<option>``; the YAML files in ``lightning_merak/conf/<group>/``
start from that schema (``defaults: [/schema/<group>/<option>@_here_]``). A
misspelled key or a value of the wrong type therefore fails while Hydra composes
the configuration, before any process is launched. The ``logger`` options, ``data`` options built
from a ``_target_`` (``hf_dataset``, ``custom``), ``module`` and ``callbacks`` are free-form
``_target_`` nodes instead: their keys are checked against the target's signature before launch
(:mod:`lightning_merak.cli.targets`).

Groups whose options add behaviour to a run follow one small protocol each, so that
``train.py`` never needs to know the options:

* ``memory`` and ``comm`` options return Lightning callbacks (:meth:`CallbackOptionConfig.build_callbacks`);
* ``adapter`` options transform the model (:meth:`AdapterConfig.apply`);
* ``moe`` options transform the model too (:meth:`MoEConfig.apply`).

Features register their own options with :func:`register_option` from a ``register()``
function in a module of :mod:`lightning_merak.cli.options` listed in :data:`FEATURE_OPTION_MODULES`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from lightning_merak.cli.options.faults import FaultsConfig
from lightning_merak.modules.config import DataConfig, ModelConfig, OptimConfig, TrainerConfig
from lightning_merak.util.fields import option

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch import nn

GROUPS = ("model", "data", "trainer", "optim", "logger", "strategy", "moe", "memory", "comm", "adapter", "profiler")

OPTION_NAME_HELP = "The option's name, which `<group>=<option>` sets."
"""What an option's ``name`` key is (options redefining ``name`` keep this description in the reference)."""


@dataclass
class StrategyConfig:
    """A strategy by its registered name, with keyword arguments for its constructor."""

    name: str = option(MISSING, "A strategy registered in Lightning's `StrategyRegistry`: `merak3d`, `ddp`, ...")
    kwargs: dict[str, Any] = option(
        default_factory=dict, help="Keyword arguments for the strategy's constructor, on top of its registered "
        "defaults and of the other keys.")

    def strategy_kwargs(self) -> dict[str, Any]:
        """Constructor arguments on top of the registered defaults."""
        return dict(self.kwargs)


@dataclass
class CallbackOptionConfig:
    """Base of the ``memory`` and ``comm`` options: each contributes Lightning callbacks."""

    name: str = option("none", OPTION_NAME_HELP)

    def build_callbacks(self) -> list[pl.Callback]:
        return []


@dataclass
class AdapterConfig:
    """Base of the ``adapter`` options: each wraps the model before training."""

    name: str = option("none", OPTION_NAME_HELP)

    def apply(self, model: nn.Module) -> nn.Module:
        return model


@dataclass
class MoEConfig:
    """Base of the ``moe`` options: each may swap the model's sparse blocks."""

    name: str = option("none", OPTION_NAME_HELP)

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def build_callbacks(self) -> list[pl.Callback]:
        return []


@dataclass
class TrainConfig:
    """The whole ``merak-train`` configuration."""

    model: ModelConfig = option(MISSING, "The causal LM: a transformers model type built with random weights, "
                                "or a pretrained directory.")
    data: Any = option(MISSING, "The training data: a generated language (`synthetic`), a file (`text`), a Hugging "
                       "Face dataset (`hf_dataset`) or your own LightningDataModule (`data._target_=pkg.Class`).")
    trainer: TrainerConfig = option(MISSING, "Lightning Trainer settings: devices, steps, precision, and any other "
                                    "`Trainer` argument.")
    optim: OptimConfig = option(MISSING, "The optimizer and learning-rate schedule: `adamw`, `sgd` or `muon`.")
    logger: Any = option(default_factory=dict, help="Where metrics go: `csv`, `tensorboard`, `wandb`, `mlflow`, or "
                         "a list of them (`logger=[csv,wandb]`; `logger=[]`: no logger, no metrics files).")
    module: dict[str, Any] = option(
        default_factory=dict, help="Your own LightningModule instead of the causal LM of `model` and `optim`: "
        "`module._target_=pkg.Class` and its keyword arguments as `module.<name>=value`.")
    callbacks: list[Any] = option(
        default_factory=list, help="More Lightning callbacks, each a `_target_` node with its keyword arguments: "
        "`'callbacks=[{_target_: lightning.pytorch.callbacks.EarlyStopping, monitor: val/loss}]'`.")
    strategy: StrategyConfig = option(MISSING, "The parallel strategy: `merak3d` (data × pipeline × tensor "
                                      "parallelism) or Lightning's `ddp`.")
    moe: Any = option(MISSING, "Mixture-of-experts layers for a sparse model: `prophet`, `deepspeed`, "
                      "`shadowing`, or `none`.")
    memory: Any = option(MISSING, "Activation memory: `delta` (swap or recompute whole blocks to keep saved "
                         "activations under a budget) or `none`.")
    comm: Any = option(MISSING, "Gradient communication of large embedding tables: `dense` (DDP's all-reduce), "
                       "`s2`, `embrace` or `auto`.")
    adapter: Any = option(MISSING, "Parameter-efficient fine-tuning on a quantized base: `lora` (QLoRA), `qbara`, "
                          "`qahira`, or `none`.")
    profiler: Any = option(MISSING, "`trace`: record a few steps on every rank (MerakTraceProfiler); `none`.")
    output_dir: str = option("${hydra:runtime.output_dir}", "Where checkpoints, metrics and TensorBoard logs go "
                             "(default: the Hydra run directory, `hydra.run.dir`).")
    faults: FaultsConfig = option(default_factory=FaultsConfig, help="What a run does on hangs, lost ranks and "
                                  "non-finite steps (`lightning_merak.cli.options.faults`).")
    resume: Optional[str] = option(
        None, "`auto`: continue from the newest complete checkpoint in `<output_dir>/checkpoints`, if any; or a "
        "checkpoint path. `auto` suits `torchrun --max-restarts`, whose restarts then resume a failed run "
        "(`lightning_merak.checkpoint.resume`).")


def reject_unknown_keys(cfg: DictConfig, path: str = "") -> None:
    """Refuse keys that no schema declares, however they were added.

    Hydra's ``+group.key=value`` opens a typed node to add a key, and ``OmegaConf.to_object``
    then drops it without a word, so a misspelled option would silently do nothing.
    Free-form ``dict`` fields (``model.config``, ``strategy.kwargs``) are not checked.
    """
    schema = OmegaConf.get_type(cfg)
    if schema is not None and dataclasses.is_dataclass(schema):
        known = [item.name for item in dataclasses.fields(schema)]
        for key in cfg.keys():
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {path}{close[0]}?" if close else f"; known keys: {', '.join(known)}"
                raise ValueError(f"unknown option {path}{key}: {schema.__name__} has no key {key!r}{hint}")
    for key in cfg.keys():
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            reject_unknown_keys(child, f"{path}{key}.")


def register_option(group: str, name: str, node: type) -> None:
    """Register ``node`` as the schema of ``<group>=<name>`` (``conf/<group>/<name>.yaml``)."""
    if group not in GROUPS:
        raise ValueError(f"unknown config group {group!r}; groups are {', '.join(GROUPS)}")
    ConfigStore.instance().store(group=f"schema/{group}", name=name, node=node)


FEATURE_OPTION_MODULES = (
    "lightning_merak.cli.options.strategy",
    "lightning_merak.cli.options.memory",
    "lightning_merak.cli.options.comm",
    "lightning_merak.cli.options.adapter",
    "lightning_merak.cli.options.moe",
    "lightning_merak.cli.options.profiler",
)


def register_configs() -> None:
    """Register the root schema, the built-in options and every feature's options (idempotent)."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    register_option("model", "base", ModelConfig)
    register_option("data", "base", DataConfig)
    register_option("trainer", "base", TrainerConfig)
    register_option("optim", "base", OptimConfig)
    register_option("strategy", "base", StrategyConfig)
    register_option("moe", "none", MoEConfig)
    register_option("memory", "none", CallbackOptionConfig)
    register_option("adapter", "none", AdapterConfig)
    for module_name in FEATURE_OPTION_MODULES:
        importlib.import_module(module_name).register()
