"""The Trainer's options and callbacks checked against a merak3d layout: gradient accumulation, micro-batches that
split nothing, and Stochastic Weight Averaging (pure: plain numbers and the callbacks list)."""

from __future__ import annotations

from typing import Any, Iterable, Optional

from lightning.pytorch.callbacks import StochasticWeightAveraging

from lightning_merak.parallel.layout import Layout

__all__ = ["accumulation_refusal", "check_weight_averaging", "unsplit_micro_batches_warning"]


def accumulation_refusal(accumulate_grad_batches: int, pipeline_parallel: Optional[int] = None,
                         tp_overlap: Optional[int] = None) -> Optional[str]:
    """Why ``accumulate_grad_batches`` is refused, with the advice that fits the layout, or None for 1.

    merak3d synchronises the gradients in every backward, so it cannot accumulate over batches. Only a pipeline's
    schedule (``pipeline_parallel > 1``) and ``tp_overlap``'s sub-batches split a batch: there ``micro_batches``
    accumulates within a step; at ``pipeline_parallel=1`` without ``tp_overlap`` it splits nothing, so the advice
    is a larger batch. Degrees not known yet (``None``, before the planner) get both pieces of advice."""
    if accumulate_grad_batches == 1:
        return None
    head = (f"accumulate_grad_batches={accumulate_grad_batches}: merak3d synchronises the gradients in every "
            "backward and does not accumulate them over batches; set accumulate_grad_batches=1 and ")
    splits = "raise micro_batches (and the batch size): the pipeline schedule accumulates its micro-batches"
    whole = ("raise the batch size (recompute='full' makes room for it): at pipeline_parallel=1 without tp_overlap "
             "micro_batches splits nothing")
    if pipeline_parallel is None or tp_overlap is None:
        return f"{head}{splits} at pipeline_parallel > 1 or tp_overlap > 1; else {whole}"
    return head + (splits if pipeline_parallel > 1 or tp_overlap > 1 else whole)


def unsplit_micro_batches_warning(layout: Layout, variable_micro_batching: bool, context_degree: str) -> Optional[str]:
    """A warning for ``micro_batches`` set explicitly where nothing splits a batch (``pipeline_parallel=1``, no
    ``tp_overlap``, no variable micro-batching or per-micro-batch context degree): every layer sees the whole batch,
    so it neither saves memory nor accumulates anything. None where it does something or was left to its default."""
    if (layout.micro_batches_by_default or layout.micro_batches == 1 or layout.pipeline_parallel > 1
            or layout.tp_overlap > 1 or variable_micro_batching or context_degree != "fixed"):
        return None
    return (f"merak3d: micro_batches={layout.micro_batches} splits nothing at pipeline_parallel=1 and tp_overlap=1: "
            "every layer runs on the whole batch (it does not save memory or accumulate gradients); leave "
            "micro_batches unset, or lower the batch size (and recompute) to save memory")


def check_weight_averaging(layout: Layout, callbacks: Iterable[Any]) -> None:
    """Refuse ``StochasticWeightAveraging`` where the model it copies is not the one trained, before the fit starts.

    The callback deep-copies the whole module when the fit starts, before merak3d's first batch cuts it into stages
    and tensor-parallel shards (or FSDP2 shards it): its average then mixes whole tensors with this rank's parts and
    fails epochs later. Lightning refuses it under FSDP and DeepSpeed alike. Replicated data parallelism keeps
    whole parameters, and works."""
    if not any(isinstance(callback, StochasticWeightAveraging) for callback in callbacks):
        return
    sharded = layout.data_parallel_sharding == "full" and layout.data_parallel > 1
    parts = {"pipeline_parallel": layout.pipeline_parallel, "tensor_parallel": layout.tensor_parallel}
    split = [f"{name}={degree}" for name, degree in parts.items() if degree > 1]
    split += ["data_parallel_sharding='full'"] if sharded else []
    if split:
        raise ValueError(f"StochasticWeightAveraging averages a copy of the whole model taken before merak3d splits it "
                         f"({', '.join(split)} gives each rank only its part), so it cannot average this layout; "
                         "remove the callback, or train with data parallelism only (any data_parallel_sharding "
                         "but 'full')")
