"""Whole matrices owned by one data-parallel rank each: work that needs a matrix whole (Muon's Newton–Schulz
orthogonalisation) done once per matrix, spread over the replicas, its result broadcast to the others.

Replicated data parallelism repeats an optimizer's step on every rank. For an elementwise optimizer that is cheap;
Muon's step is a few matrix products per matrix, as costly as a forward of a block, and its momentum is a second
copy of every matrix. Here each matrix gets one owner (:func:`assign_owners`: largest first to the least loaded
rank, so the work divides), the owner alone keeps its momentum and steps it, and :class:`OwnedMatrices` sends the
new values from the owners (in rounds, each sent while the next is computed) and, for a checkpoint, the owners'
state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.distributed.process_groups import collective_device

__all__ = ["ROUND_BYTES", "OwnedMatrices", "assign_owners", "orthogonalisation_cost", "plan_rounds",
           "spread_whole_matrix_steps"]

ROUND_BYTES = 4 * 2**20
"""Bytes of matrices sent per round: small enough that the next round is computed while one travels, large
enough that a round is not one message per matrix."""


def orthogonalisation_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton–Schulz iteration on a matrix of ``shape``, or on each matrix of a stack
    (``[..., rows, cols]``), up to a constant: matrices × rows × cols × min(rows, cols)."""
    rows, cols = int(shape[-2]), int(shape[-1])
    return math.prod(int(size) for size in shape[:-2]) * rows * cols * min(rows, cols)


def plan_rounds(numels: Sequence[int], element_bytes: Sequence[int], round_bytes: int = ROUND_BYTES
                ) -> list[list[int]]:
    """Consecutive matrices (indices) grouped into rounds of at most ``round_bytes`` (a larger matrix is a round of
    its own) and of one element size each, so a round travels as one flat tensor."""
    rounds: list[list[int]] = []
    size, width = 0, None
    for index, (numel, bytes_) in enumerate(zip(numels, element_bytes)):
        if not rounds or width != bytes_ or size + numel * bytes_ > round_bytes:
            rounds.append([])
            size, width = 0, bytes_
        rounds[-1].append(index)
        size += numel * bytes_
    return rounds


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """The owner rank of each item: largest cost first to the least loaded rank (ties to the lower rank), the same
    on every rank."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    owners = [0] * len(costs)
    load = [0.0] * ranks
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += costs[index]
    return owners


class OwnedMatrices:
    """``params`` split among the ranks of ``group`` (a collective-free constructor: every rank computes the same
    split); :meth:`broadcast_values` and :meth:`gather_state` move what the owners computed."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> None:
        self.params = list(params)
        self.group = group
        self.rank = dist.get_rank(group)
        size = dist.get_world_size(group)
        self.owners = assign_owners([orthogonalisation_cost(param.shape) for param in self.params], size)
        self._global = [dist.get_global_rank(group, rank) for rank in range(size)]
        self._owned = {id(param) for param, owner in zip(self.params, self.owners) if owner == self.rank}

    def owns(self, param: torch.Tensor) -> bool:
        return id(param) in self._owned

    def _by_owner(self) -> dict[int, list[nn.Parameter]]:
        grouped: dict[int, list[nn.Parameter]] = {}
        for param, owner in zip(self.params, self.owners):
            grouped.setdefault(owner, []).append(param)
        return grouped

    @torch.no_grad()
    def step_and_share(self, step: Callable[[list[nn.Parameter]], None], round_bytes: int = ROUND_BYTES) -> None:
        """``step(params)`` on this rank's matrices, a round at a time, each round's new values broadcast from its
        owner while the next round is computed; the other owners' rounds land in this rank's parameters. A
        collective: every rank of the group calls it (the rounds depend on shapes and owners only)."""
        rounds: dict[int, list[list[nn.Parameter]]] = {}
        for owner, params in self._by_owner().items():
            locals_ = [local_tensor(param) for param in params]
            rounds[owner] = [[params[i] for i in indices] for indices in plan_rounds(
                [tensor.numel() for tensor in locals_], [tensor.element_size() for tensor in locals_], round_bytes)]
        sent: list[tuple[int, list[nn.Parameter], torch.Tensor, Any]] = []
        for index in range(max((len(owned) for owned in rounds.values()), default=0)):
            for owner in sorted(rounds):
                if index >= len(rounds[owner]):
                    continue
                params = rounds[owner][index]
                locals_ = [local_tensor(param) for param in params]
                if owner == self.rank:
                    step(params)
                    flat = torch.cat([tensor.reshape(-1) for tensor in locals_])
                else:
                    flat = torch.empty(sum(tensor.numel() for tensor in locals_), dtype=locals_[0].dtype,
                                       device=locals_[0].device)
                work = dist.broadcast(flat, src=self._global[owner], group=self.group, async_op=True)
                sent.append((owner, params, flat, work))
        for owner, params, flat, work in sent:
            work.wait()
            if owner != self.rank:
                offset = 0
                for tensor in (local_tensor(param) for param in params):
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

    @torch.no_grad()
    def gather_state(self, state: dict[Any, dict[str, Any]], key: str) -> list[nn.Parameter]:
        """Put every owner's ``state[param][key]`` on every rank (a checkpoint holds the whole optimizer); returns
        the parameters whose entry this rank received, to drop again with :meth:`drop_state`."""
        held = torch.tensor([1.0 if key in state.get(param, {}) else 0.0 for param in self.params],
                            device=collective_device(self.group))
        dist.all_reduce(held, group=self.group)
        received = []
        for param, owner, present in zip(self.params, self.owners, held.tolist()):
            if not present:
                continue
            if owner == self.rank:
                buffer = state[param][key]
            else:
                buffer = torch.zeros_like(param)
                state.setdefault(param, {})[key] = buffer
                received.append(param)
            dist.broadcast(local_tensor(buffer), src=self._global[owner], group=self.group)
        return received

    def drop_state(self, state: dict[Any, dict[str, Any]], params: Iterable[nn.Parameter] | None = None) -> None:
        """Forget the state of ``params`` (default: every parameter this rank does not own)."""
        for param in self.params if params is None else params:
            if not self.owns(param):
                state.pop(param, None)


def spread_whole_matrix_steps(optimizers: Iterable[Any], replicated: Iterable[nn.Parameter],
                              group: dist.ProcessGroup) -> None:
    """Give every optimizer that can divide whole-matrix steps over replicas (a ``spread_over(group, ids)``
    method, as ``MuonWithAdamW`` has) the group of replicas and the parameters they all hold."""
    ids = {id(param) for param in replicated}
    for optimizer in optimizers:
        spread = getattr(getattr(optimizer, "optimizer", optimizer), "spread_over", None)  # a LightningOptimizer
        if callable(spread):
            spread(group, ids)
