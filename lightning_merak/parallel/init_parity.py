"""The eager build's random stream, kept by a model built on the meta device.

A transformers model built eagerly draws its initial weights from the CPU generator in one stream:
each layer's constructor draws (``nn.Linear`` / ``nn.Embedding`` ``reset_parameters``), then
``post_init`` runs ``_init_weights`` on every module, children before parents, each draw starting
where the previous one ended. A module's final values therefore depend on everything drawn before
it, and a meta build that seeds each module on its own (or draws on the accelerator's generator)
starts from other weights than DDP does with the same seed, so an A/B between strategies compares
two different models.

:func:`eager_init_stream` (entered by :func:`~lightning_merak.parallel.materialize.meta_device`)
makes a meta build consume the CPU generator exactly as the eager build does: every random op on a
meta tensor is also run on a CPU tensor of the same shape, strides and dtype (so the generator moves
as the eager op would move it, whatever the op's sampling path), and ``post_init`` runs
``initialize_weights`` on meta as it would on CPU. Before each module's ``_init_weights`` it stores
an :class:`EagerInit` on the module: the generator's state at that point and the tensors the module
held then. When the module is materialised, its ``_init_weights`` runs again from that state, its
draws made on the CPU generator whatever the device (:class:`CPUDraws`;
:mod:`~lightning_merak.parallel.materialize`), which gives the eager values bit for bit on any rank,
for any layout, without any rank building the whole model. The cost is the eager build's draws once
per rank, at build time (no memory beyond the largest single tensor), and a 5 KB generator state per
module; :func:`eager_init_suspended` skips them for a model whose weights a checkpoint replaces.

A seed checkpoint (torchtitan's ``--checkpoint.create_seed_checkpoint``) is exact too, but needs one
process to hold the whole model and a file every rank reads; replaying the stream needs neither.
The generator after the meta build is where the eager build leaves it, so what the program draws
next does not depend on the strategy either. Every rank must be seeded alike, as
for any seeded run (``seed_everything``; unseeded processes share torch's default seed).
"""

from __future__ import annotations

import contextlib
import warnings
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["CPUDraws", "EAGER_INIT_ATTRIBUTE", "EagerInit", "eager_init_of", "eager_init_stream",
           "eager_init_suspended", "own_tensors"]

_SUSPENDED: ContextVar[bool] = ContextVar("merak_eager_init_suspended", default=False)

EAGER_INIT_ATTRIBUTE = "_merak_eager_init"
"""The module attribute holding its :class:`EagerInit` (copied with the module by ``copy.deepcopy``)."""


@dataclass(frozen=True)
class EagerInit:
    """Where a module's ``_init_weights`` started in the eager build's CPU random stream.

    Attributes:
        rng_state: the CPU generator's state (``torch.get_rng_state()``) just before the call.
        tensors: the module's own parameters and buffers at that moment, by attribute name; a tensor
            tied in later (an LM head's weight becoming the embedding's) is not among them, so the
            replay leaves it to the module whose init the eager build kept.
    """

    rng_state: torch.Tensor
    tensors: dict[str, torch.Tensor]


def eager_init_of(module: nn.Module) -> Optional[EagerInit]:
    """The :class:`EagerInit` recorded for ``module`` by a meta build, or None."""
    return module.__dict__.get(EAGER_INIT_ATTRIBUTE)


def _off_cpu(value: Any) -> Optional[torch.device]:
    device = value.device if isinstance(value, torch.Tensor) else value if isinstance(value, torch.device) else None
    return device if device is not None and device.type != "cpu" else None


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="cpu") if value.is_meta \
            else value.cpu()
    return torch.device("cpu") if _off_cpu(value) is not None else value


def _writes_first_argument(func: Any) -> bool:
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


