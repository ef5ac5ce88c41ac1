"""Quantized fine-tuning benchmark: QLoRA vs PEFT's QA-LoRA vs Q-BaRA vs QA-HiRA, before and after merging.

``python -m benchmarks.adapters [--quick] [--leg all|accuracy|layouts] [--out PATH] [--device cpu|cuda]``

1. A small Llama-architecture model is pretrained here on a generated language (counting and copying
   sequences) and cached under ``benchmarks/results/cache/``.
2. For each downstream task (majority digit, maximum word, minimum word — none seen in
   pretraining), each method and each seed, the base is quantized, the adapter trained for the same
   number of steps at the same learning rate, and answer accuracy measured on held-out examples.
3. Each adapter is then merged into the low-precision model and accuracy measured again.

Methods (trainable parameters are reported; they match LoRA-r exactly for Q-BaRA and within a few
percent for QA-LoRA; QA-HiRA's per-layer count is d_in*d_out/(lambda_in*lambda_out), 1.125x here):

* ``qlora``: PEFT LoRA on a bitsandbytes NF4 + double-quant base; merged by re-quantizing (lossy).
* ``qalora_peft``: PEFT's own QA-LoRA code (``use_qalora``). PEFT only dispatches it for GPTQ layers
  (gptqmodel, not installed, no CPU kernels here) and *silently ignores* it on bnb and float bases, so it
  runs on the project INT4 base (also asymmetric, block-wise) through LoRA's custom-module API wrapping
  ``GPTQLoraLinear``. PEFT raises NotImplementedError on its merge, so no merged accuracy.
* ``qbara``: Q-BaRA (lambda=2, rank 2r) on NF4; merged by re-quantizing (lossy).
* ``qahira``: QA-HiRA (lambda_in = INT4 group size) on the project INT4 base; merged exactly.

All numbers are measured on this machine (label ``measured``); the memory column on CPU is computed
(weights + adapters + Adam state) because CPU torch has no peak-allocation counter.

The layout leg (``--leg layouts``, :mod:`benchmarks._adapters_layouts`) trains QLoRA, Q-BaRA and QA-HiRA against
LoRA on the float base under merak3d at tp2, pp2 and dp2 ``full`` and reports per-rank model state and step time;
its goal ``quantised_adapter_memory_ratio`` (quantised over float, per rank, worst layout) is <= 0.4 (issue 53).
Each leg has its own results file: the accuracy leg ``results/adapters[.quick].json``, the layout leg
``results/adapters_layouts[.quick].json`` (a full run also ``results/runs/adapters_layouts.K.json``, its goal taken
over the runs by :func:`benchmarks.goals.write_run`). ``--out`` names the file of the leg run alone; with both legs
it names the accuracy leg's, and the layout leg's takes the same name with ``_layouts`` after its first part.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.gptq import GPTQLoraLinear
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.report import default_out, out_help, print_table, write_json
from lightning_merak.adapters import QAHiRAConfig, QBaRAConfig, QuantLinearInt4, quantize_model

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ_LEN = 16
DIGITS = range(0, 10)
WORDS = range(10, 48)
SEP = 48
VOCAB = 64


@dataclass(frozen=True)
class Setting:
    """Sizes of one benchmark leg."""

    hidden: int
    layers: int
    pretrain_steps: int
    finetune_steps: int
    seeds: tuple[int, ...]
    tasks: tuple[str, ...]
    r: int = 4
    group_size: int = 16
    batch: int = 32
    eval_examples: int = 512

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden, intermediate_size=2 * self.hidden, num_hidden_layers=self.layers,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ_LEN,
        )


QUICK = Setting(
    hidden=128, layers=2, pretrain_steps=600, finetune_steps=100, seeds=(0, 1), tasks=("majority", "max"),
    eval_examples=256,
)
LAYOUT_QUICK = {"hidden": 128, "layers": 4, "steps": 6, "r": 4}
LAYOUT_FULL = {"hidden": 256, "layers": 4, "steps": 12, "r": 8}
"""The layout leg's Llama (intermediate 4x hidden, 4 heads, 2 key/value heads) and run."""
FULL = Setting(
    hidden=128, layers=2, pretrain_steps=600, finetune_steps=300, seeds=(0, 1, 2), tasks=("majority", "max", "min")
)


# ---------------------------------------------------------------- generated data


