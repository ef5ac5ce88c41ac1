"""Context parallelism on an emulated cluster network: per-rank activation memory, step time, loss, longest sequence.

Run from the repo root, as root (the shaped links need network namespaces)::

    python -m benchmarks.context_parallel [--quick] [--out PATH]

Every job trains a randomly initialised transformers Llama (built from its config, fp32; :data:`WORKLOAD`:
hidden 64, 2 layers, 4 heads with 4 key/value heads, because ``all_to_all`` scatters the key/value heads and
cp=4 needs 4 of them) on gloo ranks, one compute thread each, each rank in its own network namespace on a
tbf-shaped veth link (``lightning_merak.testing.netem.EmulatedCluster``) at 10 and 1 Gbit/s. The ranks of a
cluster run its jobs in turn (``benchmarks._context_parallel_ranks``); at cp = 4 on this 2-core machine every rank
gets a fixed CPU quota (``device_per_rank_quota``: one device per rank, half a core each), recorded in the JSON.
Side by side, per sequence (4096, 8192, 16384; quick: 1024, 2048), on the same token batches from the same seed:

* **cp=1** (``sdpa``): the baseline a user runs, transformers' default ``sdpa`` attention on one rank, no context
  parallelism. It runs on rank 0 of each cluster while the other ranks wait, so it gets the same CPU share per
  rank as the cluster's context-parallel ranks (the 10 Gbit/s run's; the network does not touch one rank);
* **ours** at cp = 2 and 4 (quick: 2), ``install_context_parallel(model, group, "ring" | "all_to_all")``: every
  rank is called with the whole sequence and runs on its load-balanced shard; the gradients are averaged over the
  ranks after backward, as data parallelism does;
* **torch's experimental context parallelism** (``torch.distributed.tensor.experimental.context_parallel``), a
  baseline row where it runs (10 Gbit/s); on this machine it refuses (its SDPA has no sharding rule on CPU),
  which the row records with torch's error; a refusing baseline does not fail the command.

Per row: ``step_ms`` (median over the timed steps, warm-up dropped, of the slowest rank's step, AdamW step
included), ``saved_mib`` (the bytes autograd saves for backward in one forward with labels, worst rank:
:func:`benchmarks.report.saved_activation_bytes`), ``activation_ratio`` (over cp=1's at the same sequence) beside
``ideal_ratio`` = 1/cp, ``efficiency`` = cp=1's step / (cp × this step), and ``loss_max_rel_diff`` (the largest
relative difference of the whole batch's loss from cp=1's over every step). The longest-sequence leg measures
saved bytes only, from :attr:`Setting.cap_sequence` in steps of a quarter of it (cp=1's and the largest cp's
ranks, real ranks), until a rung exceeds the cap: 1.05 × cp=1's bytes at that sequence.

**The planner leg** (:mod:`benchmarks._context_parallel_regret`), last on the largest cp's cluster (4 ranks; quick: 2)
on each link (``--planner goal-link``: 10 Gbit/s only; ``off``: none), per sequence of
:attr:`Setting.planner_sequences` (2048, 4096; quick: 1024, 2048), on one global batch of one sequence per rank:
merak3d's planner plans ``Merak3DStrategy(context_parallel="auto", plan_only=True)`` on these ranks, profiling this
model, batch and network as a user's run does; then every layout it weighed (cp over the world's divisors, ``ring``
and ``all_to_all`` where the heads allow, the other ranks data-parallel, pipeline and tensor parallel 1) trains
:attr:`Setting.planner_steps` steps with that cp and method fixed, through ``pl.Trainer`` and the strategy, on the
same batches from the same seed (:mod:`benchmarks._context_parallel_planned`), in :attr:`Setting.planner_rounds`
rounds, every other one in reverse order. Per layout: the predicted step (the planner's time per sample × the
global batch: its profile was taken before any layout trained, and no measured step reaches it), the measured step
(the slowest rank's, median over every round's steps after warm-up) and the rank by each; per plan the
planner's regret (measured step of its choice over the fastest measured, minus 1), Spearman's and Kendall's
agreement of the two rankings, and the layouts it refused for memory, with its reason (never trained; none at the
default memory limit). A layout that fails to train leaves its plan without a regret and fails the command.

Goals (issue #52; each the worst case over its leg, :func:`benchmarks.goals.worst_case`): :data:`ACTIVATION`,
:data:`LONGEST`, :data:`EFFICIENCY`, :data:`LOSS`, :data:`PLANNER_REGRET` (worst over the planner leg's sequences
and links), and :data:`VARIABLE_SPEEDUP`, which ``--leg variable`` measures in a run of its own
(:mod:`benchmarks._context_parallel_variable`, written as ``context_parallel_variable``; reported here without a
figure).
A full run is written with :func:`benchmarks.goals.write_run`; ``--quick`` writes
``results/context_parallel.quick.json``. Label "emulated": measured on this machine's CPU over a shaped network
(no latency emulation: no sch_netem). Any row that errors makes the command exit 1, except a baseline refusing
this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional, Union

from benchmarks import report
from benchmarks._context_parallel_ranks import (
    CONTEXT_METHODS,
    LADDER,
    PLANNED,
    SDPA,
    TORCH,
    Job,
    Workload,
    ladder_step,
    rank_file,
    write_jobs,
)
from benchmarks._context_parallel_regret import (
    Outcome,
    group_failures,
    planner_group,
    planner_jobs,
    regret_goal,
    slowest_steps_s,
    split_outcomes,
)
from benchmarks._context_parallel_variable import VARIABLE_FULL
from benchmarks._context_parallel_variable import leg_main as variable_leg
from benchmarks.goals import Goal, print_goals, worst_case, write_run
from lightning_merak.distributed.host_memory import with_heap_tunables
from lightning_merak.testing.cpu_quota import device_per_rank_quota, emulation_record
from lightning_merak.testing.netem import (
    EmulatedCluster,
    LinkSpec,
    LoopbackCluster,
    RankFailure,
    RankTimeout,
    emulation_available,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
RANK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLIBC_TUNABLES": with_heap_tunables(os.environ)}
"""Every rank's environment, ours and the baselines': one compute thread, the heap merak3d's launcher gives a user's
ranks."""
WORKLOAD = Workload()
RATES_MBIT = (10_000.0, 1_000.0)
GOAL_RATE_MBIT = 10_000.0
"""The step-efficiency goal's link; the cp=1 and torch baselines and the ladder run on it (it comes first)."""
CAP_SLACK = 1.05
LONGEST_CP = 4
ISSUE = 52

