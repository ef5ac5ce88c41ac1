"""The variable-length leg of ``python -m benchmarks.context_parallel --leg variable``: a context-parallel degree per
sample against fixed degrees, on 4 ranks (one device per rank emulated by CPU quotas, loopback gloo).

Every global batch is a long-tailed length mix (:class:`Mix`: most samples short, a few long). Each mode trains the
same batches from the same seed with the same model (:data:`benchmarks._context_parallel_ranks.WORKLOAD`'s Llama,
context parallelism installed over the 4 ranks, ring attention) through
:class:`~lightning_merak.parallel.context.rounds.RoundRunner`, the rounds merak3d's
``context_parallel_degree='per_micro_batch'`` runs:

* **fixed k** (k in 1, 2, 4): every sample split over ``k`` ranks (k = 4: the context parallelism a fixed degree
  runs; k = 1: plain data parallelism inside the group, only where the longest sample fits the per-rank token cap);
  samples dealt to the ``4 / k`` subgroups longest first to the least loaded;
* **per_micro_batch**: :func:`~lightning_merak.parallel.context.variable.plan_context_degrees` chooses each
  sample's degree under the same cap, on the cost model merak3d measures by default
  (:func:`~lightning_merak.parallel.context.rounds.measure_degree_cost`: each rank times one forward and backward
  per calibration length alone and split over the 4; rank 0's fit is used everywhere);
* **per_micro_batch shape cost** (its own row, not the goal's): the same on the model shape's FLOP ratios, nothing
  measured (:data:`SHAPE_COST`).

Each step (forward, backward, one flat gradient all-reduce, AdamW) is timed on every rank after a barrier; a step's
time is its slowest rank's. Per mode and run: the median over the steps after warm-up. The runs repeat every mode,
every other run in reverse order; ``variable_cp_speedup`` = the best fixed mode's step over the per-sample mode's,
worst over the runs.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

from benchmarks._context_parallel_ranks import RANK_TIMEOUT_S, Workload, rank_file

Mode = Union[int, str]
PER_SAMPLE = "per_micro_batch"
SHAPE_COST = "per_micro_batch shape cost"
"""The per-sample mode planned on the model shape's FLOP ratios
(:meth:`~lightning_merak.parallel.context.variable.DegreeCost.from_shape`) instead of the cost merak3d measures: a
labelled row beside the goal's, what planning without a measurement gives."""


