"""What merak3d reads of the LightningModule it trains: the network it parallelises, a batch's inputs, the loss.

Nothing is required of the module (:mod:`lightning_merak.protocols.module_contract` states the contract once).
:func:`module_view` finds the network among the module's children, :class:`ModuleView` reads what the module
provides and infers the rest: the token ids of a batch (a tensor, a dict's ``input_ids``, a tuple's first item)
and, with pipeline stages, the loss of a micro-batch (the transformers model's own loss when it is called with
``labels``: :class:`LabelledLoss`, else the module's ``loss_from_outputs``, else its ``training_step`` replayed on
the micro-batch's outputs: :mod:`.step_replay`), which the layout planner profiles too
(:meth:`ModuleView.planning_loss`). :class:`PipelinedNetwork` is what the network's attribute calls once the model is
cut into stages, so a ``training_step`` written for one device runs as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional

import torch
from torch import nn

from lightning_merak.modules.causal_lm import scores_next_token
from lightning_merak.parallel.context.model import IGNORE_INDEX
from lightning_merak.parallel.data.token_mean import weigh_replica_tokens
from lightning_merak.parallel.layout import LayoutGroups
from lightning_merak.parallel.pipeline.recording import mixed_blocks_note
from lightning_merak.parallel.pipeline.trace import TraceError, find_trunk
from lightning_merak.parallel.tensor.vocab import vocab_parallel_loss
from lightning_merak.protocols.module_contract import (
    CONTRACT_GUIDE,
    LOSS_FROM_OUTPUTS,
    MODEL,
    Merak3DModule,
    loss_from_outputs_snippet,
)
from lightning_merak.strategies.merak3d.step_replay import (
    ReplayedStep,
    StepReplay,
    batch_labels,
    scoring_scale,
    weighed_score,
)

__all__ = ["LabelledLoss", "ModuleView", "PipelinedNetwork", "batch_inputs", "install_module_loss", "labelled_loss",
           "module_view", "select_samples"]

MicroBatchLoss = Callable[[Any, Any], torch.Tensor]
"""``(logits, targets) -> loss`` of one micro-batch, as the pipeline schedule scores it on the last stage."""


def _is_pretrained(network: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(network, PreTrainedModel)


def _has_trunk(network: nn.Module) -> bool:
    try:
        find_trunk(network)
    except TraceError:
        return False
    return True


def find_network(module: nn.Module) -> Optional[str]:
    """The attribute of ``module`` holding the network merak3d parallelises, or None (none found).

    ``model`` where the module has one; else its one child that is a transformers ``PreTrainedModel``; else its
    one child holding an ``nn.ModuleList`` or ``nn.Sequential`` of repeated blocks (a ``ModuleList`` or
    ``ModuleDict`` child is no network: it is not called, its owner's ``forward`` is). Several candidates are
    refused, naming them.
    """
    if isinstance(getattr(module, MODEL, None), nn.Module):
        return MODEL
    children = [(name, child) for name, child in module.named_children()
                if not isinstance(child, (nn.ModuleList, nn.ModuleDict))]
    for candidates in ([name for name, child in children if _is_pretrained(child)],
                       [name for name, child in children if _has_trunk(child)]):
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise TypeError(
                f"merak3d parallelises one network, but {type(module).__name__} holds several "
                f"({', '.join(candidates)}); "
                f"hold the one to split as `self.{MODEL}` ({CONTRACT_GUIDE})")
    return None


def batch_inputs(batch: Any) -> Optional[torch.Tensor]:
    """The token ids of ``batch`` where its structure says so: a tensor, a dict's ``input_ids``, a tuple's first."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        inputs = batch.get("input_ids")
    elif isinstance(batch, (tuple, list)) and batch:
        inputs = batch[0]
    else:
        return None
    return inputs if isinstance(inputs, torch.Tensor) else None


def select_samples(batch: Any, index: torch.Tensor) -> Any:
    """``batch`` restricted to the samples ``index`` (every tensor with a first dimension is indexed along it)."""
    if isinstance(batch, torch.Tensor):
        return batch[index.to(batch.device)] if batch.ndim > 0 else batch
    if isinstance(batch, dict):
        return type(batch)({key: select_samples(value, index) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(select_samples(value, index) for value in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(select_samples(value, index) for value in batch)
    return batch


@dataclass
class ModuleView:
    """A LightningModule as merak3d uses it: where its network lives and what the module provides of the contract.

    ``attribute``: the network's attribute (None: the module itself, trained whole by plain data parallelism).
    ``contract``: whether the module implements all of
    :class:`~lightning_merak.protocols.module_contract.Merak3DModule` (its ``compute_loss`` is then the pipelined
    step; otherwise the network's attribute is).
    """

    module: Any
    attribute: Optional[str]
    contract: bool

    @property
    def network(self) -> nn.Module:
        return getattr(self.module, self.attribute) if self.attribute is not None else self.module

    @network.setter
    def network(self, value: nn.Module) -> None:
        assert self.attribute is not None, "only a network held as an attribute is replaced"
        setattr(self.module, self.attribute, value)

    @property
    def state_prefix(self) -> str:
        """The prefix of the network's names in the module's ``state_dict``."""
        return f"{self.attribute}." if self.attribute is not None else ""

    def split_batch(self, batch: Any) -> tuple[torch.Tensor, Any]:
        """``(inputs, targets)`` of ``batch``: the module's own ``split_batch``, else read from its structure (the
        targets are then the batch itself where it has no labels, for ``loss_from_outputs``)."""
        own = getattr(self.module, "split_batch", None)
        if callable(own):
            return own(batch)
        inputs = batch_inputs(batch)
        if inputs is None:
            raise TypeError(
                f"merak3d reads a batch's token ids to lay the model out, and cannot find them in "
                f"{type(self.module).__name__}'s batches ({type(batch).__name__}); yield a tensor, a dict with "
                f"`input_ids` or a tuple `(input_ids, labels)`, or add `split_batch(self, batch) -> (inputs, targets)` "
                f"({CONTRACT_GUIDE})")
        labels = batch_labels(batch)
        return inputs, labels if labels is not None and not self.has_loss_from_outputs else batch

    @property
    def has_loss_from_outputs(self) -> bool:
        """Whether the module gives its loss as ``loss_from_outputs(outputs, batch)``."""
        return callable(getattr(self.module, LOSS_FROM_OUTPUTS, None))

    def planning_loss(self, batch: Any) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """``(logits, samples) -> loss`` of the first ``samples`` of the planning ``batch``, scored as training will
        score them: the module's ``loss_from_outputs``, else its ``training_step`` replayed with the network's call
        answered as the pipelined network answers it (with the model's own loss where the step passes ``labels``).
        A module that optimizes manually is not replayed: with stages it trains only by passing ``labels``."""
        targets = self.split_batch(batch)[1]
        if self.contract:
            return lambda logits, samples: self.module.loss_from_logits(logits, targets[:samples])
        network = self.network
        if self.has_loss_from_outputs:
            scorer = self.scorer(network)
            return lambda logits, samples: scorer(logits, select_samples(targets, torch.arange(samples)))
        labels = batch_labels(batch)
        if (not getattr(self.module, "automatic_optimization", True) and _is_pretrained(network)
                and isinstance(labels, torch.Tensor)):
            labelled = labelled_loss(self.module, self.attribute, network)
            return lambda logits, samples: labelled(logits, labels[:samples])
        from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature  # lazy: Lightning

        takes_index = is_param_in_hook_signature(self.module.training_step, "batch_idx", min_args=2)
        call = _ReplayedCall(self, network)
        replay = StepReplay(self.module, network, call.outputs, ((0,) if takes_index else (), {}), self.attribute)

        def replayed(logits: torch.Tensor, samples: int) -> torch.Tensor:
            with call.watched():
                loss = replay.score(logits, select_samples(batch, torch.arange(samples)))
            if replay.error is not None:
                raise TypeError(replay.error)
            return loss

        return replayed

    def scorer(self, network: nn.Module) -> MicroBatchLoss:
        """``(logits, batch) -> loss``: the module's ``loss_from_outputs`` on what the unsplit ``network`` would have
        returned around ``logits``."""
        loss_from_outputs = getattr(self.module, LOSS_FROM_OUTPUTS)
        wrap = _outputs_wrapper(network)
        return lambda logits, batch: loss_from_outputs(wrap(logits), batch)


def _outputs_wrapper(network: nn.Module) -> Callable[[Any], Any]:
    """What the unsplit ``network`` would have returned around its logits (a transformers output, or the logits)."""
    if not _is_pretrained(network):
        return lambda logits: logits
    from transformers.modeling_outputs import CausalLMOutput  # lazy: transformers

    return lambda logits: CausalLMOutput(logits=logits)


_SHIFTED = ("ForCausalLM", "ForConditionalGeneration")
_PER_TOKEN = ("ForMaskedLM", "ForTokenClassification")
_PER_SAMPLE = ("ForSequenceClassification", "ForImageClassification", "ForVideoClassification",
               "ForAudioClassification")
"""The transformers loss types (``PreTrainedModel.loss_type``) merak3d scores on the last stage: those computed from
the logits the model returns alone. Sequence classifiers return logits pooled per sample already."""


@dataclass(frozen=True)
class LabelledLoss:
    """A transformers model's own loss of its logits against the ``labels`` it is called with (its
    ``loss_function``, of the ``loss_type`` given): what its ``forward`` returns as ``loss``."""

    network: nn.Module
    loss_type: str

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, items: Optional[float] = None) -> torch.Tensor:
        """The loss of ``logits``: the mean over the labels :meth:`counted` counts, or with ``items`` their sum over
        ``items`` (a micro-batch's share of the batch's count: the micro-batches' mean is then the batch's mean, and a
        micro-batch that counts no label adds 0 instead of the NaN of an empty mean)."""
        loss_function, config = self.network.loss_function, self.network.config
        weighed = {} if items is None else {"num_items_in_batch": items}
        if self.loss_type in _PER_SAMPLE:
            if items is not None and not self._single_label(labels):  # a mean over every sample, no ignore index
                return loss_function(labels=labels, pooled_logits=logits, config=config) * (labels.shape[0] / items)
            return loss_function(labels=labels, pooled_logits=logits, config=config, **weighed)
        if self.loss_type == "ForTokenClassification":
            return loss_function(logits=logits, labels=labels, config=config, **weighed)
        return loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **weighed)

    def counted(self, labels: torch.Tensor) -> int:
        """How many of ``labels`` the mean is over: those not ``-100`` (after the shift of a causal LM), or every
        sample of a regression or multi-label classifier."""
        if self.loss_type in _SHIFTED:
            return int((labels[..., 1:] != IGNORE_INDEX).sum())
        if self.loss_type in _PER_SAMPLE and not self._single_label(labels):
            return labels.shape[0]
        return int((labels != IGNORE_INDEX).sum())

    def _single_label(self, labels: torch.Tensor) -> bool:
        """Whether a classifier's loss is a cross-entropy over class indices (ignoring ``-100``), as transformers
        chooses it: the config's ``problem_type``, else several labels and integer targets."""
        config = self.network.config
        problem = config.problem_type or ("single_label_classification" if config.num_labels > 1 and labels.dtype in
                                          (torch.long, torch.int) else "other")
        return problem == "single_label_classification"


def labelled_loss(module: Any, attribute: Optional[str], network: nn.Module) -> LabelledLoss:
    """The loss ``network`` (a transformers model ``module`` holds as ``attribute``) computes when called with
    ``labels``, where the last stage's logits give it; refused naming the fix otherwise."""
    loss_type = getattr(network, "loss_type", None)
    if loss_type is None and network.can_generate():  # transformers' default loss: a causal LM under another name
        loss_type = "ForCausalLM"
    if loss_type in (*_SHIFTED, *_PER_TOKEN, *_PER_SAMPLE):
        return LabelledLoss(network, loss_type)
    name = type(module).__name__
    raise TypeError(
        f"{name} calls self.{attribute or MODEL} with `labels`, and with pipeline stages merak3d computes that loss "
        f"on the last stage from the logits alone: the losses of causal and masked LMs, token classification and "
        f"sequence (image, audio, video) classification; {type(network).__name__} computes another "
        f"(loss_type={loss_type}). Compute the loss in training_step from the call without `labels`, or "
        f"{loss_from_outputs_snippet(name, attribute or MODEL)}")


def _unlabelled_refusal(module: Any, attribute: Optional[str]) -> TypeError:
    """The refusal of a network that is no transformers model called with ``labels``."""
    name = type(module).__name__
    return TypeError(f"{name} calls its network with `labels`, and merak3d scores `labels` with a transformers "
                     f"model's loss_function only: {loss_from_outputs_snippet(name, attribute or MODEL)}")


class _ReplayedCall:
    """The network's call in a ``training_step`` replayed for the planner, answered as :class:`PipelinedNetwork`
    answers it: the logits, with the model's own loss where the step passes ``labels``. A forward pre-hook reads the
    call's ``labels`` (the replay answers the call without its arguments)."""

    def __init__(self, view: ModuleView, network: nn.Module) -> None:
        self._view, self._network = view, network
        self._wrap = _outputs_wrapper(network)
        self._labels: Optional[torch.Tensor] = None

    @contextlib.contextmanager
    def watched(self) -> Iterator[None]:
        """Inside, the labels of the network's calls are read."""
        def read(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            self._labels = kwargs.get("labels")

        handle = self._network.register_forward_pre_hook(read, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()
            self._labels = None

    def outputs(self, logits: torch.Tensor) -> Any:
        if self._labels is None:
            return self._wrap(logits)
        view = self._view
        if not _is_pretrained(self._network):
            raise _unlabelled_refusal(view.module, view.attribute)
        from transformers.modeling_outputs import CausalLMOutput  # lazy: transformers

        loss = labelled_loss(view.module, view.attribute, self._network)(logits, self._labels)
        return CausalLMOutput(loss=loss, logits=logits)


def module_view(module: Any, pipeline_parallel: Optional[int], tensor_parallel: Optional[int]) -> ModuleView:
    """``module`` as merak3d will train it at these degrees (None: the planner chooses), refused before any work
    where it cannot: no network to split with stages or tensor shards."""
    view = ModuleView(module, find_network(module), isinstance(module, Merak3DModule))
    splits = pipeline_parallel != 1 or tensor_parallel != 1
    if view.attribute is None and splits:
        raise TypeError(
            f"merak3d splits a transformer network, and finds none among {type(module).__name__}'s children: hold it "
            f"as an attribute (a transformers PreTrainedModel, or a module with an nn.ModuleList or nn.Sequential of "
            f"repeated blocks), "
            f"or train with pipeline_parallel=1 and tensor_parallel=1 ({CONTRACT_GUIDE}){mixed_blocks_note(module)}")
    return view


_PASSED_OVER = {"use_cache": (None, False), "return_dict": (None, True), "output_attentions": (None, False),
                "output_hidden_states": (None, False)}
"""Keyword arguments a pipelined call accepts at these values only (what the stages compute anyway)."""


def install_module_loss(view: ModuleView, groups: LayoutGroups) -> None:
    """The module's loss where no pipeline schedule runs it: scored on vocabulary-parallel logits where the head is
    split (a drop-in network gathers its logits; a context-parallel one is called with labels, whose loss needs
    whole-vocabulary logits), and, with several batch replicas, a next-token loss weighted so that their average
    is the global batch's token mean (:mod:`~lightning_merak.parallel.data.token_mean`)."""
    module = view.module
    if view.contract and groups.layout.context_parallel == 1:
        module.loss_from_logits = vocab_parallel_loss(module.loss_from_logits, module.model)
    if groups.layout.batch_replicas > 1 and scores_next_token(module):
        weigh_replica_tokens(module, view.network, groups)


class PipelinedNetwork:
    """The call of a network cut into pipeline stages, installed as the stages' ``forward`` on the network's
    attribute: ``self.net(input_ids, labels=...)`` in a ``training_step`` runs the schedule.

    Training returns the loss (the mean of the micro-batches' losses, every rank of the replica gets it) as a
    transformers output's ``loss`` (or as what ``loss_from_outputs``, replaced on the instance, then returns);
    evaluation and prediction return the whole batch's logits as the unsplit network would, the loss with them
    where ``labels`` are given.
    """

    def __init__(self, view: ModuleView, network: nn.Module) -> None:
        self._view = view
        self.step: Any = None
        """The :class:`~.pipeline_step.PipelineStep` over the stages; its loss function is :meth:`micro_batch_loss`."""
        self._pretrained = _is_pretrained(network)
        self._input_name = _first_input_name(network)
        self._wrap = _outputs_wrapper(network)
        self._outputs_scorer = view.scorer(network) if view.has_loss_from_outputs else None
        self._network = network
        self._score: Optional[MicroBatchLoss] = None
        self.batch: Any = None
        """The batch of the running training step (the strategy sets it), for ``loss_from_outputs``."""
        self.step_arguments: tuple[tuple, dict[str, Any]] = ((), {})
        """The running training step's other arguments (``batch_idx``), for a replayed step."""
        if self._outputs_scorer is not None:
            own = getattr(view.module, LOSS_FROM_OUTPUTS)
            setattr(view.module, LOSS_FROM_OUTPUTS,
                    lambda outputs, batch: outputs.loss if isinstance(outputs, _PipelinedLoss) else own(outputs, batch))

    def micro_batch_loss(self, logits: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss function: the micro-batch of samples ``index`` scored as the running call says."""
        if self._score is None:  # an evaluation forward scores nothing; the schedule still calls it
            return torch.zeros((), device=index.device)
        return self._score(logits, index)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs, labels = self._arguments(args, kwargs)
        module = self._view.module
        if not (module.training and torch.is_grad_enabled()):
            logits = self.step.forward(inputs)
            if labels is None:
                return self._wrap(logits)
            return self._output(self._labelled_loss()(logits, labels), logits)
        if labels is None and self._outputs_scorer is None:
            self._replay_step(inputs)
        self._score = self._training_score(labels)
        try:
            loss = self.step.run(inputs, torch.arange(inputs.shape[0], device=inputs.device))
        finally:
            self._score = None
        return _PipelinedLoss(loss) if self._outputs_scorer is not None else self._output(loss, None)

    def _output(self, loss: torch.Tensor, logits: Optional[torch.Tensor]) -> Any:
        if not self._pretrained:
            return _PipelinedLoss(loss)
        from transformers.modeling_outputs import CausalLMOutput  # lazy: transformers

        return CausalLMOutput(loss=loss, logits=logits)

    def _replay_step(self, inputs: torch.Tensor) -> NoReturn:
        """Run the schedule with each micro-batch scored by the module's ``training_step`` replayed on its outputs
        (:mod:`.step_replay`); end the calling ``training_step`` with the loss, or refuse it on every rank."""
        view, batch = self._view, self.batch
        replay = StepReplay(view.module, view.network, self._wrap, self.step_arguments, view.attribute)
        replay.weigh_micro_batches(batch, self.step.micro_batches)
        self._score = lambda logits, index: replay.score(logits, select_samples(batch, index))
        try:
            loss = self.step.run(inputs, torch.arange(inputs.shape[0], device=inputs.device))
        finally:
            self._score = None
        error, logged = self.step.from_last_stage((replay.error, replay.logged))
        if error is not None:
            raise TypeError(error)
        raise ReplayedStep(loss, logged)

    def _training_score(self, labels: Optional[torch.Tensor]) -> MicroBatchLoss:
        """How this training call's micro-batches are scored: ``loss_from_outputs`` on the step's batch, else the
        transformers loss of the call's ``labels``, weighted so the mean over micro-batches is the batch's mean."""
        if self._outputs_scorer is not None:  # a micro-batch whose labels are all ignored weighs 0, as replayed
            scorer, batch = self._outputs_scorer, self.batch
            scale = scoring_scale(batch, self.step.micro_batches)
            return lambda logits, index: weighed_score(scorer, logits, select_samples(batch, index), scale)
        loss = self._labelled_loss()
        items = max(loss.counted(labels), 1) / self.step.micro_batches  # the batch's counted labels per micro-batch
        return lambda logits, index: loss(logits, labels[index], items)

    def _labelled_loss(self) -> LabelledLoss:
        """The network's own loss of its logits against the call's ``labels``, or the refusal naming the fix."""
        view = self._view
        if not self._pretrained:
            raise _unlabelled_refusal(view.module, view.attribute)
        return labelled_loss(view.module, view.attribute, self._network)

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(inputs, labels)`` of a call (the inputs: its first argument, by position or by the name the network's
        ``forward`` gives it); what the stages cannot take is refused, naming it."""
        kwargs = dict(kwargs)
        inputs = args[0] if args else kwargs.pop(self._input_name, None)
        labels = kwargs.pop("labels", None)
        mask = kwargs.pop("attention_mask", None)
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError("with pipeline_parallel>1 the stages take no attention_mask; pack or pad batches without "
                             "masked tokens (mask the labels with -100 instead), or train with pipeline_parallel=1")
        others = [name for name, value in kwargs.items() if value not in _PASSED_OVER.get(name, (None,))]
        if len(args) > 1 or others or not isinstance(inputs, torch.Tensor):
            given = [f"{len(args)} positional arguments"] if len(args) > 1 else others
            raise TypeError(f"with pipeline_parallel>1 the network is called with {self._input_name} (and labels) "
                            f"only; got {', '.join(given) or f'no {self._input_name}'}")
        return inputs, labels


def _first_input_name(network: nn.Module) -> str:
    """The name of ``network``'s first ``forward`` argument, which the stages take: ``input_ids`` for a language
    model, ``pixel_values`` for a vision one."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(network.forward).parameters.values() if p.kind in positional]
    return names[0] if names else "input_ids"


@dataclasses.dataclass(frozen=True)
class _PipelinedLoss:
    """A pipelined training call's result: the loss the schedule computed on the last stage."""

    loss: torch.Tensor
