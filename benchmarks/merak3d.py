"""merak3d against Lightning's own strategies on this CPU: throughput, stage balance, memory.

Run from the repo root::

    python -m benchmarks.merak3d [--quick] [--out PATH]

Every configuration trains a randomly initialised transformers Llama on 2 gloo ranks
(``lightning_merak.testing.run_distributed``: fresh rank processes, one torch thread
each) through an ordinary ``pl.Trainer(...).fit``. Step times are the slowest rank's,
warm-up steps excluded, median over the rest. Four sections:

1. *Throughput*: merak3d dp=2 / pp=2 / tp=2 against Lightning DDP, FSDPStrategy and
   ModelParallelStrategy (FSDP2 ``fully_shard`` over the data-parallel mesh) on one model.
   A strategy that cannot run here is reported with its exact error instead of a number.
2. *Stage balance* on a model whose LM head dominates (vocabulary >> hidden): one traced
   set of measured node costs, split by autopipe, uniform-by-layer and by-parameters for
   2 and 4 stages; max/mean stage time and the 1F1B simulator's bubble and iteration time
   (*simulated*). Then the real check: measured pp=2 steps with each partition.
3. *Peak memory per rank* for recompute none / full / stage_aware (pp=2, the uniform split,
   which does not depend on timings, so only recomputation differs): ``ru_maxrss`` of
   each rank, which includes the Python/torch baseline (reported beside it), and the bytes
   autograd saves for backward in one micro-batch's forward of each stage (parameters
   excluded, each storage counted once). Checkpointed blocks keep their input alive
   outside autograd's saved tensors, so ``full`` is undercounted by one hidden state per block.
4. *Memory cap*: each rank caps its own address space (``RLIMIT_AS``) at its baseline plus
   ``CAP_PARAM_MULTIPLE`` x the model's parameter bytes, after building the full model.
   DDP needs about 5x (parameters, gradients, two AdamW moments, gradient buckets) plus
   activations; merak3d pp=2 holds about half of that state per rank.
5. *LM head over the stages* (``vocab_stages``): AutoPipe with and without the head split over the stages,
   simulated on the measured costs scaled to vocabularies of 32k and 128k, 8 and 16 blocks, 2 to 16 stages
   (``benchmarks/_vocab_stages.py``; ``heavy_head_max_over_mean`` is the worst stage over the mean with the split,
   worst case), a second timeline picture, and measured steps with the split against AutoPipe alone: pp=2 on the
   heavy-head model, and pp=4 at vocabulary 128k (4 ranks, each under a fixed CPU quota of half a core:
   ``../shared/specs/measuring.md``), the ``vocab_stages_speedup`` goal.

All figures come from this machine (JSON label "measured"); simulator rows say "simulated".
A second process on the machine (tests, another benchmark) skews the timings.
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks import _vocab_stages
from benchmarks.goals import print_goals, write_run
from benchmarks.report import (
    default_out,
    error_line,
    out_help,
    print_table,
    proc_status_mb,
    saved_activation_bytes,
)
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig, OptimConfig
from lightning_merak.parallel import pipeline
from lightning_merak.parallel.pipeline.stage import RankStages
from lightning_merak.parallel.pipeline.trace import trace_model
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from lightning_merak.testing.cpu_quota import device_per_rank_quota, emulation_record
from lightning_merak.testing.distributed import DistributedRunError

REPO_ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
RANK_TIMEOUT_S = 240.0
PIPELINE_MICRO_BATCHES = 4
RECOMPUTE_PARTITION = "uniform"
"""The recompute runs use a split that does not depend on timings, so only recompute differs between them."""
CAP_PARAM_MULTIPLE = 5.5
MIB = 2**20


@dataclass(frozen=True)
class Workload:
    """A Llama and the batches it trains on (global batch, split over data-parallel ranks)."""

    hidden: int
    layers: int
    vocab: int
    seq: int
    global_batch: int

    def model_config(self) -> ModelConfig:
        heads = max(2, self.hidden // 32)
        return ModelConfig(name="llama", model_type="llama", config={
            "hidden_size": self.hidden, "intermediate_size": self.hidden * 8 // 3 // 8 * 8,
            "num_hidden_layers": self.layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "tie_word_embeddings": False,
        })

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    def describe(self) -> str:
        return (f"llama hidden {self.hidden}, {self.layers} layers, vocab {self.vocab}, "
                f"seq {self.seq}, global batch {self.global_batch}")


THROUGHPUT_MODEL = Workload(hidden=128, layers=4, vocab=2048, seq=64, global_batch=16)
HEAVY_HEAD_MODEL = Workload(hidden=128, layers=8, vocab=32000, seq=64, global_batch=16)
CAPPED_MODEL = Workload(hidden=512, layers=8, vocab=32000, seq=32, global_batch=4)


@dataclass(frozen=True)
class Job:
    """One configuration, run in its own pair of fresh rank processes."""

    strategy: str
    layout: str
    workload: Workload
    steps: int
    merak: dict[str, Any] = field(default_factory=dict)
    cap_param_multiple: float | None = None
    count_saved_activations: bool = False
    world_size: int = WORLD_SIZE
    """Ranks; more than the cores run under a fixed CPU quota each (one device per rank emulated)."""


@dataclass(frozen=True)
class Mode:
    """Step counts: ``warmup`` steps are dropped from every median."""

    warmup: int
    throughput_steps: int
    pipeline_steps: int
    capped_steps: int


QUICK = Mode(warmup=2, throughput_steps=6, pipeline_steps=5, capped_steps=3)
FULL = Mode(warmup=3, throughput_steps=20, pipeline_steps=12, capped_steps=4)


# Inside a rank ---------------------------------------------------------------------------


class FullyShardedLM(CausalLMModule):
    """The LM for ModelParallelStrategy: FSDP2 over its data-parallel mesh, per decoder layer then the root."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class _TokenData(pl.LightningDataModule):
    """Fixed random tokens; each data-parallel rank reads its slice of every global batch."""

    def __init__(self, workload: Workload, steps: int) -> None:
        super().__init__()
        self.workload, self.steps = workload, steps

    def train_dataloader(self) -> DataLoader:
        w = self.workload
        tokens = torch.randint(w.vocab, (self.steps, w.global_batch, w.seq), generator=torch.Generator().manual_seed(0))
        sampler = self.trainer.strategy.distributed_sampler_kwargs
        replicas, rank = sampler["num_replicas"], sampler["rank"]
        local = w.global_batch // replicas
        shard = tokens[:, rank * local:(rank + 1) * local].reshape(-1, w.seq)
        return DataLoader(TensorDataset(shard), batch_size=local, shuffle=False)