ACTIVATION = Goal(
    "activation_peak_ratio_max", 0.10, "<=",
    "per-rank saved-activation bytes of one forward with labels (autograd's saved tensors, worst rank) with "
    "context parallelism over cp=1's (transformers' sdpa on one rank) at the same sequence, minus the ideal 1/cp; "
    f"{WORKLOAD.describe()}; worst over cp 2 and 4 (quick: 2), ring and all_to_all, sequences 4096, 8192, 16384 "
    "(quick: 1024, 2048), emulated 10 and 1 Gbit/s", issue=ISSUE)
LONGEST = Goal(
    "longest_sequence_ratio", 3.5, ">=",
    "longest sequence on a ladder from 4096 in steps of 1024 whose per-rank saved-activation bytes (one forward "
    "with labels, "
    f"worst rank) stay within {CAP_SLACK} x cp=1's at 4096, cp=4 over cp=1 (transformers' sdpa on one rank); "
    f"{WORKLOAD.describe()}; worst of ring and all_to_all", issue=ISSUE)
EFFICIENCY = Goal(
    "cp_step_efficiency_min", 0.8, ">=",
    "cp=1's step (transformers' sdpa on one rank with the cluster's CPU share per rank) / (cp x the context-parallel "
    "step), steps the median of the slowest rank after warm-up, AdamW, gradients averaged over the cp ranks; "
    f"{WORKLOAD.describe()}, gloo, 1 thread per rank, emulated 10 Gbit/s links; worst over cp 2 and 4 (quick: 2), "
    "ring and all_to_all, sequences 4096, 8192, 16384 (quick: 1024, 2048)", issue=ISSUE)
LOSS = Goal(
    "loss_max_rel_diff", 1e-5, "<=",
    "largest relative difference of the whole batch's loss with context parallelism from cp=1's (transformers' sdpa "
    "on one rank, same seed and batches) over every training step; worst over every cp > 1 row (cp, ring and "
    "all_to_all, sequence, network)", issue=ISSUE)
