"""Variable-length micro-batches on merak3d: pad vs pack vs dynamic (DynaPipe) on a long-tailed multi-task mix.

Run from the repo root::

    python -m benchmarks.dynapipe [--quick] [--out PATH]

Samples come from the generated language with lengths from the five-task mix of
:data:`lightning_merak.parallel.micro_batching.TASK_MIX` (16 tokens to the context length, long-tailed). The same global
batches, in the same order, train a randomly initialised tiny Llama (eager attention, so packed documents
get their block-diagonal mask) through ``pl.Trainer.fit`` with ``merak3d`` at pp=2 (2 ranks) and dp=2 × pp=2
(4 ranks), once per mode:

* ``pad``: loader order, equal sample counts per micro-batch, padded to the micro-batch's longest;
* ``pack``: loader order packed first-fit into rows of the context length, documents kept apart;
* ``dynamic``: DynaPipe's DP over the length-sorted samples with a cost model fitted on this machine (one
  process timing forward+backward over a grid of rows × lengths), micro-batches balanced over replicas,
  under a token limit equal to pack's largest micro-batch (the same activation memory per micro-batch).

Per mode: real (non-padding) tokens per second over the measured steps (median step, warm-up excluded),
the padding fraction of the planned micro-batches, and the pipeline bubble: 1 − (time the stages spent in
forward/backward) / (stages × step time), measured by timing every micro-batch's forward and backward on
each rank. The pictures show one dynamic step's micro-batches (rows × padded length, real tokens shaded)
next to pad's and pack's, and the measured pipeline timeline of that step.

Goals (issue #23, each the worst layout of the run, :func:`benchmarks.goals.worst_case`): :data:`SPEEDUP_VS_PACK`
and :data:`SPEEDUP_VS_PAD`. A full run is written with :func:`benchmarks.goals.write_run` (a spread over the full
runs); ``--quick`` writes ``results/dynapipe.quick.json``. Every mode runs eager attention
(``attn_implementation="eager"``), not transformers' default sdpa; pack's rows, several documents each, take a dense
block-diagonal mask over the whole context-length row, which eager attention computes in full. The goals'
definitions say so.

All figures are measured on this machine (JSON label "measured"); other processes on the 2 shared cores
make step times noisy. A full run took 88 s on 2 shared cores (``wall_s`` of ``results/dynapipe.json``); the
settings allow up to 12 minutes. The GPU leg is not part of this script.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from benchmarks.goals import Goal, print_goals, worst_case, write_run
from benchmarks.report import default_out, out_help, print_table
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.modules.data import SyntheticLanguage
from lightning_merak.parallel.micro_batching import CostModel, StepPlan, plan_packed
from lightning_merak.parallel.micro_batching.plan import MicroBatch
from lightning_merak.parallel.micro_batching.samples import (
    global_batch_loader,
    micro_batch_tensors,
    summed_token_loss,
    synthetic_samples,
)
from lightning_merak.parallel.pipeline.simulate import ScheduledOp, SimulationResult
from lightning_merak.parallel.pipeline.timeline import plot_timeline
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed

MODES = ("pad", "pack", "dynamic")
VOCAB = 256
MODEL = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False, "attn_implementation": "eager"})
SETTINGS = {
    True: {"context": 512, "batch": 32, "warmup": 1, "measured": 2, "micro_batches": 4},
    False: {"context": 1024, "batch": 32, "warmup": 1, "measured": 3, "micro_batches": 4},
}
"""The context (longest sample) stays below the generator's 2048 so that ``pad``, which pays attention's square
on every padded row, finishes on 2 CPU cores within the time budget (quick ≤ 4 min, full ≤ 12 min)."""
LAYOUTS = ({"data_parallel": 1, "pipeline_parallel": 2}, {"data_parallel": 2, "pipeline_parallel": 2})
ATTENTION = MODEL.config["attn_implementation"]
WORKLOAD = (f"tiny Llama (hidden {MODEL.config['hidden_size']}, {MODEL.config['num_hidden_layers']} layers) with "
            f"{ATTENTION} attention in every mode (not transformers' default sdpa; pack's packed rows take a dense "
            f"block-diagonal mask), merak3d, {SETTINGS[False]['micro_batches']} micro-batches, "
            f"{SETTINGS[False]['batch']}-sample global batches of the five-task long-tailed mix up to "
            f"{SETTINGS[False]['context']} tokens; real tokens/s of the median step of the slowest rank after "
            "warm-up; worst of " + " and ".join(f"dp{layout['data_parallel']}-pp{layout['pipeline_parallel']}"
                                                for layout in LAYOUTS))
SPEEDUP_VS_PACK = Goal(
    "dynapipe_speedup_vs_pack_min", 1.3, ">=",
    f"micro_batching='dynamic' over 'pack' (packed first-fit into rows of the context length); {WORKLOAD}", issue=23)
SPEEDUP_VS_PAD = Goal(
    "dynapipe_speedup_vs_pad_min", 2.0, ">=",
    f"micro_batching='dynamic' over 'pad' (equal sample counts, padded to the longest); {WORKLOAD}", issue=23)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_causal_lm(MODEL, vocab_size=VOCAB)
    model.config.use_cache = False
    return model


def _samples(settings: dict[str, Any]) -> list[torch.Tensor]:
    language = SyntheticLanguage(VOCAB, 3, seed=7)
    count = settings["batch"] * (settings["warmup"] + settings["measured"])
    return synthetic_samples(language.sequence, count, seed=11, max_length=settings["context"])


def fit_cost_model(context: int) -> tuple[CostModel, list[tuple[int, int, float]]]:
    """Forward+backward seconds of the whole model over rows × lengths, fitted to ``a·t + b·t² + c`` per row."""
    torch.set_num_threads(1)
    model = _model()
    grid = [(rows, length) for rows in (1, 4) for length in (32, 128, 512, context) if rows * length <= 2 * context]
    measurements = []
    for rows, length in grid:
        tensors = micro_batch_tensors(_fake_batch(rows, length), MicroBatch(tuple((i,) for i in range(rows)), length))
        times = []
        for _ in range(3):
            start = time.perf_counter()
            summed_token_loss(model(tensors.input_ids).logits, tensors.labels).backward()
            times.append(time.perf_counter() - start)
        measurements.append((rows, length, min(times)))
    return CostModel.fit(measurements), measurements


def _fake_batch(rows: int, length: int) -> Any:
    from lightning_merak.parallel.micro_batching import VariableBatch

    return VariableBatch.of([torch.randint(VOCAB, (length,)) for _ in range(rows)])


class _Module(CausalLMModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)


class _Data(pl.LightningDataModule):
    def __init__(self, settings: dict[str, Any]) -> None:
        super().__init__()
        self.settings = settings

    def train_dataloader(self):
        return global_batch_loader(_samples(self.settings), self.settings["batch"], seed=0, shuffle=False)


class _Probe(pl.Callback):
    """Step times, losses, plans and, per micro-batch, when this rank's stage ran its forward and backward."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.steps: list[float] = []
        self.losses: list[float] = []
        self.busy: list[float] = []
        self.events: list[tuple[str, int, float, float]] = []
        self.last_events: list[tuple[str, int, float, float]] = []
        self.plan: StepPlan | None = None
        self.stage_index = 0
        self._start = 0.0

    def _wrap(self, stage: Any) -> None:
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
            original = getattr(stage, name)

            def timed(chunk: int, *args: Any, _original: Any = original, _kind: str = kind, **kwargs: Any) -> Any:
                begin = time.perf_counter()
                try:
                    return _original(chunk, *args, **kwargs)
                finally:
                    self.events.append((_kind, chunk, begin, time.perf_counter()))

            setattr(stage, name, timed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.strategy._pipeline
        if batch_idx == 0:
            self._wrap(step._stage)
            self.stage_index = step._stage.stage_index
        self.events = []
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        elapsed = time.perf_counter() - self._start
        self.losses.append(float(outputs["loss"]))
        if batch_idx >= self.warmup:
            self.steps.append(elapsed)
            self.busy.append(sum(end - begin for _, _, begin, end in self.events))
        self.plan = trainer.strategy._pipeline.last_plan
        self.last_events = [(kind, chunk, begin - self._start, end - self._start)
                            for kind, chunk, begin, end in self.events]


def pack_micro_batch_tokens(lengths_per_step: list[list[int]], layout: dict[str, int], settings: dict[str, Any]) -> int:
    """The padded tokens of pack's largest micro-batch over the run: dynamic gets the same memory per micro-batch."""
    return max(micro.padded_tokens for lengths in lengths_per_step
               for replica in plan_packed(lengths, layout["data_parallel"], settings["micro_batches"],
                                          settings["context"], layout["pipeline_parallel"]).replicas
               for micro in replica)


def _rank(rank: int, world_size: int, settings: dict[str, Any], layout: dict[str, int],
          cost: tuple[float, float, float], dynamic_tokens: int) -> dict[str, Any]:
    results = {}
    steps = settings["warmup"] + settings["measured"]
    for mode in MODES:
        tokens = dynamic_tokens if mode == "dynamic" else settings["context"]
        probe = _Probe(settings["warmup"])
        strategy = Merak3DStrategy(**layout, tensor_parallel=1, micro_batching=mode, micro_batch_tokens=tokens,
                                   micro_batching_cost=cost, micro_batches=settings["micro_batches"],
                                   timeout_s=300)
        trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                             callbacks=[probe])
        trainer.fit(_Module(_model()), datamodule=_Data(settings))
        results[mode] = {"steps": probe.steps, "losses": probe.losses, "busy": probe.busy, "plan": probe.plan,
                         "events": probe.last_events, "stage": probe.stage_index}
    return results


