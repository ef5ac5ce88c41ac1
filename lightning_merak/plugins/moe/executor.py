"""The expert exchange of one layer as a single autograd node, plus replica transfers.

Forward: replica parameters arrive (Trans), replica ranks compute their own tokens
for those experts, the remaining rows go through chunked all-to-alls to their owners'
experts and back. A plan made from this call's counts has its Trans still in flight: the
replica rows are then computed after the local experts, so Trans runs under the dispatch.
Backward: the reverse all-to-alls; with Lancet's backward on, each chunk's
expert backward is split into a dX-only pass and deferred weight gradients
(:class:`~lightning_merak.distributed.weight_gradients.SplitBackward`), computed while that chunk's dX all-to-all is
in flight; replica gradients summed back into the owner's gradients (Agg). Everything is returned from
``backward``, so AccumulateGrad — and therefore DDP and ZeRO-1/2 hooks — sees the full
expert gradient. Every rank creates this node once per layer call and issues the same
collectives in the same order (all-to-alls on the EP group, Trans/Agg on a separate
transfer group), also with zero rows anywhere, so a plan can never cause a hang. All-to-alls
are launched "in turn" (:mod:`lightning_merak.distributed.collectives`): inside a sub-batch region
every wait, forward and backward, lets the other sub-batches compute first.

On CUDA each chunk's all-to-all (and Trans/Agg's sends and receives) runs on NCCL's stream while the experts
of the chunks already received compute on the compute stream; a chunk's ``wait`` makes the compute stream
wait for its exchange, and the pending exchange holds its send buffer until then.

Under autocast the experts compute in the lower precision: their outputs join the exchange in the rows'
dtype (the layer's input dtype, which its output keeps), and their gradients go back in the outputs' dtype.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from lightning_merak.distributed.collectives import (
    PendingCollective,
    in_checkpointed_region,
    plainly_saved_tensors,
    start_all_to_all_in_turn,
)
from lightning_merak.distributed.weight_gradients import SplitBackward
from lightning_merak.plugins.moe.core.dispatch import ExchangeLayout
from lightning_merak.plugins.moe.core.placement import PlacementPlan
from lightning_merak.plugins.moe.core.plan_check import PlanCheck
from lightning_merak.util.timing import DeviceTimer

__all__ = ["ExpertExchange", "ReplicaTransfer", "TransferScheduler", "flatten_params"]


def flatten_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _unflatten(template: nn.Module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    named = list(template.named_parameters())
    pieces = flat.split([p.numel() for _, p in named])
    return {name: piece.view_as(p) for (name, p), piece in zip(named, pieces)}


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


class _Pending:
    """An all-to-all in flight; ``wait`` charges the time this rank stayed blocked on it.

    Inside a sub-batch region (block-scope Lancet) waiting first hands the turn to the
    other sub-batches, so their computation runs while this all-to-all is in flight.
    """

    def __init__(self, collective: PendingCollective, launched: bool) -> None:
        self.collective, self.uncharged = collective, launched

    def wait(self, stats: dict[str, float], key: str) -> torch.Tensor:
        tensor = self.collective.wait()
        if self.uncharged:
            stats[key] = stats.get(key, 0.0) + self.collective.exposed_s
            self.uncharged = False
        return tensor


def _start_all_to_all(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any, ep_size: int
) -> _Pending:
    if ep_size == 1:
        return _Pending(PendingCollective(send, None), launched=False)
    return _Pending(start_all_to_all_in_turn(send, send_splits, recv_splits, group), launched=True)


@dataclass
class ReplicaTransfer:
    """Point-to-point Trans (owner → replicas) or Agg (replicas → owner) of one layer's plan.

    Messages are posted in plan order on every rank with a tag per (layer, expert),
    so sends and receives pair up without any further agreement.
    """

    plan: PlacementPlan
    received: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    works: list[Any] = field(default_factory=list)
    sent: list[torch.Tensor] = field(default_factory=list)
    """The tensors sent, held until :meth:`wait` (NCCL reads them on its own stream)."""

    @classmethod
    def start_trans(
        cls, plan: PlacementPlan, rank: int, ep_ranks: Sequence[int], group: Any, layer_tag: int,
        owned: dict[int, torch.Tensor], numel: int, like: torch.Tensor,
    ) -> ReplicaTransfer:
        transfer = cls(plan)
        for rep in plan.replications:
            tag = layer_tag + rep.expert
            if rep.owner == rank:
                transfer.sent.append(owned[rep.expert])
                for r in rep.replicas:
                    transfer.works.append(dist.isend(owned[rep.expert], ep_ranks[r], group=group, tag=tag))
            elif rank in rep.replicas:
                buffer = like.new_empty(numel)
                transfer.received[rep.expert] = [buffer]
                transfer.works.append(dist.irecv(buffer, ep_ranks[rep.owner], group=group, tag=tag))
        return transfer

    @classmethod
    def start_agg(
        cls, plan: PlacementPlan, rank: int, ep_ranks: Sequence[int], group: Any, layer_tag: int,
        replica_grads: dict[int, torch.Tensor], numel: int, like: torch.Tensor,
    ) -> ReplicaTransfer:
        transfer = cls(plan)
        for rep in plan.replications:
            tag = layer_tag + rep.expert
            if rep.owner == rank:
                buffers = [like.new_empty(numel) for _ in rep.replicas]
                transfer.received[rep.expert] = buffers
                for r, buffer in zip(rep.replicas, buffers):
                    transfer.works.append(dist.irecv(buffer, ep_ranks[r], group=group, tag=tag))
            elif rank in rep.replicas:
                transfer.sent.append(replica_grads[rep.expert])
                transfer.works.append(dist.isend(replica_grads[rep.expert], ep_ranks[rep.owner], group=group, tag=tag))
        return transfer

    def wait(self, stats: dict[str, float], key: str) -> dict[int, list[torch.Tensor]]:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        self.works, self.sent = [], []
        stats[key] = stats.get(key, 0.0) + time.perf_counter() - start
        return self.received


class TransferScheduler:
    """Issues layer i+1's Trans right after layer i's dispatch all-to-all (Pro-Prophet §1.3).

    Shared by the MoE layers of one model. A prefetch is used only by the layer called
    next, which is the same layer on every rank, so the choice is deterministic; an
    unused prefetch is completed and discarded. The layers also share one online plan check
    (``plan_check``, set by the first layer that checks): every layer's measurements correct
    the same per-arm ratios, so they are learnt once per model, not once per layer.
    """

    def __init__(self) -> None:
        self.layers: list[Any] = []
        self._pending: tuple[Any, ReplicaTransfer] | None = None
        self.plan_check: PlanCheck | None = None

    def register(self, layer: Any) -> int:
        self.layers.append(layer)
        return len(self.layers) - 1

    def take(self, layer: Any) -> ReplicaTransfer | None:
        """The transfer prefetched for ``layer``'s call now, if the previous layer posted one for it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        target, transfer = pending
        if target is layer and transfer.plan is layer.prefetch_plan:
            return transfer
        transfer.wait({}, "discarded_trans_s")
        return None

    def prefetch_after(self, layer: Any) -> None:
        index = self.layers.index(layer)
        if index + 1 < len(self.layers):
            nxt = self.layers[index + 1]
            transfer = nxt.start_trans(nxt.prefetch_plan) if nxt.prefetch_plan is not None else None
            if transfer is not None:
                self._pending = (nxt, transfer)


