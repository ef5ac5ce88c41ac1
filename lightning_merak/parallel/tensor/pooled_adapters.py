"""Q-BaRA and QA-HiRA layers split by tensor parallelism together with their base layers.

Both compute ``W·x + s·E_out(M·P_in(x))`` (:mod:`lightning_merak.adapters.pooling`): ``P_in`` averages groups of
``lambda_in`` inputs, ``E_out`` repeats each output ``lambda_out`` times, and ``M`` is ``B·A`` (Q-BaRA) or ``H``
(QA-HiRA). Split with its base, the adapter follows the split of ``W`` as LoRA's does
(:mod:`~lightning_merak.parallel.tensor.adapters`), a pooled group never crossing a shard:

- **column layer** (``W`` by output rows): the input is whole, so its pooling is too; ``M``'s rows are split by
  the base's, whole groups of ``lambda_out`` rows each (``out / tp`` a multiple of ``lambda_out``). Q-BaRA's ``A``
  is whole (its gradient, from this rank's ``B`` rows only, is summed over the group) and ``B`` split by rows;
  QA-HiRA's ``H`` is split by rows. A column layer whose ranks hold reordered or shared rows (fused projections,
  shared key/value heads) takes ``M`` row by row, so it needs ``lambda_out == 1``.
- **row layer** (``W`` by input features): each rank pools its own inputs (``in / tp`` a multiple of
  ``lambda_in``); ``M``'s columns are split with them. Q-BaRA's ``A`` is split by columns and ``B`` whole (its
  gradient summed); QA-HiRA's ``H`` split by columns. The partial update joins the base's partial output before
  the row layer's all-reduce (or reduce-scatter), so the sum is the row layer's own.

Parameter names stay the tuner's (``qbara_A``, ``qbara_B``, ``qahira_H``), so checkpoints and the merged export
keep working. Dropout on the pooled input is refused at ``tensor_parallel > 1`` (a column layer's ranks would need
one mask), as are merged adapters, several adapters on one layer and bases other than a float ``nn.Linear``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from lightning_merak.adapters.base import PooledAdapterLayer
from lightning_merak.adapters.pooling import expand_outputs, pool_inputs
from lightning_merak.parallel.tensor.layers import (
    ColumnGroupInput,
    ColumnParallelLinear,
    RowParallelLinear,
    sharded_parameter,
)
from lightning_merak.parallel.tensor.split_adapter import (
    SPLIT_FIX,
    SplitAdapter,
    reordered_rows_refusal,
    shared_split_problem,
)

__all__ = ["ColumnParallelPooled", "RowParallelPooled", "pooled_split_problem", "row_split_factor"]

def pooled_split_problem(layer: nn.Module) -> Optional[str]:
    """Why the Q-BaRA / QA-HiRA ``layer`` cannot be split with its base whatever its role, or None (the shard
    widths are checked when the layer is split: :class:`ColumnParallelPooled`, :class:`RowParallelPooled`)."""
    if not isinstance(layer, PooledAdapterLayer):
        return f"{type(layer).__name__} adapters are not split by tensor parallelism"
    problem = shared_split_problem(layer, layer.lambda_in)
    if problem is not None:
        return problem
    dropout = layer.adapter_dropout[next(iter(layer.lambda_in))]
    if isinstance(dropout, nn.Dropout) and dropout.p > 0:
        return ("dropout on the pooled input would need one mask for a column layer's ranks; set the adapter's "
                "dropout=0")
    return None


def row_split_factor(layer: nn.Module) -> str:
    """The factor of a pooled ``layer`` laid out by its output rows: Q-BaRA's ``B``, QA-HiRA's ``H``."""
    return layer.adapter_layer_names[-1]


class _PooledParts(SplitAdapter):
    """The adapter half of a split pooled layer, under the tuner's names (``qbara_A``/``qbara_B`` or
    ``qahira_H``, ``adapter_dropout``)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__(layer, pooled_split_problem(layer))
        self.adapter = next(iter(layer.lambda_in))
        self.method_name = layer.method_name
        self.layer_name: str = getattr(layer, "layer_name", type(layer.get_base_layer()).__name__)  # its module path
        self.factor_names: tuple[str, ...] = tuple(layer.adapter_layer_names)
        for name in self.factor_names:
            setattr(self, name, getattr(layer, name))
        self.adapter_dropout = layer.adapter_dropout
        self.lambda_in, self.lambda_out = int(layer.lambda_in[self.adapter]), int(layer.lambda_out[self.adapter])
        self.scaling = float(layer.scaling[self.adapter])

    def factor(self, name: str) -> nn.Parameter:
        return getattr(self, name)[self.adapter]

    def set_factor(self, name: str, value: nn.Parameter) -> None:
        getattr(self, name)[self.adapter] = value

    def local_factor(self, name: str) -> torch.Tensor:
        """This rank's part of factor ``name``."""
        return self.factor(name).to_local()

    def update(self, tensor: torch.Tensor) -> torch.Tensor:
        """``s·E_out(M_local·P_in(tensor))`` with this rank's parts of the factors."""
        pooled = pool_inputs(tensor, self.lambda_in)
        factors = [self.local_factor(name) for name in self.factor_names]
        product = F.linear(pooled, factors[0]) if len(factors) == 1 else F.linear(F.linear(pooled, factors[0]),
                                                                                   factors[1])
        return expand_outputs(product, self.lambda_out) * self.scaling

    def _check(self, features: int, parts: int, group: int, what: str, fix: str) -> None:
        if features % (parts * group):
            raise ValueError(f"{self.method_name}: {self.layer_name}: {what} of {features} over tensor_parallel="
                             f"{parts} does not split into whole groups of {group}; {fix}, or {SPLIT_FIX}")