class _StepTimer(pl.Callback):
    """Wall time of each training batch, from its start hook to its end hook (optimizer step included)."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.losses: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.step_s.append(time.perf_counter() - self._start)
        loss = trainer.callback_metrics.get("train/loss")
        self.losses.append(float(loss) if loss is not None else float("nan"))


def _quiet_lightning() -> None:
    """Keep Lightning's banners and deprecation chatter out of the tables."""
    warnings.filterwarnings("ignore", module="lightning")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


def _make_strategy(job: Job) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    if job.strategy == "merak3d":
        return Merak3DStrategy(**job.merak, timeout_s=RANK_TIMEOUT_S)
    if job.strategy == "ddp":
        return DDPStrategy()
    if job.strategy == "fsdp":
        return FSDPStrategy()
    if job.strategy == "model_parallel":
        return ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1)
    raise ValueError(f"unknown strategy {job.strategy!r}")


REFUSING_BASELINES = {"fsdp"}
"""Baselines that refuse this machine (Lightning's FSDPStrategy needs a GPU): their error is the result."""


def _saved_activation_bytes(module: CausalLMModule, workload: Workload, micro_batches: int) -> int:
    """Bytes autograd saves for backward in one micro-batch's forward of this rank's stage (and loss).

    Parameters are left out and every storage counts once, so this is activation memory a
    stage holds per in-flight micro-batch.
    """
    stages = module.model
    assert isinstance(stages, RankStages) and len(stages) == 1, "one stage per rank (a non-interleaved schedule)"
    stage = stages[0]
    micro = workload.global_batch // micro_batches
    ids = torch.randint(workload.vocab, (micro, workload.seq))
    if stage.is_first:
        inputs: tuple[torch.Tensor, ...] = (ids,)
    else:
        inputs = (stage.trace.sample_hidden.clone().requires_grad_(True), *stage.trace.sample_side_tensors,
                  *(stage.trace.sample_skips[index] for index in stage.skips_in))

    def forward_and_loss() -> None:
        output = stage(*inputs)
        if stage.is_last:
            module.loss_from_logits(output, ids)

    stage.train()
    return saved_activation_bytes(forward_and_loss, stage.parameters())


