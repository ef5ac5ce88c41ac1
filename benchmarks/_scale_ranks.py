"""What one rank of ``python -m benchmarks.scale`` runs: a few training steps or a pretrained load, with memory.

Each function here runs inside a fresh gloo rank (``run_distributed``) and returns plain
numbers. Memory is ``/proc/self/status``: ``VmRSS`` once everything the leg needs is imported
and before any model exists (the baseline), and ``VmHWM`` (the peak resident size) at the end.
"""

from __future__ import annotations

import logging
import re
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import transformers.models.llama.modeling_llama  # noqa: F401  (imported before the baseline, as the model needs it)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig

from benchmarks.merak3d import FullyShardedLM
from benchmarks.report import proc_status_mb, saved_activation_bytes
from lightning_merak.distributed.deepspeed_comm import init_deepspeed_comm
from lightning_merak.distributed.host_memory import heap_stats, heap_tunables_applied
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig

MIB = 2**20
RANK_TIMEOUT_S = 600.0
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class Workload:
    """A Llama built from its config (no download) and the token batches it trains on."""

    hidden: int
    layers: int
    vocab: int
    seq: int = 64
    global_batch: int = 4
    micro_batches: int = 2

    def config(self, tensor_parallel: int = 1) -> LlamaConfig:
        """The model's config; at ``tensor_parallel`` > 1, the part one tensor-parallel rank computes: its
        heads, its columns of the MLP and its rows of the vocabulary, at the full hidden width."""
        heads = max(2, self.hidden // 64)
        return LlamaConfig(hidden_size=self.hidden,
                           intermediate_size=self.hidden * 8 // 3 // 8 * 8 // tensor_parallel,
                           num_hidden_layers=self.layers, num_attention_heads=heads // tensor_parallel,
                           num_key_value_heads=heads // tensor_parallel, head_dim=self.hidden // heads,
                           vocab_size=self.vocab // tensor_parallel, max_position_embeddings=self.seq,
                           tie_word_embeddings=False, use_cache=False)

    def parameters(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(self.config()).parameters())

    def describe(self) -> str:
        return (f"llama hidden {self.hidden}, {self.layers} layers, vocab {self.vocab}, seq {self.seq}, "
                f"global batch {self.global_batch}")


@dataclass(frozen=True)
class Leg:
    """One layout of one strategy; ``merak`` holds Merak3DStrategy's degrees."""

    name: str
    strategy: str  # merak3d | ddp | fsdp2 | zero3
    world_size: int
    merak: Optional[dict[str, int]] = None
    accelerator: str = "cpu"  # "cuda": one process per GPU (the GPU leg)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric", "DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _tokens(workload: Workload, steps: int, rank: int, replicas: int) -> torch.Tensor:
    """This data-parallel rank's slice of every global batch: ``(steps * local batch, seq)``."""
    w = workload
    tokens = torch.randint(w.vocab, (steps, w.global_batch, w.seq), generator=torch.Generator().manual_seed(0))
    local = w.global_batch // replicas
    return tokens[:, rank * local:(rank + 1) * local].reshape(-1, w.seq)


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _holdings(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Which decoder layers, and whether the embedding and the LM head, this rank's parameters belong to."""
    names = [name for name, _ in named]
    return {"layers_held": sorted({int(m.group(1)) for n in names if (m := _LAYER.search(n))}),
            "has_head": any("lm_head" in n for n in names)}


class _TokenData(pl.LightningDataModule):
    """Each data-parallel rank reads its slice of every global batch (as the strategy numbers the replicas)."""

    def __init__(self, workload: Workload, steps: int) -> None:
        super().__init__()
        self.workload, self.steps = workload, steps

    def train_dataloader(self) -> DataLoader:
        sampler = self.trainer.strategy.distributed_sampler_kwargs
        replicas = sampler["num_replicas"]
        tokens = _tokens(self.workload, self.steps, sampler["rank"], replicas)
        return DataLoader(TensorDataset(tokens), batch_size=self.workload.global_batch // replicas)


class _StepTimer(pl.Callback):
    """Each step's wall time; resident and peak memory, and the freed-but-kept heap, after Lightning's setup,
    after each step's forward and backward (before the optimizer steps) and after each step."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.trace: list[tuple[str, float, float, float, Optional[float], Optional[float]]] = []
        self._start = 0.0

    def mark(self, point: str) -> None:
        """Resident memory, its peak and its file-backed part (library code the step touched first), and the
        heap's freed-but-kept and live bytes."""
        heap = heap_stats()
        self.trace.append((point, proc_status_mb("VmRSS"), proc_status_mb("VmHWM"), proc_status_mb("RssFile"),
                           heap.free / MIB if heap is not None else None,
                           heap.in_use / MIB if heap is not None else None))

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.mark(f"step {len(self.step_s) + 1} before optimizer")

    def on_train_start(self, *args: Any) -> None:
        self.mark("setup")

    def on_train_batch_start(self, *args: Any) -> None:
        _synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        _synchronize()
        self.step_s.append(time.perf_counter() - self._start)
        self.mark(f"step {len(self.step_s)}")


def _synchronize() -> None:
    """Wait for queued GPU work, so a step's wall time includes it (nothing to wait for on the CPU)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def trainer_for(leg: Leg, steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_merak.strategies.merak3d import Merak3DStrategy

    if leg.strategy == "merak3d":
        strategy: Any = Merak3DStrategy(**(leg.merak or {}), timeout_s=RANK_TIMEOUT_S)
    elif leg.strategy == "ddp":
        strategy = DDPStrategy()
    else:
        strategy = ModelParallelStrategy(data_parallel_size=leg.world_size, tensor_parallel_size=1)
    return pl.Trainer(accelerator=leg.accelerator, devices=leg.world_size, strategy=strategy, max_steps=steps,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                      callbacks=callbacks)


def _lightning_leg(rank: int, leg: Leg, workload: Workload, steps: int) -> dict[str, Any]:
    """merak3d (meta init via ``configure_model``), FSDP2 (meta init via ``init_module``) or DDP (built whole)."""
    optim = OptimConfig(warmup_steps=1)
    timer = _StepTimer()
    trainer = trainer_for(leg, steps, [timer])
    config = workload.config()
    if leg.strategy == "merak3d":
        module: CausalLMModule = CausalLMModule(None, optim, model_factory=lambda: AutoModelForCausalLM.from_config(
            config))
    elif leg.strategy == "fsdp2":
        with trainer.init_module(empty_init=True):
            model = AutoModelForCausalLM.from_config(config)
        module = FullyShardedLM(model, optim)
    else:
        module = CausalLMModule(AutoModelForCausalLM.from_config(config), optim)
    trainer.fit(module, datamodule=_TokenData(workload, steps))
    local = workload.global_batch // trainer.strategy.distributed_sampler_kwargs["num_replicas"]
    named = list(module.model.named_parameters())
    result = {"step_s": timer.step_s, "trace": timer.trace, "param_bytes": sum(_local_bytes(p) for _, p in named),
              **_holdings(named)}
    if leg.strategy == "merak3d":
        strategy = trainer.strategy
        result.update(pipeline_rank=strategy.pipeline_rank, pipeline_parallel=strategy.pipeline_parallel,
                      tensor_parallel=strategy.tensor_parallel, micro_batch=local // strategy.micro_batches,
                      micro_batches=strategy.micro_batches)
    else:
        result.update(pipeline_rank=0, pipeline_parallel=1, tensor_parallel=1, micro_batch=local, micro_batches=1)
    return result


def zero3_config(workload: Workload, world_size: int) -> dict[str, Any]:
    """DeepSpeed's config for the ZeRO-3 baseline: stage 3 and the batch, everything else at DeepSpeed's defaults."""
    return {"train_micro_batch_size_per_gpu": workload.global_batch // world_size, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}


def _zero3_leg(rank: int, leg: Leg, workload: Workload, steps: int) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 driven directly (Lightning's DeepSpeedStrategy refuses CPU); built partitioned by zero.Init."""
    import deepspeed

    ds_config = zero3_config(workload, leg.world_size)
    init_deepspeed_comm()
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = AutoModelForCausalLM.from_config(workload.config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                      dist_init_required=False)
    local = workload.global_batch // leg.world_size
    tokens = _tokens(workload, steps, rank, leg.world_size)
    timer = _StepTimer()
    timer.mark("setup")
    for step in range(steps):
        start = time.perf_counter()
        ids = tokens[step * local:(step + 1) * local]
        logits = engine(ids).logits
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        timer.step_s.append(time.perf_counter() - start)
        timer.mark(f"step {step + 1}")
    named = list(model.named_parameters())
    param_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for _, p in named)
    return {"step_s": timer.step_s, "trace": timer.trace, "param_bytes": param_bytes, "pipeline_rank": 0,
            "pipeline_parallel": 1, "tensor_parallel": 1, "micro_batch": local, "micro_batches": 1, **_holdings(named)}


def train_rank(rank: int, world_size: int, leg: Leg, workload: Workload, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps of ``workload`` under ``leg``; this rank's memory next to what it holds."""
    _quiet()
    if leg.strategy == "zero3":
        import deepspeed  # noqa: F401  (its import is part of the baseline, not of the model)
    else:
        from lightning_merak.strategies.merak3d import Merak3DStrategy  # noqa: F401
    torch.manual_seed(0)
    baseline, baseline_file = proc_status_mb("VmRSS"), proc_status_mb("RssFile")
    heap = heap_stats()
    baseline_in_use = heap.in_use / MIB if heap is not None else None
    cuda = leg.accelerator == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        cuda_baseline = torch.cuda.memory_allocated()
    run = _zero3_leg if leg.strategy == "zero3" else _lightning_leg
    result = run(rank, leg, workload, steps)
    # whether this rank's heap started with glibc's per-thread cache off (the launcher's setting) or on
    result.update(baseline_mb=baseline, baseline_file_mb=baseline_file, baseline_heap_in_use_mb=baseline_in_use,
                  peak_mb=proc_status_mb("VmHWM"), tcache_off=heap_tunables_applied())
    if cuda:  # the GPU leg's memory is the device's: its allocator's peak above what existed before the model
        result.update(baseline_mb=cuda_baseline / MIB, peak_mb=torch.cuda.max_memory_allocated() / MIB,
                      cuda_reserved_peak_mb=torch.cuda.max_memory_reserved() / MIB)
    return result


# Pretrained load -------------------------------------------------------------------------


class _TimedPretrained(CausalLMModule):
    """merak3d's pretrained seam filled by ``lightning_merak.hf.load_pretrained``, timed."""

    def __init__(self, directory: str, vocab: int) -> None:
        from lightning_merak.hf import pretrained_causal_lm

        super().__init__(None, model_factory=lambda: pretrained_causal_lm(directory, vocab,
                                                                                            weights=False))
        self.directory = directory
        self.load_s = 0.0
        self.bytes_read = 0

    def load_pretrained_weights(self, tensors: dict[str, torch.Tensor], layout_changes: dict[str, Any]) -> None:
        from lightning_merak.hf import load_pretrained

        start = time.perf_counter()
        report = load_pretrained(tensors, self.directory, layout_changes)
        self.load_s = time.perf_counter() - start
        self.bytes_read = report.bytes_read


def load_rank(rank: int, world_size: int, directory: str, merak: dict[str, int], tokens: torch.Tensor,
              checkpoint: Optional[str], accelerator: str = "cpu") -> dict[str, Any]:
    """Load ``directory`` into this rank's shard under ``merak``'s layout, predict ``tokens``, optionally save.

    The checkpoint (``checkpoint``) is taken right after the load, with no training step, for the export round trip.
    """
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    _quiet()
    module = _TimedPretrained(directory, int(tokens.max()) + 1)
    trainer = pl.Trainer(accelerator=accelerator, devices=world_size, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False,
                         strategy=Merak3DStrategy(**merak, timeout_s=RANK_TIMEOUT_S))
    logits = torch.cat(trainer.predict(module, DataLoader(TensorDataset(tokens), batch_size=len(tokens)))).cpu()
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
    return {"load_s": module.load_s, "bytes_read": module.bytes_read, "logits": logits}


def from_pretrained_rank(rank: int, world_size: int, directory: str, tokens: torch.Tensor,
                         device: str = "cpu") -> dict[str, Any]:
    """The reference: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)`` in one process, timed.

    ``call_s`` is the call alone; ``load_s`` adds reading every weight once, because the call may map
    the file and leave the reads to the first forward (merak3d's load copies into its shards). On
    ``device="cuda"`` the call places every weight on the GPU (``device_map``).
    """
    _quiet()
    start = time.perf_counter()
    placement = {} if device == "cpu" else {"device_map": device}
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **placement)
    call_s = time.perf_counter() - start
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.sum()
        _synchronize()
        load_s = time.perf_counter() - start
        logits = model.eval()(tokens.to(device)).logits.cpu()
    return {"call_s": call_s, "load_s": load_s, "logits": logits}


# Activations -----------------------------------------------------------------------------


def _saved_bytes(workload: Workload, tensor_parallel: int, device: str = "cpu") -> int:
    """Bytes autograd saves for backward in a one-sample forward and loss (parameters excluded, storages once)
    of the part of the model one of ``tensor_parallel`` ranks computes, on ``device`` (its attention kernels
    decide what is saved)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(workload.config(tensor_parallel)).to(device).train()
    ids = torch.randint(workload.vocab // tensor_parallel, (1, workload.seq), device=device)

    def forward_and_loss() -> None:
        logits = model(ids).logits
        nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1))

    return saved_activation_bytes(forward_and_loss, model.parameters())


def measure_activations(workload: Workload, tensor_parallel: int = 1, device: str = "cpu") -> dict[str, float]:
    """Saved-activation bytes per sample of one of ``tensor_parallel`` ranks: per decoder layer, and of the rest
    (embedding, final norm, head, loss).

    Measured on the part of the model one rank computes (its heads, MLP columns and vocabulary rows;
    norms and the residual stream at full width, as tensor parallelism without sequence parallelism
    keeps them), with 1 and 2 decoder layers, so no full-size model is built here.
    """
    one, two = (_saved_bytes(Workload(workload.hidden, layers, workload.vocab, workload.seq), tensor_parallel, device)
                for layers in (1, 2))
    return {"per_layer": float(two - one), "head": float(2 * one - two)}
