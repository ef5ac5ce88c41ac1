"""benchmarks.merak3d's heavy-head leg, simulated: AutoPipe with and without the LM head split over the stages.

The node costs are the ones the benchmark measures on its heavy-head Llama (vocabulary 32k, 8 blocks), made
less noisy and scaled: every block takes the median block's measured cost, the head's (and the embedding's
backward, a dense gradient of the whole table) time, parameters and saved bytes grow with the vocabulary, and
the trunk gets 8 or 16 blocks. Each row is AutoPipe's split simulated under 1F1B with ``2 × stages``
micro-batches; ``max_over_mean_stage_time`` is the worst stage's forward+backward over the mean, and
``memory_max_over_mean`` the fullest stage's estimated peak bytes (AutoPipe's memory model: parameters,
gradients and optimizer state, activations of the micro-batches in flight) over the mean.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from itertools import product
from typing import Any

from benchmarks.goals import Goal, worst_case
from lightning_merak.parallel import pipeline

MEASURED_VOCAB = 32000
VOCABS, LAYERS, STAGES = (32000, 128000), (8, 16), (2, 4, 8, 16)
ISSUE = 54
SPEEDUP_VOCAB, SPEEDUP_STAGES, SPEEDUP_MICRO_BATCHES = 128000, 4, 8
SPEEDUP_DESCRIPTION = (f"heavy-head llama at vocab {SPEEDUP_VOCAB}, pp={SPEEDUP_STAGES}, {SPEEDUP_MICRO_BATCHES} "
                       "micro-batches, 1F1B, 4 gloo ranks under a CPU quota of half a core each")

HEAVY_HEAD = Goal(
    "heavy_head_max_over_mean", 1.10, "<=",
    "[sim] worst stage's forward+backward over the mean stage's under AutoPipe with vocab_stages, on the heavy-head "
    "llama's measured node costs (hidden 128) scaled to vocab 32k/128k and 8/16 blocks, pp 2/4/8/16, 2 x pp "
    "micro-batches; worst row", issue=ISSUE)
STAGE_MEMORY = Goal(
    "stage_memory_max_over_mean", 1.15, "<=",
    "[sim] fullest stage's estimated peak bytes (AutoPipe's memory model: parameters, gradients, AdamW state, 1F1B's "
    "micro-batches in flight) over the mean with vocab_stages, same grid as heavy_head_max_over_mean; worst row",
    issue=ISSUE)
SPEEDUP = Goal(
    "vocab_stages_speedup", 1.4, ">=",
    "tokens/s of merak3d pp=4 AutoPipe with vocab_stages='on' over AutoPipe alone (vocab_stages='off'), the "
    "median after warm-up of the slowest rank's step; llama hidden 128, 8 layers, vocab 128k, seq 64, global batch "
    "16, 8 micro-batches, 1F1B, 4 gloo ranks under a CPU quota of half a core each", issue=ISSUE)
LOSS = Goal(
    "vocab_stages_loss_max_rel_diff", 1e-5, "<=",
    "largest relative difference of the logged per-step loss with vocab_stages='on' from the same run with "
    "vocab_stages='off' (same batches and seed); worst of the measured pp=2 and pp=4 legs", issue=ISSUE)


def scaled_costs(costs: list[pipeline.BlockCost], layers: int, vocab: int) -> list[pipeline.BlockCost]:
    """The measured ``[prefix, blocks…, suffix]`` costs with ``layers`` median blocks and a ``vocab``-row head."""
    prefix, blocks, suffix = costs[0], costs[1:-1], costs[-1]
    median = sorted(blocks, key=lambda block: block.forward_s + block.resolved_backward_s())[len(blocks) // 2]
    factor = vocab / MEASURED_VOCAB
    return [
        replace(prefix, backward_s=prefix.backward_s * factor, param_bytes=int(prefix.param_bytes * factor)),
        *(replace(median, name=f"model.layers.{index}") for index in range(layers)),
        replace(suffix, forward_s=suffix.forward_s * factor, backward_s=suffix.backward_s * factor,
                param_bytes=int(suffix.param_bytes * factor), saved_bytes=int(suffix.saved_bytes * factor)),
    ]


def max_over_mean(values: Sequence[float]) -> float:
    """The largest of ``values`` over their mean."""
    return max(values) / (sum(values) / len(values))


def max_over_mean_stage_time(partition: pipeline.Partition) -> float:
    """The worst stage's forward+backward time over the mean stage's."""
    return max_over_mean([f + b for f, b in zip(partition.stage_forward_s, partition.stage_backward_s)])


def simulated_rows(costs: list[pipeline.BlockCost]) -> list[dict[str, Any]]:
    """One row per (vocabulary, blocks, stages) with fewer stages than blocks: AutoPipe alone and with the split."""
    rows = []
    for vocab, layers, stages in product(VOCABS, LAYERS, STAGES):
        if stages > layers:
            continue
        scaled, micro_batches = scaled_costs(costs, layers, vocab), 2 * stages
        row: dict[str, Any] = {"section": "vocab_stages", "label": "simulated", "vocab": vocab, "layers": layers,
                               "stages": stages, "micro_batches": micro_batches}
        for key, split in (("autopipe", False), ("vocab_stages", True)):
            partition = pipeline.partition_autopipe(scaled, stages, micro_batches, vocab_stages=split)
            simulated = pipeline.simulate_schedule(partition.stage_forward_s, partition.stage_backward_s,
                                                   micro_batches, "1f1b")
            memory = partition.stage_memory_bytes or (0,)
            row.update({f"{key}_boundaries": list(partition.boundaries),
                        f"{key}_max_over_mean": max_over_mean_stage_time(partition),
                        f"{key}_memory_max_over_mean": max_over_mean(memory),
                        f"{key}_iteration_ms": simulated.iteration_s * 1e3})
        row["simulated_speedup"] = row["autopipe_iteration_ms"] / row["vocab_stages_iteration_ms"]
        rows.append(row)
    return rows


def heavy_head_max_over_mean(rows: list[dict[str, Any]]) -> float:
    """The goal figure: the worst stage over the mean with the split, worst case over the simulated rows."""
    return max(row["vocab_stages_max_over_mean"] for row in rows)


def timeline(costs: list[pipeline.BlockCost], stages: int) -> pipeline.SimulationResult:
    """The simulated 1F1B iteration of AutoPipe's split with the head over the stages, on the measured costs."""
    partition = pipeline.partition_autopipe(costs, stages, 2 * stages, vocab_stages=True)
    return pipeline.simulate_schedule(partition.stage_forward_s, partition.stage_backward_s, 2 * stages, "1f1b")