# Their targets were chosen with this file (issue #52 fixes them); the definitions are those of the full runs made
# before the planner leg existed (a changed definition would be a new goal): the leg's note names its networks too.
PLANNER_REGRET = Goal(
    "planner_cp_regret", 0.05, "<=",
    "step time of the layout merak3d's planner chooses with context parallelism among its degrees over the "
    "fastest measured layout's, minus 1; worst over sequence lengths", issue=ISSUE)
VARIABLE_SPEEDUP = Goal(
    "variable_cp_speedup", 1.2, ">=",
    "the best fixed cp's step time (the fastest of the fixed cps whose samples fit the token cap) over the step with "
    "each micro-batch's cp chosen by its sequence length (per_micro_batch, on the cost merak3d measures), 4 ranks "
    f"on loopback, median step after warm-up of the slowest rank; one length mix ({VARIABLE_FULL.mix.describe()}); "
    f"worst over {VARIABLE_FULL.runs} repetitions of every mode on that mix", issue=ISSUE)
MEASURED_ELSEWHERE = {
    VARIABLE_SPEEDUP.key: "measured by `--leg variable`, a run of its own on a variable-length mix "
                          "(context_parallel_variable); this leg's batches are of one sequence length",
}


@dataclass(frozen=True)
class Setting:
    """What one run measures: the cp sizes (one cluster each), sequences, steps, the longest-sequence ladder and the
    planner leg."""

    context_parallel: tuple[int, ...]
    sequences: tuple[int, ...]
    steps: int
    warmup: int
    cap_sequence: int
    """The ladder's first rung; the cap is CAP_SLACK x cp=1's saved bytes there."""
    ladder_top: int
    timeout_s: float
    """Per cluster run (a cluster of the largest cp runs every job of a rate in one run)."""
    planner_sequences: tuple[int, ...] = ()
    """The planner leg's sequences, on the largest cp's cluster (none: no leg, no regret figure)."""
    planner_steps: int = 10
    """Steps each layout of the planner leg trains per round (``warmup`` of them not timed)."""
    planner_rounds: int = 2
    """Rounds of the planner leg's layouts after each plan, every other one in reverse order."""
    planner_rates: tuple[float, ...] = (10_000.0, 1_000.0)
    """The links the planner leg plans and trains on (each a plan of its own)."""

    @property
    def ladder_cp(self) -> int:
        return max(self.context_parallel)


QUICK = Setting((2,), (1024, 2048), steps=4, warmup=1, cap_sequence=1024, ladder_top=8192, timeout_s=900.0,
                planner_sequences=(1024, 2048))
FULL = Setting((2, 4), (4096, 8192, 16384), steps=5, warmup=1, cap_sequence=4096, ladder_top=65536,
               timeout_s=3600.0, planner_sequences=(2048, 4096))
SMOKE = Setting((2, 4), (128, 256), steps=3, warmup=1, cap_sequence=128, ladder_top=1024, timeout_s=300.0,
                planner_sequences=(128,), planner_steps=3)
"""``--smoke`` (hidden): every code path at tiny sizes, written to the temporary directory unless ``--out``."""


def network_name(rate_mbit: Optional[float]) -> str:
    if rate_mbit is None:
        return "loopback"
    return f"{rate_mbit / 1000:g}Gbit" if rate_mbit >= 1000 else f"{rate_mbit:g}Mbit"


def check_setting(setting: Setting, workload: Workload) -> None:
    """Refuse, before any rank starts, a setting context parallelism or the report could not run."""
    for cp in setting.context_parallel:
        if cp < 2:
            raise ValueError(f"context_parallel sizes must be at least 2 (cp=1 is the baseline), got {cp}")
        for seq in setting.sequences:
            if seq % (2 * cp):
                raise ValueError(f"sequence {seq} is not a multiple of 2 x cp={cp}; change the sequences")
        if workload.kv_heads % cp:
            raise ValueError(f"all_to_all scatters the {workload.kv_heads} key/value heads: cp={cp} does not divide "
                             "them; change the model")
    if setting.steps <= setting.warmup:
        raise ValueError(f"steps={setting.steps} must exceed warmup={setting.warmup}")
    if setting.cap_sequence not in setting.sequences:
        raise ValueError(f"cap_sequence={setting.cap_sequence} must be one of the sequences {setting.sequences}")
    if setting.ladder_top < max(setting.sequences):
        raise ValueError(f"ladder_top={setting.ladder_top} is below the longest sequence {max(setting.sequences)}")
    for seq in setting.planner_sequences:
        if seq % (2 * setting.ladder_cp):
            raise ValueError(f"planner sequence {seq} is not a multiple of 2 x cp={setting.ladder_cp}; change it")
    if setting.planner_sequences and setting.planner_steps <= setting.warmup:
        raise ValueError(f"planner_steps={setting.planner_steps} must exceed warmup={setting.warmup}")
    if setting.planner_rounds < 1:
        raise ValueError(f"planner_rounds={setting.planner_rounds} must be at least 1")
    unknown = set(setting.planner_rates) - set(RATES_MBIT)
    if unknown:
        raise ValueError(f"planner_rates {sorted(unknown)} are not links this benchmark runs ({RATES_MBIT})")


