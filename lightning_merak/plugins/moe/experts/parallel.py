"""The ``merak_ep`` and ``merak_grouped`` experts implementations, registered in transformers' registry.

transformers 5 routes every ``@use_experts_implementation`` experts module through
``ALL_EXPERTS_FUNCTIONS[config._experts_implementation]`` with the family's own router output
(``top_k_index``, ``top_k_weights``), so registering here keeps each family's router, shared experts
and scaling untouched. ``merak_ep``: each rank holds its contiguous slice of the experts (an
:class:`ExpertShard` on the module); token copies go to their expert's owner with one variable-split
``all_to_all_single`` (counts first, by one all-gather that also yields the load matrix), are computed
grouped, come back by a second one and are combined with the router weights on the sender, so the
router's gradient stays local. Both all-to-alls are autograd Functions, so the backward exchanges
gradients the same way. With a placement plan (Pro-Prophet / FasterMoE replicas) the owners' expert
slices travel to the replica ranks first, which then compute their own routes to those experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from lightning_merak.distributed.collectives import all_gather_in_turn, all_to_all_in_turn
from lightning_merak.distributed.turns import in_sub_batch_region
from lightning_merak.plugins.moe.core.placement import PlacementPlan
from lightning_merak.plugins.moe.experts.exchange import DroplessExchange
from lightning_merak.plugins.moe.experts.grouped import (
    EXPERT_TENSORS,
    combine_routes,
    expert_mlp,
    gather_token_copies,
    grouped_experts_forward,
    permute_rows,
    restore_route_order,
    route_counts,
    route_positions,
)

__all__ = ["EP_IMPLEMENTATION", "GROUPED_IMPLEMENTATION", "ExpertShard", "expert_parallel_forward", "register"]

EP_IMPLEMENTATION = "merak_ep"
GROUPED_IMPLEMENTATION = "merak_grouped"
SHARD_ATTRIBUTE = "_merak_expert_shard"


@dataclass
class ExpertShard:
    """What one experts module needs to run expert parallel, and the load it has seen.

    ``load[r, e]`` accumulates the routes EP rank ``r`` sent to global expert ``e`` since the last
    :meth:`take_load` (identical on every rank of the group: it is the all-gathered count matrix).
    """

    group: Any
    ep_rank: int
    ep_size: int
    num_experts: int
    experts: range
    load: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    plan: PlacementPlan | None = None
    """Replicas to run (Pro-Prophet / FasterMoE plans); identical on every rank of the group."""

    def record(self, counts: torch.Tensor) -> None:
        self.load = counts.clone() if self.load.numel() == 0 else self.load + counts

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertShard:
        """A copy over the same group: process groups cannot be copied, and a model's copy (merak3d's trace,
        its virtual stages) runs over the same ranks."""
        return replace(self, load=self.load.clone())

    def take_load(self) -> torch.Tensor:
        """The accumulated ``[ep, E]`` route counts, reset to empty."""
        load = self.load if self.load.numel() else torch.zeros(self.ep_size, self.num_experts, dtype=torch.long)
        self.load = torch.zeros(0, dtype=torch.long)
        return load


class _AllToAll(torch.autograd.Function):
    """Variable-split ``all_to_all_single`` whose backward is the reverse exchange.

    torch's autograd-aware versions are deprecated (``torch.distributed.nn``) or cost 0.2 ms more per
    exchange on gloo here (the functional collective), hence this small Function over the plain collective.
    """

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, output_splits: list[int], input_splits: list[int],
                group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (input_splits, output_splits), group
        if in_sub_batch_region():  # block-scope Lancet: the other sub-batches compute while this one waits
            return all_to_all_in_turn(rows, input_splits, output_splits, group)
        out = rows.new_empty(sum(output_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), output_splits, input_splits, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    return _AllToAll.apply(rows, output_splits, input_splits, group)


class _CountGather:
    """The all-gather of ``[ep, E]`` route counts, launched early so the rank prepares its token copies meanwhile.

    Every collective waits for the slowest rank; sorting and copying this rank's routes needs only its own
    counts, so that work runs while the counts are in flight instead of after they arrive.
    """

    def __init__(self, local: torch.Tensor, shard: ExpertShard) -> None:
        self._gathered: torch.Tensor | None = None
        self._work: Any = None
        self._sent: torch.Tensor | None = None
        """The counts sent, held until the wait (NCCL reads them on its own stream)."""
        if shard.ep_size == 1:
            self._gathered = local.unsqueeze(0)
        elif in_sub_batch_region():  # block-scope Lancet hands the wait to the other sub-batches instead
            self._gathered = all_gather_in_turn(local.unsqueeze(0), shard.group, dim=0)
        else:
            self._gathered = local.new_empty(shard.ep_size, local.numel())
            self._sent = local.contiguous()
            self._work = dist.all_gather_single(self._gathered.view(-1), self._sent, group=shard.group,
                                                async_op=True)

    def wait(self) -> torch.Tensor:
        """The ``[ep, E]`` counts on the CPU (the layer's one host sync)."""
        if self._work is not None:
            self._work.wait()
            self._work = self._sent = None
        return self._gathered.cpu()


def _replica_tensors(module: Any, shard: ExpertShard, plan: PlacementPlan) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Trans and Agg of Pro-Prophet: owners send replicated experts' tensors to their replica ranks.

    One all-to-all of the flattened expert slices; its backward is the reverse exchange, so each
    replica's gradient reaches its owner's parameter through autograd (summed with the owner's own).
    Returns the experts this rank hosts (source-rank, then plan order) and the local tensors with
    the hosted replicas appended along the expert dimension. The sent buffer always holds a
    zero-length slice of a parameter and the received one always enters the grouped call, so every
    rank runs the backward exchange even when it sends or hosts nothing.
    """
    names = [n for n in EXPERT_TENSORS if getattr(module, n, None) is not None]
    local = {n: getattr(module, n) for n in names}
    per_expert = [local[n][0].numel() for n in names]
    rank, ep = shard.ep_rank, shard.ep_size
    pieces, send_splits, recv_splits, hosted = [], [0] * ep, [0] * ep, []
    for dest in range(ep):
        for rep in plan.replications:
            if rep.owner == rank and dest in rep.replicas:
                pieces += [local[n][rep.expert - shard.experts.start].reshape(-1) for n in names]
                send_splits[dest] += sum(per_expert)
    for src in range(ep):
        for rep in plan.replications:
            if rep.owner == src and rank in rep.replicas:
                hosted.append(rep.expert)
                recv_splits[src] += sum(per_expert)
    send = torch.cat([local[names[0]].reshape(-1)[:0], *pieces])
    flat = _all_to_all(send, recv_splits, send_splits, shard.group).view(len(hosted), sum(per_expert))
    tensors = {}
    for name, part in zip(names, flat.split(per_expert, dim=1)):
        replicas = part.reshape(len(hosted), *local[name].shape[1:])
        tensors[name] = torch.cat([local[name], replicas])
    return hosted, tensors


def expert_parallel_forward(
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """``merak_ep``: the experts module's output for this rank's tokens, experts spread over the group.

    With a placement plan on the shard, a rank hosting a replica of expert ``e`` computes its own
    routes to ``e`` locally; only the other routes are exchanged.
    """
    shard: ExpertShard | None = getattr(module, SHARD_ATTRIBUTE, None)
    if shard is None:
        raise RuntimeError(f"{type(module).__name__} runs experts_implementation={EP_IMPLEMENTATION!r} but holds no "
                           "expert shard; call lightning_merak.plugins.moe.experts.enable_expert_parallel(model)")
    if hidden_states.is_meta:  # merak3d's trace of a meta model records shapes only: nothing to route or exchange
        return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)
    k, num_experts, ep = top_k_index.size(-1), shard.num_experts, shard.ep_size
    flat = top_k_index.reshape(-1)
    local_counts = route_counts(flat, num_experts)
    counts = _CountGather(local_counts, shard)
    replicating = shard.plan is not None and bool(shard.plan.replications) and ep > 1
    # host-resident counts let the routes be ordered and copied while the gather is in flight; on an accelerator
    # reading them would be a second host sync, and replicas need every rank's counts first
    matrix = None if flat.device.type == "cpu" and not replicating else counts.wait()
    if replicating:
        hosted, tensors = _replica_tensors(module, shard, shard.plan)
        sent, key = matrix.clone(), flat.clone()
        for rep in shard.plan.replications:  # every rank's routes to a replica it hosts stay home
            sent[list(rep.replicas), rep.expert] = 0
        for slot, expert in enumerate(hosted):
            key[flat == expert] = num_experts + slot  # routes to hosted replicas sort after the sent ones
        hosted_rows = [int(matrix[shard.ep_rank, e]) for e in hosted]
        num_computed = int(sent[shard.ep_rank].sum()) + sum(hosted_rows)
    else:  # every counted route is sent (sentinel ids past the experts are not)
        hosted, tensors, hosted_rows, key = [], None, [], flat
        num_computed = int((local_counts if matrix is None else matrix[shard.ep_rank]).sum())
    order = torch.sort(key, stable=True).indices
    positions = route_positions(order, num_computed)
    rows = gather_token_copies(hidden_states, order, num_computed, positions, k)
    if matrix is None:
        matrix = counts.wait()
    if not replicating:
        sent = matrix
    shard.record(matrix)
    plan = DroplessExchange.build(sent, shard.ep_rank)
    num_sent = sum(plan.send_splits)
    send, own = rows.split([num_sent, sum(hosted_rows)]) if hosted else (rows, None)
    received = send
    if ep > 1:  # source-major from the exchange, expert-major for the grouped call (at ep=1 it already is)
        received = _all_to_all(send, plan.recv_splits, plan.send_splits, shard.group)
        received = permute_rows(received, plan.recv_to_expert_major.to(rows.device),
                                plan.expert_major_to_recv.to(rows.device))
    num_received = received.shape[0]
    out = expert_mlp(module, torch.cat([received, own]) if hosted else received, plan.expert_rows + hosted_rows,
                     tensors=tensors)
    back, own_out = out.split([num_received, out.shape[0] - num_received]) if hosted else (out, None)
    if ep > 1:
        back = permute_rows(back, plan.expert_major_to_recv.to(out.device), plan.recv_to_expert_major.to(out.device))
        back = _all_to_all(back, plan.send_splits, plan.recv_splits, shard.group)
    local_out = torch.cat([back, own_out]) if hosted else back
    return combine_routes(restore_route_order(local_out, order, positions), top_k_weights, hidden_states.dtype)


def register() -> None:
    """Add ``merak_ep`` and ``merak_grouped`` to transformers' experts registry (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EP_IMPLEMENTATION, expert_parallel_forward)
    ExpertsInterface.register(GROUPED_IMPLEMENTATION, grouped_experts_forward)
