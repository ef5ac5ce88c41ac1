"""The layers a tensor-parallel block runs: column layers split by output rows, row layers by input features.

Parameters are DTensors (column weights and biases ``Shard(0)``, row weights ``Shard(1)``,
row biases ``Replicate``) so checkpoints reshard between layouts; the layers compute on the
local shards and issue their collectives through :func:`~lightning_merak.distributed.collectives.all_reduce_in_turn`,
which lets sub-batches overlap them (``tp_overlap``) and never repeats one on recomputation.
A column group's layers share one input all-reduce in backward (q, k and v sum their
input gradients first), which runs while the group's weight gradients are computed
(:mod:`~lightning_merak.distributed.weight_gradients`).

A column layer may hold any rows of the original (:mod:`~lightning_merak.parallel.tensor.rows`);
rows several ranks hold (a key/value head shared by their query heads) get only this rank's
part of their gradient, so it is summed over the group in backward, before it accumulates.

A frozen layer's shard may be quantised after the split (:meth:`QuantizableShard.quantize_shard`: an adapter's
base, each rank quantising its own shard); its local GEMM is then the quantised layer's, registered under a name
saying which shard it is (``shard_tp1of2``), since no two ranks hold the same codes.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from lightning_merak.distributed.collectives import (
    all_reduce_in_turn,
    all_reduce_traced_or_in_turn,
    start_all_reduce_in_turn,
)
from lightning_merak.distributed.weight_gradients import DeferredWeightGradients, linear_deferring_weight_gradient
from lightning_merak.parallel.tensor.quantized_shards import shard_module_name
from lightning_merak.parallel.tensor.sequence import deferrable_weight, linear_on_gathered, reduce_scatter_sequence

__all__ = ["ColumnGroupInput", "ColumnParallelLinear", "QuantizableShard", "RowParallelLinear", "WholeWidthRMSNorm",
           "is_rms_norm", "shared_row_weights", "sharded_parameter"]


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input gradient, partial on each rank, is all-reduced in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_traced_or_in_turn(grad.contiguous().clone(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce of the row layer's partial output (plus its bias) in forward; identity backward.

    The output is a new tensor, as the unsplit layer's is: a block may add to it in place (Falcon),
    while recomputation keeps the reduced buffer as the collective's recorded result.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        reduced = all_reduce_traced_or_in_turn(tensor.contiguous(), group)
        return reduced + bias if bias is not None else reduced.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        bias_grad = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        return grad, None, bias_grad


class _ColumnGroupEntry(torch.autograd.Function):
    """Identity forward on a column group's input; its parameters are the group's local weights.

    Backward launches the all-reduce of the input gradient (partial on each rank), computes the
    group's deferred weight gradients meanwhile, then waits.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, deferred: DeferredWeightGradients,
                *weights: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.deferred = group, deferred
        ctx.set_materialize_grads(False)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        pending = (start_all_reduce_in_turn(grad.contiguous().clone(), ctx.group)
                   if grad is not None and ctx.needs_input_grad[0] else None)
        weight_grads = ctx.deferred.weight_gradients()
        return (pending.wait() if pending is not None else None, None, None, *weight_grads)


class ColumnGroupInput:
    """The input of a column group, entered into the tensor-parallel region once for all its layers.

    Held from the group's first column layer until its row layer runs (per thread, so
    sub-batches keep their own). With ``overlap_weight_gradients`` the entry also takes the
    group's weights, and computes their gradients while the input gradient is all-reduced.
    """

    def __init__(self, group: dist.ProcessGroup, overlap_weight_gradients: bool = True) -> None:
        self.group = group
        self.overlap_weight_gradients = overlap_weight_gradients
        self._layers: list[ColumnParallelLinear] = []
        self._last = threading.local()
        self._traced: tuple[Optional[torch.Tensor], Optional[torch.Tensor]] = (None, None)

    def add_layer(self, layer: "ColumnParallelLinear") -> int:
        """Register a column layer of the group; returns its index among the group's weights."""
        self._layers.append(layer)
        return len(self._layers) - 1

    def enter(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Optional[DeferredWeightGradients]]:
        """``tensor`` in the tensor-parallel region, and where the group's layers leave their weight gradients."""
        if torch.compiler.is_compiling():  # traced: one entry per group, its weight gradients left to the compiler
            if self._traced[0] is not tensor:
                self._traced = (tensor, _CopyToTensorParallel.apply(tensor, self.group))
            return self._traced[1], None
        source: Optional[weakref.ref] = getattr(self._last, "source", None)
        if source is not None and source() is tensor:
            return self._last.entered, self._last.deferred
        if self.overlap_weight_gradients:
            weights = [deferrable_weight(layer) for layer in self._layers]
            deferred = DeferredWeightGradients(weights, tensor.requires_grad)
            entered = _ColumnGroupEntry.apply(tensor, self.group, deferred, *weights)
        else:
            deferred, entered = None, _CopyToTensorParallel.apply(tensor, self.group)
        self._last.source, self._last.entered, self._last.deferred = weakref.ref(tensor), entered, deferred
        return entered, deferred

    def release(self) -> None:
        if torch.compiler.is_compiling():
            self._traced = (None, None)
            return
        self._last.source = self._last.entered = self._last.deferred = None


