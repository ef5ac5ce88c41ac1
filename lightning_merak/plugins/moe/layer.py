"""Drop-in replacement for ``deepspeed.moe.layer.MoE`` with placement and overlap options.

``MoE`` builds DeepSpeed's own layer (same constructor, same ``TopKGate`` and
``Experts``, same parameter attributes and group names) and swaps its
``deepspeed_moe`` for :class:`PlacementMOELayer`, a ``MOELayer`` subclass. DeepSpeed's
engine still finds and configures it (``set_deepspeed_parallelism``); without an
engine (plain DDP, or a model swapped before the processes exist) it creates and
attaches its expert groups lazily on its first forward, which every rank runs in
the same layer order.

Per call: the gate routes the full local batch (DeepSpeed's decisions, k = 1 or 2); the per-rank counts
are all-gathered over the EP group (one small collective, one host sync); the step planner
(:mod:`.core.step_planner`) picks, from these counts, the cheapest of no replication, dropless dispatch,
shadowing, Pro-Prophet replica sets and the plan prefetched from the previous call's counts; replica ranks
keep their rows of replicated experts; rows go through :class:`~.executor.ExchangeFunction`. A plan made
from this call's counts moves its parameters while the dispatch all-to-all runs.

The online check (:mod:`.core.plan_check`, ``online_check``) corrects those predictions per arm
(kind, timing, chunked or not) by the exchange's measured forward + backward seconds; the previous
call's measurement rides on the count all-gather as one more column, whose maximum is the slowest
rank's, so every rank corrects, explores and chooses alike without another collective.

Inside a sub-batch region (block-scope Lancet, :mod:`.lancet_block`) each sub-batch computes its gate
logits, and the sub-batches meet once per call: the routing is decided on their concatenation
(:mod:`.joint_gate`), counts are gathered, replicas received and the next plan made once, from the joint
counts. Each sub-batch then exchanges only its own kept routes and returns its share of ``l_aux``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.moe.sharded_moe import MOELayer, TopKGate, multiplicative_jitter, top1gating, top2gating
from torch import nn

from lightning_merak.distributed.sub_batches import mark_sub_batch_share
from lightning_merak.distributed.turns import in_sub_batch_region, meet_in_turn
from lightning_merak.plugins.moe.checkpoint import EXPERTS_KEY, expert_indices, select_local_experts
from lightning_merak.plugins.moe.core.dispatch import ExchangeLayout, decode, encode, routes_from_dense
from lightning_merak.plugins.moe.core.joint_gate import compact_routes, first_choice_fraction, sub_batch_gates
from lightning_merak.plugins.moe.core.lancet import choose_chunks, chunk_times
from lightning_merak.plugins.moe.core.placement import Padding, PlacementPlan, computed_max_over_mean
from lightning_merak.plugins.moe.core.placement_cost_model import CostModel
from lightning_merak.plugins.moe.core.plan_check import Candidate, PlanCheck
from lightning_merak.plugins.moe.core.shadowing import plan_shadowing
from lightning_merak.plugins.moe.core.step_planner import (
    PLAN_KINDS,
    PlannerSettings,
    StepChoice,
    choose_step_plan,
    predicted_plan,
    prefetch_pays,
    step_candidates,
)
from lightning_merak.plugins.moe.cost_measurement import profile_cost_model
from lightning_merak.plugins.moe.executor import (
    ExchangeFunction,
    ExpertExchange,
    ReplicaTransfer,
    TransferScheduler,
    flatten_params,
)
from lightning_merak.plugins.moe.groups import ExpertGroups, ensure_expert_groups
from lightning_merak.plugins.moe.options import MoEOptions, check_layer_arguments
from lightning_merak.util.timing import DeviceTimer

__all__ = ["MoE", "MoEOptions", "PlacementMOELayer"]

_GATE_TAKES_SPARSE_ROUTES = "sparse_routes" in inspect.signature(TopKGate.forward).parameters
_PROFILED: dict[tuple[Any, ...], CostModel] = {}
_LAYER_TAG_STRIDE = 1 << 16
_CURRENT_TAG_OFFSET = 1 << 15  # current-step Trans: never paired with a prefetch still in flight
_KINDS_OF = {"pro_prophet": ("none", "dropless", "pro_prophet"), "auto": PLAN_KINDS}


@dataclass
class _JointCall:
    """What the sub-batches of one layer call share: decided once, from all their tokens."""

    plan: PlacementPlan
    replica_params: dict[int, torch.Tensor]
    stats: dict[str, Any]
    exp_counts: torch.Tensor
    first_fraction: torch.Tensor
    total_tokens: int


@dataclass
class _SubBatchRoutes:
    """One sub-batch's slice of the joint routing, renumbered for an unpadded exchange."""

    indices: torch.Tensor
    locations: torch.Tensor
    counts: list[list[int]]
    chunks: int
    first: bool
    joint: _JointCall


