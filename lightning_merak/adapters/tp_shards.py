"""Whether an adapter model's frozen base and pooled adapters split over tensor-parallel ranks: every problem at once.

Tensor parallelism splits a column layer by its output rows and a row layer by its input features; each rank then
quantises its own shard of the base (:class:`~lightning_merak.adapters.meta.DeferredQuantization`) and pools its own
part of a Q-BaRA / QA-HiRA update. That is the whole model's computation, sliced, only where every quantisation block
(:func:`~lightning_merak.adapters.quantize.shard_block_problem`) and every pooled group (``lambda_in`` inputs of a row
layer, ``lambda_out`` outputs of a column layer: :func:`pooled_shard_problem`) lies inside one shard, and where the
base is not double-quantised (:func:`~lightning_merak.adapters.quantize.double_quant_problem`).
:func:`adapter_shard_problems` names all of them together, so a setting is fixed in one try: ``merak-train`` asks it
before any rank starts, on the layers :func:`block_split_layers` finds in the meta model, and the ranks again on the
layers of the traced split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .base import PooledAdapterLayer
from .qahira.layer import QAHiRALinear
from .quantize import double_quant_problem, shard_block_problem

__all__ = ["BaseQuantization", "SplitLayer", "adapter_shard_problems", "block_split_layers", "pooled_shard_problem",
           "shard_refusal", "split_layer"]


class BaseQuantization(Protocol):
    """How an adapter model's frozen base is quantised (:class:`~.meta.DeferredQuantization`)."""

    quantization: str
    group_size: int
    double_quant: bool
    skip: tuple[str, ...]


@dataclass(frozen=True)
class SplitLayer:
    """One linear layer of a block as tensor parallelism splits it, with its pooled adapter's factors if it has one."""

    name: str
    """Its name inside the block (``self_attn.o_proj``): the same in every block of one structure."""
    in_features: int
    out_features: int
    column: bool
    """Split by output rows (a column layer), else by input features (a row layer)."""
    contiguous: bool = True
    """Each rank holds its rows in order (not a fused projection's or shared key/value heads' reordered rows)."""
    method: Optional[str] = None
    """The pooled adapter on it (``Q-BaRA``, ``QA-HiRA``), None for none."""
    lambda_in: int = 1
    lambda_out: int = 1


def pooled_shard_problem(method: str, name: str, features: int, tensor_parallel: int, group: int, *,
                         column: bool) -> Optional[str]:
    """Why a pooled adapter's groups would cross the shards of its ``column`` (or row) layer ``name``, or None.

    A column layer's ranks each hold ``out / tp`` output rows, whole groups of ``lambda_out`` (``group``) each; a row
    layer's ``in / tp`` inputs, pooled in groups of ``lambda_in`` by each rank on its own."""
    if tensor_parallel <= 1 or features % (tensor_parallel * group) == 0:
        return None
    what, factor = ("outputs", "lambda_out") if column else ("inputs", "lambda_in")
    shard = f"{features // tensor_parallel}" if features % tensor_parallel == 0 else f"{features}/{tensor_parallel}"
    return (f"{method}: {name}: the {what} of {features} over tensor_parallel={tensor_parallel} ({shard} a rank) do "
            f"not split into whole groups of {factor}={group}; set adapter.{factor} to a divisor of {shard}"
            + (" (adapter.lambda_in follows adapter.group_size unless set)"
               if method == QAHiRALinear.method_name and not column else "")
            + ", or use tensor_parallel=1")


