"""fp8 training (``strategy.float8``) against bf16 on one GPU: the GPU leg of issue #51 item 4.

Run from the repo root, on a machine with one CUDA GPU of compute capability 8.9 or newer::

    python -m benchmarks.float8 [--quick] [--device cuda] [--out PATH] [--recipe rowwise|tensorwise]

One process trains a randomly initialised transformers Llama of about 1.1 billion parameters (hidden 2048, 16 layers,
intermediate 5632, 32 heads, vocab 32000; ``--quick``: 4 layers, 20 steps) in bf16 for 200 steps, then the same
model from the same seed with the blocks' linear layers in fp8 (:func:`lightning_merak.parallel.float8.
convert_blocks_to_float8`, the layers ``strategy.float8`` converts), both with their blocks compiled (regional
compile: torchao's casts are fused only when compiled), AdamW at a constant learning rate, on the same token
batches (sequence 2048, batch 4). Per row: tokens/s (median step after 10 warm-up steps, each step ended by
``torch.cuda.synchronize``) and the final loss (mean of the last 10 steps). Goals: :data:`SPEEDUP`, :data:`LOSS`.
There is no CPU leg (fp8 on CPU runs torch's reference kernel, which is not faster): without a CUDA device the
command says so, writes nothing and exits 3.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks import report
from benchmarks.goals import Goal, print_goals, worst_case, write_run

ISSUE = 51


@dataclass(frozen=True)
class Setting:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    vocab: int
    seq: int
    batch: int
    steps: int
    warmup: int


FULL = Setting(hidden=2048, layers=16, intermediate=5632, heads=32, vocab=32000, seq=2048, batch=4, steps=200,
               warmup=10)
QUICK = Setting(hidden=2048, layers=4, intermediate=5632, heads=32, vocab=32000, seq=2048, batch=4, steps=20,
                warmup=5)
SPEEDUP = Goal("float8_speedup", 1.25, ">=",
               "tokens/s of the fp8 run over the bf16 run, the median step after warm-up; Llama ~1.1B (hidden 2048, "
               "16 layers), seq 2048, batch 4, blocks compiled in both, one GPU", issue=ISSUE)
LOSS = Goal("float8_final_loss_rel_diff", 0.01, "<=",
            "relative difference of the fp8 run's final loss (mean of its last 10 steps) from the bf16 run's, after "
            "200 steps on the same batches from the same seed", issue=ISSUE)


def train(setting: Setting, recipe: Optional[str]) -> dict[str, Any]:
    """``setting``'s model trained on CUDA in bf16, with ``recipe``'s fp8 layers (None: bf16 throughout)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_merak.parallel.float8 import convert_blocks_to_float8
    from lightning_merak.parallel.regional_compile import compile_blocks

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=setting.hidden, intermediate_size=setting.intermediate,
                         num_hidden_layers=setting.layers, num_attention_heads=setting.heads,
                         num_key_value_heads=setting.heads, vocab_size=setting.vocab,
                         max_position_embeddings=setting.seq, use_cache=False)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).to("cuda")
    blocks = [(f"model.layers.{index}", block) for index, block in enumerate(model.model.layers)]
    converted = convert_blocks_to_float8(blocks, recipe) if recipe is not None else []
    compile_blocks(blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    tokens = torch.randint(setting.vocab, (setting.steps, setting.batch, setting.seq),
                           generator=torch.Generator().manual_seed(1))
    step_s, losses = [], []
    for batch in tokens:
        batch = batch.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))  # waits for the step
        torch.cuda.synchronize()
        step_s.append(time.perf_counter() - start)
    median = statistics.median(step_s[setting.warmup:])
    return {"recipe": recipe or "bf16", "converted_layers": len(converted),
            "parameters": sum(p.numel() for p in model.parameters()), "step_ms": 1e3 * median,
            "tokens_per_s": setting.batch * setting.seq / median, "final_loss": statistics.fmean(losses[-10:]),
            "losses": losses, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def main(argv: Optional[list[str]] = None) -> int:
    """Exit 0 when both rows ran, 1 when one failed, 3 without a CUDA device (nothing run)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 layers, 20 steps")
    parser.add_argument("--device", choices=("cuda",), default="cuda", help="the only leg: one CUDA GPU")
    parser.add_argument("--recipe", choices=("rowwise", "tensorwise"), default="rowwise")
    parser.add_argument("--out", type=Path, help=report.out_help("float8.gpu"))
    args = parser.parse_args(argv)
    import torch

    from lightning_merak.parallel.float8 import float8_problem

    if not torch.cuda.is_available():
        print("float8: no CUDA device here; the GPU leg was not run (there is no CPU leg)")
        return 3
    problem = float8_problem(args.recipe, torch.device("cuda"))
    if problem is not None:
        print(f"float8: {problem}; not run")
        return 3
    setting = QUICK if args.quick else FULL
    started = time.monotonic()
    rows = []
    for recipe in (None, args.recipe):
        try:
            rows.append(train(setting, recipe))
        except Exception as error:  # one failing row must not hide the other's figures
            rows.append({"recipe": recipe or "bf16", "error": report.error_line(error)})
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    bf16, fp8 = rows
    ran = "error" not in bf16 and "error" not in fp8
    goals = [worst_case(SPEEDUP, {args.recipe: fp8["tokens_per_s"] / bf16["tokens_per_s"] if ran else None}),
             worst_case(LOSS, {args.recipe: abs(fp8["final_loss"] - bf16["final_loss"]) / bf16["final_loss"]
                               if ran else None})]
    report.print_table([{k: v for k, v in row.items() if k != "losses"} for row in rows],
                       ["recipe", "converted_layers", "parameters", "step_ms", "tokens_per_s", "final_loss",
                        "peak_memory_gib", "error"])
    print_goals(goals)
    written = write_run("float8.gpu", rows, "measured", goals, quick=args.quick, out=args.out, benchmark="float8",
                        device=report.cuda_device_name(), setting=asdict(setting),
                        baseline="bf16 with the same compiled blocks, optimizer, batches and seed",
                        wall_s=round(time.monotonic() - started, 1))
    print(f"wrote {written}")
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main())
