"""LoRA layers split by tensor parallelism together with their base layers.

A PEFT LoRA layer computes ``W·x + s·B·A·x``. Split with its base, the adapter follows the split
of ``W`` so that no extra collective is needed:

- **column layer** (``W`` by output rows): ``A`` (r × in) is whole on every rank, ``B`` (out × r)
  is split by the base's rows (the same rows, in the same order: fused projections and shared
  key/value heads included). ``A`` reads the column group's input after it entered the
  tensor-parallel region, so its input gradient joins the group's one all-reduce. Each rank's ``A``
  gradient comes from its ``B`` rows only: it is summed over the group.
- **row layer** (``W`` by input features): ``A`` is split by input features, ``B`` whole. The r-wide
  partial ``A_r·x_r`` times ``B`` is added to the base's partial output before the row layer's
  all-reduce (``B·ΣA_r·x_r = Σ B·A_r·x_r``), so the sum is the row layer's own. ``B``'s gradient on
  each rank sees its part of the input only: it is summed over the group.

Whole parameters whose gradients are summed are Replicate DTensors (checkpoints read them like the
row layers' biases), reported by :func:`adapter_partial_parameters`. Parameter names stay those of
the PEFT model, so checkpoints and the merged export keep working.

Dropout on the adapter's input (``lora_dropout>0``) follows what each layer reads. A column layer's ``A``
reads the group's whole, replicated input, so its ranks draw one mask: its seed comes from a copy of the
shared random stream as the split span entered it (the same on every rank, replayed by recomputation,
distinct per layer and per forward), so no collective is needed. A row layer's ``A`` reads this rank's
input features, so each rank draws its slice's mask from a generator of its own, seeded by one draw of the
shared stream and the rank: the slices are independent, as those of one full mask are (the row layer runs
after the span has closed, where a plain ``nn.Dropout`` would repeat one pattern on every rank's slice).
The model trained at ``tensor_parallel>1`` is thus the single-process model under some dropout masks.

With sequence parallelism a column layer receives the whole sequence gathered, and ``A`` reads it there: its
input gradient joins the base's in the gather's reduce-scatter. A row layer's partial ``B·A_r·x_r`` joins the
base's partial output before its reduce-scatter, as it joins the all-reduce without it.

Adapters outside the transformer blocks (on the LM head or the input embedding) are not split: the layer they
wrap stays whole on every tensor-parallel rank, as everything outside the blocks is, and vocabulary parallelism
leaves such a head or embedding (and its tied partner) whole. Each rank computes the same update from the same
whole hidden states, so no collective is added.

Q-BaRA and QA-HiRA layers split the same way (:mod:`~lightning_merak.parallel.tensor.pooled_adapters`). A quantised
base (built on meta, quantised once its weights are in) is quantised per shard after the split, each rank its own
(:mod:`~lightning_merak.parallel.tensor.quantized_shards`); the adapter reads the same input and adds to the same
partial output whatever the base's GEMM. What is not split is refused by :func:`check_adapter_split` before any work:
a base quantised before the split, shards whose quantisation blocks would cross a shard, DoRA and other LoRA
variants, ``lora_bias``, dropout on a pooled adapter, a pooled adapter's ``lambda_out > 1`` on key/value heads
several ranks share, and several adapters on one layer, inside the blocks.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_merak.distributed.rank_streams import shared_stream_state
from lightning_merak.parallel.pipeline.recording import TraceError, find_trunk
from lightning_merak.parallel.tensor.layers import (
    ColumnGroupInput,
    ColumnParallelLinear,
    RowParallelLinear,
    sharded_parameter,
)
from lightning_merak.parallel.tensor.quantized_shards import quantized_base_problem
from lightning_merak.parallel.tensor.split_adapter import (
    SPLIT_FIX,
    SplitAdapter,
    reordered_rows_refusal,
    shared_split_problem,
)
from lightning_merak.util.random_state import spread_seed

__all__ = ["ColumnParallelLoRA", "RowParallelLoRA", "adapter_partial_parameters", "check_adapter_split",
           "is_tuner_layer", "linear_features", "row_following_parameters", "split_base", "split_linear"]

def is_tuner_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT tuner layer (an adapter wrapping a base layer).

    PEFT is looked up only if already imported: without it no model holds tuner layers.
    """
    tuners = sys.modules.get("peft.tuners.tuners_utils")  # not imported: PEFT is heavy and optional
    return tuners is not None and isinstance(module, tuners.BaseTunerLayer)