def measured_rows(run: Callable[[str, dict[str, Any], int, dict[str, Any]], dict[str, Any]],
                  pp2_autopipe: dict[str, Any], heavy_head: dict[str, Any], pp2_micro_batches: int
                  ) -> list[dict[str, Any]]:
    """Measured steps with the vocabulary split against AutoPipe alone: pp=2 on the heavy-head model (its AutoPipe
    run, ``pp2_autopipe``, is the benchmark's balance run) and pp=4 at vocabulary 128k.

    ``run(label, workload, stages, merak_kwargs)`` trains one configuration on ``stages`` fresh ranks."""
    legs = []
    pp2 = {"data_parallel": 1, "pipeline_parallel": 2, "micro_batches": pp2_micro_batches, "partition": "autopipe"}
    legs.append((heavy_head, 2, pp2_autopipe, run("pp=2 autopipe vocab_stages=on", heavy_head, 2,
                                                   {**pp2, "vocab_stages": "on"})))
    wide = {**heavy_head, "vocab": SPEEDUP_VOCAB}
    pp4 = {"data_parallel": 1, "pipeline_parallel": SPEEDUP_STAGES, "micro_batches": SPEEDUP_MICRO_BATCHES,
           "partition": "autopipe"}
    legs.append((wide, SPEEDUP_STAGES, run("pp=4 autopipe", wide, SPEEDUP_STAGES, pp4),
                 run("pp=4 autopipe vocab_stages=on", wide, SPEEDUP_STAGES, {**pp4, "vocab_stages": "on"})))
    rows = []
    for workload, stages, off, on in legs:
        pair = []
        for name, outcome in (("off", off), ("on", on)):
            ranks = outcome.get("ranks")
            pair.append({"section": "vocab_stages_measured", "label": "measured", "vocab": workload["vocab"],
                         "stages": stages, "vocab_stages": name,
                         "boundaries": ranks[0].get("boundaries") if ranks else None,
                         "step_ms": outcome["step_s"] * 1e3 if ranks else None,
                         "tokens_per_s": outcome.get("tokens_per_s"), "losses": outcome.get("losses"),
                         "error": outcome.get("error")})
        (off_row, on_row) = pair
        if off_row["tokens_per_s"] and on_row["tokens_per_s"]:
            on_row["vs_autopipe"] = on_row["tokens_per_s"] / off_row["tokens_per_s"]
            on_row["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(on_row["losses"], off_row["losses"]))
        rows += pair
    return rows


def goal_figures(simulated: list[dict[str, Any]], measured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 54's goals for one run: the simulated grid's worst rows and the measured legs'."""
    def grid(key: str) -> dict[str, float]:
        return {f"vocab{row['vocab']}/layers{row['layers']}/pp{row['stages']}": row[key] for row in simulated}

    split = [row for row in measured if row["vocab_stages"] == "on"]
    return [
        worst_case(HEAVY_HEAD, grid("vocab_stages_max_over_mean"), note="simulated"),
        worst_case(STAGE_MEMORY, grid("vocab_stages_memory_max_over_mean"), note="simulated"),
        worst_case(SPEEDUP, {f"vocab{row['vocab']}/pp{row['stages']}": row.get("vs_autopipe")
                             for row in split if row["stages"] == SPEEDUP_STAGES}),
        worst_case(LOSS, {f"vocab{row['vocab']}/pp{row['stages']}": row.get("loss_max_rel_diff") for row in split}),
    ]