def adapter_shard_problems(layers: Iterable[SplitLayer], tensor_parallel: int,
                           base: Optional[BaseQuantization]) -> list[str]:
    """Every reason ``layers`` (each at most once by name) would not split over ``tensor_parallel`` ranks as the
    whole model computes: the base's double quantisation (where a quantised layer is split), quantisation blocks and
    pooled groups across shards."""
    if tensor_parallel <= 1:
        return []
    quantized = base if base is not None and base.quantization != "none" else None
    problems: list[Optional[str]] = []
    split_quantized = False
    seen: set[str] = set()
    for layer in layers:
        if layer.name in seen:
            continue
        seen.add(layer.name)
        if quantized is not None and layer.name.removesuffix(".base_layer").rpartition(".")[2] not in quantized.skip:
            problems.append(shard_block_problem(quantized.quantization, layer.name, layer.in_features,
                                                tensor_parallel, column=layer.column, contiguous=layer.contiguous,
                                                group_size=quantized.group_size))
            split_quantized = True
        if layer.method is not None:
            features, group = ((layer.out_features, layer.lambda_out) if layer.column
                               else (layer.in_features, layer.lambda_in))
            problems.append(pooled_shard_problem(layer.method, layer.name, features, tensor_parallel, group,
                                                 column=layer.column))
    if quantized is not None and split_quantized:
        problems.insert(0, double_quant_problem(quantized.quantization, quantized.double_quant, tensor_parallel))
    return [problem for problem in problems if problem is not None]


def shard_refusal(problems: list[str]) -> Optional[str]:
    """One message naming every problem of :func:`adapter_shard_problems`, numbered; None for none."""
    if len(problems) <= 1:
        return problems[0] if problems else None
    listed = "; ".join(f"({number}) {problem}" for number, problem in enumerate(problems, start=1))
    return f"{len(problems)} problems with the adapter at tensor parallelism: {listed}"


def _units(block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The block's linear layers as the split takes them: a tuner layer whole (its base and factors inside it), and
    float ``nn.Linear`` layers (a subclass computes the same ``x @ W.T + b``), in registration order."""
    units: list[tuple[str, nn.Module]] = []
    for name, module in block.named_modules():
        if any(name.startswith(unit + ".") for unit, _ in units):
            continue
        if isinstance(module.get_base_layer() if isinstance(module, BaseTunerLayer) else module, nn.Linear):
            units.append((name, module))
    return units


def block_split_layers(block: nn.Module, hidden_size: int) -> list[SplitLayer]:
    """The column and row layers of one transformer ``block`` (its modules need no weights: a meta block will do).

    As the traced split pairs them, column layers read the block's hidden state (``in == hidden_size``) and their row
    partner writes it back (``out == hidden_size``). Before any input flows, a group is told by its module: the
    linear layers one module holds (``self_attn``'s ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) are a group and
    its partner, the partner being the last of them to write the hidden state back (a square ``q_proj`` comes before
    its ``o_proj``; Phi-3 registers ``o_proj`` before its wider ``qkv_proj``)."""
    by_parent: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in _units(block):
        by_parent.setdefault(name.rpartition(".")[0], []).append((name, module))
    layers = []
    for members in by_parent.values():
        writers = [name for name, module in members if _features(module)[1] == hidden_size]
        columns = [(name, module) for name, module in members
                   if _features(module)[0] == hidden_size and writers and name != writers[-1]]
        if not columns:
            continue
        layers += [split_layer(name, module, column=True) for name, module in columns]
        layers.append(split_layer(writers[-1], dict(members)[writers[-1]], column=False))
    return layers


def _features(module: nn.Module) -> tuple[int, int]:
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    return base.in_features, base.out_features


def split_layer(name: str, module: nn.Module, *, column: bool) -> SplitLayer:
    """``module`` (a linear layer, or a tuner layer over one) at ``name`` in its block, split as a ``column`` or row
    layer, with its pooled adapter's factors where it has one."""
    in_features, out_features = _features(module)
    if not isinstance(module, PooledAdapterLayer) or not module.lambda_in:
        return SplitLayer(name, in_features, out_features, column)
    adapter = next(iter(module.lambda_in))
    return SplitLayer(name, in_features, out_features, column, method=module.method_name,
                      lambda_in=int(module.lambda_in[adapter]), lambda_out=int(module.lambda_out[adapter]))