@dataclass(frozen=True)
class Mix:
    """``short`` samples of uniform lengths in ``short_range`` (both ends included) and ``long`` samples of
    ``long_length`` tokens per global batch; ``token_cap``: the tokens one rank may hold."""

    short: int = 30
    short_range: tuple[int, int] = (256, 1024)
    long: int = 2
    long_length: int = 8192
    token_cap: int = 4096

    def batches(self, steps: int, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        batches = []
        for _ in range(steps):
            lengths = [int(n) for n in rng.integers(self.short_range[0], self.short_range[1] + 1, self.short)]
            lengths += [self.long_length] * self.long
            batches.append([lengths[i] for i in rng.permutation(len(lengths))])
        return batches

    def describe(self) -> str:
        return (f"{self.short} samples of {self.short_range[0]}-{self.short_range[1]} tokens and {self.long} of "
                f"{self.long_length} per global batch, cap {self.token_cap} tokens per rank")


@dataclass(frozen=True)
class VariableSetting:
    """What one run of the leg measures: the mix, the steps per mode (``warmup`` of them not timed), the runs of
    every mode, on ``world_size`` ranks."""

    mix: Mix
    steps: int
    warmup: int
    runs: int
    world_size: int = 4
    timeout_s: float = 3600.0


VARIABLE_FULL = VariableSetting(Mix(), steps=4, warmup=1, runs=3)
VARIABLE_QUICK = VariableSetting(Mix(short=14, short_range=(128, 512), long=2, long_length=2048, token_cap=1024),
                                 steps=2, warmup=1, runs=1, timeout_s=900.0)


def measured_modes(setting: VariableSetting) -> list[Mode]:
    """Every mode a run trains: :func:`modes` and the per-sample mode on the shape's cost model."""
    return [*modes(setting), SHAPE_COST]


def modes(setting: VariableSetting) -> list[Mode]:
    """The fixed degrees the cap allows (the longest sample's share fits it), then the per-sample mode."""
    mix, size = setting.mix, setting.world_size
    fixed = [k for k in range(1, size + 1) if size % k == 0 and -(-mix.long_length // k) <= mix.token_cap]
    return [*fixed, PER_SAMPLE]


# On each rank -----------------------------------------------------------------------------


def _step(runner: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, plan: Any, tokens: torch.Tensor,
          lengths: list[int], size: int) -> tuple[float, float]:
    """One training step of ``plan``; ``(seconds of the slowest rank, the global batch's token-mean loss)``."""
    rounds = plan.replicas[0]
    targets = sum(length - 1 for length in lengths)
    dist.barrier()
    start = time.perf_counter()
    share = runner.run(rounds, tokens, lengths, targets,
                       lambda loss, degree: (loss * (size * len(rounds) / degree)).backward())
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat)
    flat /= size * len(rounds)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    seconds = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    dist.all_reduce(share)
    return float(seconds), float(share)


def rank_main(workload: Workload, setting: VariableSetting, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    from lightning_merak.parallel.context.model import install_context_parallel
    from lightning_merak.parallel.context.rounds import RoundRunner, context_subgroups, measure_degree_cost
    from lightning_merak.parallel.context.variable import DegreeCost, plan_context_degrees
    from lightning_merak.parallel.layout import Layout, LayoutGroups

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=RANK_TIMEOUT_S))
    try:
        layout = Layout(data_parallel=size, pipeline_parallel=1, tensor_parallel=1, virtual_stages=1,
                        schedule="1f1b", micro_batches=1, micro_batches_by_default=True, tp_overlap=1,
                        recompute="none", recompute_ratio=0.0, context_parallel=size)
        groups = LayoutGroups.create(layout, "cpu")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(workload.config())
        install_context_parallel(model, groups.context_group, "ring")
        runner = RoundRunner(model.forward, context_subgroups(groups))
        cost = measure_degree_cost(runner, model, size, setting.mix.token_cap, workload.vocab, torch.device("cpu"))
        shape_cost = DegreeCost.from_shape(workload.hidden, workload.vocab)
        batches = setting.mix.batches(setting.steps, seed=1)
        generator = torch.Generator().manual_seed(2)
        tokens = [torch.randint(workload.vocab, (len(lengths), max(lengths)), generator=generator)
                  for lengths in batches]
        results: list[dict[str, Any]] = []
        initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        for run in range(setting.runs):
            order = measured_modes(setting) if run % 2 == 0 else measured_modes(setting)[::-1]
            for mode in order:
                model.load_state_dict(initial)  # every mode trains the same model on the same batches
                optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr)
                steps, losses, degrees = [], [], []
                for lengths, batch in zip(batches, tokens):
                    plan = (plan_context_degrees(lengths, 1, size, shape_cost, setting.mix.token_cap, PER_SAMPLE)
                            if mode == SHAPE_COST else
                            plan_context_degrees(lengths, 1, size, cost, setting.mix.token_cap, mode))
                    seconds, loss = _step(runner, model, optimizer, plan, batch, lengths, size)
                    steps.append(seconds)
                    losses.append(loss)
                    degrees.append(sorted(plan.degrees))
                results.append({"run": run, "mode": mode, "steps_s": steps, "losses": losses,
                                "step_s": statistics.median(steps[setting.warmup:]),
                                "degrees": {str(k): degrees[0].count(k) for k in sorted(set(degrees[0]))}})
        if rank == 0:
            with rank_file(out, rank).open("w") as file:
                json.dump({"cost": asdict(cost), "results": results}, file)
    finally:
        dist.destroy_process_group()


# The driver ---------------------------------------------------------------------------------


def speedup_by_run(results: Sequence[dict[str, Any]], mode: str = PER_SAMPLE) -> dict[str, float]:
    """Per run: the best fixed mode's step over ``mode``'s (the per-sample mode's)."""
    figures = {}
    for run in sorted({row["run"] for row in results}):
        rows = [row for row in results if row["run"] == run]
        fixed = min(row["step_s"] for row in rows if isinstance(row["mode"], int))
        (mine,) = [row["step_s"] for row in rows if row["mode"] == mode]
        figures[f"run{run}"] = fixed / mine
    return figures


