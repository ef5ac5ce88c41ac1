"""A pipelined module's loss read from its own ``training_step``, run per micro-batch on the last stage.

With pipeline stages the loss of each micro-batch is computed on the last stage, so merak3d must know how it
comes from the network's outputs. Where the module neither calls a transformers network with ``labels`` nor
gives ``loss_from_outputs``, the code that turns the outputs into the loss is the ``training_step`` itself:
:class:`StepReplay` runs it on each micro-batch's samples with the network's call answered by that micro-batch's
outputs, and holds back what it logs. The ``training_step`` the trainer called ends at its network call
(:class:`ReplayedStep` carries the schedule's loss out to the strategy), and what the replays logged is logged
once on every rank, averaged over the micro-batches — as the unsplit step logs the batch's mean loss.

The replay needs a step that calls the network once and computes its loss from what that call returns; any other
step is refused at its first batch, on every rank, with the one method that replaces the inference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from lightning_merak.protocols.module_contract import MODEL, loss_from_outputs_snippet

__all__ = ["LoggedValues", "ReplayedStep", "StepReplay"]


@dataclass
class LoggedValues:
    """What a step's replays logged: each name's values (one per micro-batch) and the options of its first call."""

    values: dict[str, list[float]] = field(default_factory=dict)
    options: dict[str, tuple[tuple, dict[str, Any]]] = field(default_factory=dict)

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
        self.options.setdefault(name, (args, kwargs))

    def log_means(self, module: Any, micro_batches: int) -> None:
        """Log each name's mean over the step's last ``micro_batches`` values (a first step's shape inference scores
        one micro-batch more) through ``module.log``, with the options it was logged with."""
        for name, values in self.values.items():
            args, kwargs = self.options[name]
            values = values[-micro_batches:]
            mean = torch.tensor(sum(values) / len(values), dtype=torch.float32, device=module.device)
            module.log(name, mean, *args, **kwargs)


class ReplayedStep(BaseException):
    """Raised by the pipelined network's call inside ``training_step`` once the schedule ran: the step's loss and
    what its replays logged. A ``BaseException``, so an ``except Exception`` around the call lets it through."""

    def __init__(self, loss: torch.Tensor, logged: LoggedValues) -> None:
        super().__init__("the pipelined training step ran; merak3d's strategy takes its loss")
        self.loss = loss
        self.logged = logged


class _NotReplayable(Exception):
    """Why a step cannot be replayed on a micro-batch's outputs."""


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

    def score(self, logits: Any, samples: Any) -> torch.Tensor:
        """The loss ``training_step`` computes on ``samples`` (a micro-batch of the step's batch) when its network
        returns ``logits``; a failure is kept and scores zero (still connected to ``logits``, so the schedule's
        backward runs)."""
        if self.error is None:
            try:
                return self._replay(logits, samples)
            except Exception as error:  # kept for every rank to raise after the schedule
                self.error = self.refusal(f"{type(error).__name__}: {error}")
        anchor = next((leaf for leaf in tree_flatten(logits)[0] if isinstance(leaf, torch.Tensor)), None)
        return anchor.sum() * 0.0 if anchor is not None else torch.zeros(())

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
        own_forward = network.__dict__.get("forward")
        network.forward = answer
        module.log = self.logged.record
        args, kwargs = self._step_arguments
        try:
            result = module.training_step(samples, *args, **kwargs)
        finally:
            del module.log
            if own_forward is None:
                del network.forward
            else:
                network.forward = own_forward
        loss = result.get("loss") if isinstance(result, Mapping) else result
        if calls == 0:
            raise _NotReplayable(f"training_step does not call self.{self._network_name}")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise _NotReplayable(f"training_step returns {type(result).__name__}, not a scalar loss tensor or a "
                                 "dict with one under 'loss'")
        if not loss.requires_grad:
            raise _NotReplayable(f"the loss training_step returns does not depend on self.{self._network_name}'s "
                                 "outputs")
        return loss.reshape(())