class _SumSharedRows(torch.autograd.Function):
    """Identity forward on a local weight or bias; backward sums the rows other ranks hold too.

    ``positions`` are those rows' places in the local tensor, ``slots`` their places among the
    ``count`` rows held by more than one rank (the same numbering on every rank).
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, count: int,
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.positions, ctx.slots, ctx.count, ctx.group = positions, slots, count, group
        ctx.set_materialize_grads(False)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        if grad is None:
            return None, None, None, None, None
        positions, slots = ctx.positions.to(grad.device), ctx.slots.to(grad.device)
        summed = grad.new_zeros((ctx.count, *grad.shape[1:]))
        summed[slots] = grad[positions]
        all_reduce_in_turn(summed, ctx.group)
        grad = grad.clone()
        grad[positions] = summed[slots]
        return grad, None, None, None, None


LocalMatmul = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
"""``(input, local weight, local bias) -> output``: a split layer's local GEMM other than ``F.linear`` (fp8)."""


ShardQuantizer = Callable[[nn.Linear, Optional[Callable[[torch.Tensor], torch.Tensor]]], nn.Module]
"""``(shard as a bias-less nn.Linear, whole-row absmax or None) -> its quantised layer`` (an adapter's deferred
quantisation, :meth:`~lightning_merak.adapters.meta.DeferredQuantization.quantize_linear`)."""


class QuantizableShard(nn.Module):
    """What the split layers share to run a frozen shard quantised: :meth:`quantize_shard` replaces the float
    shard (``weight``, then None) by its quantised layer (:attr:`quantized`), which the forward then calls."""

    weight: Optional[nn.Parameter]
    group: dist.ProcessGroup
    _quantized_name: Optional[str] = None

    @property
    def quantized(self) -> Optional[nn.Module]:
        """This rank's shard quantised, or None while the weight is float."""
        return None if self._quantized_name is None else getattr(self, self._quantized_name)

    def quantize_shard(self, quantize: ShardQuantizer) -> None:
        """Quantise this rank's frozen weight shard with ``quantize`` (bias kept: the split layer adds it)."""
        if self.weight is None or self.weight.requires_grad:
            raise ValueError("only a frozen float weight shard is quantised (an adapter's base), once")
        local = self.weight.to_local().detach()
        shard = nn.Linear(local.shape[1], local.shape[0], bias=False, device="meta")
        shard.weight = nn.Parameter(local, requires_grad=False)
        quantized = quantize(shard, self.whole_row_absmax if isinstance(self, RowParallelLinear) else None)
        self._quantized_name = shard_module_name(dist.get_rank(self.group), dist.get_world_size(self.group))
        self._local_shape = tuple(local.shape)
        self.weight = None
        self.add_module(self._quantized_name, quantized)

    def quantized_matmul(self, tensor: torch.Tensor) -> torch.Tensor:
        """The quantised shard's output for ``tensor`` (its layer's own forward, as the whole model's)."""
        return self.quantized(tensor)

    def split_geometry(self) -> tuple[bool, int, int, int, bool]:
        raise NotImplementedError

    def quantized_split(self) -> Optional[dict[str, Any]]:
        """How the group's quantised shards join into the whole layer's weight, for a checkpoint's readers (the
        merged export dequantises each shard alone): ``dim`` 0 (output rows) or 1 (input columns), ``degree``,
        the whole ``shape`` and, for column layers the plan reorders, ``rows[r]``: the original rows rank ``r``
        holds. None while the weight is float."""
        if self.quantized is None:
            return None
        column, in_features, out_features, degree, _ = self.split_geometry()
        order = getattr(self, "_order", None)
        rows = [list(part) for part in order] if order is not None else None
        if rows is not None:  # rows shared by several ranks are one row of the whole layer
            out_features = len({row for part in rows for row in part})
        return {"dim": 0 if column else 1, "degree": degree, "shape": [out_features, in_features], "rows": rows}


def sharded_parameter(parameter: nn.Parameter, mesh: DeviceMesh, placement: Any) -> nn.Parameter:
    """``parameter`` as a DTensor over ``mesh``; a frozen one stays frozen."""
    return nn.Parameter(distribute_tensor(parameter.detach(), mesh, [placement]),
                        requires_grad=parameter.requires_grad)


