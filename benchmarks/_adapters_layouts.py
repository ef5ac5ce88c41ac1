"""The layout leg of ``python -m benchmarks.adapters``: quantised adapters against LoRA on a float base, per rank.

Each layout (``tp2``, ``pp2``, ``dp2_full``: merak3d at tensor, pipeline and fully sharded data parallelism, two
ranks) trains QLoRA (LoRA on NF4), Q-BaRA (NF4) and QA-HiRA (INT4) and LoRA on the float base, each the same Llama
blocks, built on meta and quantised by each rank after the split. Per rank it records the model state the rank
holds once training runs (its parameters and buffers with a 4-bit base's statistics, as its state dict holds
them, plus gradients and the optimizer's state: what a training step keeps besides activations, computed from the
tensors since CPU torch has no peak-allocation counter) and the median step time. ``quantised_adapter_memory_ratio``
is a quantised method's per-rank state over LoRA-on-float's at the same layout, worst rank, worst method and
layout. NF4 runs without double quantisation, which ``tensor_parallel > 1`` refuses (its statistics span the whole
weight), so every layout keeps the same base.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.goals import Goal

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel": 2},
    "pp2": {"pipeline_parallel": 2, "partition": "uniform"},
    "dp2_full": {"data_parallel": 2, "data_parallel_sharding": "full"},
}
"""Two ranks each; pp2's stages two blocks each, not AutoPipe's profiled split (whose cost differs per method)."""
METHODS = ("lora_float", "qlora_nf4", "qbara_nf4", "qahira_int4")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VOCAB, SEQ, BATCH = 64, 32, 8
MEMORY_RATIO = Goal(
    key="quantised_adapter_memory_ratio", target=0.4, direction="<=", issue=53,
    definition=("per-rank model state (weights and statistics, gradients, Adam state) of QLoRA (NF4), Q-BaRA (NF4) "
                "and QA-HiRA (INT4) over LoRA on the float base at the same layout (tp2, pp2, dp2 full), 4-layer "
                "Llama, worst rank, method and layout"))


def method_option(method: str, r: int) -> Any:
    """The ``adapter=`` option of ``method`` (all linear layers of the blocks adapted, rank ``r``)."""
    from lightning_merak.cli.options.adapter import (
        LoRAAdapterConfig,
        QAHiRAAdapterConfig,
        QBaRAAdapterConfig,
        Quantization,
    )

    if method == "lora_float":
        return LoRAAdapterConfig(r=r, quantization=Quantization.none, target_modules=list(TARGETS))
    if method == "qlora_nf4":
        return LoRAAdapterConfig(r=r, quantization=Quantization.nf4, double_quant=False, target_modules=list(TARGETS))
    if method == "qbara_nf4":
        return QBaRAAdapterConfig(r=r, quantization=Quantization.nf4, double_quant=False, target_modules=list(TARGETS))
    return QAHiRAAdapterConfig(r=r, quantization=Quantization.int4, group_size=32, lambda_in=32,
                               target_modules=list(TARGETS))


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> int:
    """What this rank holds of the model between steps: its state dict's tensors (a quantised base's codes and
    statistics included; shared storage counted once), gradients and optimizer state."""
    seen: set[int] = set()
    total = 0
    tensors = [value for value in module.state_dict(keep_vars=True).values() if isinstance(value, torch.Tensor)]
    tensors += [param.grad for param in module.parameters() if param.grad is not None]
    tensors += [value for optimizer in optimizers for entry in optimizer.state.values() for value in entry.values()
                if isinstance(value, torch.Tensor)]
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = local.untyped_storage().data_ptr() if local.numel() else id(local)
        if key not in seen:
            seen.add(key)
            total += _local_bytes(tensor)
    return total


class _Probe(pl.Callback):
    """Each step's wall time, and the rank's state after the last step (gradients still held)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.bytes = 0
        self._started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._started)
        if trainer.global_step >= trainer.max_steps:  # after the last step, its gradients not yet freed
            self.bytes = state_bytes(pl_module, trainer.strategy.optimizers)


def layout_rank(rank: int, world_size: int, layout: str, hidden: int, layers: int, steps: int, r: int
                ) -> list[dict[str, Any]]:
    """Every method at ``layout`` on this rank, one after another: its state bytes and median step time."""
    from lightning_merak.adapters.meta import attach_on_meta
    from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
    from lightning_merak.modules.config import ModelConfig
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    config = ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False})
    tokens = torch.randint(VOCAB, (steps * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    rows = []
    for method in METHODS:
        torch.manual_seed(0)
        factory: Callable[[], torch.nn.Module] = functools.partial(
            lambda name: attach_on_meta(method_option(name, r), build_causal_lm(config, vocab_size=VOCAB)), method)
        module = CausalLMModule(None, model_factory=factory)
        probe = _Probe()
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**LAYOUTS[layout], timeout_s=300),
            max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[probe])
        per_rank = BATCH // LAYOUTS[layout].get("data_parallel", 1)
        trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=per_rank))
        rows.append({"layout": layout, "method": method, "rank": rank, "state_mb": probe.bytes / 2**20,
                     "step_s": statistics.median(probe.times[2:] or probe.times)})
    return rows


def run_layouts(hidden: int, layers: int, steps: int, r: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every layout's rows (one per method and rank) and the memory goal's worst case over them."""
    from benchmarks.goals import worst_case
    from lightning_merak.testing import run_distributed

    rows: list[dict[str, Any]] = []
    by_config: dict[str, float | None] = {}
    for layout in LAYOUTS:
        try:
            results = run_distributed(layout_rank, 2, args=(layout, hidden, layers, steps, r), timeout_s=900)
        except Exception as error:  # a failed layout is a missing figure, never a dropped one
            by_config.update({f"{layout}/{method}": None for method in METHODS[1:]})
            rows.append({"layout": layout, "error": str(error).strip().splitlines()[-1]})
            continue
        layout_rows = [row for result in results for row in result]
        rows += layout_rows
        for method in METHODS[1:]:
            ratios = []
            for rank in range(2):
                mine = {row["method"]: row for row in layout_rows if row["rank"] == rank}
                ratios.append(mine[method]["state_mb"] / mine["lora_float"]["state_mb"])
            by_config[f"{layout}/{method}"] = max(ratios)
    return rows, worst_case(MEMORY_RATIO, by_config)