def plan_jobs(setting: Setting, world_size: int, rate_mbit: Optional[float]) -> list[Job]:
    """One cluster run's jobs, sequence by sequence (the rows compared are measured close in time).

    The goal rate's run also carries cp=1 (rank 0 alone) before ours at every sequence, then, in the largest
    cluster, the longest-sequence ladder, then torch's context parallelism (a baseline that may refuse); last, in the
    largest cluster on each of ``planner_rates``, the planner leg (:func:`benchmarks._context_parallel_regret.
    planner_jobs`: it trains through the strategy, so a failure there loses no other job).
    """
    first = rate_mbit == RATES_MBIT[0]
    jobs: list[Job] = []
    for seq in setting.sequences:
        if first:
            jobs.append(Job(SDPA, seq, setting.steps))
        jobs += [Job(method, seq, setting.steps) for method in CONTEXT_METHODS]
    if first and world_size == setting.ladder_cp:
        jobs += [Job(LADDER, max(setting.sequences), ladder_method=method, cap_sequence=setting.cap_sequence,
                     cap_slack=CAP_SLACK, top=setting.ladder_top) for method in (SDPA, *CONTEXT_METHODS)]
    if first:
        jobs += [Job(TORCH, seq, setting.steps) for seq in setting.sequences]
    if world_size == setting.ladder_cp and rate_mbit in setting.planner_rates:
        jobs += planner_jobs(world_size, setting.planner_sequences, setting.planner_steps, WORKLOAD,
                             setting.planner_rounds)
    return jobs


# Running clusters --------------------------------------------------------------------------


def read_outcomes(out: Path, world_size: int, jobs: Sequence[Job], error: Optional[str]) -> dict[int, Outcome]:
    """Every job's per-rank results from the ranks' files; a job some rank did not finish gets ``error``."""
    by_rank: list[dict[int, dict[str, Any]]] = []
    for rank in range(world_size):
        path = rank_file(out, rank)
        lines = path.read_text().splitlines() if path.exists() else []
        by_rank.append({entry["index"]: entry for entry in map(json.loads, lines)})
    outcomes: dict[int, Outcome] = {}
    for index in range(len(jobs)):
        if all(index in results for results in by_rank):
            outcomes[index] = [results[index] for results in by_rank]
        else:
            outcomes[index] = error or "no result"
    return outcomes


def run_cluster(world_size: int, rate_mbit: Optional[float], jobs: list[Job], workload: Workload,
                setting: Setting, work: Path) -> dict[int, Outcome]:
    """Run ``jobs`` on ``world_size`` ranks (a CPU quota each at more ranks than cores) on links of ``rate_mbit``
    (loopback when None)."""
    tag = f"{world_size}-{network_name(rate_mbit)}"
    jobs_file = write_jobs(work / f"jobs-{tag}.json", workload, jobs)
    out = work / f"results-{tag}.jsonl"
    quota = device_per_rank_quota(world_size)
    cluster = (LoopbackCluster(world_size, cpu_quota=quota) if rate_mbit is None
               else EmulatedCluster(world_size, LinkSpec(rate_mbit=rate_mbit), cpu_quota=quota))
    argv = [sys.executable, "-m", "benchmarks._context_parallel_ranks", str(jobs_file), str(out)]
    error: Optional[str] = None
    try:
        with cluster:
            cluster.run(argv, timeout_s=setting.timeout_s, extra_env=RANK_ENV, cwd=REPO_ROOT)
    except (RankFailure, RankTimeout) as failure:
        error = report.rank_failure_line(failure)
    return read_outcomes(out, world_size, jobs, error)