def _run_rank(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """Train ``job`` on this rank; returns its step times and memory figures."""
    _quiet_lightning()
    baseline_rss_mb = proc_status_mb("VmRSS")
    baseline_vm_mb = proc_status_mb("VmSize")
    torch.manual_seed(0)
    model = build_causal_lm(job.workload.model_config(), job.workload.vocab)
    model.config.use_cache = False
    result: dict[str, Any] = {"baseline_rss_mb": baseline_rss_mb}
    if job.cap_param_multiple is not None:
        param_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
        cap = int(baseline_vm_mb * MIB + job.cap_param_multiple * param_bytes)
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
        result.update(cap_mb=cap / MIB, param_mb=param_bytes / MIB)
    module_class = FullyShardedLM if job.strategy == "model_parallel" else CausalLMModule
    module = module_class(model, OptimConfig(warmup_steps=1))
    timer = _StepTimer()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=_make_strategy(job), max_steps=job.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[timer],
    )
    trainer.fit(module, datamodule=_TokenData(job.workload, job.steps))
    strategy = trainer.strategy
    if isinstance(strategy, Merak3DStrategy) and strategy.partition is not None:
        result["boundaries"] = list(strategy.partition.boundaries)
    result.update(step_s=timer.step_s, losses=timer.losses,
                  max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  peak_vm_mb=proc_status_mb("VmPeak"))
    if job.count_saved_activations:
        assert isinstance(strategy, Merak3DStrategy)
        result["saved_mb"] = _saved_activation_bytes(module, job.workload, strategy.micro_batches) / MIB
    return result


# Driver ----------------------------------------------------------------------------------



def _rejected_before_launch(job: Job) -> str | None:
    """The error Lightning raises when building the Trainer for ``job``, if it does.

    Lightning checks a strategy against the accelerator in ``Trainer.__init__``, before any
    rank process exists, so such a configuration is reported without spawning ranks.
    """
    try:
        pl.Trainer(accelerator="cpu", devices=job.world_size, strategy=_make_strategy(job), logger=False,
                   enable_checkpointing=False, enable_progress_bar=False)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def run_job(job: Job, warmup: int) -> dict[str, Any]:
    """Run ``job`` on fresh ranks; per-rank results plus the median step, or the error that stopped it."""
    rejected = _rejected_before_launch(job)
    if rejected is not None:
        print(f"  {job.strategy} {job.layout}: rejected by pl.Trainer(...)", flush=True)
        return {"error": rejected}
    started = time.perf_counter()
    try:
        ranks = run_distributed(_run_rank, job.world_size, args=(job,), timeout_s=RANK_TIMEOUT_S, threads_per_rank=1,
                                cpu_quota=device_per_rank_quota(job.world_size))
    except DistributedRunError as error:
        print(f"  {job.strategy} {job.layout}: failed ({time.perf_counter() - started:.0f} s)", flush=True)
        return {"error": error_line(error)}
    slowest = [max(steps) for steps in zip(*(rank["step_s"] for rank in ranks))]
    timed = slowest[warmup:] or slowest
    step_s = statistics.median(timed)
    print(f"  {job.strategy} {job.layout}: {step_s * 1e3:.0f} ms/step ({time.perf_counter() - started:.0f} s)",
          flush=True)
    return {"ranks": ranks, "step_s": step_s, "timed_steps": len(timed),
            "tokens_per_s": job.workload.tokens_per_step / step_s, "losses": ranks[0]["losses"]}


