"""The single-GPU leg of ``benchmarks.moe_families`` (ep=1, one process, CUDA).

Per family and dtype: a training step (forward and backward) of the unswapped model with
transformers' eager expert loop, with its default experts implementation (the model built without
``experts_implementation``; the one transformers picked is recorded), and with ours
(``merak_grouped``, the dropless grouped core), timed with ``torch.cuda.synchronize``; plus
ours' largest output difference from the eager loop. Each family routes as it does (its experts and
top-k) at its own width proportions (:func:`~lightning_merak.plugins.moe.experts.family_widths`), as the CPU
leg's goal workload. Imports torch, transformers and the
experts package only (no DeepSpeed, no Hydra), so it runs on a bare GPU machine.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import torch

from lightning_merak.plugins.moe.experts import enable_grouped_experts, family_widths, tiny_moe_model


def _step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(model: torch.nn.Module, ids: torch.Tensor, warmup: int, steps: int, device: str) -> float:
    for _ in range(warmup):
        _step(model, ids)
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        _step(model, ids)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_gpu(families: list[str], quick: bool, device: str = "cuda",
            size: tuple[int, int, int] | None = None, repeats: tuple[int, int] | None = None
            ) -> list[dict[str, Any]]:
    """One row per (family, dtype); a failure is a row with its error.

    ``size`` is (hidden, batch, sequence), ``repeats`` (warm-up, timed steps); ``device="cpu"`` only checks the
    path here.
    """
    hidden, batch, seq = size or ((256, 4, 128) if quick else (1024, 8, 512))
    warmup, steps = repeats or ((2, 5) if quick else (3, 20))
    rows = []
    for family in families:
        for dtype in (torch.bfloat16, torch.float32):
            row: dict[str, Any] = {"family": family, "dtype": str(dtype).removeprefix("torch."), "hidden": hidden}
            try:
                row["widths"] = family_widths(family, hidden)
                default = tiny_moe_model(family, hidden=hidden, layers=2, vocab=1024, dtype=dtype,
                                         intermediate="family", routing="family",
                                         experts_implementation=None).to(device)
                row["default_implementation"] = default.config._experts_implementation
                ids = torch.randint(0, 1024, (batch, seq), device=device,
                                    generator=torch.Generator(device).manual_seed(0))
                base = copy.deepcopy(default)
                base.set_experts_implementation("eager")
                ours = copy.deepcopy(base)
                enable_grouped_experts(ours)
                row["output_diff_vs_eager"] = (_step(ours, ids) - _step(base, ids)).abs().max().item()
                row["step_ms"] = {"ours": _time(ours, ids, warmup, steps, device)}
                for name, model in (("eager", base), ("default", default)):
                    try:  # a baseline that fails here (e.g. no kernel for this dtype) is noted, not fatal
                        row["step_ms"][name] = _time(model, ids, warmup, steps, device)
                        row[f"speedup_vs_{name}"] = row["step_ms"][name] / row["step_ms"]["ours"]
                    except Exception as error:
                        row[f"{name}_error"] = f"{type(error).__name__}: {error}"
                        row[f"speedup_vs_{name}"] = None
                del base, default, ours
                if device == "cuda":
                    torch.cuda.empty_cache()
            except Exception as error:  # one family failing is a failed row
                row["error"] = f"{type(error).__name__}: {error}"
            rows.append(row)
    return rows
