"""Which output rows of a column layer each tensor-parallel rank holds, found by data flow.

A rank holds the row layer's input features ``[r·n/tp, (r+1)·n/tp)`` (its heads, or its slice of
the MLP's hidden features). The column layers' output rows it needs are the ones those features
depend on, whatever the layout: GPT-2's and MPT's fused ``[q | k | v]``, Phi-3's ``qkv_proj``
with fewer key/value heads and ``gate_up_proj``, GPT-NeoX's and BLOOM's per-head interleaving,
Falcon's grouped layout, or a key/value head several ranks' query heads read (multi-query): that
one is held by each of those ranks. :func:`probe_row_units` finds the dependencies once per
block class by replacing the column layers' outputs with random leaves and asking autograd which
of them each slice of the row layer's input reads; no layout is hard-coded. Each rank keeps its
rows in the original order, so its local projection has the original structure with fewer heads
and the module's own reshapes still apply.

:class:`LayoutChange` records how the sharded parameter's full tensor (the ranks' rows one after
the other) maps to the original, so checkpoints keep the unsplit model's layout.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_merak.util.module_mode import hooks_removed_after, modules_in_mode

__all__ = ["LayoutChange", "probe_row_units", "rank_rows", "shared_rows", "unit_count"]


@dataclass(frozen=True)
class LayoutChange:
    """How a parameter's full tensor differs from the original model's after sharding.

    ``rows[i]`` is the original row that row ``i`` of the sharded full tensor holds (rank r's
    rows are the r-th of ``tensor_parallel`` equal parts); a row several ranks hold appears once
    per rank. ``transposed`` marks a GPT-2 ``Conv1D`` weight, stored ``(in, out)`` in the original.
    """

    transposed: bool = False
    rows: Optional[tuple[int, ...]] = None

    def to_original(self, full: torch.Tensor) -> torch.Tensor:
        """The original layout of a sharded full tensor (a row held by several ranks: its first copy)."""
        if self.rows is not None:
            order = torch.tensor(self.rows)
            first = torch.full((int(order.max()) + 1,), len(self.rows), dtype=torch.long)
            first = first.scatter_reduce(0, order, torch.arange(len(self.rows)), "amin")
            full = full[first.to(full.device)]
        return full.t() if self.transposed and full.ndim == 2 else full

    def from_original(self, full: torch.Tensor) -> torch.Tensor:
        """The sharded full tensor of an original one."""
        full = full.t() if self.transposed and full.ndim == 2 else full
        return full[torch.tensor(self.rows, device=full.device)] if self.rows is not None else full

    def local_rows(self, rank: int, tensor_parallel: int) -> list[int]:
        """The original rows rank ``rank`` holds, in its order (for a loader reading only those)."""
        if self.rows is None:
            raise ValueError("this change keeps the rows; each rank holds its contiguous part")
        per_rank = len(self.rows) // tensor_parallel
        return list(self.rows[rank * per_rank:(rank + 1) * per_rank])


def probe_row_units(block: nn.Module, run_block: Callable[[], Any], groups: Sequence[Sequence[str]],
                    rows: Sequence[str], units: Sequence[int], passed_through: Sequence[str] = (),
                    ) -> tuple[dict[str, list[tuple[int, ...]]], dict[str, str]]:
    """For each column layer, the output rows each of ``units[i]`` equal slices of its row partner's input reads.

    ``run_block()`` runs one forward of ``block``. The column layers' outputs are replaced by random
    leaves (seeded, the global generators untouched) and dropout is off, so what comes back depends
    on the wiring only, not on the weights. Modules in ``passed_through`` (norms over a whole
    projection, which will be split to keep rows apart) return their input meanwhile; the second
    result names, for each of them fed straight by a column layer, that layer.
    """
    generator = torch.Generator().manual_seed(0)
    outputs: dict[str, torch.Tensor] = {}
    row_inputs: dict[str, torch.Tensor] = {}
    fed_by: dict[str, str] = {}

    def identity(name: str) -> Callable[..., torch.Tensor]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            source = next((column for column, leaf in outputs.items() if leaf is args[0]), None)
            if source is not None:
                fed_by.setdefault(name, source)
            return args[0]
        return hook

    def replace(name: str) -> Callable[..., torch.Tensor]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not isinstance(output, torch.Tensor):
                return output
            leaf = torch.randn(output.shape, generator=generator).to(output).requires_grad_(True)
            outputs.setdefault(name, leaf)
            return leaf
        return hook

    def keep(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            row_inputs.setdefault(name, args[0])
        return hook

    handles = [block.get_submodule(name).register_forward_hook(replace(name)) for group in groups for name in group]
    handles += [block.get_submodule(name).register_forward_pre_hook(keep(name)) for name in rows]
    handles += [block.get_submodule(name).register_forward_hook(identity(name)) for name in passed_through]
    with hooks_removed_after(handles), modules_in_mode(block, training=False), torch.enable_grad():
        run_block()
    found: dict[str, list[tuple[int, ...]]] = {}
    for members, row, count in zip(groups, rows, units, strict=True):
        inputs = row_inputs[row]
        width = inputs.shape[-1] // count
        missing = [name for name in members if name not in outputs]
        if missing:
            raise ValueError(f"{', '.join(missing)} return no tensor, so tensor parallelism cannot split them; "
                             "use tensor_parallel=1")
        leaves = [outputs[name] for name in members]
        found.update({name: [] for name in members})
        started = time.monotonic()
        for unit in range(count):
            direction = torch.zeros_like(inputs)
            direction[..., unit * width:(unit + 1) * width] = torch.randn(
                direction[..., :width].shape, generator=generator).to(direction)
            grads = torch.autograd.grad(inputs, leaves, direction, retain_graph=True, allow_unused=True)
            for name, grad, leaf in zip(members, grads, leaves, strict=True):
                read = (torch.zeros(leaf.shape[-1], dtype=torch.bool) if grad is None
                        else grad.detach().reshape(-1, leaf.shape[-1]).ne(0).any(0).cpu())
                found[name].append(tuple(read.nonzero().flatten().tolist()))
            if unit == 0:
                _announce_long_probe(members, row, count, time.monotonic() - started)
    return found, fed_by


LONG_PROBE_S = 30.0
"""Probing longer than this (estimated from its first backward) is announced, so that it does not look hung."""


def _announce_long_probe(members: Sequence[str], row: str, count: int, first_s: float) -> None:
    """Say how long probing ``count`` slices will take where a block is slow to differentiate (a mixer whose
    backward is slow, without its fused kernels), rather than leave the ranks silent for minutes."""
    if first_s * count > LONG_PROBE_S:
        rank_zero_info(f"merak3d: finding which rows of {', '.join(members)} each of the {count} slices of {row}'s "
                       f"input reads takes one backward each ({first_s:.1f} s the first), about "
                       f"{first_s * count:.0f} s in all")


def rank_rows(units: Sequence[Sequence[int]], rank: int, tensor_parallel: int) -> list[int]:
    """The rows rank ``rank`` holds: those its share of the units reads, in the original order."""
    per_rank = len(units) // tensor_parallel
    return sorted(set().union(*units[rank * per_rank:(rank + 1) * per_rank]))


def shared_rows(units: Sequence[Sequence[int]], tensor_parallel: int) -> list[int]:
    """Rows more than one rank holds (a key/value head read by several ranks' query heads)."""
    counts: dict[int, int] = {}
    for rank in range(tensor_parallel):
        for row in rank_rows(units, rank, tensor_parallel):
            counts[row] = counts.get(row, 0) + 1
    return sorted(row for row, count in counts.items() if count > 1)


def unit_count(row_features: int, heads: Optional[int]) -> int:
    """How finely to probe a row layer's input: by head, and at most as finely as any valid degree needs."""
    return math.gcd(row_features, heads if heads else 64)