def core_share(world_size: int) -> float:
    """The cores each rank of a ``world_size`` cluster may use: its quota, or one (one compute thread)."""
    quota = device_per_rank_quota(world_size)
    return 1.0 if quota is None else round(quota.share, 4)


# Rows and figures --------------------------------------------------------------------------


def _relative_difference(value: float, reference: float) -> float:
    return abs(value - reference) / max(abs(reference), 1e-30)


def job_row(world_size: int, network: str, share: float, job: Job, outcome: Outcome, warmup: int) -> dict[str, Any]:
    """A training job's row: the slowest rank's median step and the worst rank's saved bytes (rank 0 alone for
    cp=1), the losses of rank 0 (the whole batch's on every rank)."""
    row: dict[str, Any] = {"cluster": f"{world_size} ranks", "core_share": share, "network": network,
                           "method": job.method, "cp": 1 if job.method == SDPA else world_size, "seq": job.seq}
    if isinstance(outcome, str):
        return {**row, "error": outcome}
    if "refused" in outcome[0]:
        return {**row, "refused": outcome[0]["refused"]}
    working = [result for result in outcome if not result.get("idle")]
    timed = [result["steps"][warmup:] for result in working]
    slowest = slowest_steps_s(outcome, warmup)
    losses = [step["loss"] for step in working[0]["steps"]]
    return {**row, "step_ms": statistics.median(slowest) * 1e3,
            "cpu_ms_per_rank": max(statistics.median(step["cpu_s"] for step in steps) for steps in timed) * 1e3,
            "saved_bytes": working[0]["saved_bytes_worst"], "saved_mib": working[0]["saved_bytes_worst"] / 2**20,
            "final_loss": losses[-1], "losses": losses, "timed_steps": len(slowest)}


def compare(rows: list[dict[str, Any]]) -> None:
    """Add each row's figures against cp=1 of its cluster at the same sequence (the goal rate's run): saved bytes
    over cp=1's beside the ideal 1/cp, step efficiency, loss difference. Rows without a baseline get None."""
    baselines = {(row["cluster"], row["seq"]): row for row in rows if row["method"] == SDPA and "step_ms" in row}
    for row in rows:
        if row["method"] == SDPA or "step_ms" not in row:
            continue
        base = baselines.get((row["cluster"], row["seq"]))
        if base is None:
            row.update(activation_ratio=None, ideal_ratio=1 / row["cp"], activation_excess=None, efficiency=None,
                       loss_max_rel_diff=None)
            continue
        ratio = row["saved_bytes"] / base["saved_bytes"]
        row.update(activation_ratio=ratio, ideal_ratio=1 / row["cp"], activation_excess=ratio - 1 / row["cp"],
                   efficiency=base["step_ms"] / (row["cp"] * row["step_ms"]),
                   loss_max_rel_diff=max(_relative_difference(value, reference)
                                         for value, reference in zip(row["losses"], base["losses"])))