def run_leg(workload: Workload, setting: VariableSetting, work: Path, rank_env: dict[str, str],
            repo_root: Path) -> Union[dict[str, Any], str]:
    """Run the leg on a loopback cluster (a CPU quota per rank where there are more ranks than cores); its record,
    or the error."""
    from benchmarks import report
    from lightning_merak.testing.cpu_quota import device_per_rank_quota
    from lightning_merak.testing.netem import LoopbackCluster, RankFailure, RankTimeout

    spec = work / "variable.json"
    spec.write_text(json.dumps({"workload": asdict(workload), "setting": asdict(setting)}))
    out = work / "variable-results.json"
    try:
        with LoopbackCluster(setting.world_size, cpu_quota=device_per_rank_quota(setting.world_size)) as cluster:
            cluster.run([sys.executable, "-m", "benchmarks._context_parallel_variable", str(spec), str(out)],
                        timeout_s=setting.timeout_s, extra_env=rank_env, cwd=repo_root)
    except (RankFailure, RankTimeout) as failure:
        return report.rank_failure_line(failure)
    return json.loads(rank_file(out, 0).read_text())


def leg_main(goal: Any, quick: bool, out: Optional[Path], rank_env: dict[str, str], repo_root: Path) -> int:
    """``--leg variable``: run the leg, print each mode's steps and the goal, write the run as
    ``context_parallel_variable`` (:func:`benchmarks.goals.write_run`); exit 1 when the leg failed."""
    import tempfile

    from benchmarks import report
    from benchmarks.goals import print_goals, worst_case, write_run
    from lightning_merak.testing.cpu_quota import device_per_rank_quota, emulation_record

    setting, workload = VARIABLE_QUICK if quick else VARIABLE_FULL, Workload()
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    print(f"{workload.describe()}; {setting.mix.describe()}; modes {measured_modes(setting)}, {setting.steps} steps "
          f"({setting.warmup} warm-up), {setting.runs} runs on {setting.world_size} ranks", flush=True)
    with tempfile.TemporaryDirectory(prefix="merak-variable-cp-") as work:
        record = run_leg(workload, setting, Path(work), rank_env, repo_root)
    rows = [] if isinstance(record, str) else [
        {key: row[key] for key in ("run", "mode", "step_s", "degrees")} for row in record["results"]]
    report.print_table(rows, ["run", "mode", "step_s", "degrees"])
    by_run = {} if isinstance(record, str) else speedup_by_run(record["results"])
    goals = [worst_case(goal, by_run or {"leg": None})]
    print_goals(goals)
    shape_cost_by_run = {} if isinstance(record, str) else speedup_by_run(record["results"], SHAPE_COST)
    if shape_cost_by_run:
        print(f"{SHAPE_COST}: best fixed step over its step, worst run {min(shape_cost_by_run.values()):.3g}")
    wall_s = round(time.monotonic() - started, 1)
    written = write_run(
        "context_parallel_variable", rows, "emulated", goals, quick=quick, out=out, benchmark="context_parallel",
        leg="variable", backend="gloo", threads_per_rank=1, rank_env=rank_env, workload=asdict(workload),
        workload_description=workload.describe(), setting=asdict(setting), mix=setting.mix.describe(),
        record=record, baseline="the fastest fixed context-parallel degree among those the cap allows",
        shape_cost_speedup_by_run=shape_cost_by_run,
        rank_cpu=emulation_record(device_per_rank_quota(setting.world_size), setting.world_size), wall_s=wall_s,
        load_average={"start": load_at_start, "end": os.getloadavg()[0]})
    print(f"wrote {written} in {wall_s:.0f} s")
    if isinstance(record, str):
        print(f"context_parallel --leg variable: {record}", file=sys.stderr)
        return 1
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m benchmarks._context_parallel_variable SPEC OUT``: one rank of the leg (:func:`run_leg` starts
    them), ``SPEC`` the JSON of the workload and the setting."""
    spec_path, out = argv if argv is not None else sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    setting = spec["setting"]
    mix = Mix(**{**setting["mix"], "short_range": tuple(setting["mix"]["short_range"])})
    rank_main(Workload(**spec["workload"]), VariableSetting(**{**setting, "mix": mix}), Path(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