def _candidate(choice: StepChoice, max_over_mean: float = 1.0) -> Candidate:
    """What the online check sees of a choice: a chunked plan is a variant of the same plan unchunked."""
    base = f"{choice.kind}/{choice.timing}" if choice.chunks is not None and choice.chunks > 1 else None
    return Candidate(choice.arm, choice.predicted_s, base, max_over_mean, bool(choice.plan.replications))


class PlacementMOELayer(MOELayer):
    """DeepSpeed's ``MOELayer`` with dropless dispatch, expert replication and chunked overlap."""

    top1_weight_one = False
    """At k = 1, weight a token's expert output by its probability renormalised over the one choice (1, as Mixtral
    does) rather than by the probability (DeepSpeed's ``top1gating``); the block swap sets it."""

    def __init__(
        self,
        gate: nn.Module,
        experts: nn.Module,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        options: MoEOptions,
        cost_model: CostModel | None = None,
        scheduler: TransferScheduler | None = None,
        data_parallel_groups: Sequence[Sequence[int]] | None = None,
    ) -> None:
        super().__init__(gate, experts, ep_group_name, ep_size, num_local_experts)
        options.validate(getattr(gate, "drop_tokens", True))
        self.options = options
        self.num_experts = ep_size * num_local_experts
        self.cost_model = cost_model
        self.scheduler = scheduler if scheduler is not None else TransferScheduler()
        self.layer_index = self.scheduler.register(self)
        self.data_parallel_groups = data_parallel_groups
        self.groups: ExpertGroups | None = None
        self.plan = PlacementPlan(self.num_experts, ep_size)
        self.prefetch_plan: PlacementPlan | None = None
        self._prefetch_kind = "none"
        self._predicted: tuple[str, PlacementPlan] | None = None
        self._plan_counts: list[list[int]] | None = None
        self._calls = 0
        self.stats: dict[str, Any] = {}
        if self.scheduler.plan_check is None:
            self.scheduler.plan_check = PlanCheck(explore_every=options.explore_every,
                                                  max_regret=options.explore_regret, seed=options.explore_seed,
                                                  balance_tolerance=options.balance_tolerance)
        self.plan_check = self.scheduler.plan_check
        self._checked: tuple[Candidate, dict[str, Any]] | None = None

    @property
    def ep_rank(self) -> int:
        return self.groups.ep_ranks.index(dist.get_rank()) if self.groups is not None else 0

    def _attach(self) -> None:
        # at ep_size=1 too when distributed: the expert-data-parallel group (every data-parallel rank) is the one
        # a data-parallel strategy reduces and clips the experts' gradients over
        if self.groups is not None or (self.ep_size == 1 and not dist.is_initialized()):
            return
        self.groups = ensure_expert_groups(self.ep_size, self.ep_group_name, self.data_parallel_groups)
        if self.ep_group is None:
            self._set_ep_group(self.groups.ep_group)

    def _needs_cost_model(self) -> bool:
        return self.options.placement != "none" or self.options.lancet_chunks == "auto"

    def _ensure_cost_model(self, like: torch.Tensor) -> CostModel:
        if self.cost_model is None:
            expert = self.experts.deepspeed_experts[0]
            ranks = tuple(self.groups.ep_ranks) if self.groups else (0,)
            key = (ranks, like.size(-1), like.dtype, like.device.type, sum(p.numel() for p in expert.parameters()))
            if key not in _PROFILED:
                group = self.groups.ep_group if self.groups else None
                _PROFILED[key] = profile_cost_model(
                    expert, like.size(-1), self.num_local_experts, group, list(ranks), like.dtype, like.device)
            self.cost_model = _PROFILED[key]
        return self.cost_model

    def _gate(self, tokens: torch.Tensor, used_token: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        if _GATE_TAKES_SPARSE_ROUTES:
            l_aux, capacity, _, indices, locations, gates, counts = self.gate(
                tokens, used_token, sparse_routes=True, use_tutel=False)
            return l_aux, capacity, indices, locations, gates, counts
        l_aux, combine_weights, dispatch_mask, counts = self.gate(tokens, used_token, use_tutel=False)
        indices, locations, gates, capacity = routes_from_dense(combine_weights, dispatch_mask, self.gate.k)
        return l_aux, capacity, indices, locations, gates, counts

    def _route(self, logits: torch.Tensor, used_token: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """DeepSpeed's gating of ``logits`` (a copy: top-2 sampling edits them in place), without its l_aux."""
        gate = self.gate
        capacity_factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
        scratch = logits.detach().clone()
        sparse = {"sparse_routes": True} if _GATE_TAKES_SPARSE_ROUTES else {}
        if gate.k == 1:
            routed = top1gating(scratch, capacity_factor, gate.min_capacity, used_token,
                                gate.noisy_gate_policy if gate.training else None, gate.drop_tokens, gate.use_rts,
                                gate.ep_group, use_tutel=False, **sparse)
        else:
            routed = top2gating(scratch, capacity_factor, gate.min_capacity, gate.drop_tokens, gate.ep_group,
                                gate.top2_2nd_expert_sampling, **sparse)
        if sparse:
            _, capacity, _, indices, locations, _, counts = routed
        else:
            _, combine_weights, dispatch_mask, counts = routed
            indices, locations, _, capacity = routes_from_dense(combine_weights, dispatch_mask, gate.k)
        return capacity, indices, locations, counts

    def _gather_counts(self, local: torch.Tensor) -> list[list[int]]:
        local = local.to(torch.int64).reshape(1, -1)
        if self.ep_size == 1:
            return local.tolist()
        gathered = [torch.empty_like(local) for _ in range(self.ep_size)]
        dist.all_gather(gathered, local, group=self.ep_group)
        return torch.cat(gathered).tolist()

    def _checking(self) -> bool:
        """Whether the online check picks this call's plan (layer scope, a placement that chooses, EP > 1)."""
        return (self.options.online_check and self.options.placement in _KINDS_OF and self.ep_size > 1
                and not in_sub_batch_region())

    def _gather_and_check(self, local: torch.Tensor) -> list[list[int]]:
        """Counts over the EP group; the previous checked call's measured microseconds ride along as a column.

        Their maximum (the slowest rank's time, zero where no backward ran) is what the check learns.
        """
        if not self._checking():
            return self._gather_counts(local)
        last, self._checked = self._checked, None
        measured_us = 0
        if last is not None and "exchange_backward_s" in last[1]:
            measured_us = round(1e6 * (last[1]["exchange_forward_s"] + last[1]["exchange_backward_s"]))
        local = local.to(torch.int64).reshape(-1)
        rows = self._gather_counts(torch.cat([local, local.new_tensor([measured_us])]))
        slowest_us = max(row[-1] for row in rows)
        if last is not None and slowest_us > 0:
            self.plan_check.observe(last[0].arm, last[0].predicted_s, slowest_us / 1e6, last[0].base)
        return [row[:-1] for row in rows]

    def _padding(self, capacity: torch.Tensor) -> Padding:
        if self.options.dispatch == "dropless":
            return Padding("dropless")
        if self.gate.drop_tokens:
            return Padding("fixed", int(capacity))
        return Padding("max")

    def _chunks(self, counts: list[list[int]], plan: PlacementPlan, padding: Padding) -> int:
        if self.ep_size == 1:
            return 1
        if self.options.lancet_chunks == "auto":
            return choose_chunks(self.cost_model, counts, plan, padding)
        return int(self.options.lancet_chunks)

    def start_trans(self, plan: PlacementPlan, current: bool = False) -> ReplicaTransfer | None:
        """Post this layer's parameter transfers for ``plan`` (None when nothing moves)."""
        if not plan.replications or self.groups is None:
            return None
        first = self.ep_rank * self.num_local_experts
        local = self.experts.deepspeed_experts
        owned = {rep.expert: flatten_params(local[rep.expert - first]) for rep in plan.owned_by(self.ep_rank)}
        template = local[0]
        tag = self.layer_index * _LAYER_TAG_STRIDE + (_CURRENT_TAG_OFFSET if current else 0)
        return ReplicaTransfer.start_trans(
            plan, self.ep_rank, self.groups.ep_ranks, self.groups.transfer_group, tag, owned,
            sum(p.numel() for p in template.parameters()), next(template.parameters()).detach())

    def _start_agg(self, plan: PlacementPlan) -> Any:
        template = self.experts.deepspeed_experts[0]
        numel = sum(p.numel() for p in template.parameters())
        like = next(template.parameters()).detach()

        def start(replica_grads: dict[int, torch.Tensor]) -> ReplicaTransfer:
            if not plan.replications or self.groups is None:
                return ReplicaTransfer(plan)
            return ReplicaTransfer.start_agg(
                plan, self.ep_rank, self.groups.ep_ranks, self.groups.transfer_group,
                self.layer_index * _LAYER_TAG_STRIDE, replica_grads, numel, like)

        return start

    def _choose(self, counts: list[list[int]], padding: Padding, prefetched: ReplicaTransfer | None) -> StepChoice:
        """This call's plan, from this call's counts (identical on every EP rank)."""
        policy = self.options.placement
        empty = PlacementPlan(self.num_experts, self.ep_size)
        plain = "dropless" if padding.mode == "dropless" else "none"
        if policy == "none" or self.ep_size == 1:
            return StepChoice(plain, "current", empty, padding, 0.0)
        if policy == "shadowing":
            plan = plan_shadowing(counts, self.cost_model)
            return StepChoice("shadowing" if plan.replications else plain, "current", plan, padding,
                              self.cost_model.total(counts, plan, padding, "current"))
        offered = (self._prefetch_kind, prefetched.plan) if prefetched is not None else None
        current = self.options.plan_from != "previous"
        if not self._checking():
            return choose_step_plan(counts, self.cost_model, padding, self._settings(), prefetched=offered,
                                    current=current)
        candidates = step_candidates(counts, self.cost_model, padding, self._settings(), prefetched=offered,
                                     current=current)
        arms = [variant for candidate in candidates for variant in self._chunk_variants(counts, candidate)]
        balance = {id(candidate.plan): computed_max_over_mean(counts, candidate.plan, self.num_local_experts)
                   for candidate in candidates}
        offers = [_candidate(arm, balance[id(arm.plan)]) for arm in arms]
        picked = self.plan_check.select(offers)
        best_current_s = min(self.plan_check.corrected(offer) for offer, arm in zip(offers, arms)
                             if arm.timing == "current")
        return replace(arms[picked.index], best_current_s=best_current_s, corrected_s=picked.corrected_s,
                       explored=picked.explored)

    def _chunk_variants(self, counts: list[list[int]], candidate: StepChoice) -> list[StepChoice]:
        """``candidate`` at its chunk count; where ``auto`` chose several, at one chunk too (priced without
        the overlap the simulation credits the chunks with), so the check can tell whether chunks pay."""
        chunks = self._chunks(counts, candidate.plan, candidate.padding)
        if chunks == 1 or self.options.lancet_chunks != "auto":
            return [replace(candidate, chunks=chunks)]
        times = chunk_times(self.cost_model, counts, candidate.plan, candidate.padding)
        saved = max(0.0, times[1] - times[chunks])
        return [replace(candidate, chunks=1),
                replace(candidate, chunks=chunks, predicted_s=max(0.0, candidate.predicted_s - saved))]

    def _settings(self) -> PlannerSettings:
        options = self.options
        return PlannerSettings(_KINDS_OF[options.placement], options.exclude_fewest, options.alpha,
                               options.slots_per_rank)

    def _replan_due(self, counts: list[list[int]]) -> bool:
        due = self._calls % self.options.replan_every == 0
        if not due and self.options.replan_threshold is not None and self._plan_counts is not None:
            before = sum(map(sum, self._plan_counts))
            drift = sum(abs(a - b) for ra, rb in zip(counts, self._plan_counts) for a, b in zip(ra, rb))
            due = drift > self.options.replan_threshold * max(before, 1)
        return due or self._plan_counts is None

    def _plan_next(self, counts: list[list[int]], choice: StepChoice) -> None:
        """Predict the next call's plan from these counts; prefetch it only where the model says it pays.

        ``plan_from="previous"`` always prefetches (Pro-Prophet), ``current`` never; ``auto`` prefetches
        when the previous prediction, priced on these counts, beat this call's best current-step plan.
        """
        self.prefetch_plan = None
        if self.options.placement in ("none", "shadowing") or self.ep_size == 1 or self.options.plan_from == "current":
            return
        previous = self._predicted
        if self._replan_due(counts):
            self._plan_counts = counts
            self._predicted = predicted_plan(counts, self.cost_model, choice.padding, self._settings())
        if self._predicted is None:
            return
        correction = self.plan_check.correction(f"{previous[0]}/predicted") if previous and self._checking() else 1.0
        pays = self.options.plan_from == "previous" or (previous is not None and prefetch_pays(
            counts, self.cost_model, previous[1], choice.padding, choice.best_current_s, correction))
        if pays:
            self._prefetch_kind, self.prefetch_plan = self._predicted

    def _replicas(self, choice: StepChoice, prefetched: ReplicaTransfer | None,
                  stats: dict[str, Any]) -> tuple[dict[int, torch.Tensor], ReplicaTransfer | None]:
        """Replica parameters ready now (a used prefetch), or the current-step transfer still in flight."""
        if prefetched is not None and choice.timing != "predicted":
            prefetched.wait(stats, "discarded_trans_s")
        if choice.timing == "predicted":
            received = prefetched.wait(stats, "exposed_trans_s")
            return {e: bufs[0] for e, bufs in received.items()}, None
        return {}, self.start_trans(choice.plan, current=True)

    def _take_prefetch(self) -> ReplicaTransfer | None:
        """The prefetched transfer of this call (posted under the previous layer, or now for the first layer)."""
        if self.prefetch_plan is None:
            return None
        transfer = self.scheduler.take(self) if self.options.overlap_transfer else None
        return transfer if transfer is not None else self.start_trans(self.prefetch_plan)

    def _exchange(
        self, tokens: torch.Tensor, layout: ExchangeLayout, rows: torch.Tensor, gates: torch.Tensor,
        plan: PlacementPlan, replica_params: dict[int, torch.Tensor], stats: dict[str, Any], prefetch: bool,
        replica_transfer: ReplicaTransfer | None = None, while_dispatching: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Tokens → experts (local, replica, or over the all-to-alls) → gate-weighted sum per token;
        ``while_dispatching``: host work for the next call, run under the first dispatch's wait."""
        routed_in = encode(tokens, rows, layout.num_rows)
        params = [p for expert in self.experts.deepspeed_experts for p in expert.parameters()]
        build_graph = torch.is_grad_enabled() and (routed_in.requires_grad or any(p.requires_grad for p in params))

        def after_first_dispatch() -> None:
            if self.options.overlap_transfer and prefetch:
                self.scheduler.prefetch_after(self)
            if while_dispatching is not None:
                while_dispatching()

        exchange = ExpertExchange(
            layout=layout,
            group=self.ep_group,
            experts=list(self.experts.deepspeed_experts),
            replica_params=replica_params,
            agg_start=self._start_agg(plan),
            lancet_backward=self.options.lancet_backward,
            after_first_dispatch=after_first_dispatch,
            stats=stats,
            replica_transfer=replica_transfer,
        )
        routed_out = ExchangeFunction.apply(exchange, build_graph, routed_in, *params)
        if self.top1_weight_one and self.gate.k == 1:  # p / p as Mixtral: 1, dropped routes stay 0
            gates = gates / gates.clamp(min=torch.finfo(gates.dtype).tiny)
        return decode(routed_out, rows, gates)

    def forward(self, *input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        self._attach()
        if in_sub_batch_region():
            return self._forward_sub_batch(hidden, used_token)
        if self._needs_cost_model():
            self._ensure_cost_model(hidden)
        tokens = hidden.reshape(-1, hidden.size(-1))
        self.l_aux, capacity, indices, locations, gates, self.exp_counts = self._gate(tokens, used_token)
        counts = self._gather_and_check(self.exp_counts)
        stats: dict[str, Any] = {}
        prefetched = self._take_prefetch()
        planning = time.perf_counter()
        choice = self._choose(counts, self._padding(capacity), prefetched)
        chunks = choice.chunks if choice.chunks is not None else self._chunks(counts, choice.plan, choice.padding)
        stats["planning_s"] = time.perf_counter() - planning
        layout = ExchangeLayout.build(self.ep_rank, counts, choice.plan, choice.padding, self.num_local_experts,
                                      chunks)
        rows = layout.route_rows(indices, locations)
        self._record(stats, counts, choice, chunks, int((indices < 0).sum()), layout.num_rows)
        with DeviceTimer(tokens.device) as exchange:
            replica_params, in_flight = self._replicas(choice, prefetched, stats)
            output = self._exchange(tokens, layout, rows, gates, choice.plan, replica_params, stats, prefetch=True,
                                    replica_transfer=in_flight,
                                    while_dispatching=lambda: self._plan_next_timed(counts, choice, stats))
        stats["exchange_forward_s"] = exchange.seconds
        if choice.corrected_s is not None:
            self._checked = (_candidate(choice), stats)
        return output.reshape(hidden.shape)

    def _plan_next_timed(self, counts: list[list[int]], choice: StepChoice, stats: dict[str, Any]) -> None:
        start = time.perf_counter()
        self._plan_next(counts, choice)
        stats["next_plan_s"] = time.perf_counter() - start

    def _record(self, stats: dict[str, Any], counts: list[list[int]], choice: StepChoice, chunks: int,
                dropped: int, routed_rows: int) -> None:
        stats.update(counts=counts, plan=choice.plan, chunks=chunks, padding=choice.padding, dropped_routes=dropped,
                     routed_rows=routed_rows, plan_kind=choice.kind, plan_timing=choice.timing,
                     predicted_s=choice.predicted_s, corrected_s=choice.corrected_s, explored=choice.explored)
        self.stats = stats
        self.plan = choice.plan
        self._calls += 1

    def _forward_sub_batch(self, hidden: torch.Tensor, used_token: torch.Tensor | None) -> torch.Tensor:
        """One sub-batch's call: joint routing (met once per call), own gates, l_aux share and exchange."""
        tokens = hidden.reshape(-1, hidden.size(-1))
        gate_input = tokens.float()
        if self.gate.noisy_gate_policy == "Jitter" and self.gate.training:
            gate_input = multiplicative_jitter(gate_input, device=gate_input.device)
        logits = F.linear(gate_input, weight=self.gate.wg.weight.float(), bias=None)
        used = used_token.detach().reshape(-1) if used_token is not None else None
        submission = (logits.detach(), used, hidden.new_empty(0, hidden.size(-1)))
        part: _SubBatchRoutes = meet_in_turn(("moe", id(self)), submission, self._route_jointly)
        joint = part.joint
        gates, l_aux = sub_batch_gates(logits, part.indices, joint.first_fraction, joint.total_tokens)
        layout = ExchangeLayout.build(self.ep_rank, part.counts, joint.plan, Padding("dropless"),
                                      self.num_local_experts, part.chunks)
        rows = layout.route_rows(part.indices, part.locations)
        output = self._exchange(tokens, layout, rows, gates, joint.plan, joint.replica_params, joint.stats,
                                prefetch=part.first)
        joint.stats["routed_rows"] += layout.num_rows
        joint.stats["aux_loss"] = joint.stats.get("aux_loss", 0.0) + float(l_aux.detach())
        self.l_aux = mark_sub_batch_share(l_aux)
        self.exp_counts = joint.exp_counts
        self.stats = joint.stats
        return output.reshape(hidden.shape)

    def _route_jointly(self, submissions: list[tuple[Any, ...]]) -> list[_SubBatchRoutes]:
        """Runs once per call on one thread: everything that must see all sub-batches' tokens."""
        like = submissions[0][2]
        if self._needs_cost_model():
            self._ensure_cost_model(like)
        logits = torch.cat([s[0] for s in submissions])
        used = torch.cat([s[1] for s in submissions]) if submissions[0][1] is not None else None
        sizes = [s[0].size(0) for s in submissions]
        capacity, indices, locations, exp_counts = self._route(logits, used)
        first_fraction = (exp_counts.float() / logits.size(0) if self.gate.k == 1
                          else first_choice_fraction(logits))
        pieces = [compact_routes(i, l, self.num_experts)
                  for i, l in zip(indices.split(sizes, dim=1), locations.split(sizes, dim=1))]
        local = torch.stack([exp_counts.to(torch.int64)] + [counts for _, counts in pieces])
        gathered = [torch.tensor(row).view(len(pieces) + 1, -1).tolist() for row in self._gather_counts(local)]
        counts = [rank_rows[0] for rank_rows in gathered]
        sub_counts = [[rank_rows[1 + i] for rank_rows in gathered] for i in range(len(pieces))]
        stats: dict[str, Any] = {}
        prefetched = self._take_prefetch()
        choice = self._choose(counts, self._padding(capacity), prefetched)  # as the unsplit layer would
        replica_params, in_flight = self._replicas(choice, prefetched, stats)
        if in_flight is not None:  # the sub-batches share the replicas: the first dispatch cannot wait for them
            replica_params = {e: bufs[0] for e, bufs in in_flight.wait(stats, "exposed_trans_s").items()}
        chunks = [self._chunks(c, choice.plan, Padding("dropless")) for c in sub_counts]
        self._record(stats, counts, choice, max(chunks), int((indices < 0).sum()), 0)
        stats.update(sub_batches=len(pieces))
        joint = _JointCall(choice.plan, replica_params, stats, exp_counts, first_fraction, logits.size(0))
        self._plan_next(counts, choice)
        return [
            _SubBatchRoutes(i.to(torch.int64), compact, sub_counts[n], chunks[n], n == 0, joint)
            for n, (i, (compact, _)) in enumerate(zip(indices.split(sizes, dim=1), pieces))
        ]


class MoE(DeepSpeedMoE):
    """``deepspeed.moe.layer.MoE`` with ``dispatch``, ``placement`` and Lancet options.

    Extra keyword arguments (see :class:`MoEOptions`): ``dispatch`` "capacity" (DeepSpeed's
    padded all-to-all) or "dropless" (split-size all-to-all, needs ``drop_tokens=False``);
    ``placement`` "none", "pro_prophet" or "shadowing"; ``lancet_chunks`` an int or "auto";
    ``cost_model`` to skip on-machine profiling; ``scheduler`` shared by a model's layers so
    layer i+1's transfers overlap layer i; ``data_parallel_groups`` to carve EP groups from a
    3D layout's data-parallel ranks.
    """

    local_experts_key = EXPERTS_KEY  # makes it a protocols.experts.ExpertParallelLayer (found without DeepSpeed)

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: Optional[str] = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        options: MoEOptions | None = None,
        cost_model: CostModel | None = None,
        scheduler: TransferScheduler | None = None,
        data_parallel_groups: Sequence[Sequence[int]] | None = None,
        **option_kwargs: Any,
    ) -> None:
        check_layer_arguments(hidden_size, num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity,
                              noisy_gate_policy, use_residual=use_residual, drop_tokens=drop_tokens, use_rts=use_rts,
                              use_tutel=use_tutel, enable_expert_tensor_parallelism=enable_expert_tensor_parallelism,
                              top2_2nd_expert_sampling=top2_2nd_expert_sampling)
        if not isinstance(expert, nn.Module):
            raise ValueError(f"expert={expert!r} must be a torch.nn.Module: the one expert each slot copies")
        if options is not None and (option_kwargs or not isinstance(options, MoEOptions)):
            raise ValueError(f"options={type(options).__name__} and keywords {sorted(option_kwargs)}: pass a "
                             "MoEOptions as options or its fields as keywords, not both")
        options = options if options is not None else MoEOptions(**option_kwargs)
        options.validate(drop_tokens, ep_size)
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, False, False,
                         top2_2nd_expert_sampling)
        stock = self.deepspeed_moe
        self.deepspeed_moe = PlacementMOELayer(
            stock.gate, stock.experts, stock.ep_group_name, ep_size, self.num_local_experts, options,
            cost_model=cost_model, scheduler=scheduler, data_parallel_groups=data_parallel_groups)
        self.register_load_state_dict_pre_hook(_keep_local_experts)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by DeepSpeed's engine: attach the expert groups once, however often it is called.

        The layer may already have attached its groups (a Lightning callback's ``setup`` or a
        first forward), and ``MOELayer._set_ep_group`` refuses a second call, so an attached
        layer is left as it is. Groups carved from a 3D layout's data-parallel ranks follow
        DeepSpeed's default order, which ``use_data_before_expert_parallel_`` would change.
        """
        layer = self.deepspeed_moe
        if layer.ep_group is not None:
            return
        if use_data_before_expert_parallel_ and layer.data_parallel_groups is not None:
            raise ValueError(
                "use_data_before_expert_parallel_ reorders expert groups, which conflicts with data_parallel_groups; "
                "drop one of them")
        if self.ep_size == 1 or use_data_before_expert_parallel_:
            super().set_deepspeed_parallelism(use_data_before_expert_parallel_)
            return
        layer._attach()


def _keep_local_experts(module: MoE, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """Load hook: a state with every expert (a gathered checkpoint) loads this rank's slice.

    Finding the EP rank attaches the expert groups, which is collective; ``load_state_dict``
    runs on every rank in the same module order, so every rank gets here together.
    """
    layer = module.deepspeed_moe
    key_prefix = prefix + EXPERTS_KEY
    if expert_indices(state_dict, key_prefix) != list(range(layer.num_experts)):
        select_local_experts(state_dict, key_prefix, 0, layer.num_local_experts, layer.num_experts)
        return
    layer._attach()
    select_local_experts(state_dict, key_prefix, layer.ep_rank, layer.num_local_experts, layer.num_experts)