@dataclass
class ExpertExchange:
    """Everything one layer call needs to run its autograd node; ``stats`` collects timings."""

    layout: ExchangeLayout
    group: Any
    experts: Sequence[nn.Module]
    replica_params: dict[int, torch.Tensor]
    agg_start: Any
    lancet_backward: bool
    after_first_dispatch: Any
    stats: dict[str, float]
    replica_transfer: ReplicaTransfer | None = None

    def params(self) -> list[nn.Parameter]:
        return [p for expert in self.experts for p in expert.parameters()]

    def _run_experts(self, grouped: torch.Tensor, rows: list[int]) -> torch.Tensor:
        pieces = grouped.split(rows)
        outputs = [_first(expert(piece)) for expert, piece in zip(self.experts, pieces)]
        return torch.cat(outputs) if outputs else grouped

    def forward(self, routed_in: torch.Tensor, build_graph: bool) -> tuple[torch.Tensor, dict[str, Any]]:
        lay, stats = self.layout, self.stats
        sent_chunks = routed_in[: lay.num_sent].split([sum(s) for s in lay.send_splits])
        dispatches = [
            _start_all_to_all(sent_chunks[0], lay.send_splits[0], lay.recv_splits[0], self.group, lay.ep_size)
        ]
        self.after_first_dispatch()
        replica_graphs: list[tuple[Any, ...]] = []
        replica_outs: list[torch.Tensor] = []
        if self.replica_transfer is None:
            self._run_replicas(routed_in, build_graph, replica_graphs, replica_outs)
        chunk_graphs, combines = [], []
        for c in range(lay.chunks):
            if c + 1 < lay.chunks:
                dispatches.append(_start_all_to_all(
                    sent_chunks[c + 1], lay.send_splits[c + 1], lay.recv_splits[c + 1], self.group, lay.ep_size))
            received = dispatches[c].wait(stats, "exposed_a2a_forward_s")
            order = lay.recv_by_expert[c].to(received.device)
            x = received.index_select(0, order).detach().requires_grad_(build_graph)
            deferred = SplitBackward(self.experts) if build_graph and self.lancet_backward else None
            start = time.perf_counter()
            with torch.set_grad_enabled(build_graph), deferred.recording() if deferred else nullcontext():
                y = self._run_experts(x, lay.expert_rows[c])
            stats["expert_s"] = stats.get("expert_s", 0.0) + time.perf_counter() - start
            chunk_graphs.append((x, y, order, deferred))
            back = torch.empty_like(received).index_copy_(0, order, y.detach().to(received.dtype))
            combines.append(_start_all_to_all(back, lay.recv_splits[c], lay.send_splits[c], self.group, lay.ep_size))
        if self.replica_transfer is not None:
            received = self.replica_transfer.wait(stats, "exposed_trans_s")
            self.replica_params = {e: buffers[0] for e, buffers in received.items()}
            self._run_replicas(routed_in, build_graph, replica_graphs, replica_outs)
        outputs = [pending.wait(stats, "exposed_a2a_forward_s") for pending in combines]
        routed_out = (torch.cat(outputs + replica_outs) if outputs or replica_outs
                      else routed_in.new_zeros(0, routed_in.size(1)))
        return routed_out, {"chunks": chunk_graphs, "replicas": replica_graphs}

    def _run_replicas(self, routed_in: torch.Tensor, build_graph: bool, graphs: list[tuple[Any, ...]],
                      outs: list[torch.Tensor]) -> None:
        """This rank's own rows of the experts it hosts a replica of, with the received parameters."""
        for expert, start, length in self.layout.replica_segments:
            x = routed_in[start: start + length].detach().requires_grad_(build_graph)
            flat = self.replica_params[expert].detach().requires_grad_(build_graph)
            with torch.set_grad_enabled(build_graph):
                y = _first(functional_call(self.experts[0], _unflatten(self.experts[0], flat), (x,)))
            graphs.append((expert, x, flat, y))
            outs.append(y.detach().to(routed_in.dtype))

    def backward(self, state: dict[str, Any], grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lay, stats = self.layout, self.stats
        params = self.params()
        grad_in = torch.zeros_like(grad_out)
        grad_sent = grad_out[: lay.num_sent].split([sum(s) for s in lay.send_splits])
        returns = [
            _start_all_to_all(grad_sent[c], lay.send_splits[c], lay.recv_splits[c], self.group, lay.ep_size)
            for c in range(lay.chunks)
        ]
        replica_grads: dict[int, torch.Tensor] = {}
        for (expert, x, flat, y), (_, start, length) in zip(state["replicas"], lay.replica_segments):
            dx, dflat = torch.autograd.grad(y, [x, flat], grad_out[start: start + length].to(y.dtype),
                                            allow_unused=True)
            grad_in[start: start + length] = dx if dx is not None else 0.0
            replica_grads[expert] = dflat if dflat is not None else torch.zeros_like(flat)
        aggregation = self.agg_start(replica_grads)
        param_grads = [torch.zeros_like(p) for p in params]
        dispatch_grads = []
        for c, (x, y, order, deferred) in enumerate(state["chunks"]):
            g = returns[c].wait(stats, "exposed_a2a_backward_s").index_select(0, order).to(y.dtype)
            if deferred is not None:
                dispatch_grads.append(self._return_dx(deferred.input_grad(y, x, g), order, c))
                start = time.perf_counter()
                weight_grads = deferred.compute(y, g, params)
                stats["deferred_dw_s"] = stats.get("deferred_dw_s", 0.0) + time.perf_counter() - start
            else:
                dx, *weight_grads = torch.autograd.grad(y, [x, *params], g, allow_unused=True)
                pending = self._return_dx(dx, order, c)
                pending.wait(stats, "exposed_a2a_backward_s")
                dispatch_grads.append(pending)
            for acc, grad in zip(param_grads, weight_grads):
                if grad is not None:
                    acc.add_(grad)
        self._add_aggregated(aggregation.wait(stats, "exposed_agg_s"), params, param_grads)
        chunks = [pending.wait(stats, "exposed_a2a_backward_s") for pending in dispatch_grads]
        if chunks:
            grad_in[: lay.num_sent] = torch.cat(chunks)
        return grad_in, param_grads

    def _return_dx(self, dx: torch.Tensor, order: torch.Tensor, chunk: int) -> _Pending:
        lay = self.layout
        ungrouped = torch.empty_like(dx).index_copy_(0, order, dx)
        return _start_all_to_all(ungrouped, lay.recv_splits[chunk], lay.send_splits[chunk], self.group, lay.ep_size)

    def _add_aggregated(
        self, received: dict[int, list[torch.Tensor]], params: list[nn.Parameter], param_grads: list[torch.Tensor]
    ) -> None:
        per_expert = len(list(self.experts[0].parameters()))
        first_local = self.layout.rank * self.layout.experts_per_rank
        for expert, buffers in received.items():
            total = torch.stack(buffers).sum(0)
            local = expert - first_local
            sizes = [p.numel() for p in params[local * per_expert: (local + 1) * per_expert]]
            for i, piece in enumerate(total.split(sizes)):
                param_grads[local * per_expert + i].add_(piece.view_as(param_grads[local * per_expert + i]))


class ExchangeFunction(torch.autograd.Function):
    """Autograd node ``(routed rows, *local expert params) -> expert outputs per row``.

    Its backward runs ``torch.autograd.grad`` over the experts' graphs of the forward. In a recomputed block
    those graphs keep their tensors (:func:`~lightning_merak.distributed.collectives.plainly_saved_tensors`; the
    experts' activations stay in memory): each of those backward passes would otherwise recompute the whole
    block, its exchange and planning included, once more.
    """

    @staticmethod
    def forward(
        ctx: Any, exchange: ExpertExchange, build_graph: bool, routed_in: torch.Tensor, *params: torch.Tensor
    ) -> torch.Tensor:
        with plainly_saved_tensors() if in_checkpointed_region() else nullcontext():
            out, state = exchange.forward(routed_in, build_graph)
        ctx.exchange, ctx.state = exchange, state
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        """The reverse exchange; its seconds go to ``stats["exchange_backward_s"]`` for the online plan check."""
        with DeviceTimer(grad_out.device) as exchange:
            grad_in, param_grads = ctx.exchange.backward(ctx.state, grad_out.contiguous())
        stats = ctx.exchange.stats
        stats["exchange_backward_s"] = stats.get("exchange_backward_s", 0.0) + exchange.seconds
        ctx.state = None
        return (None, None, grad_in, *param_grads)
