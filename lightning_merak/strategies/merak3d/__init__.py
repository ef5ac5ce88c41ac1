"""``Trainer(strategy="merak3d")``: data × pipeline × tensor parallelism for unmodified models.

The LightningModule stays an ordinary module that also trains on one device. merak3d
relies on four things it provides (:class:`lightning_merak.modules.causal_lm.CausalLMModule` has
them all):

* ``self.model`` — the network, called as ``self.model(inputs)`` and returning logits
  (a tensor, or an output with ``.logits`` such as transformers models return);
* ``split_batch(batch) -> (inputs, targets)``;
* ``loss_from_logits(logits, targets) -> loss`` — evaluated per micro-batch;
* ``compute_loss(batch)`` — called by its ``training_step``/``validation_step``;
  merak3d replaces it on the instance so that it drives the pipeline schedule.

The parallel layout is built on the first batch, when the real shapes are known: the
model is recorded once (:mod:`~lightning_merak.parallel.pipeline.trace`), every rank
agrees on rank 0's partition of the measured costs, each rank prunes its copy to its
stage, splits its blocks over the tensor-parallel group, wraps the blocks chosen for
recomputation, and the optimizers are rebuilt over the parameters the rank now owns.

One module per concern, composed by :mod:`.strategy` (the hooks Lightning calls):

* :mod:`.arguments` — the user's arguments, checked once, and the refusals before launch;
* :mod:`.layout` — the frozen :class:`~.layout.Layout` (every degree) and its device mesh;
* :mod:`.planning` — search space, profile and plan → a new ``Layout``;
* :mod:`.build` — the first batch's build: trace, split, cut, recompute, overlap;
* :mod:`.pipeline_step` — a pipelined step through torch's schedules;
* :mod:`.gradients` — gradient synchronisation, the norm over all stages and shards, clipping;
* :mod:`.checkpoint` — sharded checkpoints under the unsplit model's names.

Importing a piece (the gradient primitives, say) does not import the strategy: its names
here are loaded on first use, so importing the package (for :mod:`.options`, say) imports no torch.
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
