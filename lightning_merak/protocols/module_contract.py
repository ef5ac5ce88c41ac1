"""What ``Trainer(strategy="merak3d")`` uses of a LightningModule, as one Protocol: :class:`Merak3DModule`.

The module stays an ordinary LightningModule that also trains on one device; merak3d needs four members on it
to run the network in pieces. :class:`~lightning_merak.modules.causal_lm.CausalLMModule` implements them. The
strategy refuses a module that lacks one before any process starts, naming the members :func:`missing_members`
finds (:func:`lightning_merak.strategies.merak3d.arguments.check_module_members`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = ["MEMBERS", "Merak3DModule", "contract_name", "missing_members"]


@runtime_checkable
class Merak3DModule(Protocol):
    """The members merak3d reads (and, on the instance, replaces) on the LightningModule it trains."""

    model: nn.Module
    """The network, built by the time the strategy's ``setup`` runs (``__init__`` or ``configure_model``).
    Called as ``model(inputs)``, it returns the logits: a tensor, or an output with ``.logits`` as transformers
    models return. merak3d traces it, cuts it into pipeline stages, splits its blocks over the tensor-parallel
    ranks, and puts this rank's part (with pipeline stages, their ``RankStages``) back in its place."""

    def split_batch(self, batch: Any) -> tuple[Tensor, Tensor]:
        """``(inputs, targets)`` of a batch from the dataloader: what ``model`` takes and what the loss scores.

        Both are split along their first dimension (the samples) into micro-batches; one batch also gives the
        planner and the first-batch build their shapes."""
        ...

    def loss_from_logits(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The scalar mean loss of one micro-batch's ``logits`` against its ``targets``.

        The pipeline schedule scores each micro-batch on the last stage with it and averages them; with the
        vocabulary split, merak3d wraps it (on the instance) to score sharded logits."""
        ...

    def compute_loss(self, batch: Any) -> Tensor:
        """The loss of a whole batch, which ``training_step`` and ``validation_step`` return or log.

        With pipeline stages, merak3d replaces it on the instance by a step that runs the batch through the
        schedule (gradients included), as it replaces ``forward`` by the pipelined forward."""
        ...


MEMBERS = ("model", "split_batch", "loss_from_logits", "compute_loss")
""":class:`Merak3DModule`'s members, in the order above."""


def contract_name() -> str:
    """The Protocol's import path, as errors name it."""
    return f"{Merak3DModule.__module__}.{Merak3DModule.__qualname__}"


def missing_members(module: Any) -> list[str]:
    """The members of :class:`Merak3DModule` that ``module`` lacks, in the Protocol's order (empty: it implements
    it, as ``isinstance(module, Merak3DModule)`` then says too)."""
    return [name for name in MEMBERS if not hasattr(module, name)]
