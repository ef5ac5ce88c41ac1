"""The planner leg of ``python -m benchmarks.context_parallel``: which layouts it trains, and from the ranks' results
each layout's predicted and measured step, both rankings, their agreement and the planner's regret.

On one cluster (every rank of the largest cp), per sequence and network, a ``plan`` job asks merak3d's planner
for ``context_parallel="auto"`` and a ``merak3d`` job trains each layout it weighs
(:mod:`benchmarks._context_parallel_planned`): cp over the divisors of the world, ``ring`` and, where cp divides
the key/value heads, ``all_to_all``, the other ranks data-parallel, on one global batch of ``world`` sequences.

The planner ranks layouts by predicted time per sample, each priced at the batch its planning read (a global-batch
dataloader shows it the whole global batch as one replica's); the leg's predicted step of a layout is that time per
sample times the global batch, which every layout trains per step. Its measured step is the slowest rank's step,
median over the steps after warm-up of every round (each layout trains once per round, every other round in reverse
order). The predictions come from the planner's own profile, taken before any layout trains, never from the measured
steps.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from typing import Any, Optional, Union

from benchmarks._context_parallel_ranks import CONTEXT_METHODS, MERAK3D, PLAN, Job, Workload
from benchmarks.goals import Goal, worst_case

Outcome = Union[list[dict[str, Any]], str]
"""A job's result on every rank, or the error that stopped it."""


def slowest_steps_s(outcome: list[dict[str, Any]], warmup: int) -> list[float]:
    """Per timed step (``warmup`` dropped) the slowest working rank's; idle ranks (cp=1 alone on rank 0) are not
    working. Their median is a row's step."""
    timed = [result["steps"][warmup:] for result in outcome if not result.get("idle")]
    return [max(step["step_s"] for step in steps) for steps in zip(*timed)]


def candidate_name(cp: int, method: Optional[str]) -> str:
    return "cp1" if cp == 1 else f"cp{cp} {method}"


def planner_candidates(world_size: int, seq: int, workload: Workload) -> list[tuple[int, Optional[str]]]:
    """The layouts merak3d's planner weighs for ``context_parallel="auto"`` with every other option at its default
    (pipeline and tensor parallel 1, no sharding or recompute), asked of the planner's own rules: its candidates
    (:func:`~lightning_merak.planning.planner.candidate_layouts`, cp over the world's divisors, the rest
    data-parallel) that the model's attention runs (:meth:`~lightning_merak.planning.planner.ContextAttention.
    methods`: ``ring`` where the sequence splits into 2 x cp chunks, ``all_to_all`` where cp also divides the
    key/value heads). ``(cp, method)``, method None at cp=1."""
    from lightning_merak.planning.planner import ContextAttention, SearchSpace, candidate_layouts

    divisors = tuple(degree for degree in range(1, world_size + 1) if world_size % degree == 0)
    space = SearchSpace(world_size=world_size, global_batch_size=None, replica_batch_size=world_size,
                        tp_degrees_allowed=(1,), max_pipeline_stages=1, overlap_choices=(1,), recompute_ratios=(0.0,),
                        context_parallel_degrees=divisors, context_attention_methods=CONTEXT_METHODS)
    attention = ContextAttention(sequence_length=seq, hidden_size=workload.hidden, heads=workload.heads,
                                 key_value_heads=workload.kv_heads, head_dim=workload.hidden // workload.heads,
                                 element_bytes=4)
    return [(layout.cp, layout.context_attention if layout.cp > 1 else None)
            for layout in candidate_layouts(space, workload.layers)
            if layout.context_attention in attention.methods(layout.cp, layout.tp)]


def planner_jobs(world_size: int, sequences: Sequence[int], steps: int, workload: Workload,
                 rounds: int = 2) -> list[Job]:
    """Per sequence, a plan on a global batch of ``world_size`` sequences, then every candidate trained on it in
    ``rounds`` rounds, every other round in reverse order: a slow spell of a shared machine then falls on both ends
    of the order instead of on one layout."""
    jobs: list[Job] = []
    for seq in sequences:
        jobs.append(Job(PLAN, seq, batch=world_size))
        candidates = planner_candidates(world_size, seq, workload)
        for round_index in range(rounds):
            jobs += [Job(MERAK3D, seq, steps, batch=world_size, context_parallel=cp, context_attention=method)
                     for cp, method in (candidates if round_index % 2 == 0 else candidates[::-1])]
    return jobs