def _summarise(layout: dict[str, int], per_rank: list[dict[str, Any]], lengths_per_step: list[list[int]],
               settings: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    real_tokens = statistics.mean(sum(lengths) for lengths in lengths_per_step[settings["warmup"]:])
    stages = layout["pipeline_parallel"]
    for mode in MODES:
        slowest = [max(rank[mode]["steps"][i] for rank in per_rank) for i in range(settings["measured"])]
        step_s = statistics.median(slowest)
        bubbles = [1.0 - statistics.mean(rank[mode]["busy"]) / statistics.mean(slowest) for rank in per_rank]
        plan: StepPlan = per_rank[0][mode]["plan"]
        rows.append({
            "layout": f"dp{layout['data_parallel']}-pp{stages}", "mode": mode, "step_ms": 1e3 * step_s,
            "real_tokens_per_s": real_tokens / step_s,
            "padding_fraction": plan.padding_fraction(lengths_per_step[-1]),
            "bubble": statistics.mean(bubbles),
            "micro_batches_per_replica": [len(replica) for replica in plan.replicas],
            "losses": per_rank[0][mode]["losses"],
        })
    return rows


def speedups_by_layout(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per layout: dynamic's real tokens/s over pack's and over pad's."""
    speed = {(row["layout"], row["mode"]): row["real_tokens_per_s"] for row in rows}
    return {layout: {"vs_pack": speed[(layout, "dynamic")] / speed[(layout, "pack")],
                     "vs_pad": speed[(layout, "dynamic")] / speed[(layout, "pad")]}
            for layout in dict.fromkeys(row["layout"] for row in rows)}


def goal_figures(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Both goals, each the worst layout of this run's rows."""
    speedups = speedups_by_layout(rows)
    return [worst_case(SPEEDUP_VS_PACK, {layout: s["vs_pack"] for layout, s in speedups.items()}),
            worst_case(SPEEDUP_VS_PAD, {layout: s["vs_pad"] for layout, s in speedups.items()})]


def _plot_micro_batches(plans: dict[str, StepPlan], lengths: list[int], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 3.6))
    FigureCanvasAgg(figure)
    for column, (mode, plan) in enumerate(plans.items()):
        axes = figure.add_subplot(1, len(plans), column + 1)
        x = 0.0
        for replica, micro_batches in enumerate(plan.replicas):
            for micro in micro_batches:
                rows = len(micro.rows)
                axes.add_patch(_rectangle(x, 0, rows, micro.length, "#dddddd" if replica else "#cfd8e8"))
                for row, samples in enumerate(micro.rows):
                    axes.add_patch(_rectangle(x + row, 0, 1, sum(lengths[i] for i in samples),
                                              "#4c72b0" if replica == 0 else "#dd8452"))
                x += rows + 0.5
        axes.set_xlim(0, x)
        axes.set_ylim(0, max(mb.length for r in plan.replicas for mb in r) * 1.05)
        axes.set_title(f"{mode}: padding {plan.padding_fraction(lengths):.0%}", fontsize=9)
        axes.set_xlabel("rows (samples or packed rows), micro-batch after micro-batch", fontsize=7)
        axes.set_ylabel("tokens per row", fontsize=7)
    figure.suptitle("one global batch's micro-batches (colour = data-parallel replica; grey = padding)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=110)
    return path


def _rectangle(x: float, y: float, width: float, height: float, colour: str) -> Any:
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, facecolor=colour, edgecolor="white", linewidth=0.3)


def _timeline(per_rank: list[dict[str, Any]], mode: str) -> SimulationResult:
    ops = tuple(ScheduledOp(rank[mode]["stage"], chunk, kind, begin, end)
                for rank in per_rank for kind, chunk, begin, end in rank[mode]["events"])
    iteration = max(op.end_s for op in ops)
    stages = max(op.stage for op in ops) + 1
    busy = sum(op.duration_s for op in ops)
    return SimulationResult(iteration, ops, 0, (), 1.0 - busy / (stages * iteration))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="context 512, 32-sample batches, 2 measured steps")
    parser.add_argument("--out", type=Path, default=None, help=out_help("dynapipe"))
    args = parser.parse_args()
    settings = SETTINGS[args.quick]
    out = args.out or default_out("dynapipe", args.quick)
    started = time.perf_counter()
    cost, measurements = fit_cost_model(settings["context"])
    print(f"cost model fitted on this machine: {cost}")
    samples = _samples(settings)
    lengths = [len(sample) for sample in samples]
    batch = settings["batch"]
    lengths_per_step = [lengths[i:i + batch] for i in range(0, len(lengths), batch)]
    rows: list[dict[str, Any]] = []
    pictures: dict[str, str] = {}
    for layout in LAYOUTS:
        world_size = layout["data_parallel"] * layout["pipeline_parallel"]
        dynamic_tokens = pack_micro_batch_tokens(lengths_per_step, layout, settings)
        coefficients = (cost.per_token, cost.per_token_squared, cost.overhead)
        per_rank = run_distributed(_rank, world_size, args=(settings, layout, coefficients, dynamic_tokens),
                                   timeout_s=900)
        rows.extend({**row, "micro_batch_tokens": settings["context"] if row["mode"] != "dynamic" else dynamic_tokens}
                    for row in _summarise(layout, per_rank, lengths_per_step, settings))
        if layout["data_parallel"] == 1:
            stem = out.with_suffix("")
            plans = {mode: per_rank[0][mode]["plan"] for mode in MODES}
            pictures["micro_batches"] = str(_plot_micro_batches(plans, lengths_per_step[-1],
                                                                Path(f"{stem}_micro_batches.png")))
            pictures["timeline"] = str(plot_timeline(_timeline(per_rank, "dynamic"), Path(f"{stem}_timeline.png"),
                                                     title="dynamic, pp=2, one measured step"))
    by = {(row["layout"], row["mode"]): row for row in rows}
    loss_diff = max(abs(d - p) / abs(p) for layout in {row["layout"] for row in rows}
                    for d, p in zip(by[(layout, "dynamic")]["losses"], by[(layout, "pad")]["losses"]))
    goals = goal_figures(rows)
    print_table(rows, ["layout", "mode", "step_ms", "real_tokens_per_s", "padding_fraction", "bubble",
                       "micro_batches_per_replica"])
    path = write_run(
        "dynapipe", rows, "measured", goals, quick=args.quick, out=args.out,
        loss_max_rel_diff=loss_diff, speedups_by_layout=speedups_by_layout(rows), attention=ATTENTION,
        settings=settings, model=MODEL.config, task_mix="lightning_merak.parallel.micro_batching.TASK_MIX",
        cost_model={"per_token_s": cost.per_token, "per_token_squared_s": cost.per_token_squared,
                    "per_micro_batch_s": cost.overhead, "measurements": measurements},
        pictures=pictures, gpu_leg="not run by this script", wall_s=time.perf_counter() - started,
        note="2 shared CPU cores: step times are noisy; bubble from timed forward/backward calls per rank")
    print_goals(goals)
    print(f"loss max rel diff {loss_diff:.2e}; wrote {path}")


if __name__ == "__main__":
    main()