def pretraining_batch(batch: int, generator: torch.Generator) -> torch.Tensor:
    """Counting sequences over words and digit strings copied after a separator."""
    half = batch // 2
    start = torch.randint(0, len(WORDS), (half, 1), generator=generator)
    step = torch.randint(1, 4, (half, 1), generator=generator)
    counting = WORDS.start + (start + step * torch.arange(SEQ_LEN)) % len(WORDS)
    source = torch.randint(0, 10, (batch - half, SEQ_LEN // 2 - 1), generator=generator)
    separator = torch.full((batch - half, 1), SEP)
    copying = torch.cat([source, separator, source, torch.full((batch - half, 1), SEP)], dim=1)
    return torch.cat([counting, copying])


def task_examples(task: str, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` sequences ``x_1 .. x_14 SEP answer`` of a task the base never saw."""
    body = SEQ_LEN - 2
    if task == "majority":
        tokens = torch.randint(0, 10, (count, body), generator=generator)
        counts = F.one_hot(tokens, 10).sum(dim=1) + torch.arange(10) * 1e-3  # ties go to the larger digit
        answer = counts.argmax(dim=1)
    elif task == "max":
        tokens = WORDS.start + torch.randint(0, len(WORDS), (count, body), generator=generator)
        answer = tokens.max(dim=1).values
    elif task == "min":
        tokens = WORDS.start + torch.randint(0, len(WORDS), (count, body), generator=generator)
        answer = tokens.min(dim=1).values
    else:
        raise ValueError(f"unknown task {task!r}")
    return torch.cat([tokens, torch.full((count, 1), SEP), answer.unsqueeze(1)], dim=1)


def answer_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits[:, -1]
    return F.cross_entropy(logits.float(), batch[:, -1])


@torch.no_grad()
def accuracy(model: torch.nn.Module, examples: torch.Tensor) -> float:
    logits = model(input_ids=examples[:, :-1]).logits[:, -1]
    return (logits.argmax(dim=-1) == examples[:, -1]).float().mean().item()


# ---------------------------------------------------------------- base model


def pretrained_base(setting: Setting, device: torch.device) -> dict[str, torch.Tensor]:
    """Pretrain the float base once per setting and cache its weights."""
    cache = RESULTS / "cache" / f"adapters_base_h{setting.hidden}_l{setting.layers}_s{setting.pretrain_steps}.pt"
    if cache.exists():
        return torch.load(cache, weights_only=True)
    torch.manual_seed(1234)
    model = LlamaForCausalLM(setting.llama_config()).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1234)
    for _ in range(setting.pretrain_steps):
        batch = pretraining_batch(64, generator).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"pretrained base: final LM loss {loss.item():.3f} -> {cache}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.save(state, cache)
    return state


# ---------------------------------------------------------------- methods


def parity_ranks(setting: Setting, base: torch.nn.Module) -> dict[str, int]:
    """QA-LoRA rank per module kind giving LoRA-r's parameter count: r(d_in+d_out) / (d_in/G + d_out)."""
    layer = base.model.layers[0]
    modules = {**dict(layer.self_attn.named_children()), **dict(layer.mlp.named_children())}
    return {
        name: max(
            1,
            round(
                setting.r * (m.in_features + m.out_features) / (m.in_features // setting.group_size + m.out_features)
            ),
        )
        for name, m in modules.items()
        if name in TARGETS
    }


def wrap_qlora(setting: Setting, base: torch.nn.Module) -> torch.nn.Module:
    quantize_model(base, "nf4", double_quant=True)
    return get_peft_model(base, LoraConfig(r=setting.r, lora_alpha=2 * setting.r, target_modules=TARGETS))


def wrap_qalora_peft(setting: Setting, base: torch.nn.Module) -> torch.nn.Module:
    config = LoraConfig(
        r=setting.r, lora_alpha=2 * setting.r, target_modules=TARGETS, rank_pattern=parity_ranks(setting, base),
        use_qalora=True, qalora_group_size=setting.group_size,
    )
    config._register_custom_module({QuantLinearInt4: GPTQLoraLinear})
    quantize_model(base, "int4", group_size=setting.group_size)
    return get_peft_model(base, config)


def wrap_qbara(setting: Setting, base: torch.nn.Module) -> torch.nn.Module:
    quantize_model(base, "nf4", double_quant=True)
    config = QBaRAConfig(r=setting.r, alpha=2 * setting.r, lambda_in=2, lambda_out=2, target_modules=TARGETS)
    return get_peft_model(base, config)


def wrap_qahira(setting: Setting, base: torch.nn.Module) -> torch.nn.Module:
    quantize_model(base, "int4", group_size=setting.group_size)
    config = QAHiRAConfig(
        r=setting.r, alpha=2 * setting.r, lambda_in=setting.group_size, lambda_out=1, target_modules=TARGETS
    )
    return get_peft_model(base, config)


METHODS: dict[str, tuple[Callable[[Setting, torch.nn.Module], torch.nn.Module], str]] = {
    "qlora": (wrap_qlora, "re-quantize NF4 (lossy)"),
    "qalora_peft": (wrap_qalora_peft, "none (PEFT raises NotImplementedError)"),
    "qbara": (wrap_qbara, "re-quantize NF4 (lossy)"),
    "qahira": (wrap_qahira, "zero-point shift INT4 (exact)"),
}


# Adam learning rate per method, picked by ``--tune``: accuracy on a *validation* set of the "max" task
# (examples drawn from another seed than the reported test set), seed 0, 100 steps; results in
# results/adapters_lr_sweep.json. One shared rate is
# unfair here: the mean pool scales QA-HiRA's update by 1/lambda_in, so it needs a larger rate.
LEARNING_RATES = {"qlora": 3e-3, "qalora_peft": 1e-2, "qbara": 3e-3, "qahira": 3e-2}
SWEEP_RATES = (1e-3, 3e-3, 1e-2, 3e-2)
TEST_SEED, VALIDATION_SEED = 99, 98


def static_memory_mb(model: torch.nn.Module) -> float:
    """Weights and buffers as stored, plus two fp32 Adam moments per trainable parameter."""
    stored = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    adam = sum(2 * 4 * p.numel() for p in model.parameters() if p.requires_grad)
    return (stored + adam) / 2**20


def run_one(
    setting: Setting,
    method: str,
    task: str,
    seed: int,
    base_state: dict,
    device: torch.device,
    lr: float,
    eval_seed: int = TEST_SEED,
) -> dict:
    wrap, merge_kind = METHODS[method]
    torch.manual_seed(seed)
    base = LlamaForCausalLM(setting.llama_config())
    base.load_state_dict(base_state)
    model = wrap(setting, base.to(device))
    train_generator = torch.Generator().manual_seed(10_000 + seed)
    eval_examples = task_examples(task, setting.eval_examples, torch.Generator().manual_seed(eval_seed)).to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    step_times = []
    for _ in range(setting.finetune_steps):
        batch = task_examples(task, setting.batch, train_generator).to(device)
        started = time.perf_counter()
        loss = answer_loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - started)
    memory_mb = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else static_memory_mb(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Evaluate in train mode: bitsandbytes' CPU eval path repacks weights and computes in bf16.
    adapted_accuracy = accuracy(model, eval_examples)
    merged_accuracy = None
    if method != "qalora_peft":
        merged = model.merge_and_unload()
        merged_accuracy = accuracy(merged, eval_examples)
    return {
        "method": method,
        "task": task,
        "seed": seed,
        "lr": lr,
        "trainable": trainable,
        "accuracy": adapted_accuracy,
        "merged_accuracy": merged_accuracy,
        "merge": merge_kind,
        "step_ms": 1000 * statistics.median(step_times[5:]),
        "memory_mb": memory_mb,
        "final_loss": loss.item(),
    }


def tune(setting: Setting, base_state: dict, device: torch.device, out: Path) -> None:
    """Validation accuracy on "max" (seed 0, 100 steps) for every method and rate in SWEEP_RATES."""
    sweep = Setting(**{**setting.__dict__, "finetune_steps": 100, "eval_examples": 256})
    rows = [
        run_one(sweep, method, "max", 0, base_state, device, lr, eval_seed=VALIDATION_SEED)
        for method in METHODS
        for lr in SWEEP_RATES
    ]
    print_table(rows, ["method", "lr", "accuracy", "final_loss"])
    write_json(out, rows, label="measured", benchmark="adapters learning-rate sweep", device=str(device))


def mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.1f} ± {100 * spread:.1f}"


def summarize(rows: list[dict], setting: Setting) -> list[dict]:
    table = []
    for method in METHODS:
        for task in setting.tasks:
            runs = [r for r in rows if r["method"] == method and r["task"] == task]
            merged = [r["merged_accuracy"] for r in runs if r["merged_accuracy"] is not None]
            table.append({
                "method": method,
                "task": task,
                "trainable": runs[0]["trainable"],
                "acc %": mean_std([r["accuracy"] for r in runs]),
                "merged acc %": mean_std(merged),
                "step ms": round(statistics.mean(r["step_ms"] for r in runs), 1),
                "mem MB": round(statistics.mean(r["memory_mb"] for r in runs), 2),
            })
    return table


def main(argv: list[str] | None = None) -> int:
    """Exit status 1 when a layout of the layout leg failed (after its table and JSON), else 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="2 tasks x 2 seeds x 100 steps (under 5 minutes on 2 CPU cores)"
    )
    parser.add_argument("--out", type=Path, help=out_help("adapters") + "; the layout leg: adapters_layouts")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--tune", action="store_true", help="sweep each method's learning rate (validation set of the max task)"
    )
    parser.add_argument("--leg", choices=("all", "accuracy", "layouts"), default="all",
                        help="accuracy: the quantised fine-tuning tasks; layouts: per-rank memory and step time of "
                             "the quantised adapters at tp2, pp2 and dp2 full against LoRA on a float base")
    args = parser.parse_args(argv)
    layouts_out = args.out if args.leg == "layouts" else args.out and layouts_path(args.out)
    args.out = args.out or default_out("adapters", args.quick)
    setting = QUICK if args.quick else FULL
    device = torch.device(args.device)
    # One thread: on a shared 2-core machine, multi-threaded tiny matmuls are 10-30x slower and erratic.
    torch.set_num_threads(1)
    if args.tune:
        tune(setting, pretrained_base(setting, device), device, args.out.with_name("adapters_lr_sweep.json"))
        return 0
    if args.leg != "layouts":
        accuracy_leg(setting, device, args.quick, args.out)
    return 1 if args.leg != "accuracy" and layouts_leg(args.quick, layouts_out) else 0


def layouts_path(out: Path) -> Path:
    """The layout leg's file beside the accuracy leg's ``out``: ``_layouts`` after the name's first part."""
    stem, dot, rest = out.name.partition(".")
    return out.with_name(f"{stem}_layouts{dot}{rest}")


def accuracy_leg(setting: Setting, device: torch.device, quick: bool, out: Path) -> None:
    """Train every method on every task and seed, print the table and write ``out``."""
    started = time.perf_counter()
    base_state = pretrained_base(setting, device)
    rows = [
        run_one(setting, method, task, seed, base_state, device, LEARNING_RATES[method])
        for task in setting.tasks
        for method in METHODS
        for seed in setting.seeds
    ]
    table = summarize(rows, setting)
    print_table(table)
    chance = {"majority": 0.1, "max": 1 / len(WORDS), "min": 1 / len(WORDS)}
    print("chance accuracy: " + ", ".join(f"{t} {100 * chance[t]:.1f}%" for t in setting.tasks))
    wall = time.perf_counter() - started
    print(
        f"wall time {wall:.0f} s on {device}; memory: "
        f"{'peak CUDA allocation' if device.type == 'cuda' else 'computed static (weights+adapters+Adam)'}"
    )
    write_json(
        out,
        rows,
        label="measured",
        benchmark="adapters",
        quick=quick,
        device=str(device),
        setting=setting.__dict__,
        summary=table,
        wall_seconds=round(wall, 1),
        memory_column=(
            "peak CUDA allocation" if device.type == "cuda"
            else "computed: stored weights + buffers + 2x fp32 Adam state"
        ),
        notes=[
            "qalora_peft runs PEFT's QALoraLinearVariant on the project INT4 base via "
            "LoraConfig._register_custom_module"
            " (GPTQ/gptqmodel unavailable); PEFT silently ignores use_qalora on bitsandbytes and float bases",
            "evaluation runs in train mode (no dropout is used) because bitsandbytes' CPU eval path "
            "repacks 4-bit weights",
        ],
    )
    print(f"wrote {out}")


def layouts_leg(quick: bool, out: Path | None) -> list[str]:
    """Every layout and method on two CPU ranks (gloo, whatever ``--device`` says); writes ``adapters_layouts``
    (a full run: one more of its runs). The layouts that failed, each with its error (none refuses: all are
    merak3d's)."""
    from benchmarks._adapters_layouts import run_layouts
    from benchmarks.goals import print_goals, write_run

    started = time.perf_counter()
    size = LAYOUT_QUICK if quick else LAYOUT_FULL
    rows, goal = run_layouts(**size)
    print_table(rows)
    print_goals([goal])
    wall = time.perf_counter() - started
    print(f"layout leg: wall time {wall:.0f} s")
    written = write_run("adapters_layouts", rows, "measured", [goal], quick=quick, out=out,
                        benchmark="adapters layouts", layout_setting=size, wall_seconds=round(wall, 1),
                        memory_column="computed per rank: state dict tensors + gradients + optimizer state")
    print(f"wrote {written}")
    failed = [f"{row['layout']}: {row['error']}" for row in rows if "error" in row]
    for line in failed:
        print(f"adapters layouts: {line}", file=sys.stderr)
    return failed


if __name__ == "__main__":
    sys.exit(main())
