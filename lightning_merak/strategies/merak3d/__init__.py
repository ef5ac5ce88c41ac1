"""``Trainer(strategy="merak3d")``: data × pipeline × tensor parallelism for unmodified models.

The LightningModule stays an ordinary module that also trains on one device, and under DDP; what merak3d
reads of it — nothing required without pipeline stages — is stated once in
:mod:`lightning_merak.protocols.module_contract`, and found or inferred by :mod:`.network`. Every argument, its
default and its meaning: :class:`~lightning_merak.strategies.merak3d.options.Merak3DOptions`.

The parallel layout is built on the first batch, when the real shapes are known: the model is recorded once
(:mod:`lightning_merak.parallel.pipeline.trace`), every rank agrees on rank 0's partition of the measured
costs, each rank prunes its copy to its stages, splits its blocks over the tensor-parallel group, wraps the
blocks chosen for recomputation, and the optimizers are rebuilt over the parameters the rank now owns.

This package holds the Lightning hooks and their orchestration only; the techniques live below it
(``docs/architecture.md``):

* :mod:`.strategy` — the hooks Lightning calls, each handing its work to one of the modules below;
* :mod:`.layout_queries` — what callbacks and the CLI read of the layout, and the checks before launch;
* :mod:`.options` / :mod:`.arguments` — the arguments, declared once, checked once, refused before launch;
* :mod:`.network` — the module's network, a batch's inputs and the pipeline's loss, found or inferred;
* :mod:`.planning` — search space, profile and plan → a new :class:`~lightning_merak.parallel.layout.Layout`;
* :mod:`.build` — the first batch's build: trace, split, cut, recompute, overlap, shard;
* :mod:`.pipeline_step` / :mod:`.variable_step` — a pipelined step through torch's schedules;
* :mod:`.checkpoint_hooks` — sharded checkpoints (:mod:`lightning_merak.checkpoint.sharded`) from the hooks.

Names here are loaded on first use, so importing the package (for :mod:`.options`, say) imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_merak.util.lazy import lazy_attributes

if TYPE_CHECKING:
    from lightning_merak.parallel.data.gradients import average_gradients, scale_gradients, squared_norm
    from lightning_merak.strategies.merak3d.strategy import Merak3DStrategy

__all__ = ["Merak3DStrategy", "average_gradients", "scale_gradients", "squared_norm"]

_GRADIENTS = "lightning_merak.parallel.data.gradients"

__getattr__ = lazy_attributes(__name__, {
    "Merak3DStrategy": ".strategy",
    "average_gradients": _GRADIENTS,
    "scale_gradients": _GRADIENTS,
    "squared_norm": _GRADIENTS,
})