# Rankings ----------------------------------------------------------------------------------


def average_ranks(values: Sequence[float]) -> list[float]:
    """1 for the smallest value; tied values share the mean of their places."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            ranks[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation (Pearson's over average ranks); None with fewer than 2 values or a constant side."""
    if len(a) != len(b):
        raise ValueError(f"spearman needs paired values, got {len(a)} and {len(b)}")
    if len(a) < 2:
        return None
    ra, rb = average_ranks(a), average_ranks(b)
    mean = (len(a) + 1) / 2
    covariance = sum((x - mean) * (y - mean) for x, y in zip(ra, rb))
    spread = math.sqrt(sum((x - mean) ** 2 for x in ra) * sum((y - mean) ** 2 for y in rb))
    return None if spread == 0 else covariance / spread


def kendall_tau_b(a: Sequence[float], b: Sequence[float]) -> Optional[float]:
    """Kendall's tau-b (ties counted out of each side's pairs); None with fewer than 2 values or a constant side."""
    if len(a) != len(b):
        raise ValueError(f"kendall_tau_b needs paired values, got {len(a)} and {len(b)}")
    concordant = discordant = tied_a = tied_b = 0
    for i, j in itertools.combinations(range(len(a)), 2):
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            tied_a += 1
        elif db == 0:
            tied_b += 1
        elif (da > 0) == (db > 0):
            concordant += 1
        else:
            discordant += 1
    pairs = concordant + discordant
    denominator = math.sqrt((pairs + tied_a) * (pairs + tied_b))
    return None if denominator == 0 else (concordant - discordant) / denominator


# One plan and its layouts ------------------------------------------------------------------


def _relative_difference(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-30)


def _candidate_row(job: Job, outcomes: Sequence[Outcome], predicted: dict[str, dict[str, Any]],
                   warmup: int) -> dict[str, Any]:
    """One layout of a plan from its runs (one per round): predicted and measured step (the median of every
    round's timed steps, each the slowest rank's)."""
    name = candidate_name(job.context_parallel, job.context_attention)
    row: dict[str, Any] = {"layout": name, "cp": job.context_parallel, "method": job.context_attention}
    if name in predicted:
        entry = predicted[name]
        row.update(batch_replicas=entry["dp"], predicted_step_ms=entry["time_per_sample_s"] * job.batch * 1e3,
                   predicted_rank=entry["rank"],
                   planner_step_s=entry["step_s"], planner_samples=entry["samples"],
                   planner_memory_bytes=entry["memory_bytes"], planner_components=entry["components"])
    failed = next((outcome for outcome in outcomes if isinstance(outcome, str)), None)
    if failed is not None:
        return {**row, "error": failed}
    refused = next((outcome[0]["refused"] for outcome in outcomes if "refused" in outcome[0]), None)
    if refused is not None:
        return {**row, "refused": refused}
    slowest = [[seconds * 1e3 for seconds in slowest_steps_s(outcome, warmup)] for outcome in outcomes]
    return {**row, "measured_step_ms": statistics.median(itertools.chain(*slowest)),
            "round_steps_ms": [statistics.median(steps) for steps in slowest], "slowest_steps_ms": slowest,
            "losses": [step["loss"] for step in outcomes[0][0]["steps"]]}


