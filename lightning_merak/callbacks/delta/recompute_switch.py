"""Switch a block between running normally and recomputing its forward in backward.

The block's ``forward`` is replaced *on the instance* by a :class:`SwitchableForward`,
so the module tree, parameter names and ``state_dict`` stay exactly as the user wrote
them, and DDP (which wraps after ``Callback.setup``) sees the same parameters. The plan
only flips :attr:`SwitchableForward.recompute` afterwards.

The recomputation replays the block in training mode, so it leaves the block's buffers as the original forward
left them (:class:`~lightning_merak.util.buffers.KeptBuffers`): a BatchNorm's running statistics count each
training batch once, as without DeltaMemory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_merak.protocols.layout_aware import RecomputedForward
from lightning_merak.util.buffers import KeptBuffers
from lightning_merak.util.model_outputs import no_cache

__all__ = [
    "SwitchableForward", "install_switch", "remove_switch", "strategy_recompute", "turn_off_kv_caches",
    "user_checkpointing",
]


class SwitchableForward:
    """Calls the block's own forward, through non-reentrant checkpointing when recomputing.

    ``preserve_rng_state=True`` replays the forward's RNG state, so dropout masks in the
    recomputation match the original ones and gradients are identical. The replay takes the
    same arguments, so a key/value cache among them is refused (see :func:`turn_off_kv_caches`),
    and keeps the buffers the original forward left (running statistics updated once per batch).
    """

    def __init__(self, module: nn.Module) -> None:
        self.original = module.forward
        self.module = module
        self.block_type = type(module).__name__
        self.recompute = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.recompute and torch.is_grad_enabled():
            self._refuse_kv_cache(kwargs)
            return checkpoint(
                self.original,
                *args,
                use_reentrant=False,
                preserve_rng_state=True,
                determinism_check="default",
                context_fn=self._contexts,
                **kwargs,
            )
        return self.original(*args, **kwargs)

    def _contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """Checkpointing's contexts: the forward runs as it is; each recomputation keeps the buffers."""
        return contextlib.nullcontext(), KeptBuffers(self.module)

    def _refuse_kv_cache(self, kwargs: Mapping[str, Any]) -> None:
        """A cache the first forward appended to would get the block's keys and values a second time."""
        for name, value in kwargs.items():
            if callable(getattr(value, "get_seq_length", None)):
                raise ValueError(
                    f"DeltaMemory recomputes a {self.block_type} whose call got a key/value cache "
                    f"({name}={type(value).__name__}); the recomputation would append its keys to the cache a "
                    "second time: call the model with use_cache=False in training"
                )


def turn_off_kv_caches(module: nn.Module) -> list[Any]:
    """Turn off the key/value cache of every transformers model under ``module``; returns the configs changed.

    Recompute replays a block's call with the same arguments, so a cache in them would take the keys
    twice (transformers' own gradient checkpointing turns the cache off for the same reason).
    """
    changed: dict[int, Any] = {}
    for submodule in module.modules():
        config = getattr(submodule, "config", None)
        if getattr(config, "use_cache", False) is True:
            no_cache(submodule)
            changed[id(config)] = config
    return list(changed.values())


def install_switch(module: nn.Module) -> SwitchableForward:
    if isinstance(module.__dict__.get("forward"), SwitchableForward):
        return module.__dict__["forward"]
    switch = SwitchableForward(module)
    module.forward = switch
    return switch


def remove_switch(module: nn.Module) -> None:
    if isinstance(module.__dict__.get("forward"), SwitchableForward):
        del module.__dict__["forward"]


def user_checkpointing(module: nn.Module) -> Optional[str]:
    """Why ``module`` is already managed by someone else's checkpointing, or None."""
    if hasattr(module, "_checkpoint_wrapped_module"):  # where torch's CheckpointWrapper holds the module it wraps
        return "wrapped by torch checkpoint_wrapper"
    if getattr(module, "gradient_checkpointing", False) is True:
        return "transformers gradient checkpointing is enabled"
    forward = module.__dict__.get("forward")
    if forward is not None and not isinstance(forward, SwitchableForward):
        return "its forward was replaced on the instance by another wrapper"
    return None


def strategy_recompute(module: nn.Module, strategy: Any) -> Optional[str]:
    """Why ``module`` is recomputed by the training strategy, or None.

    A strategy that recomputes a block installs a :class:`~lightning_merak.protocols.layout_aware.RecomputedForward`
    on it (merak3d with ``recompute="full"``/``"stage_aware"``).
    """
    if not isinstance(module.__dict__.get("forward"), RecomputedForward):
        return None
    name = getattr(strategy, "strategy_name", type(strategy).__name__)
    return f"recomputed by the {name} strategy (recompute={getattr(strategy, 'recompute', None)!r})"
