"""``Merak3DStrategy``'s options, declared once: every argument with its default and its description (no torch).

The strategy's signature repeats them in this order with these defaults (a test holds it to that);
:class:`~lightning_merak.strategies.merak3d.arguments.Merak3DArguments` extends the class with the checks, and
the Hydra schema of ``strategy=merak3d`` (:mod:`lightning_merak.cli.options.strategy`) takes its fields with their
descriptions, which ``merak-train --help`` and ``docs/reference/cli.md`` show. Each description is the field's
``metadata["help"]`` (:func:`lightning_merak.util.fields.option`, which says why metadata).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from lightning_merak.util.fields import option

__all__ = ["Degree", "Merak3DOptions"]

Degree = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class Merak3DOptions:
    """``Merak3DStrategy``'s arguments, their defaults and what each does."""

    data_parallel: Degree = option(
        "auto", "Replicas of the model; `auto` takes what the other degrees leave of the world size.")
    pipeline_parallel: Degree = option(
        1, "Pipeline stages the model is cut into (`auto`: chosen by the layout planner).")
    tensor_parallel: Degree = option(
        1, "Ranks each transformer block is split over (`auto`: chosen by the layout planner).")
    tp_overlap: Degree = option(
        1, "Sub-batches per micro-batch, so that one sub-batch's tensor-parallel all-reduce runs while the next "
        "computes (1: no overlap; `auto`: planned). The overlap spans blocks, in forward and backward; the value "
        "must divide the micro-batch size.")
    tp_weight_grad_overlap: Optional[bool] = option(
        None, "Run each column group's input-gradient all-reduce while its weight gradients are computed "
        "(`null`: on, except with `interleaved_zero_bubble`). Column groups are q/k/v and gate/up; with "
        "sequence parallelism the all-reduce is a reduce-scatter. `interleaved_zero_bubble` computes weight "
        "gradients in a pass of their own, so `true` is refused there.")
    sequence_parallel: bool = option(
        False, "Split the blocks' norms, dropout and residual stream along the sequence over the tensor-parallel "
        "ranks. Each all-reduce becomes a reduce-scatter and an all-gather, and activations between the split "
        "layers shrink by `tensor_parallel`, which must divide the sequence length (the planner searches only "
        "such degrees).")
    context_parallel: Degree = option(
        1, "Ranks each sequence is split over (context parallelism), each holding a load-balanced share of every "
        "sample's tokens; attention spans the whole sequence through `context_attention`. These ranks hold the same "
        "parameters, so gradients are averaged over data_parallel × context_parallel ranks; the sequence length must "
        "be a multiple of 2 × context_parallel. Needs a transformers model calling its attention interface; runs with "
        "tensor and sequence parallelism (each rank's share split again over tensor_parallel) and with "
        "pipeline_parallel>1 at a fixed degree (every stage's blocks on the shard, CausalLMModule's loss on the "
        "last stage's rows) and with tp_overlap sub-batches (each attends over the whole sequence in its turn), "
        "with micro_batching (packed rows' document ids travel between the stages) "
        "(`lightning_merak.parallel.context`). `auto`: the layout planner chooses it with the other degrees, "
        "pricing 1/context_parallel of each sequence's work and activations per rank against the attention exchange "
        "(context_parallel=1 where a fixed option or the model rules it out).")
    context_attention: str = option(
        "auto", "How attention spans a split sequence: `ring` (key/value shards passed around the ranks while the "
        "local block computes), `all_to_all` (Ulysses: heads scattered, sequence gathered; context_parallel must "
        "divide each tensor-parallel rank's key/value heads) or `auto`: chosen by the layout planner by their "
        "predicted steps where the layout is planned (any degree `auto`), else `ring`, which runs at any head count.")
    context_parallel_degree: str = option(
        "fixed", "How many ranks each sample of a variable-length global batch (`data.lengths=variable`) is split "
        "over: `fixed` (every sample over all `context_parallel` ranks) or `per_micro_batch` (each sample its own "
        "divisor of `context_parallel`, planned per global batch from a cost model and the per-rank token cap "
        "`micro_batch_tokens`: long samples split, short ones run whole on one rank, balanced over the group; "
        "`lightning_merak.parallel.context.variable`). `per_micro_batch` needs a fixed context_parallel > 1, "
        "pipeline_parallel=1, micro_batching=none, tp_overlap=1, data_parallel_sharding "
        "other than `full` and CausalLMModule's loss.")
    micro_batches: Optional[int] = option(
        None, "Micro-batches per batch in the pipeline schedule (`null`: 2 × pipeline stages).")
    schedule: str = option(
        "1f1b", "Pipeline schedule: `1f1b`, `gpipe`, `shifted_critical_path`, `interleaved_1f1b` or "
        "`interleaved_zero_bubble`. `shifted_critical_path` (Merak) keeps no activations for cool-down forwards "
        "and recomputes them while their gradients are in flight. The interleaved schedules run `virtual_stages` "
        "stages per rank, round-robin; zero-bubble also splits backward into input and weight gradients.")
    virtual_stages: int = option(2, "Stages per rank for the interleaved schedules.")
    recompute: str = option(
        "none", "Activation recomputation: `none`, `full` (every block), `stage_aware`, or `auto` (planned among "
        "ratios 0, 0.5 and 1). With `stage_aware` (Merak), stage i of S recomputes a fraction "
        "1 − (1 − r)(S − 1)/(S − 1 − i) of its blocks and the last stage none, r being `recompute_ratio`.")
    recompute_ratio: float = option(0.5, "The fraction of its blocks the first stage recomputes with `stage_aware`.")
    compile: bool = option(
        False, "Compile each transformer block with `torch.compile` (regional compilation, one graph per block class, "
        "reused by every block of it), under every layout, sharding mode and recompute mode. A block torch.compile "
        "cannot capture whole has its parts compiled one by one and the rest run eagerly, with one notice naming it "
        "(`lightning_merak.parallel.regional_compile`).")
    float8: Optional[str] = option(
        None, "Train the blocks' linear layers in fp8 with torchao: `rowwise`, `tensorwise` or `mxfp8` (`null`: "
        "off). Master weights, gradients and optimizer state keep the run's precision; layers narrower than 1024 or "
        "not multiples of 16 (at tensor_parallel > 1: each rank's shard) stay as they are "
        "(`lightning_merak.parallel.float8`). Refused, before training, on a device without fp8 GEMMs (`mxfp8`: CUDA "
        "compute capability 10.0), and `mxfp8` at tensor_parallel > 1. Pair it with `compile`, which fuses the "
        "casts.")
    partition: str = option(
        "autopipe", "How blocks are cut into pipeline stages: `autopipe`, `min_max`, `parameters` or `uniform`. "
        "`autopipe` refines the min–max split by simulating the schedule; `uniform` puts equal blocks on every "
        "stage.")
    process_group_backend: Optional[str] = option(
        None, "Collective backend, `gloo` or `nccl` (`null`: chosen from the device).")
    timeout_s: float = option(600.0, "Collective timeout in seconds, so that a failed rank ends every rank.")
    memory_limit: Optional[float] = option(
        None, "Bytes per rank the planned layout must fit (`null`: 90% of what the device offers). On CPU, that "
        "is 90% of the host memory available per process.")
    plan_only: bool = option(False, "Plan the layout, log it, and stop before training.")
    planner_calibration: str = option(
        "analytic", "How the planner ranks layouts: `analytic` (its cost model), or by replaying traces given as "
        "comma-separated paths. The traces are `MerakTraceProfiler`'s, of short runs of this model and batch; the "
        "first calibrates, the rest are probes (`lightning_merak.planning.replay.calibration`).")
    vocab_parallel: bool = option(
        True, "Split the input embedding and the LM head by vocabulary rows over the tensor-parallel ranks, and "
        "compute the loss on the sharded logits. Nothing to do at `tensor_parallel=1` "
        "(`lightning_merak.parallel.tensor.vocab`).")
    vocab_stages: str = option(
        "off", "Split the LM head and the input embedding by vocabulary rows over the pipeline ranks (over the "
        "pipeline × tensor-parallel ranks at tensor_parallel>1), so neither end stage carries a whole table; `auto`: "
        "on where the layout allows it, the layout planner (when it plans) prices it faster and AutoPipe's "
        "simulation predicts a shorter step. Every rank scores its rows of each micro-batch (the loss pieces "
        "all-reduced) and looks its rows of each step's tokens up for the first stage; a tied head and embedding are "
        "one weight, and an embedding that is not a plain nn.Embedding stays on the first stage. Runs with every "
        "`schedule` (under interleaved_zero_bubble the embedding stays whole) and context_parallel (each context "
        "rank scores its shard of the sequence), an nn.Linear head (or plain LoRA on one: its lora_B rows split "
        "with the head's) and next-token cross-entropy; under data_parallel_sharding=`full` the rows stay whole on "
        "each replica (`lightning_merak.parallel.pipeline.vocab_stages`, `.embedding_stages`).")
    compact_host_memory: bool = option(
        False, "Return freed host memory to the system at once, for CPU runs near their memory limit; steps take "
        "longer. Allocations over 128 KiB are mapped on their own (glibc), so peak resident memory stays near the "
        "live tensors' instead of the heap's high-water mark (`lightning_merak.distributed.host_memory`).")
    data_parallel_sharding: str = option(
        "none", "What the data-parallel ranks shard instead of each holding a copy: `none`, `optimizer` (ZeRO-1), "
        "`gradients` (ZeRO-2), `full` (FSDP2) or `auto` (planned). With `optimizer` each rank keeps and steps the "
        "optimizer state of one slice of the parameters; gradients are reduce-scattered and updated parameters "
        "all-gathered. `gradients` also frees the full gradient buffer once reduce-scattered, and `full` shards "
        "the parameters too (FSDP2's `fully_shard` over the data-parallel ranks).")
    data_parallel_shard_size: Optional[int] = option(
        None, "Ranks each shard group spans (`null`: all data-parallel ranks). Hybrid sharding: shard inside "
        "groups of this size, replicate across them.")
    overlap_grad_reduce: bool = option(
        True, "Reduce each gradient bucket once the last micro-batch's backward has finished it, while the "
        "backward goes on (`false`: all buckets at once after it).")
    overlap_param_gather: Optional[bool] = option(
        None, "With `data_parallel_sharding=optimizer`, gather updated parameters while the next forward runs, "
        "each bucket just before the first module using it (`null`: on with `optimizer`, which then hides the "
        "gather as DDP hides its all-reduce). Until then a callback's `on_train_batch_end` reads the previous "
        "step's parameters; checkpoints, validation and the end of training wait for them. `false` gathers "
        "right after the optimizer step.")
    grad_bucket_mb: Optional[float] = option(
        None, "Size in MB of a gradient bucket, the unit of the data-parallel reduction (`null`: 25 MB, or less "
        "for a small model). The default is an eighth of the stage's gradients when that is smaller than 25 MB, "
        "at least 1 MB, so that a small model still overlaps.")
    micro_batching: str = option(
        "none", "Micro-batches of variable-length samples (`data.lengths=variable`): `none`, `pad`, `pack` or "
        "`dynamic`; needs `pipeline_parallel` ≥ 2. `pad` makes equal sample counts padded to the longest, `pack` "
        "rows of up to `micro_batch_tokens` tokens (each micro-batch as long as its fullest row), `dynamic` runs "
        "DynaPipe's planner over a cost model and a token limit (`lightning_merak.parallel.micro_batching`).")
    micro_batch_tokens: Optional[int] = option(
        None, "Padded tokens one micro-batch may hold per rank: `dynamic`'s memory limit (a micro-batch split over "
        "context_parallel ranks holds that many times more), `pack`'s row capacity (`null`: 4096, and never below "
        "the longest sample).")
    micro_batching_cost: Optional[tuple[float, float, float]] = option(
        None, "Seconds per token, per token² and per micro-batch, the cost model of `dynamic`'s planner and of "
        "context_parallel_degree=per_micro_batch's (`null`: FLOP ratios of the model's shape for `dynamic`; measured "
        "on the ranks at the first global batch for per_micro_batch).")