def planner_group(network: str, plan_job: Job, plan: Outcome, trained: Sequence[tuple[Job, Outcome]],
                  warmup: int) -> dict[str, Any]:
    """One plan and the layouts trained after it (each in every round): per layout the predicted and measured step and
    both ranks; the planner's choice, the fastest measured layout, the regret and the rankings' agreement.

    ``error`` says why there is no regret: the plan failed, it weighed other layouts than were trained, or a
    layout it accepted has no measurement (a failed layout is never left out of the best).
    """
    group: dict[str, Any] = {"network": network, "seq": plan_job.seq, "batch": plan_job.batch}
    if isinstance(plan, str):
        return {**group, "error": f"plan: {plan}", "candidates": []}
    ranked, rejected = plan[0]["ranked"], plan[0]["rejected"]
    predicted = {candidate_name(entry["cp"], entry["method"]): {**entry, "rank": index + 1}
                 for index, entry in enumerate(ranked)}
    refusals = {candidate_name(entry["cp"], entry["method"]): entry["reason"] for entry in rejected}
    runs: dict[str, tuple[Job, list[Outcome]]] = {}
    for job, outcome in trained:  # every round's run of a layout, in the order of the first round
        runs.setdefault(candidate_name(job.context_parallel, job.context_attention), (job, []))[1].append(outcome)
    rows = [_candidate_row(job, outcomes, predicted, warmup) for job, outcomes in runs.values()]
    for row in rows:
        if row["layout"] in refusals:
            row.setdefault("refused", f"the planner refused it for memory: {refusals[row['layout']]}")
    chosen = candidate_name(plan[0]["chosen"]["cp"], plan[0]["chosen"]["method"])
    group.update(plan_s=plan[0]["plan_s"], chosen=chosen, candidates=rows,
                 rejected_for_memory=refusals)
    weighed, trained_names = set(predicted) | set(refusals), {row["layout"] for row in rows}
    if weighed != trained_names:
        return {**group, "error": f"the planner weighed {sorted(weighed)}, the leg trained {sorted(trained_names)}"}
    fitting = [row for row in rows if row["layout"] in predicted]
    missing = [row["layout"] for row in fitting if "measured_step_ms" not in row]
    measured = [row for row in fitting if "measured_step_ms" in row]
    for row in measured:
        row["measured_rank"] = 1 + sum(other["measured_step_ms"] < row["measured_step_ms"] for other in measured)
    baseline = next((row for row in measured if row["cp"] == 1), None)
    if baseline is not None:
        for row in measured:
            row["loss_max_rel_diff_vs_cp1"] = max(_relative_difference(value, reference)
                                                  for value, reference in zip(row["losses"], baseline["losses"]))
    pairs = [(row["predicted_step_ms"], row["measured_step_ms"]) for row in measured]
    group.update(spearman=spearman(*zip(*pairs)) if pairs else None,
                 kendall_tau_b=kendall_tau_b(*zip(*pairs)) if pairs else None)
    if missing:
        return {**group, "regret": None, "error": f"no measured step for {', '.join(missing)}"}
    best = min(measured, key=lambda row: row["measured_step_ms"])
    pick = next(row for row in measured if row["layout"] == chosen)
    return {**group, "best_measured": best["layout"],
            "regret": pick["measured_step_ms"] / best["measured_step_ms"] - 1}


def group_name(group: dict[str, Any]) -> str:
    return f"seq {group['seq']} {group['network']}"


def regret_goal(goal: Goal, groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``goal`` (the planner's regret) over every plan of the leg; the rankings' worst agreement in the note."""
    agreement = [(group_name(group), group.get("spearman"), group.get("kendall_tau_b")) for group in groups]

    def number(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.2f}"

    ranks = sorted({group["batch"] for group in groups})
    note = (f"context_parallel='auto' planned and each layout it weighed trained on {'/'.join(map(str, ranks))} ranks, "
            "a global batch of one sequence per rank; predicted vs measured ranking: "
            + "; ".join(f"{name} Spearman {number(rho)}, Kendall {number(tau)}" for name, rho, tau in agreement))
    return worst_case(goal, {group_name(group): group.get("regret") for group in groups}, note=note)


def group_failures(groups: Sequence[dict[str, Any]]) -> list[str]:
    """What of the leg makes the command fail: a group's error and each candidate that errored."""
    failed = [f"planner leg {group_name(group)}: {group['error']}" for group in groups if group.get("error")]
    failed += [f"planner leg {group_name(group)} {row['layout']}: {row['error']}" for group in groups
               for row in group["candidates"] if row.get("error")]
    return failed


Planned = tuple[Job, Outcome, list[tuple[Job, Outcome]]]
"""A plan's job and outcome, and its trained layouts' jobs and outcomes."""


def split_outcomes(jobs: Sequence[Job], outcomes: dict[int, Outcome]) -> list[Planned]:
    """The planner leg's jobs of one cluster run grouped per plan (other jobs are left out)."""
    groups: list[Planned] = []
    for index, job in enumerate(jobs):
        if job.method == PLAN:
            groups.append((job, outcomes[index], []))
        elif job.method == MERAK3D:
            groups[-1][2].append((job, outcomes[index]))
    return groups

