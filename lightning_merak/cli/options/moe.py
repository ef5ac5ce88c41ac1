"""Hydra ``moe`` options: DeepSpeed-MoE, Pro-Prophet and FasterMoE-style shadowing.

``apply`` swaps a Mixtral-style model's sparse blocks before any process exists (and,
with ``lancet_scope=block``, runs each decoder layer as Lancet sub-batches); the
layers attach their expert groups lazily, and :meth:`ProphetMoEConfig.build_callbacks`
returns the callback that prepares them for DDP and logs balance metrics (with ``experts=merak_ep``, the one
that runs the family's own experts expert-parallel). At the end of training either writes the expert-load heatmap
to ``<output dir>/csv/moe_load_heatmap.png`` (``trainer.log_dir``, next to ``metrics.csv``; ``merak-train`` prints
the output dir).

The layer's options are not listed here: the schema takes :class:`~lightning_merak.plugins.moe.options.MoEOptions`'
fields (a ``Literal`` becomes ``str``, ``lancet_chunks``' union ``Any``) and each preset names only the
defaults it changes; ``MoEOptions`` checks the values.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional

from lightning_merak.cli.config import MoEConfig, register_option
from lightning_merak.cli.options.schema import schema_of
from lightning_merak.plugins.moe.options import MoEOptions, option_keys
from lightning_merak.util.fields import option

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy
    from torch import nn

__all__ = ["DeepSpeedMoEConfig", "ProphetMoEConfig", "ShadowingMoEConfig", "register"]

@dataclass
class _SwapOptions(MoEConfig):
    name: str = "prophet"
    ep_size: int = option(2, "Expert-parallel ranks each layer's experts are spread over.")
    num_experts: Optional[int] = option(None, "Experts per layer, checked against the model's (`null`: the model's).")
    k: Optional[int] = option(None, "Experts each token is routed to, checked against the model's (`null`: the "
                              "model's).")
    capacity_factor: float = option(1.0, "An expert's capacity, as a multiple of an even share of the tokens.")
    drop_tokens: bool = option(False, "Drop the tokens past an expert's capacity (never with `dispatch=dropless`).")


_ProphetLayerOptions = schema_of(MoEOptions, "_ProphetLayerOptions", dispatch="dropless", placement="auto",
                                  lancet_chunks="auto")


@dataclass
class ProphetMoEConfig(_ProphetLayerOptions, _SwapOptions):  # type: ignore[misc,valid-type]
    """Swap sparse blocks for ``lightning_merak.plugins.moe.MoE`` (placement planned per step by default: ``auto``).

    The layer's options are :class:`~lightning_merak.plugins.moe.options.MoEOptions`' fields, checked there.
    """

    lancet_scope: str = option(
        "layer", "`layer`: Lancet's chunks inside each MoE layer; `block`: attention + MoE of each decoder layer "
        "as overlapped sub-batches.")
    lancet_block_chunks: str = option("auto", "With `lancet_scope=block`: sub-batches per decoder layer, or `auto` "
                                      "(measured).")
    aux_loss_coef: float = option(0.01, "Weight of the router's load-balancing loss.")
    log_every_n_steps: Optional[int] = option(
        None, "Optimizer steps between logged expert-balance metrics (`null`: `trainer.log_every_n_steps`); the "
        "last step is logged too.")
    experts: str = option(
        "deepspeed", "`deepspeed`: swap sparse blocks for our DeepSpeed-MoE layer; `merak_ep`: keep the family's "
        "own blocks (any transformers-5 MoE family, any top-k) and run its experts expert-parallel over `ep_size` "
        "ranks (`lightning_merak.plugins.moe.experts`). With `merak_ep`, of the layer options only "
        "`placement=pro_prophet|shadowing` (replicas re-planned every `replan_every` batches under DDP; `auto` and "
        "`none` run none) and `lancet_scope=block` apply.")

    def __post_init__(self) -> None:
        self._data_parallel: Optional[int] = None  # the ranks the experts spread over, once check_layout knows them

    def check_layout(self, strategy: Strategy, world_size: int) -> None:
        """Refuse, before the model is built and before any process starts, a layout these experts do not run in,
        and note the data-parallel degree the experts spread over (all ranks under DDP, each stage's under
        merak3d; unknown while the planner chooses it), so that :meth:`apply` offers only ``ep_size`` values
        dividing it."""
        merak3d = getattr(strategy, "strategy_name", None) == "merak3d"
        fixed = merak3d and not strategy.needs_planning  # else the planner's layout is checked at setup
        if self.experts == "deepspeed":
            from lightning_merak.parallel.experts import swapped_experts_problem  # lazy: torch

            problem = swapped_experts_problem(strategy, world_size, self.ep_size)
            if problem is not None:
                raise ValueError(problem)
            tensor_parallel = strategy.resolve_layout(world_size)[2] if fixed else 1
            if tensor_parallel > 1:
                raise ValueError(
                    f"strategy.tensor_parallel={tensor_parallel} is not supported with moe.experts=deepspeed: the "
                    "swapped DeepSpeed-MoE layer's router and experts cannot be split over tensor-parallel ranks; use "
                    "moe.experts=merak_ep (keeps the model's own MoE blocks, whose experts every tensor-parallel rank "
                    "holds) or strategy.tensor_parallel=1")
        if not merak3d:
            self._data_parallel = world_size
        elif fixed:
            self._data_parallel = strategy.resolve_layout(world_size)[0]

    def _block_chunks(self) -> int | str:
        if self.lancet_scope not in ("layer", "block"):
            raise ValueError(f"moe.lancet_scope={self.lancet_scope!r}: use layer (inside the MoE layer) or block "
                             "(attention + MoE of each decoder layer as sub-batches)")
        if self.lancet_block_chunks == "auto":
            return "auto"
        if not str(self.lancet_block_chunks).isdigit() or int(self.lancet_block_chunks) < 1:
            raise ValueError(f"moe.lancet_block_chunks={self.lancet_block_chunks!r}: use auto or a positive integer")
        return int(self.lancet_block_chunks)

    def _typed_keys(self) -> dict[str, str]:
        """The key each checked value came from, for refusals: ``moe.<field>``, or the model's config key where an
        unset field takes the model's value (the number of experts and the top-k)."""
        keys = {item.name: f"moe.{item.name}" for item in fields(self)}
        for name, key in (("num_experts", "model.config.num_local_experts"), ("k", "model.config.num_experts_per_tok")):
            if getattr(self, name, None) is None:
                keys[name] = key
        return keys

    def apply(self, model: nn.Module) -> nn.Module:
        with option_keys(self._typed_keys()):
            return self._apply(model)

    def _apply(self, model: nn.Module) -> nn.Module:
        from lightning_merak.plugins.moe.block_replacement import swap_sparse_moe_blocks  # lazy: torch, DeepSpeed
        from lightning_merak.plugins.moe.lancet_block import lancet_overlap  # lazy: torch, DeepSpeed
        from lightning_merak.util.model_outputs import no_cache  # lazy: torch

        if self.experts == "merak_ep":
            from lightning_merak.plugins.moe.experts import expert_split_problem, family_support  # lazy: torch

            supported, reason = family_support(model)
            if not supported:
                raise ValueError(f"moe.experts=merak_ep refused: {reason}; use moe.experts=deepspeed or moe=none")
            problem = expert_split_problem(model, self.ep_size, self._data_parallel)
            if problem is not None:
                raise ValueError(problem)
            block_chunks = self._block_chunks()
            if self.lancet_scope == "block":
                from lightning_merak.plugins.moe.experts.lancet import (  # lazy: torch, transformers
                    expert_parallel_lancet,
                )

                no_cache(model)
                expert_parallel_lancet(model, block_chunks)
            return model  # sliced per rank by ExpertParallelCallback once the process group exists
        if self.experts != "deepspeed":
            raise ValueError(f"moe.experts={self.experts!r}: use deepspeed or merak_ep")

        config = getattr(model, "config", None)
        model_experts = getattr(config, "num_local_experts", None)
        model_k = getattr(config, "num_experts_per_tok", None)
        if self.num_experts is not None and self.num_experts != model_experts:
            raise ValueError(
                f"moe.num_experts={self.num_experts} but the model has {model_experts} experts per layer; "
                f"set model.config.num_local_experts={self.num_experts} or drop moe.num_experts"
            )
        if self.k is not None and self.k != model_k:
            raise ValueError(f"moe.k={self.k} but the model routes top-{model_k}; set model.config.num_experts_per_tok")
        options = MoEOptions(**{item.name: getattr(self, item.name) for item in fields(MoEOptions)})
        options.validate(self.drop_tokens)
        block_chunks = self._block_chunks()
        swap_sparse_moe_blocks(
            model, self.ep_size, options, capacity_factor=self.capacity_factor,
            drop_tokens=self.drop_tokens, aux_loss_coef=self.aux_loss_coef,
        )
        if self.lancet_scope == "block":
            no_cache(model)
            lancet_overlap(model, block_chunks)
        return model

    def build_callbacks(self) -> list[pl.Callback]:
        with option_keys(self._typed_keys()):
            return self._build_callbacks()

    def _build_callbacks(self) -> list[pl.Callback]:
        from lightning_merak.callbacks.moe.placement import MoEPlacementCallback  # lazy: Lightning, DeepSpeed

        if self.experts == "merak_ep":
            from lightning_merak.callbacks.moe.experts import ExpertParallelCallback  # lazy: torch, Lightning

            replicas = self.placement if self.placement in ("pro_prophet", "shadowing") else "none"
            return [ExpertParallelCallback(ep_size=self.ep_size, log_every_n_steps=self.log_every_n_steps,
                                           placement=replicas, replan_every=self.replan_every,
                                           heatmap_in_log_dir=True)]

        return [MoEPlacementCallback(log_every_n_steps=self.log_every_n_steps, heatmap_in_log_dir=True)]


@dataclass
class DeepSpeedMoEConfig(ProphetMoEConfig):
    """Plain DeepSpeed-MoE behaviour: capacity-padded dispatch, no replication, no chunking."""

    name: str = "deepspeed"
    dispatch: str = MoEOptions.dispatch
    drop_tokens: bool = True
    placement: str = MoEOptions.placement
    lancet_chunks: Any = str(MoEOptions.lancet_chunks)
    capacity_factor: float = 1.25


@dataclass
class ShadowingMoEConfig(ProphetMoEConfig):
    """FasterMoE-style shadowing baseline: hot experts broadcast to every rank."""

    name: str = "shadowing"
    placement: str = "shadowing"
    lancet_chunks: Any = "1"


def register() -> None:
    """Register ``moe=prophet``, ``moe=deepspeed`` and ``moe=shadowing`` (called by the lead's set-up)."""
    register_option("moe", "prophet", ProphetMoEConfig)
    register_option("moe", "deepspeed", DeepSpeedMoEConfig)
    register_option("moe", "shadowing", ShadowingMoEConfig)
