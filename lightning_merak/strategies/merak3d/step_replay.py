"""A pipelined module's loss read from its own ``training_step``, run per micro-batch on the last stage.

With pipeline stages the loss of each micro-batch is computed on the last stage, so merak3d must know how it
comes from the network's outputs. Where the module neither calls a transformers network with ``labels`` nor
gives ``loss_from_outputs``, the code that turns the outputs into the loss is the ``training_step`` itself:
:class:`StepReplay` runs it on each micro-batch's samples with the network's call answered by that micro-batch's
outputs, and holds back what it logs. The ``training_step`` the trainer called ends at its network call
(:class:`ReplayedStep` carries the schedule's loss out to the strategy), and what the replays logged is logged
once on every rank, reduced over the micro-batches by its ``reduce_fx`` (a mean weighted by their samples, a max, a
min or a sum) — as the unsplit step logs the batch's. What the step the trainer called logged before its network
call saw the whole batch, and is kept (:func:`names_logged`).

The replay needs a step that calls the network once and computes its loss from what that call returns; any other
step is refused at its first batch, on every rank, with the one method that replaces the inference. A step whose
loss reads the network's parameters itself (an L2 term over ``self.model.parameters()``) is refused alike: the last
stage holds only its own, so the term would silently leave out the other stages'.

A micro-batch whose labels are all the ignore index (``-100``) scores nothing: a mean loss over its labels is NaN
(0/0), which would make the step's loss and gradients NaN where one process, scoring the whole batch, gives a
number. Once :meth:`StepReplay.weigh_micro_batches` saw the step's batch, such a micro-batch weighs 0 and the
others' mean is re-normalised over the micro-batches that score a label; a module's own ``loss_from_outputs`` is
weighed alike (:func:`weighed_score`).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_merak.parallel.context.model import IGNORE_INDEX
from lightning_merak.protocols.module_contract import MODEL, loss_from_outputs_snippet

__all__ = ["LoggedValues", "ReplayedStep", "StepReplay", "batch_labels", "names_logged", "scoring_scale",
           "weighed_score"]


def batch_labels(batch: Any) -> Any:
    """The targets of ``batch`` where its structure says so: a dict's ``labels``, a tuple's second item."""
    if isinstance(batch, dict):
        return batch.get("labels")
    if isinstance(batch, (tuple, list)) and len(batch) > 1:
        return batch[1]
    return None


def _scores_a_label(samples: Any) -> bool:
    """Whether ``samples`` (a micro-batch) hold a label other than the ignore index, or no labels tensor at all."""
    labels = batch_labels(samples)
    return not isinstance(labels, torch.Tensor) or bool((labels != IGNORE_INDEX).any())


def scoring_scale(batch: Any, micro_batches: int) -> float:
    """The weight of each micro-batch that scores a label when ``batch`` is split into ``micro_batches`` along its
    first dimension as the schedule splits it: ``micro_batches`` over their count, so that with the others weighing 0
    the schedule's mean is theirs (1 where every one scores a label, none does, or the batch names no labels)."""
    labels = batch_labels(batch)
    if not isinstance(labels, torch.Tensor):
        return 1.0
    scoring = int(sum((part != IGNORE_INDEX).any() for part in torch.tensor_split(labels, micro_batches)))
    return micro_batches / scoring if scoring else 1.0


def weighed_score(score: Callable[[Any, Any], torch.Tensor], logits: Any, samples: Any,
                  scale: float) -> torch.Tensor:
    """``score(logits, samples)`` weighed by ``scale`` (:func:`scoring_scale`); a micro-batch that scores no label is
    not scored (its mean loss is 0/0) and gives zero, still connected to ``logits`` so the schedule's backward runs."""
    if scale == 1.0:
        return score(logits, samples)
    if _scores_a_label(samples):
        return score(logits, samples) * scale
    return _zero_loss_of(logits)


def _samples_in(micro_batch: Any) -> int:
    """How many samples ``micro_batch`` holds: its first tensor's first dimension (1 without a tensor)."""
    first = next((leaf for leaf in tree_flatten(micro_batch)[0] if isinstance(leaf, torch.Tensor) and leaf.ndim), None)
    return first.shape[0] if first is not None else 1


def _reduce_fx_of(args: tuple, kwargs: dict[str, Any]) -> Any:
    """The ``reduce_fx`` of a ``LightningModule.log(name, value, *args, **kwargs)`` call (default ``"mean"``)."""
    from lightning.pytorch import LightningModule  # lazy: only read when a replayed step logged something

    bound = inspect.signature(LightningModule.log).bind(None, "", 0, *args, **kwargs)
    return bound.arguments.get("reduce_fx", "mean")