class ColumnParallelLinear(QuantizableShard):
    """A linear layer holding its output features' shard; output stays split over the group.

    ``group_input`` enters the input into the tensor-parallel region; without one (sequence
    parallelism) the input arrives gathered, its gradient reduce-scattered by the gather, and
    only this rank's slice of it is kept for the weight gradient (gathered again in backward).
    ``rows[r]`` are the original output rows rank r holds (default: its contiguous part).
    """

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, group_input: Optional[ColumnGroupInput],
                 rows: Optional[Sequence[Sequence[int]]] = None) -> None:
        super().__init__()
        weight, bias = linear.weight, linear.bias
        self._shared: Optional[tuple[torch.Tensor, torch.Tensor, int]] = None
        self._order = rows
        if rows is not None:
            order = torch.tensor([row for part in rows for row in part], device=weight.device)
            weight, bias = weight[order], bias[order] if bias is not None else None
            self._shared = _shared_positions(rows, mesh.get_local_rank())
        self.register_buffer("row_share", _row_shares(rows, mesh.get_local_rank()).to(weight.device)
                             if self._shared is not None else None, persistent=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = sharded_parameter(weight, mesh, Shard(0))
        self.bias = sharded_parameter(bias, mesh, Shard(0)) if bias is not None else None
        self.group = mesh.get_group()
        self.group_input = group_input
        self._index = group_input.add_layer(self) if group_input is not None else -1
        # other split parameters laid out by this layer's output rows (a LoRA ``B``): shared rows counted once
        self.rows_alike: tuple[nn.Parameter, ...] = ()
        self.float8_matmul: Optional[LocalMatmul] = None

    def local_features(self) -> tuple[int, int]:
        """``(in, out)`` features of the GEMM this rank runs: its shard of the output rows."""
        if self.weight is None:
            return self.in_features, self._local_shape[0]
        return self.in_features, self.weight.to_local().shape[0]

    def local(self, parameter: Optional[nn.Parameter]) -> Optional[torch.Tensor]:
        """This rank's shard of ``parameter``, whose shared rows get their gradient summed over the group."""
        if parameter is None:
            return None
        local = parameter.to_local()
        if self._shared is None:
            return local
        return _SumSharedRows.apply(local, *self._shared, self.group)

    def split_geometry(self) -> tuple[bool, int, int, int, bool]:
        """``(column, in, out, ranks, contiguous)``: split by output rows, whole widths, group size, and whether
        this rank holds its contiguous part of the rows (not reordered nor shared)."""
        return True, self.in_features, self.out_features, dist.get_world_size(self.group), self._order is None

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        bias = self.local(self.bias)
        if self.weight is None:  # quantised: a frozen GEMM, no weight gradient to defer
            entered = tensor if self.group_input is None else self.group_input.enter(tensor)[0]
            output = self.quantized_matmul(entered)
            return output + bias if bias is not None else output
        if self.float8_matmul is not None:  # its weight gradient comes from the fp8 backward, never deferred
            entered = tensor if self.group_input is None else self.group_input.enter(tensor)[0]
            return self.float8_matmul(entered, self.local(self.weight), bias)
        if self.group_input is None:
            return linear_on_gathered(tensor, self.local(self.weight), bias, layer=self)
        entered, deferred = self.group_input.enter(tensor)
        if deferred is None:
            return F.linear(entered, self.local(self.weight), bias)
        return linear_deferring_weight_gradient(entered, self.weight.to_local(), bias, deferred, self._index)


def _row_shares(rows: Sequence[Sequence[int]], rank: int) -> torch.Tensor:
    """1 / the number of ranks holding each of ``rank``'s rows."""
    copies: dict[int, int] = {}
    for part in rows:
        for row in part:
            copies[row] = copies.get(row, 0) + 1
    return torch.tensor([1.0 / copies[row] for row in rows[rank]])


def shared_row_weights(module: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Split parameters of ``module`` whose rows some ranks share, each with its local rows' 1 / copies.

    For a gradient norm that counts each shared row once: weight each local row's square by it.
    """
    found = []
    for layer in module.modules():
        share = getattr(layer, "row_share", None)
        if isinstance(share, torch.Tensor):
            params = (layer.weight, getattr(layer, "bias", None), *getattr(layer, "rows_alike", ()))
            found += [(param, share) for param in params if param is not None]
    return found


def _shared_positions(rows: Sequence[Sequence[int]], rank: int) -> Optional[tuple[torch.Tensor, torch.Tensor, int]]:
    """Where the rows other ranks hold too sit in ``rank``'s shard and among all such rows; None if there are none."""
    counts: dict[int, int] = {}
    for part in rows:
        for row in part:
            counts[row] = counts.get(row, 0) + 1
    shared = sorted(row for row, count in counts.items() if count > 1)
    if not shared:
        return None
    slot = {row: index for index, row in enumerate(shared)}
    positions = [index for index, row in enumerate(rows[rank]) if row in slot]
    return (torch.tensor(positions, dtype=torch.long), torch.tensor([slot[rows[rank][i]] for i in positions],
                                                                    dtype=torch.long), len(shared))


class RowParallelLinear(QuantizableShard):
    """A linear layer holding its input features' shard; partial outputs are summed over the group.

    With ``sequence_parallel`` the sum is reduce-scattered: each rank keeps its slice of the sequence.
    """

    def __init__(self, linear: nn.Linear, mesh: DeviceMesh, partner_input: Optional[ColumnGroupInput] = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = sharded_parameter(linear.weight, mesh, Shard(1))
        self.bias = (sharded_parameter(linear.bias, mesh, Replicate())
                     if linear.bias is not None else None)
        self.group = mesh.get_group()
        self.partner_input = partner_input
        self.sequence_parallel = sequence_parallel
        self.float8_matmul: Optional[LocalMatmul] = None

    def local_features(self) -> tuple[int, int]:
        """``(in, out)`` features of the GEMM this rank runs: its shard of the input features."""
        if self.weight is None:
            return self._local_shape[1], self.out_features
        return self.weight.to_local().shape[1], self.out_features

    def split_geometry(self) -> tuple[bool, int, int, int, bool]:
        """``(column, in, out, ranks, contiguous)``: split by input features, whole widths, group size."""
        return False, self.in_features, self.out_features, dist.get_world_size(self.group), True

    def whole_row_absmax(self, local: torch.Tensor) -> torch.Tensor:
        """The largest magnitude of each whole row, from this rank's (``local``): the max over the group (exact)."""
        whole = local.clone()
        dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=self.group)
        return whole

    def forward(self, tensor: torch.Tensor, addend: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``addend``: another partial output summed with this one (a LoRA path on this rank's input features)."""
        if self.partner_input is not None:
            self.partner_input.release()
        if self.weight is None:
            partial = self.quantized_matmul(tensor)
        elif self.float8_matmul is None:
            partial = F.linear(tensor, self.weight.to_local())
        else:
            partial = self.float8_matmul(tensor, self.weight.to_local(), None)
        if addend is not None:
            partial = partial + addend
        bias = self.bias.to_local() if self.bias is not None else None
        if not self.sequence_parallel:
            return _ReduceFromTensorParallel.apply(partial, self.group, bias)
        output = reduce_scatter_sequence(partial, self.group)
        return output + bias if bias is not None else output




class _SumOverGroup(torch.autograd.Function):
    """A per-rank partial sum made whole in forward; its gradient, read by every rank, summed in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return all_reduce_in_turn(tensor.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_traced_or_in_turn(grad.contiguous().clone(), ctx.group), None


class WholeWidthRMSNorm(nn.Module):
    """An RMS norm over a whole column projection (OLMo 2's q/k norms) run on this rank's rows of it.

    The mean square is summed over the group (rows several ranks hold counted once), so each
    rank normalises its rows as the whole norm would: one all-reduce of one value per token in
    forward and in backward, instead of gathering the projection. The weight is split like the
    projection's rows (``rows[r]``: the original rows rank r holds).
    """

    def __init__(self, norm: nn.Module, mesh: DeviceMesh, rows: Optional[Sequence[Sequence[int]]]) -> None:
        super().__init__()
        width = norm.weight.shape[0]
        rows = rows if rows is not None else [range(r * width // mesh.size(), (r + 1) * width // mesh.size())
                                              for r in range(mesh.size())]
        order = torch.tensor([row for part in rows for row in part], device=norm.weight.device)
        self.weight = sharded_parameter(norm.weight[order], mesh, Shard(0))
        self.eps = next(getattr(norm, a) for a in ("variance_epsilon", "eps") if hasattr(norm, a))
        self.width, self.group = width, mesh.get_group()
        self.register_buffer("_share", _row_shares(rows, mesh.get_local_rank()).to(norm.weight.device),
                             persistent=False)
        self._shared = _shared_positions(rows, mesh.get_local_rank())
        self.register_buffer("row_share", self._share.clone() if self._shared is not None else None,
                             persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        squares = _SumOverGroup.apply((hidden.pow(2) * self._share).sum(-1, keepdim=True), self.group)
        hidden = hidden * torch.rsqrt(squares / self.width + self.eps)
        weight = self.weight.to_local()
        if self._shared is not None:
            weight = _SumSharedRows.apply(weight, *self._shared, self.group)
        return (weight * hidden).to(dtype)


def is_rms_norm(module: nn.Module) -> bool:
    """An RMS norm :class:`WholeWidthRMSNorm` reproduces: a 1-D weight, an epsilon, no bias."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.ndim == 1
            and getattr(module, "bias", None) is None
            and any(isinstance(getattr(module, a, None), float) for a in ("variance_epsilon", "eps")))