def _split_problem(layer: nn.Module) -> Optional[str]:
    """Why the tuner ``layer`` cannot be split with its base, or None."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(layer, LoraLayer):
        from lightning_merak.parallel.tensor.pooled_adapters import pooled_split_problem  # lazy: PEFT

        return pooled_split_problem(layer)
    problem = shared_split_problem(layer, layer.lora_A)
    if problem is not None:
        return problem
    adapter = next(iter(layer.lora_A))
    if adapter in getattr(layer, "lora_variant", {}) or layer.use_dora.get(adapter, False):
        return "LoRA variants (DoRA and others) are not split"
    if layer.lora_bias.get(adapter, False):
        return "lora_bias is not split"
    return None


def check_adapter_split(model: nn.Module, tensor_parallel: int) -> None:
    """Refuse, before any work, an adapter model that tensor parallelism cannot split at ``tensor_parallel``.

    Tuner layers outside the transformer blocks are left whole on every rank (module docstring), so only those
    inside are checked.
    """
    if tensor_parallel <= 1 or not getattr(model, "peft_config", None):
        return
    try:
        trunk_path: Optional[str] = find_trunk(model)[0]
    except TraceError:
        trunk_path = None
    if trunk_path is not None:  # a quantised base is quantised per shard: whole blocks of it in each
        problem = quantized_base_problem(model, trunk_path, tensor_parallel)
        if problem is not None:
            raise ValueError(problem)
    from lightning_merak.adapters.moe import expert_adapters  # lazy: PEFT (a model with adapters imported it)

    # tensor parallelism splits attention only: fused experts and their factors stay whole on every tp rank
    on_experts = {id(adapter.wrapper) for adapter in expert_adapters(model)}
    for name, module in model.named_modules():
        if not is_tuner_layer(module) or id(module) in on_experts:
            continue
        if trunk_path is not None and not name.startswith(trunk_path + "."):
            continue  # whole on every rank
        problem = _split_problem(module)
        if problem is not None:
            raise ValueError(f"tensor_parallel={tensor_parallel}: the adapter on {name} cannot be split: {problem}; "
                             + SPLIT_FIX)
        parent = model.get_submodule(name.rpartition(".")[0])
        if _pooled_on_shared_key_value_rows(module, parent, getattr(model, "config", None), tensor_parallel):
            lambda_out = module.lambda_out[next(iter(module.lambda_out))]
            raise ValueError(f"tensor_parallel={tensor_parallel}: "
                             + reordered_rows_refusal(module.method_name, module.layer_name, lambda_out))


def _pooled_on_shared_key_value_rows(layer: nn.Module, parent: nn.Module, config: Any, tensor_parallel: int) -> bool:
    """Whether ``layer`` is a Q-BaRA / QA-HiRA layer with ``lambda_out > 1`` on a key or value projection whose heads
    several ranks share (``num_key_value_heads`` not a multiple of ``tensor_parallel``): each of those ranks holds
    the head's rows, which the split refuses once its rows are probed (:mod:`~lightning_merak.parallel.tensor.rows`),
    after launch. Told by the config: the layer's width is the key/value heads' and a layer beside it (``parent``'s)
    of the same input width gives the query heads'."""
    heads, key_value = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if (not hasattr(layer, "lambda_out") or all(factor == 1 for factor in layer.lambda_out.values())
            or not isinstance(heads, int) or not isinstance(key_value, int) or not 0 < key_value < heads
            or key_value % tensor_parallel == 0):
        return False
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    return layer.out_features == key_value * head_dim and any(
        getattr(sibling, "in_features", None) == layer.in_features
        and getattr(sibling, "out_features", None) == heads * head_dim for sibling in parent.children())


def row_following_parameters(layer: nn.Module) -> list[str]:
    """Names of ``layer``'s parameters laid out by its output rows: all of a plain layer's; of a LoRA layer,
    its base's and ``B``'s (``A`` reads the input); of a pooled one, its base's and ``B``'s or ``H``'s."""
    names = [name for name, _ in layer.named_parameters()]
    if not is_tuner_layer(layer):
        return names
    if hasattr(layer, "lambda_in"):  # Q-BaRA / QA-HiRA
        from lightning_merak.parallel.tensor.pooled_adapters import row_split_factor  # lazy: PEFT

        return [name for name in names if name.startswith(("base_layer.", row_split_factor(layer) + "."))]
    return [name for name in names if not name.startswith("lora_A.")]


class _LoRAParts(SplitAdapter):
    """The adapter half of a split LoRA layer, under PEFT's names (``lora_A``, ``lora_B``, ``lora_dropout``)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer, _split_problem(layer))
        self.adapter = next(iter(layer.lora_A))
        self.lora_A, self.lora_B, self.lora_dropout = layer.lora_A, layer.lora_B, layer.lora_dropout
        self.scaling = float(layer.scaling[self.adapter])

    @property
    def a(self) -> nn.Linear:
        return self.lora_A[self.adapter]

    @property
    def b(self) -> nn.Linear:
        return self.lora_B[self.adapter]

    def mask_generator(self, device: torch.device) -> Optional[torch.Generator]:
        """Where this layer's dropout mask is drawn from: None for the current stream."""
        return None

    def dropout_mask(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The adapter input's dropout mask for this forward, kept entries scaled by ``1/(1-p)`` as
        ``nn.Dropout`` scales them; None when no dropout applies (``p=0`` or evaluation)."""
        dropout = self.lora_dropout[self.adapter]
        if not isinstance(dropout, nn.Dropout) or not dropout.training or dropout.p == 0:
            return None
        keep = 1.0 - dropout.p
        generator = self.mask_generator(tensor.device)
        return torch.empty_like(tensor).bernoulli_(keep, generator=generator).div_(keep)

    def adapter_path(self, tensor: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        mask = self.dropout_mask(tensor)
        dropped = tensor if mask is None else tensor * mask
        return F.linear(F.linear(dropped, a), b) * self.scaling


class ColumnParallelLoRA(_LoRAParts):
    """A LoRA layer over a column layer: the base's rows split, ``A`` whole (gradient summed), ``B`` by the rows;
    its dropout mask is one for the group (module docstring). Without ``group_input`` (sequence parallelism) the
    input arrives gathered."""

    _numbering = itertools.count()
    """Numbers the layers in the order they are split, which every rank of a group follows."""

    def __init__(self, layer: nn.Module, mesh: DeviceMesh, group_input: Optional[ColumnGroupInput],
                 rows: Optional[Sequence[Sequence[int]]] = None) -> None:
        super().__init__(layer)
        self.mask_index = next(self._numbering)
        self.base_layer = ColumnParallelLinear(layer.get_base_layer(), mesh, group_input, rows)
        b = self.b.weight
        if rows is not None:
            b = b[torch.tensor([row for part in rows for row in part], device=b.device)]
        self.a.weight = sharded_parameter(self.a.weight, mesh, Replicate())
        self.b.weight = sharded_parameter(b, mesh, Shard(0))
        self.base_layer.rows_alike = (self.b.weight,)

    def mask_generator(self, device: torch.device) -> torch.Generator:
        """A generator seeded alike on every rank of the group: from a copy of the shared stream where the
        split span entered it (outside a span, the current stream is the shared one and is drawn from)."""
        shared = shared_stream_state()
        if shared is None:
            draw = torch.randint(2**62, (1,))
        else:
            draw = torch.randint(2**62, (1,), generator=torch.Generator().set_state(shared[0]))
        return torch.Generator(device=device).manual_seed(spread_seed(int(draw), self.mask_index))

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(tensor)
        group_input = self.base_layer.group_input
        entered = tensor if group_input is None else group_input.enter(tensor)[0]  # the entry the base took
        return result + self.adapter_path(entered, self.a.weight.to_local(), self.base_layer.local(self.b.weight))

    def partial_parameters(self) -> list[nn.Parameter]:
        return [self.a.weight] if self.a.weight.requires_grad else []


class RowParallelLoRA(_LoRAParts):
    """A LoRA layer over a row layer: ``A`` split by input features, ``B`` whole (gradient summed); its partial
    output joins the base's before the one all-reduce (reduce-scatter with sequence parallelism)."""

    def __init__(self, layer: nn.Module, mesh: DeviceMesh, partner_input: Optional[ColumnGroupInput] = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__(layer)
        self.base_layer = RowParallelLinear(layer.get_base_layer(), mesh, partner_input, sequence_parallel)
        self.rank = mesh.get_local_rank()
        self.a.weight = sharded_parameter(self.a.weight, mesh, Shard(1))
        self.b.weight = sharded_parameter(self.b.weight, mesh, Replicate())

    def mask_generator(self, device: torch.device) -> torch.Generator:
        """This rank's generator for its slice's mask: one draw of the current stream (alike on every rank,
        replayed by recomputation) spread by the rank."""
        draw = int(torch.randint(2**62, (1,)))
        return torch.Generator(device=device).manual_seed(spread_seed(draw, self.rank))

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.base_layer(tensor, self.adapter_path(tensor, self.a.weight.to_local(), self.b.weight.to_local()))

    def partial_parameters(self) -> list[nn.Parameter]:
        return [self.b.weight] if self.b.weight.requires_grad else []


def adapter_partial_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Whole adapter parameters of the split adapter layers in ``module`` whose gradients are partial on each
    rank."""
    return [param for layer in module.modules() if isinstance(layer, SplitAdapter)
            for param in layer.partial_parameters()]


def split_linear(layer: nn.Module, mesh: DeviceMesh, *, column: bool, group_input: Optional[ColumnGroupInput],
                 rows: Optional[Sequence[Sequence[int]]] = None, sequence_parallel: bool = False) -> nn.Module:
    """``layer`` (an ``nn.Linear``, or a LoRA, Q-BaRA or QA-HiRA layer over one) split as a column or a row
    layer."""
    if not is_tuner_layer(layer):
        if column:
            return ColumnParallelLinear(layer, mesh, group_input, rows)
        return RowParallelLinear(layer, mesh, group_input, sequence_parallel=sequence_parallel)
    if hasattr(layer, "lambda_in"):  # Q-BaRA / QA-HiRA
        from lightning_merak.parallel.tensor.pooled_adapters import (  # lazy: PEFT
            ColumnParallelPooled,
            RowParallelPooled,
        )

        if column:
            return ColumnParallelPooled(layer, mesh, group_input, rows)
        return RowParallelPooled(layer, mesh, group_input, sequence_parallel)
    if column:
        return ColumnParallelLoRA(layer, mesh, group_input, rows)
    return RowParallelLoRA(layer, mesh, group_input, sequence_parallel)


def split_base(layer: nn.Module) -> nn.Module:
    """The split layer computing ``layer``'s base: a split adapter layer's base layer, else ``layer`` itself (a
    sequence gather defers the weight gradients of these)."""
    return layer.base_layer if isinstance(layer, SplitAdapter) else layer


def linear_features(module: nn.Module) -> Optional[tuple[int, int]]:
    """``(in, out)`` features of a LoRA layer, else None (the caller reads a plain layer's)."""
    if is_tuner_layer(module):
        return int(module.in_features), int(module.out_features)
    return None
