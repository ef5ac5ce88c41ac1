"""Hydra options of the ``adapter`` group: ``lora`` (QLoRA baseline), ``qbara`` and ``qahira``.

Each option quantizes the base model's linear layers (``lm_head`` excepted) as configured, wraps
it with its PEFT adapter and leaves only adapter parameters trainable. ``quantization`` is an enum,
so a misspelled value fails while Hydra composes the configuration.

``experts`` decides whether an MoE model's fused routed experts (3D parameters in transformers 5) get one
LoRA per expert, sharded with its expert under ``moe.experts=merak_ep`` (:mod:`lightning_merak.adapters.moe`).
``null`` (the default) leaves it to ``target_modules`` as PEFT does: PEFT 0.21 maps the transformers-4 names
``gate_proj`` / ``up_proj`` / ``down_proj`` (in the default targets) onto the fused experts of the families
whose checkpoints transformers converts (Mixtral, Qwen2/3-MoE, OLMoE, ...), so a user's usual LoRA targets
adapt the experts there, as they would outside this project. ``true`` adapts every fused expert weight of
any registry family whatever the targets; ``false`` refuses targets that would reach the experts, naming the fix.
Q-BaRA and QA-HiRA put one pooled adapter per expert on the fused weights
(:mod:`lightning_merak.adapters.pooled_experts`); ``null`` maps ``target_modules`` the same way for every
registry family (``gate_proj``/``up_proj`` → ``gate_up_proj`` or ``up_proj``, ``down_proj`` → ``down_proj``),
``false`` adapts no expert. With ``quantization=int4`` the adapted experts are stored in INT4 too
(:func:`~lightning_merak.adapters.int4_experts.quantize_experts_int4`); bitsandbytes quantizations leave them
in float (bitsandbytes has no layer for a 3D tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Optional

from lightning_merak.cli.config import AdapterConfig, register_option
from lightning_merak.util.fields import option
from lightning_merak.util.values import is_finite_number

if TYPE_CHECKING:
    from torch import nn

LLAMA_LINEAR_LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Quantization(Enum):
    none = "none"
    nf4 = "nf4"
    fp4 = "fp4"
    int8 = "int8"
    int4 = "int4"


@dataclass
class QuantizedAdapterConfig(AdapterConfig):
    """Fields every adapter option shares: the adapter size and how the base is quantized.

    ``group_size`` is the INT4 group (``quantization=int4`` only); bitsandbytes 4-bit uses blocks of 64.
    """

    r: int = option(8, "The adapter's rank.")
    alpha: float = option(16.0, "Scaling numerator: the adapter's output is scaled by `alpha / r`.")
    dropout: float = option(0.0, "Dropout on the adapter's input.")
    target_modules: list[str] = option(
        default_factory=lambda: list(LLAMA_LINEAR_LAYERS), help="Names of the linear layers to adapt.")
    quantization: Quantization = option(Quantization.nf4, "How the frozen base's linear layers are stored.")
    double_quant: bool = option(True, "bitsandbytes 4-bit: quantize the quantization constants too.")
    group_size: int = option(32, "`quantization=int4`: weights per quantization group.")
    experts: Optional[bool] = option(
        None, "Adapt an MoE model's fused routed experts (LoRA, or one Q-BaRA / QA-HiRA per expert): `null` as "
        "`target_modules` map onto them, `true` all of them, `false` none (`lightning_merak.cli.options.adapter`).")

    def pooled_expert_targets(self, model: nn.Module) -> Optional[list[str]]:
        """Q-BaRA / QA-HiRA: the fused expert weights ``experts`` selects (None when none), before quantizing."""
        from lightning_merak.plugins.moe.experts import experts_modules  # lazy: torch, transformers

        if self.experts is False or (self.experts is None and not experts_modules(model)):
            return None
        from lightning_merak.adapters.moe import expert_target_parameters  # lazy: torch, PEFT

        if self.dropout:
            raise ValueError(f"adapter={self.name} with experts needs adapter.dropout=0: the update of a fused expert "
                             "tensor is added to its weight, which cannot carry dropout (or set adapter.experts=false)")
        names = set(self.target_modules)
        wanted = ({"gate_up_proj", "up_proj"} if names & {"gate_proj", "up_proj"} else set()) | (
            {"down_proj"} & names)
        chosen = [target for target in expert_target_parameters(model)
                  if self.experts or target.rpartition(".")[2] in wanted]
        return chosen or None

    def check_settings(self) -> None:
        """Refuse an adapter size PEFT would refuse with its own words (``r=0``) or take silently though it cannot
        be meant: a negative or zero ``alpha`` (the update's sign flipped, or no update), a dropout outside [0, 1)."""
        problems = []
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            problems.append(f"adapter.r={self.r!r} must be an integer >= 1 (the adapter's rank)")
        if not is_finite_number(self.alpha) or self.alpha <= 0:
            problems.append(f"adapter.alpha={self.alpha!r} must be a finite number > 0 (the update is scaled by "
                            "alpha / r)")
        if not is_finite_number(self.dropout) or not 0 <= self.dropout < 1:
            problems.append(f"adapter.dropout={self.dropout!r} must be in [0, 1)")
        if problems:
            raise ValueError(f"adapter={self.name}: " + "; ".join(problems))

    def check_targets(self, model: nn.Module) -> None:
        """Refuse bad settings (:meth:`check_settings`) and ``target_modules`` that name no layer of ``model`` (PEFT
        would, less helpfully), listing the names of the linear layers it has; warn where ``r`` exceeds a targeted
        layer's smaller side, past which the update's rank cannot grow."""
        from lightning.pytorch.utilities.rank_zero import rank_zero_warn  # lazy: Lightning

        from lightning_merak.adapters.base import names_module  # lazy: torch, PEFT
        from lightning_merak.plugins.moe.experts import experts_modules  # lazy: torch, transformers

        self.check_settings()
        if self.experts is not False and experts_modules(model):  # targets may name fused expert weights (PEFT maps
            return  # gate_proj/up_proj/down_proj onto them), which are parameters, not layers
        names = [name for name, _ in model.named_modules()]
        if any(names_module(target, name) for name in names for target in self.target_modules):
            sides = {name: min(layer.in_features, layer.out_features) for name, layer in model.named_modules()
                     if any(names_module(target, name) for target in self.target_modules)
                     and isinstance(getattr(layer, "in_features", None), int)
                     and isinstance(getattr(layer, "out_features", None), int)}
            narrowest = min(sides, key=sides.__getitem__, default=None)
            if narrowest is not None and self.r > sides[narrowest]:
                rank_zero_warn(f"adapter.r={self.r} exceeds {narrowest}'s smaller side ({sides[narrowest]}): its "
                               f"update has rank {sides[narrowest]} at most, with more adapter parameters than the "
                               f"layer; adapter.r={sides[narrowest]} or lower adapts every targeted layer fully")
            return
        linear = sorted({name.rpartition(".")[2] for name, layer in model.named_modules()
                         if type(layer).__name__ in ("Linear", "Conv1D") and not name.endswith("lm_head")})
        raise ValueError(f"adapter.target_modules={list(self.target_modules)} names no layer of "
                         f"{type(model).__name__}; its linear layers are {', '.join(linear) or 'none'}: e.g. "
                         f"adapter.target_modules=[{','.join(linear)}]")

    def quantize(self, model: nn.Module, experts: bool = False) -> nn.Module:
        from lightning_merak.adapters import quantize_model  # lazy: torch, PEFT

        return quantize_model(model, self.quantization.value, self.group_size, self.double_quant,
                              experts=experts and self.quantization is Quantization.int4)


@dataclass
class LoRAAdapterConfig(QuantizedAdapterConfig):
    """PEFT LoRA on the quantized base: QLoRA with ``quantization=nf4``."""

    name: str = "lora"

    def apply(self, model: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        if self.quantization is Quantization.int4:
            raise ValueError("adapter=lora: PEFT LoRA has no layer for the project INT4 base; use nf4/fp4/int8/none")
        self.check_targets(model)
        parameters = None
        if self.experts:
            from lightning_merak.adapters.moe import expert_target_parameters  # lazy: torch, PEFT

            if self.dropout:
                raise ValueError("adapter.experts=true needs adapter.dropout=0: PEFT's LoRA on fused expert tensors "
                                 "cannot factor dropout out of the merged weight")
            parameters = expert_target_parameters(model)
        config = LoraConfig(r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout,
                            target_modules=list(self.target_modules), target_parameters=parameters)
        if parameters:
            from lightning_merak.adapters.moe import add_moe_adapters  # lazy: torch, PEFT

            return add_moe_adapters(self.quantize(model), config)
        adapted = get_peft_model(self.quantize(model), config)
        if self.experts is False:
            from lightning_merak.adapters.moe import expert_adapters  # lazy: torch, PEFT

            if expert_adapters(adapted):
                raise ValueError("adapter.experts=false, but PEFT maps adapter.target_modules' gate_proj/up_proj/"
                                 "down_proj onto this model's fused experts; drop those names from "
                                 "adapter.target_modules (e.g. adapter.target_modules=[q_proj,k_proj,v_proj,o_proj])")
        return adapted


@dataclass
class QBaRAAdapterConfig(QuantizedAdapterConfig):
    """Q-BaRA: pooled inputs, expanded outputs, rank ``lambda * r``; as many parameters as LoRA-``r``."""

    name: str = "qbara"
    lambda_in: int = option(2, "Input pooling factor.")
    lambda_out: int = option(2, "Output expansion factor.")

    def apply(self, model: nn.Module) -> nn.Module:
        from lightning_merak.adapters import QBaRAConfig  # lazy: torch, PEFT

        self.check_targets(model)
        parameters = self.pooled_expert_targets(model)
        config = QBaRAConfig(
            r=self.r,
            alpha=self.alpha,
            dropout=self.dropout,
            lambda_in=self.lambda_in,
            lambda_out=self.lambda_out,
            target_modules=list(self.target_modules),
            target_parameters=parameters,
        )
        return adapt(self.quantize(model, experts=bool(parameters)), config)


@dataclass
class QAHiRAAdapterConfig(QuantizedAdapterConfig):
    """QA-HiRA on an INT4 base whose groups equal the pooling (``lambda_in`` defaults to ``group_size``)."""

    name: str = "qahira"
    quantization: Quantization = Quantization.int4
    lambda_in: Optional[int] = option(None, "Input pooling factor (`null`: `group_size`, so the merge is exact).")
    lambda_out: int = option(1, "Output expansion factor.")
    init: str = option("zero", "`zero` starts from the base model; `kaiming` reproduces the authors' code, which "
                       "perturbs the model at step 0.")

    def apply(self, model: nn.Module) -> nn.Module:
        from lightning_merak.adapters import QAHiRAConfig  # lazy: torch, PEFT

        self.check_targets(model)
        parameters = self.pooled_expert_targets(model)
        config = QAHiRAConfig(
            r=self.r,
            alpha=self.alpha,
            dropout=self.dropout,
            lambda_in=self.input_pooling(model),
            lambda_out=self.lambda_out,
            init=self.init,
            target_modules=list(self.target_modules),
            target_parameters=parameters,
        )
        return adapt(self.quantize(model, experts=bool(parameters)), config)

    def input_pooling(self, model: nn.Module) -> int:
        """``lambda_in``, or ``group_size`` when unset; a group size that does not divide a targeted layer's inputs is
        refused here, naming ``adapter.group_size`` (the adapter itself could only name ``lambda_in``)."""
        from lightning_merak.adapters.base import names_module  # lazy: torch, PEFT

        if self.lambda_in is not None:
            return self.lambda_in
        for name, layer in model.named_modules():
            inputs = getattr(layer, "in_features", getattr(layer, "nx", None))  # Linear, INT4, bnb; GPT-2's Conv1D
            targeted = any(names_module(target, name) for target in self.target_modules)
            if targeted and isinstance(inputs, int) and inputs % self.group_size:
                raise ValueError(
                    f"adapter=qahira: adapter.group_size={self.group_size} does not divide the {inputs} inputs of "
                    f"{name}; adapter.lambda_in follows adapter.group_size unless set, and QA-HiRA pools whole "
                    f"groups. Pick an adapter.group_size dividing {inputs}, or set adapter.lambda_in")
        return self.group_size


def adapt(model: nn.Module, config: object) -> nn.Module:
    """``get_peft_model``, through :func:`~lightning_merak.adapters.moe.add_moe_adapters` when experts are adapted
    (checked, and marked like their experts under ``merak_ep``)."""
    if getattr(config, "target_parameters", None):
        from lightning_merak.adapters.moe import add_moe_adapters  # lazy: torch, PEFT

        return add_moe_adapters(model, config)
    from peft import get_peft_model

    return get_peft_model(model, config)


def register() -> None:
    """Register the ``adapter`` options' schemas (``conf/adapter/{lora,qbara,qahira}.yaml``)."""
    register_option("adapter", "lora", LoRAAdapterConfig)
    register_option("adapter", "qbara", QBaRAAdapterConfig)
    register_option("adapter", "qahira", QAHiRAAdapterConfig)