def ours(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our context-parallel rows (every cp > 1 row but torch's baseline)."""
    return [row for row in rows if row["method"] in CONTEXT_METHODS]


def config_name(row: dict[str, Any]) -> str:
    return f"cp{row['cp']} {row['method']} seq {row['seq']} {row['network']}"


def longest_rung(peaks: dict[int, float], cap: float, start: int) -> int:
    """The last rung ``start + k x step`` up to which every rung is measured and within ``cap``; 0 when ``start`` is
    not (``step``: :func:`ladder_step`)."""
    longest, seq = 0, start
    while seq in peaks and peaks[seq] <= cap:
        longest, seq = seq, seq + ladder_step(start)
    return longest


def longest_sequence_leg(rows: Sequence[dict[str, Any]], ladders: Sequence[Union[dict[str, Any], str]],
                         setting: Setting) -> dict[str, Any]:
    """The ladder of the largest cp's cluster: the cap, per method the saved bytes per rung (the trained sequences'
    from the goal rate's rows, the longer ones from the ladder jobs) and the longest rung within the cap, and per
    context-parallel method its longest over cp=1's. ``ladders``: the ladder jobs' rank-0 results or errors."""
    cluster, network = f"{setting.ladder_cp} ranks", network_name(GOAL_RATE_MBIT)
    leg: dict[str, Any] = {"cp": setting.ladder_cp, "start": setting.cap_sequence, "top": setting.ladder_top,
                           "cap_rule": f"{CAP_SLACK} x cp=1's saved bytes at {setting.cap_sequence}"}
    trained = [row for row in rows if row["cluster"] == cluster and row["network"] == network
               and row["method"] in (SDPA, *CONTEXT_METHODS)]
    errors = [row.get("error") for row in trained if row.get("error")]
    errors += [ladder for ladder in ladders if isinstance(ladder, str)]
    base = next((row for row in trained if row["method"] == SDPA and row["seq"] == setting.cap_sequence), None)
    if errors or base is None:
        return {**leg, "error": errors[0] if errors else "no cp=1 row at the cap sequence"}
    cap = CAP_SLACK * base["saved_bytes"]
    peaks: dict[str, dict[int, float]] = {
        method: {row["seq"]: row["saved_bytes"] for row in trained if row["method"] == method}
        for method in (SDPA, *CONTEXT_METHODS)}
    for ladder in ladders:
        assert not isinstance(ladder, str)
        peaks[ladder["ladder_method"]].update({rung["seq"]: rung["saved_bytes_worst"] for rung in ladder["rungs"]})
    longest = {method: longest_rung(by_seq, cap, setting.cap_sequence) for method, by_seq in peaks.items()}
    return {**leg, "cap_mib": cap / 2**20, "longest": longest,
            "at_top": [method for method, seq in longest.items() if seq >= setting.ladder_top],
            "ratio": {method: longest[method] / longest[SDPA] for method in CONTEXT_METHODS},
            "saved_mib": {method: {seq: value / 2**20 for seq, value in sorted(by_seq.items())}
                          for method, by_seq in peaks.items()}}


def not_measured(goal: Goal, note: str) -> dict[str, Any]:
    """A goal this run has no figure for: shaped as :func:`worst_case`'s, ``met`` None (never "met")."""
    return {**asdict(goal), "value": None, "worst_config": None, "met": None, "missing": [], "by_config": {},
            "note": note}


def goal_figures(rows: Sequence[dict[str, Any]], leg: dict[str, Any],
                 planner: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """Every goal of issue #52, each the worst case over its leg's configurations (a row that failed has no figure,
    so its goal has none); ``planner``: the planner leg's groups (:func:`benchmarks._context_parallel_regret.
    planner_group`), none where the run has no planner leg."""
    mine = ours(rows)
    goal_network = network_name(GOAL_RATE_MBIT)
    goals = [
        worst_case(ACTIVATION, {config_name(row): row.get("activation_excess") for row in mine},
                   note="figure: saved bytes over cp=1's minus 1/cp"),
        longest_goal(leg),
        worst_case(EFFICIENCY, {config_name(row): row.get("efficiency") for row in mine
                                if row["network"] == goal_network}),
        worst_case(LOSS, {config_name(row): row.get("loss_max_rel_diff") for row in mine}),
    ]
    regret = (regret_goal(PLANNER_REGRET, planner) if planner
              else not_measured(PLANNER_REGRET, "this run has no planner leg (no planner_sequences)"))
    return goals + [regret, not_measured(VARIABLE_SPEEDUP, MEASURED_ELSEWHERE[VARIABLE_SPEEDUP.key])]


def longest_goal(leg: dict[str, Any]) -> dict[str, Any]:
    """:data:`LONGEST` from the ladder leg: worst of the methods; no figure where the run has no cp=4 cluster."""
    if leg["cp"] != LONGEST_CP:
        ratios = ", ".join(f"{method} {value:.3g}" for method, value in leg.get("ratio", {}).items()) or "-"
        return not_measured(LONGEST, f"this run's largest cp is {leg['cp']}, not {LONGEST_CP}: its ladder (from "
                                     f"{leg['start']}) gives {ratios}")
    if "error" in leg:
        return worst_case(LONGEST, {f"cp{LONGEST_CP} {method}": None for method in CONTEXT_METHODS},
                          note=leg["error"])
    top = f"; {', '.join(leg['at_top'])} reached the ladder's top {leg['top']} (a lower bound)" if leg["at_top"] else ""
    note = (f"longest within {leg['cap_mib']:.1f} MiB: "
            + ", ".join(f"{method} {seq}" for method, seq in leg["longest"].items()) + top)
    return worst_case(LONGEST, {f"cp{LONGEST_CP} {method}": leg["ratio"][method] for method in CONTEXT_METHODS},
                      note=note)


def failures(rows: Sequence[dict[str, Any]], leg: dict[str, Any], planner: Sequence[dict[str, Any]] = ()) -> list[str]:
    """What makes the command fail: every row, ladder or planner-leg job that errored (a baseline refusing this
    machine does not, nor a layout the planner refuses for memory)."""
    failed = [f"{config_name(row)}: {row['error']}" for row in rows if row.get("error")]
    if "error" in leg:
        failed.append(f"longest-sequence ladder: {leg['error']}")
    return failed + group_failures(planner)


# Driver ------------------------------------------------------------------------------------


COLUMNS = ["cluster", "network", "method", "cp", "seq", "step_ms", "saved_mib", "activation_ratio", "ideal_ratio",
           "efficiency", "loss_max_rel_diff", "status"]


def printable(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows with a short status (refusals and errors are printed in full below the table)."""
    return [{**row, "status": "refused" if row.get("refused") else ("error" if row.get("error") else "ok")}
            for row in rows]


PLANNER_CHOICES = ("both", "goal-link", "off")


def planner_setting(setting: Setting, choice: str) -> Setting:
    """``setting`` with the planner leg on both links, on the goal link only, or off (``--planner``)."""
    if choice == "off":
        return replace(setting, planner_sequences=())
    return setting if choice == "both" else replace(setting, planner_rates=(GOAL_RATE_MBIT,))


PLANNER_COLUMNS = ["network", "seq", "layout", "batch_replicas", "predicted_step_ms", "predicted_rank",
                   "measured_step_ms", "measured_rank", "status"]


def print_planner_leg(groups: Sequence[dict[str, Any]]) -> None:
    """Per plan: each layout's predicted and measured step and rank, then the choice, the regret and agreement."""
    if not groups:
        return
    print(f"\nPlanner leg: context_parallel='auto' on {groups[0]['batch']} ranks, predicted vs measured (merak3d)")
    report.print_table([{**row, "network": group["network"], "seq": group["seq"],
                         "status": "refused" if row.get("refused") else ("error" if row.get("error") else "ok")}
                        for group in groups for row in group["candidates"]], PLANNER_COLUMNS)
    def number(value: Optional[float], scale: float = 1.0, form: str = ".2f") -> str:
        return "-" if value is None else format(scale * value, form)

    for group in groups:
        print(f"  seq {group['seq']} {group['network']}: planner chose {group.get('chosen', '-')} (planning "
              f"{number(group.get('plan_s'), form='.0f')} s), fastest measured {group.get('best_measured', '-')}, "
              f"regret {number(group.get('regret'), 100, '+.1f')}%, Spearman {number(group.get('spearman'))}, "
              f"Kendall {number(group.get('kendall_tau_b'))}" + (f"; error: {group['error']}" if group.get("error")
                                                                  else ""))


def planner_record(groups: Sequence[dict[str, Any]], setting: Setting) -> dict[str, Any]:
    """The planner leg for the JSON: what it runs and its groups."""
    return {"world_size": setting.ladder_cp, "global_batch": setting.ladder_cp,
            "sequences": list(setting.planner_sequences),
            "networks": [network_name(rate) for rate in setting.planner_rates if setting.planner_sequences],
            "steps": setting.planner_steps, "warmup": setting.warmup, "rounds": setting.planner_rounds,
            "strategy": "Merak3DStrategy(context_parallel='auto', plan_only=True) plans; each layout it weighs "
                        "trains with Merak3DStrategy(context_parallel=cp, context_attention=method), every other "
                        "option at its default",
            "predicted_step": "the planner's time per sample x the global batch (it prices each layout at the "
                              "batch its planning read: the whole global batch per replica)",
            "groups": list(groups)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Benchmark entry point; exit 0 when every row and the ladder ran, 1 otherwise, 2 when the host cannot emulate
    the network."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="cp 2 only, sequences 1024 and 2048 (about 4 minutes)")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=report.out_help("context_parallel"))
    parser.add_argument("--planner", choices=PLANNER_CHOICES, default="both",
                        help="the planner leg's links: both (default), the goal link (10 Gbit/s) only, or off "
                             "(not for a full run joining the goal's runs: with --out or --quick); a full run took 20 "
                             "minutes on an idle 2-core machine, the planner leg about 12 of them")
    parser.add_argument("--leg", choices=("all", "variable"), default="all",
                        help="variable: only the per-sample context-parallel degree leg (variable_cp_speedup; "
                             "4 ranks on loopback, written as context_parallel_variable)")
    args = parser.parse_args(argv)
    if args.leg == "variable":
        return variable_leg(VARIABLE_SPEEDUP, args.quick, args.out, RANK_ENV, REPO_ROOT)
    if args.planner != "both" and not (args.quick or args.smoke or args.out):
        parser.error(f"--planner {args.planner} leaves links out of the planner_cp_regret leg, so this run would join "
                     "the goal's full runs with a smaller leg than theirs; run the whole leg, or write it elsewhere "
                     "with --out PATH (or --quick)")
    setting = planner_setting(SMOKE if args.smoke else QUICK if args.quick else FULL, args.planner)
    out = args.out or (Path(tempfile.gettempdir()) / "context_parallel.smoke.json" if args.smoke else None)
    workload = WORKLOAD
    check_setting(setting, workload)
    if not emulation_available():
        return 2
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    print(f"{workload.describe()}; cp {setting.context_parallel}, sequences {setting.sequences}, {setting.steps} "
          f"steps ({setting.warmup} warm-up); emulated links {RATES_MBIT} Mbit/s", flush=True)
    rows: list[dict[str, Any]] = []
    ladders: list[Union[dict[str, Any], str]] = []
    planner: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="merak-context-parallel-") as work:
        for world_size in setting.context_parallel:
            share = core_share(world_size)
            for rate in RATES_MBIT:
                network = network_name(rate)
                jobs = plan_jobs(setting, world_size, rate)
                run_started = time.monotonic()
                outcomes = run_cluster(world_size, rate, jobs, workload, setting, Path(work))
                for index, job in enumerate(jobs):
                    outcome = outcomes[index]
                    if job.method == LADDER:
                        ladders.append(outcome if isinstance(outcome, str) else outcome[0])
                    elif job.method not in PLANNED:
                        rows.append(job_row(world_size, network, share, job, outcome, setting.warmup))
                planner += [planner_group(network, plan_job, plan, trained, setting.warmup)
                            for plan_job, plan, trained in split_outcomes(jobs, outcomes)]
                failed = sum(1 for outcome in outcomes.values() if isinstance(outcome, str))
                print(f"  {world_size} ranks, {network}: {len(jobs)} jobs"
                      + (f", {failed} failed" if failed else "") + f" ({time.monotonic() - run_started:.0f} s)",
                      flush=True)
    compare(rows)
    leg = longest_sequence_leg(rows, ladders, setting)
    goals = goal_figures(rows, leg, planner)

    print(f"\nContext parallelism vs cp=1 (emulated network, measured; {workload.describe()})")
    report.print_table(printable(rows), COLUMNS)
    for message in dict.fromkeys(row.get("refused") or row.get("error") for row in rows):
        if message:
            print(f"  {'refused' if any(row.get('refused') == message for row in rows) else 'error'}: {message}")
    if "ratio" in leg:
        print(f"longest sequence within {leg['cap_rule']} ({leg['cap_mib']:.1f} MiB), cp={leg['cp']}: "
              + ", ".join(f"{method} {seq}" for method, seq in leg["longest"].items()))
    print_planner_leg(planner)
    print_goals(goals)
    wall_s = round(time.monotonic() - started, 1)
    written = write_run(
        "context_parallel", rows, "emulated", goals, quick=args.quick or args.smoke, out=out,
        benchmark="context_parallel", backend="gloo", threads_per_rank=1, rank_env=RANK_ENV,
        workload=asdict(workload), workload_description=workload.describe(), setting=asdict(setting),
        smoke=args.smoke, baseline="cp=1: transformers' default sdpa attention on rank 0 of the cluster alone (the "
        "cluster's CPU share per rank), no context parallelism; torch's experimental context_parallel as a second "
        "baseline where it runs",
        rank_cpu={n: emulation_record(device_per_rank_quota(n), n) for n in setting.context_parallel},
        longest_sequence_leg=leg, planner_leg=planner_record(planner, setting),
        network_note="tbf rate shaping on veth links; no latency emulation (no sch_netem)",
        gpu_leg="not run: this benchmark's runs are CPU/gloo on an emulated network", wall_s=wall_s,
        load_average={"start": load_at_start, "end": os.getloadavg()[0]},
    )
    print(f"wrote {written} in {wall_s:.0f} s")
    failed = failures(rows, leg, planner)
    for line in failed:
        print(f"context_parallel: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
