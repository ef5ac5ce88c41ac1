"""The optimizers the first batch's build re-creates, kept in the objects Lightning, the schedulers and callbacks hold.

``configure_optimizers`` runs at setup over the whole model; the build then replaces the parameters with this rank's
stages and shards, so it runs again (its optimizers, Muon's split included, see the parameters they step; a group
whose parameters all live on other pipeline stages is empty on this rank, and an optimizer whose parameters all do
is refused with the fix). Between
the two, callbacks may change the first optimizers (``on_train_start`` setting a learning rate, a scheduler
``StochasticWeightAveraging`` appends): :func:`adopt_rebuilt` makes each first optimizer the rebuilt one in place,
its groups keeping their hyperparameters, so that nothing a callback set or holds is lost.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch

__all__ = ["EMPTY_OPTIMIZER", "HyperParameters", "adopt_rebuilt", "empty_optimizer_refusal", "group_counts_match",
           "hyperparameters", "refuse_changes"]

HyperParameters = list[list[dict[str, Any]]]
"""Per optimizer, per param group, everything but its parameters."""

EMPTY_OPTIMIZER = "optimizer got an empty parameter list"
"""torch's refusal of an optimizer given no parameter (one whose parameters all live on other pipeline stages)."""

_KEPT_ATTRIBUTES = ("step", "_opt_called")
"""An optimizer's instance attributes a scheduler sets on it (a ``step`` wrapper bound to that very object)."""


def hyperparameters(optimizers: Sequence[torch.optim.Optimizer]) -> HyperParameters:
    """What each group of ``optimizers`` sets besides its parameters (a copy)."""
    return [[{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
            for optimizer in optimizers]


def group_counts_match(first: Sequence[torch.optim.Optimizer], rebuilt: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether ``rebuilt`` are as many optimizers of the same types with as many groups as ``first``: their groups
    then correspond one to one (not where ``configure_optimizers`` makes groups per layer this rank holds)."""
    return len(first) == len(rebuilt) and all(
        type(old) is type(new) and len(old.param_groups) == len(new.param_groups) for old, new in zip(first, rebuilt))


def adopt_rebuilt(first: Sequence[torch.optim.Optimizer], rebuilt: Sequence[torch.optim.Optimizer]) -> None:
    """Make each of ``first`` (:func:`group_counts_match`) the rebuilt optimizer in place, with its groups'
    hyperparameters as ``first`` had them: its parameters, state and structure are ``rebuilt``'s; the hooks
    registered on it and the ``step`` its schedulers wrapped stay."""
    for old, new in zip(first, rebuilt):
        groups = hyperparameters([old])[0]
        kept = {key: vars(old)[key] for key in _KEPT_ATTRIBUTES if key in vars(old)}
        hooks = {key: value for key, value in vars(old).items() if key.endswith("_hooks")}
        vars(old).clear()
        vars(old).update({key: value for key, value in vars(new).items() if key not in _KEPT_ATTRIBUTES})
        vars(old).update(kept)
        for key, registered in hooks.items():
            setattr(old, key, OrderedDict([*registered.items(), *vars(new).get(key, {}).items()]))
        for group, values in zip(old.param_groups, groups):
            group.update(values)


def empty_optimizer_refusal(pipeline_parallel: int) -> str:
    """Why an optimizer of ``configure_optimizers`` cannot be re-created on a rank that holds none of its
    parameters, and the fix: a parameter group, which torch takes empty."""
    return (f"configure_optimizers makes an optimizer of parameters that all live on other pipeline stages than some "
            f"rank's (pipeline_parallel={pipeline_parallel}; e.g. `SGD(self.model.head.parameters())` on a rank "
            f"without the head), and torch refuses an optimizer with no parameter ({EMPTY_OPTIMIZER!r}); give them "
            "as a parameter group, which may be empty on a rank: `SGD([{'params': self.model.head.parameters()}], "
            "lr=...)`, or train with pipeline_parallel=1")


def refuse_changes(configured: HyperParameters, first: Sequence[torch.optim.Optimizer],
                   scheduler_counts: tuple[int, int]) -> None:
    """Where the rebuilt optimizers' groups do not correspond to the first ones', refuse what a callback changed in
    the first since ``configure_optimizers`` (``configured``) or a scheduler it added (``scheduler_counts``: the
    schedulers held, and those ``configure_optimizers`` gives now): it would be lost."""
    changed = [index for index, (before, now) in enumerate(zip(configured, hyperparameters(first)))
               if not _same(before, now)]
    if len(configured) != len(first):
        changed.append(len(configured))
    held, configured_now = scheduler_counts
    if changed or held != configured_now:
        what = (f"optimizer {changed[0]}'s param groups (a learning rate, an added group)" if changed
                else f"the learning-rate schedulers ({held} held, {configured_now} from configure_optimizers)")
        raise RuntimeError(
            f"a callback changed {what} before the first batch, and merak3d re-creates the optimizers there over "
            "this rank's part of the model, whose groups configure_optimizers makes differently from the whole "
            "model's, so the change would be lost; make it in configure_optimizers, or from on_train_batch_start "
            "(after the first batch's build)")


def _same(before: list[dict[str, Any]], now: list[dict[str, Any]]) -> bool:
    """Whether two lists of groups' hyperparameters are equal (tensor values compared by value)."""
    if len(before) != len(now) or any(first.keys() != second.keys() for first, second in zip(before, now)):
        return False
    for first, second in zip(before, now):
        for key, value in first.items():
            other = second[key]
            equal = torch.equal(value, other) if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) \
                else value == other
            if not equal:
                return False
    return True
