"""Meta-device models: give one module at a time real storage and the model's own initialisation.

A model built under ``torch.device("meta")`` (Lightning's ``trainer.init_module(empty_init=True)``
or ``configure_model()`` under merak3d) has shapes but no storage. merak3d decides the layout on
the meta model and then materialises only what this rank holds, module by module
(:class:`Materializer`): storage on the device (ties between parameters kept), then the
initialisation the model itself would run — a transformers model's ``_init_weights`` on each
module (it recomputes rotary ``inv_freq`` buffers too), ``reset_parameters()`` elsewhere, the
convention of Lightning's ``_materialize_distributed_module``; a module carrying a ``materialize_init``
callable (adapter weights: :mod:`lightning_merak.adapters.meta`) is initialised by it instead. Storage
is filled with NaN (integers with their minimum) first, so a parameter or buffer that no initialisation
wrote is refused by name instead of training on garbage.

A transformers model built in :func:`meta_device` draws exactly what the eager build
(``AutoModelForCausalLM.from_config`` under the same seed, i.e. DDP's model) draws: each module's
``_init_weights`` replays from the CPU generator state the eager build was in when it reached that
module (:mod:`~lightning_merak.parallel.init_parity`), so the initial model does not depend on the
strategy or the layout. Other modules are seeded from their name in the unsplit model. Either way every
rank that holds a module (data-parallel replicas, the tensor-parallel ranks before the split) draws the
same values without communicating. Pretrained weights replace the random ones afterwards through a
:data:`WeightLoader` (:func:`local_tensors` names what this rank holds).
"""

from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from lightning_merak.parallel.init_parity import CPUDraws, EagerInit, eager_init_of, eager_init_stream, own_tensors

if TYPE_CHECKING:
    from lightning_merak.parallel.tensor.quantized_shards import QuantizedShard

__all__ = ["Materializer", "RestoreAfterRewrite", "WeightLoader", "copy_full_tensors", "has_meta", "init_owners",
           "local_tensors", "meta_device"]

WeightLoader = Callable[[dict[str, torch.Tensor], dict[str, Any]], None]
"""``(tensors, layout_changes) -> None``: fill this rank's ``tensors`` (by unsplit name: plain tensors, or
DTensor shards of the tensor-parallel split) in place, from pretrained weights. ``layout_changes`` maps an
unsplit name to the :class:`~lightning_merak.parallel.tensor.blocks.LayoutChange` its full tensor went through."""