class ColumnParallelPooled(_PooledParts):
    """A pooled adapter over a column layer: ``M`` split by the base's output rows, Q-BaRA's ``A`` whole."""

    def __init__(self, layer: nn.Module, mesh: DeviceMesh, group_input: Optional[ColumnGroupInput],
                 rows: Optional[Sequence[Sequence[int]]] = None) -> None:
        super().__init__(layer)
        parts = mesh.size()
        self._check(self.out_features, parts, self.lambda_out, "the outputs", "choose lambda_out dividing out/tp")
        if rows is not None and self.lambda_out != 1:
            raise ValueError(reordered_rows_refusal(self.method_name, self.layer_name, self.lambda_out))
        self.base_layer = ColumnParallelLinear(layer.get_base_layer(), mesh, group_input, rows)
        order = (torch.tensor([row for part in rows for row in part]) if rows is not None else None)
        row_split = self.factor_names[-1]  # B, or H
        split = []
        for name in self.factor_names:
            value = self.factor(name)
            if name == row_split:
                value = value[order.to(value.device)] if order is not None else value
                self.set_factor(name, sharded_parameter(value, mesh, Shard(0)))
                split.append(self.factor(name))
            else:
                self.set_factor(name, sharded_parameter(value, mesh, Replicate()))
        self.base_layer.rows_alike = tuple(split) if rows is not None else ()

    def local_factor(self, name: str) -> torch.Tensor:
        """The row-split factor through the base's :meth:`~ColumnParallelLinear.local` (rows several ranks hold
        get their gradient summed); the whole one as it is."""
        if name == self.factor_names[-1]:
            return self.base_layer.local(self.factor(name))
        return self.factor(name).to_local()

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(tensor)
        group_input = self.base_layer.group_input
        entered = tensor if group_input is None else group_input.enter(tensor)[0]  # the entry the base took
        return result + self.update(entered)

    def partial_parameters(self) -> list[nn.Parameter]:
        """Q-BaRA's whole ``A``, whose gradient each rank forms from its rows of ``B``."""
        whole = [self.factor(name) for name in self.factor_names[:-1]]
        return [param for param in whole if param.requires_grad]


class RowParallelPooled(_PooledParts):
    """A pooled adapter over a row layer: each rank pools its inputs, ``M`` split by the pooled columns, Q-BaRA's
    ``B`` whole; the partial update joins the base's before the group's sum."""

    def __init__(self, layer: nn.Module, mesh: DeviceMesh, partner_input: Optional[ColumnGroupInput] = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__(layer)
        self._check(self.in_features, mesh.size(), self.lambda_in, "the inputs", "choose lambda_in dividing in/tp")
        self.base_layer = RowParallelLinear(layer.get_base_layer(), mesh, partner_input, sequence_parallel)
        column_split = self.factor_names[0]  # A, or H
        for name in self.factor_names:
            placement = Shard(1) if name == column_split else Replicate()
            self.set_factor(name, sharded_parameter(self.factor(name), mesh, placement))

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.base_layer(tensor, self.update(tensor))

    def partial_parameters(self) -> list[nn.Parameter]:
        """Q-BaRA's whole ``B``, whose gradient each rank forms from its part of the inputs."""
        whole = [self.factor(name) for name in self.factor_names[1:]]
        return [param for param in whole if param.requires_grad]
