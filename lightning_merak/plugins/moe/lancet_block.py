"""Block-scope Lancet: each decoder block that holds our ``MoE`` runs as overlapped sub-batches.

The batch is split into ``chunks`` sub-batches that run the whole block (attention, then
the MoE layer) as round-robin coroutines (:func:`~lightning_merak.distributed.sub_batches.run_sub_batches`):
a sub-batch computes until it waits for an all-to-all, and the other sub-batches' expert
or dense computation runs meanwhile, in the forward and in the backward. The MoE layer
gates all sub-batches jointly, so tokens are kept and dropped exactly as without the
split, and each sub-batch returns its share of ``l_aux``, which the region sums.

The model is not edited: :func:`lancet_overlap` replaces the blocks' ``forward``. With
``chunks="auto"`` the first call of each block runs unsplit and measures the block's
dense compute time (block minus MoE); the second runs as two sub-batches, and what it
costs beyond the simulation is each sub-batch's overhead (switching turns, smaller
kernels). With both, the layer's cost model and expert counts, the sub-batch count is
picked by simulation (:func:`~.lancet.choose_block_chunks`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.distributed.process_groups import collective_device
from lightning_merak.distributed.sub_batches import run_sub_batches
from lightning_merak.plugins.moe.block_split import Chunks, check_chunks, enclosing_block, split_batch
from lightning_merak.plugins.moe.core.lancet import choose_block_chunks, simulated_block_time
from lightning_merak.plugins.moe.core.placement_cost_model import CostModel
from lightning_merak.plugins.moe.layer import MoE, PlacementMOELayer
from lightning_merak.util.timing import DeviceStamp, DeviceTimer

__all__ = ["LancetBlockForward", "lancet_overlap"]


class LancetBlockForward:
    """A block's ``forward`` as ``chunks`` overlapped sub-batches; install with :func:`lancet_overlap`."""

    def __init__(self, block: nn.Module, chunks: Chunks) -> None:
        check_chunks(chunks)
        self.block, self.forward = block, block.forward
        self.layers = [m.deepspeed_moe for m in block.modules() if isinstance(m, MoE)]
        if not self.layers:
            raise ValueError(f"{type(block).__name__} holds no lightning_merak MoE layer; wrap the blocks that do")
        self.chunks: Optional[int] = None if chunks == "auto" else int(chunks)
        self.dense_s: Optional[float] = None
        self.sub_batch_overhead_s: Optional[float] = None
        self._unsplit_s: Optional[float] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        batch = split_batch(self.block, args, kwargs, self.chunks)
        if self.chunks is None:
            if self.dense_s is None:
                return self._measure_unsplit(batch, args, kwargs)
            return self._measure_split_and_choose(batch, args, kwargs)
        return self._run_split(self.chunks, args, kwargs)

    def _run_split(self, chunks: int, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The block's forward as ``chunks`` overlapped sub-batches."""
        parameters = [p for p in self.block.parameters() if p.requires_grad]
        return run_sub_batches(self.forward, chunks, args, kwargs, parameters)

    def _cost_model(self) -> CostModel:
        """The first MoE layer's cost model (profiled on first use)."""
        layer = self.layers[0]
        return layer._ensure_cost_model(layer.gate.wg.weight.detach())

    def _agreed(self, seconds: float) -> float:
        """The largest of the EP group's measurements, so every rank chooses alike."""
        layer = self.layers[0]
        measured = torch.tensor([seconds], dtype=torch.float64,
                                device=collective_device(layer.ep_group) if layer.ep_size > 1 else "cpu")
        if layer.ep_size > 1:
            dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=layer.ep_group)
        return measured.item()

    def _choose(self, batch: int) -> int:
        layer = self.layers[0]
        return choose_block_chunks(self._cost_model(), layer.stats["counts"], layer.stats["plan"], self.dense_s, batch,
                                   sub_batch_overhead_s=self.sub_batch_overhead_s or 0.0)

    def _device(self) -> torch.device:
        """Where the block computes: its times are read on this device."""
        return next(self.block.parameters()).device

    def _measure_unsplit(self, batch: int, args: tuple, kwargs: dict[str, Any]) -> Any:
        """First call: run unsplit, timing the block and its MoE layers."""
        device = self._device()
        moe_started: list[DeviceStamp] = []
        moe_finished: list[DeviceStamp] = []
        handles = [h for layer in self.layers
                   for h in (layer.register_forward_pre_hook(lambda *_: moe_started.append(DeviceStamp(device))),
                             layer.register_forward_hook(lambda *_: moe_finished.append(DeviceStamp(device))))]
        try:
            with DeviceTimer(device) as unsplit:
                output = self.forward(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        block_s = unsplit.seconds
        moe_s = sum(end.seconds_since(start) for start, end in zip(moe_started, moe_finished))
        self.dense_s = self._agreed(max(block_s - moe_s, 0.0))
        self._unsplit_s = self._agreed(block_s)
        if batch % 2 or self.layers[0].ep_size == 1:
            self.chunks = self._choose(batch)
        return output

    def _measure_split_and_choose(self, batch: int, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Second call: run as two sub-batches; the time the simulation misses is the per-sub-batch overhead."""
        layer = self.layers[0]
        with DeviceTimer(self._device()) as split:
            output = self._run_split(2, args, kwargs)
        split_s = self._agreed(split.seconds)
        cost_model = self._cost_model()
        counts, plan = layer.stats["counts"], layer.stats["plan"]
        simulated_gain = (simulated_block_time(cost_model, counts, plan, self.dense_s, 1, blocks=1)
                          - simulated_block_time(cost_model, counts, plan, self.dense_s, 2, blocks=1))
        # two sub-batches pay the overhead twice, one whole batch once: the difference is one overhead
        self.sub_batch_overhead_s = max(0.0, split_s - (self._unsplit_s - simulated_gain))
        self.chunks = self._choose(batch)
        return output


def _enclosing_blocks(model: nn.Module) -> list[nn.Module]:
    """For each MoE, its nearest ancestor (or itself) held by an ``nn.ModuleList`` or ``nn.Sequential``."""
    modules = dict(model.named_modules())
    blocks: list[nn.Module] = []
    for name, module in modules.items():
        if not isinstance(module, MoE):
            continue
        block = enclosing_block(modules, name)
        if block is None:
            raise ValueError(
                f"MoE layer {name or type(model).__name__!r} is not inside a block held by an nn.ModuleList or "
                f"nn.Sequential; pass the decoder blocks explicitly: lancet_overlap(model, chunks, blocks=[...])")
        if all(block is not seen for seen in blocks):
            blocks.append(block)
    return blocks


def lancet_overlap(model: nn.Module, chunks: Chunks = "auto",
                   blocks: Optional[Sequence[nn.Module]] = None) -> list[nn.Module]:
    """Run every decoder block holding our ``MoE`` as ``chunks`` overlapped sub-batches; return the blocks.

    ``blocks`` defaults to each MoE's nearest ancestor held by a ``ModuleList``/``Sequential``
    (a transformer's layer list). A block's outputs must be batch-first, ``l_aux`` as
    returned by the MoE (summed over sub-batches), or equal across sub-batches.
    """
    check_chunks(chunks)
    if not any(isinstance(m, PlacementMOELayer) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} has no lightning_merak MoE layer; build or swap one in first")
    targets = list(blocks) if blocks is not None else _enclosing_blocks(model)
    for block in targets:
        if isinstance(block.forward, LancetBlockForward):
            raise ValueError(f"{type(block).__name__} already runs block-scope Lancet; call lancet_overlap once")
    for block in targets:
        block.forward = LancetBlockForward(block, chunks)
    return targets