@contextlib.contextmanager
def meta_device(precision: Optional[Any] = None) -> Iterator[None]:
    """Tensors created meanwhile go on the meta device (in ``precision``'s dtype when a precision plugin is given),
    drawing from the CPU generator as an eager build would (:func:`~lightning_merak.parallel.init_parity.
    eager_init_stream`), so materialised modules get the eager build's values."""
    dtype = precision.tensor_init_context() if precision is not None else contextlib.nullcontext()
    with torch.device("meta"), dtype, eager_init_stream():
        yield


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is still on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def init_owners(model: nn.Module) -> dict[str, Any]:
    """By module name, the nearest transformers ``PreTrainedModel`` (itself included) above each module of
    ``model``, as its ``initialize_weights`` dispatches init functions. Names hold for copies and parts of it."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return {}
    owners: dict[str, Any] = {}

    def visit(name: str, module: nn.Module, owner: Any) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        if owner is not None:
            owners[name] = owner
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, owner)

    visit("", model, None)
    return owners


def _poison(tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).min)


def _poisoned(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    if tensor.dtype == torch.bool or tensor.numel() == 0:
        return False
    return bool((tensor == torch.iinfo(tensor.dtype).min).any())


_KEPT_MARKS = ("allreduce", "group_name")
"""Parameter attributes a real parameter keeps from its meta one (DeepSpeed's and ``merak_ep``'s expert marks)."""


class Materializer:
    """Materialises parts of one meta model on ``device``; parameters tied in it stay tied.

    A module whose eager initialisation a meta build recorded replays it; for any other, ``seed`` (the same on
    every rank) and its unsplit name fix its random initialisation. ``owners`` are :func:`init_owners` of the
    unsplit model. ``observer`` (tests) is called after each module is materialised.
    """

    observer: Optional[Callable[[], None]] = None

    def __init__(self, device: torch.device, seed: int, owners: dict[str, Any]) -> None:
        self.device = torch.device(device)
        self.seed = seed
        self._owners = owners
        self._memo: dict[int, torch.Tensor] = {}

    def materialize(self, module: nn.Module, name: str, recurse: bool = True) -> None:
        """Give ``module`` (named ``name`` in the unsplit model) and, with ``recurse``, everything under it
        storage and initial values (children before parents, as transformers' ``post_init`` goes)."""
        fresh: list[tuple[str, nn.Module, dict[str, torch.Tensor]]] = []
        with torch.no_grad():
            for path, sub in _post_order(module, name) if recurse else [(name, module)]:
                replaced = self._replace_meta(sub)
                if replaced or (eager_init_of(sub) is not None and not own_tensors(sub)):
                    fresh.append((path, sub, replaced))
            for path, sub, replaced in fresh:
                self._initialise(path, sub, replaced)
            for path, sub, _ in fresh:
                self._check_written(path, sub)
        if Materializer.observer is not None:
            Materializer.observer()

    def _replace_meta(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Swap ``module``'s own meta tensors for poisoned real ones; returns the meta tensors replaced, by key."""
        replaced: dict[str, torch.Tensor] = {}
        for store, make in ((module._parameters, self._parameter), (module._buffers, self._buffer)):
            for key, tensor in store.items():
                if tensor is not None and tensor.is_meta:
                    store[key] = make(tensor)
                    replaced[key] = tensor
        return replaced

    def _parameter(self, meta: torch.Tensor) -> torch.Tensor:
        if id(meta) not in self._memo:
            real = torch.empty_like(meta, device=self.device)
            _poison(real)
            param = nn.Parameter(real, requires_grad=meta.requires_grad)
            for mark in _KEPT_MARKS:  # expert weights stay out of the data-parallel average once real
                if hasattr(meta, mark):
                    setattr(param, mark, getattr(meta, mark))
            self._memo[id(meta)] = param
        return self._memo[id(meta)]

    def _buffer(self, meta: torch.Tensor) -> torch.Tensor:
        if id(meta) not in self._memo:
            real = torch.empty_like(meta, device=self.device)
            _poison(real)
            self._memo[id(meta)] = real
        return self._memo[id(meta)]

    def _initialise(self, name: str, module: nn.Module, replaced: dict[str, torch.Tensor]) -> None:
        owner = self._owners.get(name)
        own_init = getattr(module, "materialize_init", None)  # a module's own init (adapter weights), else the model's
        record = eager_init_of(module)
        if own_init is None and owner is not None and record is not None:
            _replay_eager_init(module, owner, record, replaced)
            return
        self._seed(name)
        if own_init is not None:
            own_init(module)
        elif owner is not None:
            owner._init_weights(module)

    def _seed(self, name: str) -> None:
        torch.manual_seed((self.seed + zlib.crc32(name.encode())) % (2**63))

    def _check_written(self, name: str, module: nn.Module) -> None:
        """``reset_parameters()`` for what no initialisation wrote, else a refusal naming the tensor."""
        if _unwritten(module) and hasattr(module, "reset_parameters"):
            self._seed(name)
            module.reset_parameters()
        unwritten = _unwritten(module)
        if unwritten:
            raise RuntimeError(
                f"{name}.{unwritten[0]} ({type(module).__name__}) was built on the meta device and nothing initialised "
                "it after materialisation: give the module a reset_parameters() that sets every parameter and "
                "buffer (or, for a transformers model, handle it in _init_weights), or build the model without "
                "empty_init"
            )


def _post_order(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """``module.named_modules(prefix=prefix)``, each module after its children."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(path: str, sub: nn.Module) -> None:
        seen.add(id(sub))
        for child_name, child in sub.named_children():
            if id(child) not in seen:
                visit(f"{path}.{child_name}" if path else child_name, child)
        order.append((path, sub))

    visit(prefix, module)
    return order


def _replay_eager_init(module: nn.Module, owner: Any, record: EagerInit, replaced: dict[str, torch.Tensor]) -> None:
    """Run ``owner._init_weights(module)`` as the eager build ran it: from the CPU generator state ``record`` holds,
    drawing on the CPU generator whatever the device (:class:`~lightning_merak.parallel.init_parity.CPUDraws`).

    A tensor tied in after the eager init (not among ``record``'s) is drawn into a stand-in, which the eager build
    discarded too; it is copied in only where nothing else on this rank wrote the tensor (a tied head on the last
    pipeline stage, which the build then makes equal to the first stage's embedding).
    """
    tied_in = [(store, key) for store in (module._parameters, module._buffers) for key, tensor in store.items()
               if tensor is not None and not (key in replaced and record.tensors.get(key) is replaced[key])]
    targets = {key: store[key] for store, key in tied_in}
    stand_ins = {key: torch.empty_like(target) for key, target in targets.items()}
    for store, key in tied_in:
        _poison(stand_ins[key])
        store[key] = stand_ins[key]
    try:
        with torch.random.fork_rng(devices=[]), CPUDraws():
            torch.set_rng_state(record.rng_state)
            owner._init_weights(module)
    finally:
        for store, key in tied_in:
            store[key] = targets[key]
    for key, target in targets.items():
        if _poisoned(target) and not _poisoned(stand_ins[key]):
            target.copy_(stand_ins[key])


def _unwritten(module: nn.Module) -> list[str]:
    return [key for store in (module._parameters, module._buffers) for key, tensor in store.items()
            if tensor is not None and _poisoned(tensor)]


def local_tensors(named_parameters: Iterable[tuple[str, torch.Tensor]],
                  named_buffers: Iterable[tuple[str, torch.Tensor]], non_persistent: set[str],
                  original_name: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """``{unsplit name: tensor}`` of the parameters and persistent buffers one rank holds (a tied weight once,
    under the first name that reaches it)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in named_parameters:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[original_name(name)] = tensor
    for name, tensor in named_buffers:
        if name not in non_persistent and id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[original_name(name)] = tensor
    return tensors


def copy_full_tensors(tensors: dict[str, torch.Tensor], layout_changes: dict[str, Any],
                      state_dict: dict[str, torch.Tensor]) -> None:
    """Fill ``tensors`` (a :data:`WeightLoader`'s first argument) from a full, unsplit ``state_dict``:
    each name's tensor brought to the split layout, and this rank's shard of it copied in.

    A reference loader (tests, small models); a real checkpoint reads only its slices instead.
    """
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, target in tensors.items():
            part = _local_part(name, target, state_dict[name], layout_changes)
            (target.to_local() if isinstance(target, DTensor) else target).copy_(part)


def _local_part(name: str, target: torch.Tensor, full: torch.Tensor, layout_changes: dict[str, Any]) -> torch.Tensor:
    """The part of the unsplit ``full`` that ``target`` (this rank's tensor named ``name``: a shard, or whole) holds."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if name in layout_changes:
        full = layout_changes[name].from_original(full)
    if not isinstance(target, DTensor):
        return full
    return distribute_tensor(full.to(target.device), target.device_mesh, target.placements,
                             src_data_rank=None).to_local()


@dataclass(frozen=True)
class RestoreAfterRewrite:
    """A :data:`WeightLoader` for a checkpoint of a model whose ``after_materialize`` hook rewrites its weights
    (quantises an adapter's frozen base), so the checkpoint holds rewritten tensors the float part cannot take.

    Called as a loader it rebuilds the float part as the run that wrote the checkpoint did (its ``pretrained``
    seam, else the same seeded init); once the hook has run, :meth:`restore` copies the checkpoint's trainable
    tensors in and requires every frozen one to equal what was rebuilt.
    """

    pretrained: Optional[WeightLoader]
    state: dict[str, torch.Tensor]

    def __call__(self, tensors: dict[str, torch.Tensor], layout_changes: dict[str, Any]) -> None:
        if self.pretrained is not None:
            self.pretrained(tensors, layout_changes)

    def restore(self, tensors: dict[str, torch.Tensor], layout_changes: dict[str, Any],
                shards: Sequence[QuantizedShard] = ()) -> None:
        """``shards``: this rank's quantised shards. Where the checkpoint holds a layer's whole quantisation instead
        of this degree's shard (it was written at another ``tensor_parallel``), the shard is cut from it
        (:func:`~lightning_merak.parallel.tensor.quantized_shards.shards_from_whole`) and must equal the rebuilt
        one."""
        state = self.state
        absent = [name for name in tensors if name not in state]
        if shards and absent:
            from lightning_merak.parallel.tensor.quantized_shards import shards_from_whole  # lazy: PEFT

            state = {**state, **shards_from_whole(state, shards, absent)}
        missing = sorted(name for name in absent if name not in state)
        unsharded = [name for name in missing if ".shard_tp" in name]
        if unsharded:
            raise ValueError(f"{unsharded[0]} is this rank's tensor-parallel shard of a quantised base, which the "
                             "checkpoint holds neither as this shard nor whole; resume from a checkpoint of this "
                             "model, or start from the pretrained weights with its adapters alone (merak-export "
                             "--adapter-only)")
        if missing:
            raise ValueError(f"the checkpoint has no {', '.join(missing[:3])}; resume from one this model wrote")
        from torch.distributed.tensor import DTensor

        for name, tensor in tensors.items():
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if not tensor.requires_grad and not torch.equal(local, _local_part(name, tensor, state[name],
                                                                                layout_changes)):
                raise ValueError(f"{name} is frozen but differs from the checkpoint's: resume with the model.path "
                                 "and seed of the run that wrote it")
        copy_full_tensors({name: t for name, t in tensors.items() if t.requires_grad}, layout_changes, state)