def _reduced(values: list[float], samples: list[int], reduce_fx: Any) -> float:
    """``values`` (one per micro-batch of ``samples`` samples) reduced as ``reduce_fx`` reduces them over the steps:
    ``max``, ``min`` and ``sum`` over the micro-batches, a mean weighted by their samples (the whole batch's mean
    where each value is its micro-batch's mean)."""
    name = (reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")).lower()
    if name in ("max", "amax"):
        return max(values)
    if name in ("min", "amin"):
        return min(values)
    if name == "sum":
        return sum(values)
    return sum(value * count for value, count in zip(values, samples)) / sum(samples)


@contextlib.contextmanager
def names_logged(module: Any, watched: bool = True) -> Iterator[set[str]]:
    """Inside, the names ``module.log`` logs (those of the step the trainer called, before its network call, which
    saw the whole batch: its replays' values of them are dropped); an empty set where not ``watched``."""
    names: set[str] = set()
    if not watched:
        yield names
        return
    log = module.log

    def logging(name: str, *args: Any, **kwargs: Any) -> Any:
        names.add(name)
        return log(name, *args, **kwargs)

    own_log = module.__dict__.get("log")
    module.log = logging
    try:
        yield names
    finally:
        _restore(module, "log", own_log)


def _restore(owner: Any, name: str, own: Any) -> None:
    """Put back ``owner``'s instance attribute ``name`` as it was (``own``; None: it had none)."""
    if own is None:
        owner.__dict__.pop(name, None)
    else:
        setattr(owner, name, own)


def _zero_loss_of(logits: Any) -> torch.Tensor:
    """A zero loss connected to ``logits``' first tensor (so a backward through it runs), or a plain zero."""
    anchor = next((leaf for leaf in tree_flatten(logits)[0] if isinstance(leaf, torch.Tensor)), None)
    return anchor.sum() * 0.0 if anchor is not None else torch.zeros(())


@dataclass
class LoggedValues:
    """What a step's replays logged: each name's values (one per micro-batch) and the options of its first call."""

    values: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[str, list[int]] = field(default_factory=dict)
    """Per value, the samples of its micro-batch (a mean weighs them)."""
    options: dict[str, tuple[tuple, dict[str, Any]]] = field(default_factory=dict)
    counted: dict[str, list[bool]] = field(default_factory=dict)
    """Per value, whether its micro-batch counts in the mean (one that scores no label does not)."""
    counting: bool = True
    """Whether the values logged now count (:class:`StepReplay` sets it per micro-batch)."""
    micro_batch_samples: int = 1
    """The samples of the micro-batch whose values are logged now (:class:`StepReplay` sets it)."""

    def record(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """``LightningModule.log``'s signature: keep the value, log nothing yet."""
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            number = float(value.detach().float())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        else:
            raise TypeError(f"self.log({name!r}, ...) gets a {type(value).__name__}; in a pipelined training_step "
                            "merak3d averages what is logged over the micro-batches, so log a scalar tensor or number")
        self.values.setdefault(name, []).append(number)
        self.samples.setdefault(name, []).append(self.micro_batch_samples)
        self.counted.setdefault(name, []).append(self.counting)
        self.options.setdefault(name, (args, kwargs))

    def log_means(self, module: Any, micro_batches: int, logged_outside: Iterable[str] = ()) -> None:
        """Log each name's step's last ``micro_batches`` values (a first step's shape inference scores one
        micro-batch more) that count, all of them if none does, reduced by its ``reduce_fx`` (:func:`_reduced`),
        through ``module.log`` with the options it was logged with; not the names in ``logged_outside``, which the
        step the trainer called logged on the whole batch."""
        for name, values in self.values.items():
            if name in logged_outside:
                continue
            args, kwargs = self.options[name]
            kept = list(zip(values, self.samples[name], self.counted[name]))[-micro_batches:]
            kept = [entry for entry in kept if entry[2]] or kept
            value = _reduced([entry[0] for entry in kept], [entry[1] for entry in kept], _reduce_fx_of(args, kwargs))
            module.log(name, torch.tensor(value, dtype=torch.float32, device=module.device), *args, **kwargs)


class ReplayedStep(BaseException):
    """Raised by the pipelined network's call inside ``training_step`` once the schedule ran: the step's loss and
    what its replays logged. A ``BaseException``, so an ``except Exception`` around the call lets it through."""

    def __init__(self, loss: torch.Tensor, logged: LoggedValues) -> None:
        super().__init__("the pipelined training step ran; merak3d's strategy takes its loss")
        self.loss = loss
        self.logged = logged


class _NotReplayable(Exception):
    """Why a step cannot be replayed on a micro-batch's outputs."""


class _StageParametersRead(Exception):
    """The refusal of a step whose loss reads the network's parameters itself (the whole message)."""


def _parameters_read(loss: torch.Tensor, outputs: Any, network: nn.Module) -> list[str]:
    """The names of ``network``'s parameters that ``loss`` depends on other than through ``outputs`` (the network
    call's answer): autograd's graph of ``loss``, not followed into the graph that made ``outputs``."""
    made_outputs = {leaf.grad_fn for leaf in tree_flatten(outputs)[0]
                    if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None}
    names = {id(param): name for name, param in network.named_parameters()}
    original = getattr(network, "original_name", lambda name: name)
    read: set[int] = set()
    seen: set[Any] = set()
    pending = [loss.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or node in seen or node in made_outputs:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad: the leaf it accumulates into
        if variable is not None and id(variable) in names:
            read.add(id(variable))
        pending.extend(following for following, _ in node.next_functions)
    return [original(name) for key, name in names.items() if key in read]


class StepReplay:
    """Replays ``module.training_step`` on micro-batches, ``network`` answering its call with given outputs.

    ``wrap`` turns a micro-batch's logits into what the unsplit network returns (a transformers output, or the
    logits); ``step_arguments`` are the training step's arguments after the batch (``batch_idx``) and its keyword
    arguments. Failures are kept, not raised (:attr:`error`): the last stage must finish the schedule with its
    peers before every rank refuses the step together.
    """

    def __init__(self, module: Any, network: nn.Module, wrap: Callable[[Any], Any],
                 step_arguments: tuple[tuple, dict[str, Any]], network_name: Optional[str]) -> None:
        if not getattr(module, "automatic_optimization", True):
            name = type(module).__name__
            raise TypeError(
                f"{name} optimizes manually, and merak3d reads its pipelined loss by running training_step once per "
                f"micro-batch, which would run its manual_backward and optimizer steps as often; call "
                f"self.{network_name or MODEL} with `labels` (a transformers model), or "
                f"{loss_from_outputs_snippet(name, network_name or MODEL)}")
        self._module = module
        self._network = network
        self._wrap = wrap
        self._step_arguments = step_arguments
        self._network_name = network_name or MODEL
        self.logged = LoggedValues()
        self.error: Optional[str] = None
        self._scale = 1.0
        """What a micro-batch scoring a label weighs: the micro-batches over those of them that score one."""

    def weigh_micro_batches(self, batch: Any, micro_batches: int) -> None:
        """Weigh the step's micro-batches, ``batch`` split into ``micro_batches`` along its first dimension as the
        schedule splits it: one whose labels are all the ignore index weighs 0, the others ``micro_batches`` over
        their count, so the schedule's mean is theirs (nothing changes where every one scores a label, or none)."""
        self._scale = scoring_scale(batch, micro_batches)

    def score(self, logits: Any, samples: Any) -> torch.Tensor:
        """The loss ``training_step`` computes on ``samples`` (a micro-batch of the step's batch) when its network
        returns ``logits``, weighed (:meth:`weigh_micro_batches`); a failure is kept, and it and a micro-batch that
        weighs 0 score zero (still connected to ``logits``, so the schedule's backward runs)."""
        if self.error is None:
            counts = self._scale == 1.0 or _scores_a_label(samples)
            self.logged.counting, self.logged.micro_batch_samples = counts, _samples_in(samples)
            try:
                loss = self._replay(logits, samples)
                if counts:
                    return loss if self._scale == 1.0 else loss * self._scale
            except _StageParametersRead as error:
                self.error = str(error)
            except Exception as error:  # kept for every rank to raise after the schedule
                self.error = self.refusal(f"{type(error).__name__}: {error}")
        return _zero_loss_of(logits)

    def refusal(self, reason: str) -> str:
        name = type(self._module).__name__
        return (f"merak3d infers {name}'s loss at pipeline_parallel>1 by running its training_step on each "
                f"micro-batch's outputs on the last stage, and could not ({reason}); "
                f"{loss_from_outputs_snippet(name, self._network_name)}")

    def _replay(self, logits: Any, samples: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(logits, DTensor):  # vocabulary-sharded: the module's own code expects whole logits
            logits = logits.full_tensor()
        calls = 0

        def answer(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise _NotReplayable(f"training_step calls self.{self._network_name} more than once")
            return self._wrap(logits)

        network, module = self._network, self._module
        own_forward, own_log = network.__dict__.get("forward"), module.__dict__.get("log")
        network.forward = answer
        module.log = self.logged.record
        args, kwargs = self._step_arguments
        try:
            result = module.training_step(samples, *args, **kwargs)
        finally:
            _restore(module, "log", own_log)
            _restore(network, "forward", own_forward)
        loss = result.get("loss") if isinstance(result, Mapping) else result
        if calls == 0:
            raise _NotReplayable(f"training_step does not call self.{self._network_name}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise _NotReplayable(f"training_step returns {type(result).__name__}, not a scalar loss tensor or a "
                                 "dict with one under 'loss'")
        if not loss.requires_grad:
            raise _NotReplayable(f"the loss training_step returns does not depend on self.{self._network_name}'s "
                                 "outputs")
        read = _parameters_read(loss, logits, network)
        if read:
            shown = ", ".join(read[:3]) + (f" and {len(read) - 3} more" if len(read) > 3 else "")
            raise _StageParametersRead(
                f"{type(module).__name__}.training_step reads the network's parameters itself ({shown}), not only "
                f"through the outputs of self.{self._network_name}: at pipeline_parallel>1 the loss is computed on "
                "the last pipeline stage, which holds only that stage's parameters, so a term over them (an L2 "
                f"penalty over self.{self._network_name}.parameters()) would leave the other stages' out; give such a "
                "penalty as the optimizer's weight_decay (2λ for a term λ·Σ p²), or train with pipeline_parallel=1")
        return loss.reshape(())