def throughput(mode: Mode) -> list[dict[str, Any]]:
    """Tokens/s of every strategy on THROUGHPUT_MODEL, and its ratio to Lightning DDP."""
    steps, w = mode.throughput_steps, THROUGHPUT_MODEL
    jobs = [
        Job("merak3d", "dp=2", w, steps, merak={"data_parallel": 2}),
        Job("merak3d", f"pp=2 mb={PIPELINE_MICRO_BATCHES}", w, steps,
            merak={"data_parallel": 1, "pipeline_parallel": 2, "micro_batches": PIPELINE_MICRO_BATCHES}),
        Job("merak3d", "tp=2", w, steps, merak={"data_parallel": 1, "tensor_parallel": 2}),
        Job("ddp", "dp=2", w, steps),
        Job("fsdp", "dp=2 full shard", w, steps),
        Job("model_parallel", "fully_shard dp=2", w, steps),
    ]
    rows = []
    for job in jobs:
        outcome = run_job(job, mode.warmup)
        rows.append({
            "section": "throughput", "label": "measured", "strategy": job.strategy, "layout": job.layout,
            "tokens_per_s": outcome.get("tokens_per_s"),
            "step_ms": outcome["step_s"] * 1e3 if "step_s" in outcome else None,
            "max_rss_mb": max(rank["max_rss_mb"] for rank in outcome["ranks"]) if "ranks" in outcome else None,
            "timed_steps": outcome.get("timed_steps"), "error": outcome.get("error"),
        })
    ddp = next(row["tokens_per_s"] for row in rows if row["strategy"] == "ddp")
    for row in rows:
        row["vs_ddp"] = row["tokens_per_s"] / ddp if ddp and row["tokens_per_s"] else None
    return rows