class CPUDraws(TorchDispatchMode):
    """Seeded random ops on tensors off the CPU (meta tensors included) draw on the CPU generator instead.

    The op runs on a CPU twin of the same shape, strides and dtype, so the generator moves as the eager op on CPU
    would move it (how many values an op consumes depends on the op, shape, strides and dtype only); an in-place
    op's twin is then copied into its tensor (a no-op on meta), an out-of-place op's result moved to the device.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        device = next(filter(None, map(_off_cpu, tree_flatten((args, kwargs))[0])), None)
        if device is None or (device.type == "meta" and _SUSPENDED.get()):
            return func(*args, **kwargs)
        cpu_args, cpu_kwargs = tree_map(_on_cpu, (args, kwargs))
        if _writes_first_argument(func):
            if args[0].device.type != "cpu":
                cpu_args = (torch.empty_strided(args[0].size(), args[0].stride(), dtype=args[0].dtype),
                            *cpu_args[1:])
            func(*cpu_args, **cpu_kwargs)
            return args[0].copy_(cpu_args[0]) if cpu_args[0] is not args[0] else args[0]
        return tree_map(lambda out: out.to(device) if isinstance(out, torch.Tensor) else out,
                        func(*cpu_args, **cpu_kwargs))


def own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s own parameters and buffers (not its children's), by attribute name."""
    return {key: tensor for store in (module._parameters, module._buffers) for key, tensor in store.items()
            if tensor is not None}


@contextlib.contextmanager
def _transformers_init_on_meta() -> Iterator[None]:
    """``post_init`` initialises on meta as on CPU (transformers skips it on meta), recording an
    :class:`EagerInit` before each module's ``_init_weights``."""
    try:
        from transformers import PreTrainedModel
        from transformers.modeling_utils import get_torch_context_manager_or_global_device
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    original_init_weights = PreTrainedModel.init_weights
    original_initialize = PreTrainedModel._initialize_weights

    def recording_initialize(self: Any, module: nn.Module, is_custom_code: bool = False) -> None:
        if not getattr(module, "_is_hf_initialized", False):
            module.__dict__[EAGER_INIT_ATTRIBUTE] = EagerInit(torch.get_rng_state(), own_tensors(module))
        original_initialize(self, module, is_custom_code)

    def init_weights(self: Any) -> None:
        if get_torch_context_manager_or_global_device() == torch.device("meta") and not _SUSPENDED.get():
            _initialize_on_meta(self)  # the eager build's draws; transformers' own call below skips them on meta
        original_init_weights(self)

    PreTrainedModel.init_weights = init_weights
    PreTrainedModel._initialize_weights = recording_initialize
    try:
        yield
    finally:
        PreTrainedModel.init_weights = original_init_weights
        PreTrainedModel._initialize_weights = original_initialize


def _initialize_on_meta(model: Any) -> None:
    """``model.initialize_weights()`` on meta; where an ``_init_weights`` needs values meta tensors lack, the stream
    and records are rolled back and the model's modules fall back to per-module seeds, with a warning."""
    state = torch.get_rng_state()
    try:
        model.initialize_weights()
    except (RuntimeError, NotImplementedError) as error:
        torch.set_rng_state(state)
        for module in model.modules():
            if module.__dict__.pop(EAGER_INIT_ATTRIBUTE, None) is not None:
                module.__dict__.pop("_is_hf_initialized", None)
        warnings.warn(f"{type(model).__name__}._init_weights cannot run on the meta device ({error}); its modules "
                      "are initialised from per-module seeds, not the eager build's values", stacklevel=2)


@contextlib.contextmanager
def eager_init_stream() -> Iterator[None]:
    """Meanwhile, models built on the meta device draw from the CPU generator as an eager build would and
    record where each module's transformers initialisation starts (:class:`EagerInit`)."""
    with _transformers_init_on_meta(), CPUDraws():
        yield


@contextlib.contextmanager
def eager_init_suspended() -> Iterator[None]:
    """Meanwhile, a meta build inside :func:`eager_init_stream` draws nothing and records nothing: for a model whose
    weights a checkpoint will replace, the eager build's draws (as long as the eager build itself) would be
    wasted. Its modules then fall back to per-module seeds where they are initialised at all."""
    token = _SUSPENDED.set(True)
    try:
        yield
    finally:
        _SUSPENDED.reset(token)
