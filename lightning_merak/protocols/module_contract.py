"""What ``Trainer(strategy="merak3d")`` uses of a LightningModule, stated once.

**Nothing is required.** Any LightningModule that trains under ``DDPStrategy`` trains under merak3d unchanged:
its own ``training_step``, ``validation_step``, ``test_step`` and ``predict_step`` run as written. merak3d finds
the network to split among the module's children — ``self.model``, else the one child that is a transformers
``PreTrainedModel``, else the one holding an ``nn.ModuleList`` (or ``nn.Sequential``) of repeated blocks,
whatever its attribute name — and parallelises it in place. Without pipeline stages or tensor shards the module
may hold any network.

**With pipeline stages** (``pipeline_parallel > 1``) the loss is computed on the last stage, so merak3d must know
how it comes from the network's outputs. It infers it: a transformers network called with ``labels`` is scored
by its own ``loss_function`` (shift and ignore index included); any other loss computed in ``training_step`` from
one call of the network is read from the step itself, which the last stage runs on each micro-batch with the
network's call answered by that micro-batch's outputs (what it logs is logged once, averaged over the
micro-batches). A step the replay cannot answer (the network called twice, or not at all) is refused at its first
batch on every rank, with the one method that replaces the inference, :class:`LossFromOutputs`'s
``loss_from_outputs(outputs, batch)`` (:func:`loss_from_outputs_snippet`). The ``training_step`` calls the network
with the batch's ``input_ids`` (and ``labels``); batches are a tensor of token ids, a dict with ``input_ids``
(``labels``, an all-ones ``attention_mask``) or a tuple ``(input_ids, labels)``.

**Optional accelerations**: the members of :class:`Merak3DModule`, which
:class:`~lightning_merak.modules.causal_lm.CausalLMModule` implements. A module with all four gets its pipelined
step as ``compute_loss`` and its vocabulary-split head scored without gathering full logits; ``split_batch`` alone
reads batches of any other structure (the first batch lays the model out on its token ids).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = ["CONTRACT_GUIDE", "LOSS_FROM_OUTPUTS", "MEMBERS", "MODEL", "LossFromOutputs", "Merak3DModule",
           "contract_name", "loss_from_outputs_snippet"]

CONTRACT_GUIDE = "docs/guides/merak3d.md, 'Your LightningModule'"
"""Where errors send the user: the guide's section on this contract."""


@runtime_checkable
class Merak3DModule(Protocol):
    """Optional members that speed merak3d up; it reads (and, on the instance, replaces) them when all are there."""

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


@runtime_checkable
class LossFromOutputs(Protocol):
    """The one method a module adds when merak3d cannot read its loss from ``training_step`` at
    ``pipeline_parallel > 1`` (the step calls its network more than once, or the loss is cheaper to give)."""

    def loss_from_outputs(self, outputs: Any, batch: Any) -> Tensor:
        """The scalar mean loss of one micro-batch: ``outputs`` as the network returns them for its samples (a
        transformers output with ``.logits``, or the logits), ``batch`` those samples of the batch.

        Call it from ``training_step`` on the network's outputs: with pipeline stages merak3d runs it per
        micro-batch on the last stage, and the call in ``training_step`` returns the schedule's loss."""
        ...


MODEL = "model"
"""The attribute merak3d looks at first for the network."""

LOSS_FROM_OUTPUTS = "loss_from_outputs"
""":class:`LossFromOutputs`' method."""

MEMBERS = ("model", "split_batch", "loss_from_logits", "compute_loss")
""":class:`Merak3DModule`'s members, in the order above."""


def contract_name() -> str:
    """The Protocol's import path, as errors name it."""
    return f"{Merak3DModule.__module__}.{Merak3DModule.__qualname__}"


def loss_from_outputs_snippet(module_name: str, network: str) -> str:
    """The refusal of a module whose pipeline loss cannot be inferred, with the method ``module_name`` should add
    (``network``: the attribute holding its network)."""
    return (
        f"with pipeline stages (pipeline_parallel>1, or 'auto') merak3d computes the loss on the last stage, so it "
        f"must know how {module_name}'s loss comes from self.{network}'s outputs; add this method to {module_name} "
        f"and compute the loss with it in training_step:\n\n"
        f"    def {LOSS_FROM_OUTPUTS}(self, outputs, batch):\n"
        f"        # outputs: what self.{network}(...) returns for these samples; batch: the same samples of the batch\n"
        f"        return <the mean loss of outputs against batch>\n\n"
        f"({CONTRACT_GUIDE})")