def trace_heavy_head() -> list[pipeline.BlockCost]:
    """Measured per-node costs of HEAVY_HEAD_MODEL on one pipeline micro-batch, in this process."""
    w = HEAVY_HEAD_MODEL
    torch.manual_seed(0)
    model = build_causal_lm(w.model_config(), w.vocab)
    model.config.use_cache = False
    sample = torch.randint(w.vocab, (w.global_batch // PIPELINE_MICRO_BATCHES, w.seq))
    return trace_model(model, sample).costs


def balance(costs: list[pipeline.BlockCost], timeline_path: Path) -> list[dict[str, Any]]:
    """Each partitioner on the same measured costs, judged by max/mean stage time and the 1F1B simulator."""
    rows = []
    for stages in (2, 4):
        micro_batches = 2 * stages
        partitions = [
            pipeline.partition_autopipe(costs, stages, micro_batches),
            pipeline.partition_uniform(costs, stages),
            pipeline.partition_by_parameters(costs, stages),
        ]
        for partition in partitions:
            simulated = pipeline.simulate_schedule(partition.stage_forward_s, partition.stage_backward_s,
                                                   micro_batches, "1f1b")
            rows.append({
                "section": "balance", "label": "simulated", "stages": stages, "micro_batches": micro_batches,
                "partition": partition.method, "boundaries": list(partition.boundaries),
                "max_over_mean_stage_time": _vocab_stages.max_over_mean_stage_time(partition),
                "bubble_fraction": simulated.bubble_fraction, "iteration_ms": simulated.iteration_s * 1e3,
            })
            if partition.method == "autopipe" and stages == 4:
                pipeline.plot_timeline(simulated, timeline_path,
                                       title=f"autopipe, {stages} stages, {micro_batches} micro-batches (simulated)")
    return rows


def pipeline_runs(mode: Mode, same_as_uniform: bool) -> dict[tuple[str, str], dict[str, Any]]:
    """pp=2 on HEAVY_HEAD_MODEL: each partition without recompute, then RECOMPUTE_PARTITION with recomputation.

    ``partition="parameters"`` is not run again when its split (which, like uniform's, does
    not depend on timings) equals uniform's: it would be the same configuration.
    """
    w, steps = HEAVY_HEAD_MODEL, mode.pipeline_steps
    common = {"data_parallel": 1, "pipeline_parallel": 2, "micro_batches": PIPELINE_MICRO_BATCHES}
    configurations = [("autopipe", "none"), ("uniform", "none"), ("parameters", "none"),
                      (RECOMPUTE_PARTITION, "full"), (RECOMPUTE_PARTITION, "stage_aware")]
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for partition, recompute in configurations:
        if partition == "parameters" and same_as_uniform:
            runs[(partition, recompute)] = {**runs[("uniform", "none")], "note": "same split as uniform, not rerun"}
            continue
        job = Job("merak3d", f"pp=2 {partition} recompute={recompute}", w, steps,
                  merak={**common, "partition": partition, "recompute": recompute}, count_saved_activations=True)
        runs[(partition, recompute)] = run_job(job, mode.warmup)
    return runs


def _per_stage(outcome: dict[str, Any], key: str) -> list[Any] | None:
    return [rank[key] for rank in outcome["ranks"]] if "ranks" in outcome else None


def partition_rows(runs: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Measured pp=2 step time of each partition, relative to uniform."""
    rows = []
    for partition in ("autopipe", "uniform", "parameters"):
        outcome = runs[(partition, "none")]
        ranks = outcome.get("ranks")
        rows.append({
            "section": "balance_measured", "label": "measured", "stages": 2,
            "micro_batches": PIPELINE_MICRO_BATCHES, "partition": partition,
            "boundaries": ranks[0].get("boundaries") if ranks else None,
            "step_ms": outcome["step_s"] * 1e3 if ranks else None, "tokens_per_s": outcome.get("tokens_per_s"),
            "note": outcome.get("note"), "error": outcome.get("error"),
        })
    uniform = rows[1]["tokens_per_s"]
    for row in rows:
        row["vs_uniform"] = row["tokens_per_s"] / uniform if uniform and row["tokens_per_s"] else None
    return rows


def recompute_rows(runs: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Peak RSS per rank (= per stage at pp=2) and saved activations per micro-batch, per recompute mode."""
    rows = []
    for recompute in ("none", "full", "stage_aware"):
        outcome = runs[(RECOMPUTE_PARTITION, recompute)]
        rss, baseline, saved = (_per_stage(outcome, key) for key in ("max_rss_mb", "baseline_rss_mb", "saved_mb"))
        rows.append({
            "section": "recompute", "label": "measured", "partition": RECOMPUTE_PARTITION, "recompute": recompute,
            "boundaries": outcome["ranks"][0].get("boundaries") if "ranks" in outcome else None,
            "max_rss_mb_stage0": rss[0] if rss else None, "max_rss_mb_stage1": rss[1] if rss else None,
            "baseline_rss_mb": min(baseline) if baseline else None,
            "saved_mb_per_microbatch_stage0": saved[0] if saved else None,
            "saved_mb_per_microbatch_stage1": saved[1] if saved else None,
            "step_ms": outcome["step_s"] * 1e3 if rss else None, "error": outcome.get("error"),
        })
    return rows


def memory_cap(mode: Mode) -> list[dict[str, Any]]:
    """The same capped model under DDP and merak3d pp=2: which completes its steps."""
    w, steps = CAPPED_MODEL, mode.capped_steps
    jobs = [
        Job("ddp", "dp=2", w, steps, cap_param_multiple=CAP_PARAM_MULTIPLE),
        Job("merak3d", "pp=2 mb=2", w, steps, merak={"data_parallel": 1, "pipeline_parallel": 2, "micro_batches": 2},
            cap_param_multiple=CAP_PARAM_MULTIPLE),
    ]
    rows = []
    for job in jobs:
        outcome = run_job(job, warmup=1)
        ranks = outcome.get("ranks")
        rows.append({
            "section": "memory_cap", "label": "measured", "strategy": job.strategy, "layout": job.layout,
            "param_mb": ranks[0]["param_mb"] if ranks else None,
            "cap_mb_per_rank": [round(rank["cap_mb"]) for rank in ranks] if ranks else None,
            "peak_vm_mb_per_rank": [round(rank["peak_vm_mb"]) for rank in ranks] if ranks else None,
            "completed_steps": len(ranks[0]["step_s"]) if ranks else 0, "of_steps": steps,
            "error": outcome.get("error"),
        })
    return rows


TABLE_ERROR_CHARS = 90


def _print_section(title: str, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A titled table; long errors are cut here and kept whole in the JSON."""
    print(f"\n{title}")
    shown = []
    for row in rows:
        error = row.get("error")
        if error and len(error) > TABLE_ERROR_CHARS:
            row = {**row, "error": error[:TABLE_ERROR_CHARS] + "..."}
        shown.append(row)
    print_table(shown, columns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under 3 minutes on 2 cores)")
    parser.add_argument("--out", type=Path, help=out_help("merak3d"))
    args = parser.parse_args(argv)
    pictures = args.out or default_out("merak3d", args.quick)
    mode = QUICK if args.quick else FULL
    torch.set_num_threads(1)
    _quiet_lightning()
    started = time.perf_counter()
    timeline = pictures.with_name(f"{pictures.stem}_timeline.png")

    print(f"1. throughput: {THROUGHPUT_MODEL.describe()}, {WORLD_SIZE} gloo ranks", flush=True)
    throughput_table = throughput(mode)
    costs = trace_heavy_head()
    balance_table = balance(costs, timeline)
    uniform, by_parameters = (partition(costs, 2) for partition in (pipeline.partition_uniform,
                                                                   pipeline.partition_by_parameters))
    print(f"2./3. pipeline runs: {HEAVY_HEAD_MODEL.describe()}, pp=2, {PIPELINE_MICRO_BATCHES} micro-batches",
          flush=True)
    runs = pipeline_runs(mode, same_as_uniform=uniform.boundaries == by_parameters.boundaries)
    measured_balance = partition_rows(runs)
    recompute_table = recompute_rows(runs)
    vocab_measured = _vocab_stages.measured_rows(
        lambda label, workload, stages, merak: run_job(Job("merak3d", label, Workload(**workload), mode.pipeline_steps,
                                                           merak=merak, world_size=stages), mode.warmup),
        runs[("autopipe", "none")], asdict(HEAVY_HEAD_MODEL), PIPELINE_MICRO_BATCHES)
    print(f"5. LM head over the stages, measured: {_vocab_stages.SPEEDUP_DESCRIPTION}", flush=True)
    vocab_simulated = _vocab_stages.simulated_rows(costs)
    vocab_timeline = pictures.with_name(f"{pictures.stem}_timeline_vocab_stages.png")
    pipeline.plot_timeline(_vocab_stages.timeline(costs, 4), vocab_timeline,
                           title="autopipe + vocab_stages, 4 stages, 8 micro-batches (simulated)")
    print(f"4. memory cap: {CAPPED_MODEL.describe()}", flush=True)
    cap_table = memory_cap(mode)

    _print_section(f"Throughput (measured, {THROUGHPUT_MODEL.describe()})", throughput_table,
                   ["strategy", "layout", "tokens_per_s", "step_ms", "vs_ddp", "max_rss_mb", "error"])
    _print_section(f"Stage balance (simulated 1F1B over measured node costs, {HEAVY_HEAD_MODEL.describe()})",
                   balance_table, ["stages", "partition", "boundaries", "max_over_mean_stage_time",
                                   "bubble_fraction", "iteration_ms"])
    _print_section("Stage balance (measured, pp=2)", measured_balance,
                   ["partition", "boundaries", "step_ms", "tokens_per_s", "vs_uniform", "note", "error"])
    _print_section("LM head over the stages (simulated 1F1B, AutoPipe over measured costs scaled; "
                   "max_over_mean: worst stage / mean)", vocab_simulated,
                   ["vocab", "layers", "stages", "autopipe_max_over_mean", "vocab_stages_max_over_mean",
                    "autopipe_memory_max_over_mean", "vocab_stages_memory_max_over_mean", "simulated_speedup",
                    "vocab_stages_boundaries"])
    _print_section("LM head over the stages (measured; pp=4 under a CPU quota per rank)", vocab_measured,
                   ["vocab", "stages", "vocab_stages", "boundaries", "step_ms", "tokens_per_s", "vs_autopipe",
                    "loss_max_rel_diff", "error"])
    goals = _vocab_stages.goal_figures(vocab_simulated, vocab_measured)
    print_goals(goals)
    _print_section(f"Recompute, pp=2 {RECOMPUTE_PARTITION} (measured; RSS includes the baseline)", recompute_table,
                   ["recompute", "boundaries", "max_rss_mb_stage0", "max_rss_mb_stage1", "baseline_rss_mb",
                    "saved_mb_per_microbatch_stage0", "saved_mb_per_microbatch_stage1", "step_ms", "error"])
    _print_section(f"Memory cap: RLIMIT_AS = baseline + {CAP_PARAM_MULTIPLE} x parameter bytes per rank (measured)",
                   cap_table, ["strategy", "layout", "param_mb", "cap_mb_per_rank", "peak_vm_mb_per_rank",
                               "completed_steps", "of_steps", "error"])
    wall_s = time.perf_counter() - started
    out = write_run(
        "merak3d", [*throughput_table, *balance_table, *measured_balance, *recompute_table, *cap_table,
                    *vocab_simulated, *vocab_measured], "measured", goals, args.quick, args.out,
        vocab_stages_timeline_png=vocab_timeline.name,
        rank_cpu_pp4=emulation_record(device_per_rank_quota(4), 4),
        benchmark="merak3d", world_size=WORLD_SIZE, backend="gloo",
        threads_per_rank=1, warmup_steps=mode.warmup,
        workloads={"throughput": THROUGHPUT_MODEL.describe(), "heavy_head": HEAVY_HEAD_MODEL.describe(),
                   "memory_cap": CAPPED_MODEL.describe()},
        heavy_head_costs=[{"name": c.name, "forward_ms": c.forward_s * 1e3, "backward_ms": c.backward_s * 1e3,
                           "param_mb": c.param_bytes / MIB, "saved_mb": c.saved_bytes / MIB} for c in costs],
        cap_param_multiple=CAP_PARAM_MULTIPLE, timeline_png=timeline.name, wall_s=round(wall_s, 1),
    )
    print(f"\nwrote {out} and {timeline} in {wall_s:.0f} s")
    # a baseline refusing this machine, or DDP running out under the cap, is a result; any other error fails
    failed = [row for row in (*throughput_table, *measured_balance, *recompute_table, *cap_table, *vocab_measured)
              if row.get("error") and row.get("strategy") not in REFUSING_BASELINES
              and not (row.get("section") == "memory_cap" and row.get("strategy") != "merak3d")]
    for row in failed:
        print(f"merak3d: {row.get('section')} {row.get('strategy', row.get('partition', row.get('recompute')))} "
              f"failed: {row['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
