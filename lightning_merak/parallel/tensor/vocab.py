"""Vocabulary parallelism: the input embedding and the LM head split by vocabulary rows over the tensor group.

Megatron's layout: rank ``r`` of ``tp`` holds rows ``[r·c, min((r+1)·c, V))`` with ``c = ⌈V/tp⌉`` of the
embedding and of the head (the boundaries of a vocabulary padded to a multiple of ``tp``).
The parameters are DTensors sharded ``Shard(0)`` with the model's real global shape — DTensor's
uneven sharding, whose chunks are exactly those rows — so a sharded checkpoint holds the unpadded
vocabulary and any layout (tp=1 included) resumes it; no padded row exists anywhere.

* The embedding looks up the ids in its range, zeros the others and all-reduces the sum.
* The head computes its rows' logits. In a training forward whose loss goes through
  :func:`vocab_parallel_loss`, the logits stay sharded: a DTensor ``Shard(-1)`` of the real global
  shape, on which the user's own ``F.cross_entropy`` runs as torch's
  :func:`~torch.distributed.tensor.parallel.loss_parallel` does it (all-reduce of the max and of the sum of
  exponentials, the target's logit from its owner; backward softmax − one-hot on each shard), so
  full logits never exist. Everywhere else (evaluation, prediction, a loss nobody wrapped) the
  head gathers full logits: each shard is padded to ``c`` columns with −inf, gathered, and the
  padding cut off before anything sees it. torch's loss-parallel operators stay on (process-wide) from
  such a loss's forward until its backward has passed the logits, as Lightning runs the backward
  outside any context the loss could open; meanwhile cross-entropy on any other DTensor must be
  sharded on its class dimension too.
* Tied weights stay one parameter per rank: the head's shard is the embedding's shard.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_merak.distributed.collectives import all_gather_in_turn, all_reduce_in_turn, reduce_scatter_in_turn
from lightning_merak.parallel.pipeline.stage import RemovedModule
from lightning_merak.parallel.tensor.adapters import is_tuner_layer
from lightning_merak.parallel.tensor.sequence import SEQUENCE_DIM
from lightning_merak.util.row_shards import padded_rows, row_shard_range

__all__ = ["LocalRows", "VocabParallelEmbedding", "VocabParallelLMHead", "check_vocabulary_split",
           "keep_tied_vocabulary_whole", "pad_vocab_shard", "padded_vocab_size", "split_vocabulary",
           "vocab_parallel_loss", "vocab_shard_range", "vocabulary_modules"]

LocalRows = Callable[[nn.Module, str, int, int], nn.Module]
"""``(module, unsplit path, start, end) -> rows``: for an embedding or head still on the meta device, a real
module of its kind holding only its vocabulary rows ``[start, end)`` (and its other tensors, e.g. a scale)."""


# Pure helpers ---------------------------------------------------------------------------------

padded_vocab_size = padded_rows
"""``vocab_size`` rounded up to a multiple of ``parts``: the width of the gathered logits before cutting."""
vocab_shard_range = row_shard_range
"""``[start, end)`` of the vocabulary rows rank ``rank`` of ``parts`` holds (``torch.chunk``'s, DTensor's)."""


def pad_vocab_shard(logits: torch.Tensor, width: int) -> torch.Tensor:
    """``logits`` (this rank's columns) padded with −inf to ``width`` columns, so every rank's shard is as wide."""
    missing = width - logits.shape[-1]
    return F.pad(logits, (0, missing), value=float("-inf")) if missing else logits


def check_vocabulary_split(vocab_size: int, parts: int) -> None:
    """Refuse a vocabulary so small that a rank would hold no rows of it, naming the fix."""
    start, end = vocab_shard_range(vocab_size, parts, parts - 1)
    if end <= start:
        raise ValueError(
            f"a vocabulary of {vocab_size} rows split over tensor_parallel={parts} ranks leaves the last rank "
            "without rows; use vocab_parallel=False or a smaller tensor_parallel"
        )


# Collectives with their gradients -------------------------------------------------------------

def _sum_over_group(tensor: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """``tensor`` summed over ``group`` (in place): one all-reduce, or with sequence parallelism a reduce-scatter
    and an all-gather over the sequence, the collectives such layouts run (as costly as one all-reduce)."""
    if not sequence_parallel:
        return all_reduce_in_turn(tensor, group)
    return all_gather_in_turn(reduce_scatter_in_turn(tensor, group, SEQUENCE_DIM), group, SEQUENCE_DIM)


class _SumOverGroup(torch.autograd.Function):
    """Sum of per-rank partial results in forward (the embedding's lookups); identity backward.

    Where the sum is the input reduced in place, the input is marked dirty: the output is then its new version, not
    a view of it, which the model may scale in place as it would its own embeddings (CTRL's ``inputs_embeds *=``).
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
        summed = _sum_over_group(tensor.contiguous(), group, sequence_parallel)
        if summed is tensor:
            ctx.mark_dirty(tensor)
        return summed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


class _EnterVocabShards(torch.autograd.Function):
    """Identity forward on the head's input; its gradient, partial per vocabulary shard, is summed in backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
        ctx.group, ctx.sequence_parallel = group, sequence_parallel
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _sum_over_group(grad.contiguous().clone(), ctx.group, ctx.sequence_parallel), None, None


class _GatherVocab(torch.autograd.Function):
    """Full logits, padding included, from every rank's columns; backward keeps this rank's columns.

    Only the last ranks' shards are short, so the padding is the last columns: the caller cuts it off outside,
    leaving an ordinary view of the gathered logits, which the model may update in place (a view made inside a
    custom function may not be).
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup, vocab_size: int,
                start: int) -> torch.Tensor:
        ctx.start, ctx.end = start, start + local.shape[-1]
        parts = dist.get_world_size(group)
        padded = pad_vocab_shard(local, padded_vocab_size(vocab_size, parts) // parts)
        return all_gather_in_turn(padded.contiguous(), group, dim=local.ndim - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad[..., ctx.start:ctx.end].contiguous(), None, None, None


# Layers -------------------------------------------------------------------------------------

def _rows(parameter: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    """``parameter`` as a DTensor sharded by rows over ``mesh`` (uneven where the rows do not divide).

    Every rank holds the same whole tensor here (broadcast at setup, or materialised and loaded alike),
    so each keeps its rows without communicating.
    """
    return nn.Parameter(distribute_tensor(parameter.detach(), mesh, [Shard(0)], src_data_rank=None),
                        requires_grad=parameter.requires_grad)


def _held_rows(local: torch.Tensor, global_rows: int, mesh: DeviceMesh) -> nn.Parameter:
    """``local``, this rank's rows only, as the row-sharded parameter of a ``global_rows``-row tensor
    (no whole tensor ever exists: a meta model materialised row-split)."""
    start, end = vocab_shard_range(global_rows, mesh.size(), mesh.get_local_rank())
    if local.shape[0] != end - start:
        raise ValueError(f"rank {mesh.get_local_rank()} holds rows [{start}, {end}) of {global_rows}, "
                         f"got {local.shape[0]}")
    shape = torch.Size((global_rows, *local.shape[1:]))
    return nn.Parameter(DTensor.from_local(local.detach(), mesh, [Shard(0)], run_check=False, shape=shape,
                                           stride=_contiguous_strides(shape)), requires_grad=local.requires_grad)


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` holding this rank's vocabulary rows; lookups are summed over the group (then scaled
    by ``embed_scale`` where transformers' scaled word embeddings have one).

    ``weight`` is the row-sharded parameter to use (the head's, when they are tied); ``rows`` (see
    :data:`LocalRows`) holds this rank's rows of a meta ``embedding``.
    """

    def __init__(self, embedding: nn.Embedding, mesh: DeviceMesh, weight: Optional[nn.Parameter] = None,
                 sequence_parallel: bool = False, rows: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        check_vocabulary_split(self.num_embeddings, mesh.size())
        if weight is None:
            weight = (_rows(embedding.weight, mesh) if rows is None
                      else _held_rows(rows.weight, self.num_embeddings, mesh))
        self.weight = weight
        self.group = mesh.get_group()
        self.start, self.end = vocab_shard_range(self.num_embeddings, mesh.size(), mesh.get_local_rank())
        padding = embedding.padding_idx
        self.padding_idx = padding
        self._local_padding = padding - self.start if padding is not None and self.start <= padding < self.end else None
        scale = getattr(rows if rows is not None else embedding, "embed_scale", None)
        self.embed_scale: Optional[torch.Tensor]
        self.register_buffer("embed_scale", torch.as_tensor(scale) if scale is not None else None, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        weight = self.weight.to_local()
        rows = F.embedding(local_ids, weight, self._local_padding)
        summed = _SumOverGroup.apply(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group, self.sequence_parallel)
        return summed * self.embed_scale.to(weight.dtype) if self.embed_scale is not None else summed


_loss_parallel_lock = threading.Lock()
_loss_parallel_users = 0
_loss_parallel_context: Optional[Any] = None


def _enter_loss_parallel() -> None:
    """Turn on torch's loss-parallel operators until as many :func:`_leave_loss_parallel` calls came.

    Sharded logits need them from the loss's forward to the end of its backward, which Lightning
    runs later, outside any context the loss could open; counted, as micro-batches overlap.
    """
    global _loss_parallel_users, _loss_parallel_context
    from torch.distributed.tensor.parallel import loss_parallel

    with _loss_parallel_lock:
        if _loss_parallel_users == 0:
            _loss_parallel_context = loss_parallel()
            _loss_parallel_context.__enter__()
        _loss_parallel_users += 1


def _leave_loss_parallel() -> None:
    global _loss_parallel_users, _loss_parallel_context
    with _loss_parallel_lock:
        _loss_parallel_users -= 1
        if _loss_parallel_users == 0 and _loss_parallel_context is not None:
            _loss_parallel_context.__exit__(None, None, None)
            _loss_parallel_context = None


class VocabParallelLMHead(nn.Module):
    """An LM head (``nn.Linear``) holding this rank's vocabulary rows.

    Returns full logits, or with ``shard_logits`` set (by :func:`vocab_parallel_loss`) and
    gradients enabled, a DTensor sharded on the vocabulary. ``weight`` and ``rows`` as for
    :class:`VocabParallelEmbedding`.
    """

    def __init__(self, head: nn.Linear, mesh: DeviceMesh, weight: Optional[nn.Parameter] = None,
                 sequence_parallel: bool = False, rows: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.in_features, self.out_features = head.in_features, head.out_features
        check_vocabulary_split(self.out_features, mesh.size())

        def split(name: str) -> nn.Parameter:
            whole = getattr(head, name)
            return _rows(whole, mesh) if rows is None else _held_rows(getattr(rows, name), self.out_features, mesh)

        self.weight = weight if weight is not None else split("weight")
        self.bias = split("bias") if head.bias is not None else None
        self.mesh = mesh
        self.group = mesh.get_group()
        self.start, _ = vocab_shard_range(self.out_features, mesh.size(), mesh.get_local_rank())
        self.shard_logits = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        entered = _EnterVocabShards.apply(hidden, self.group, self.sequence_parallel)
        local = F.linear(entered, self.weight.to_local(), self.bias.to_local() if self.bias is not None else None)
        if self.shard_logits and torch.is_grad_enabled():
            shape = (*local.shape[:-1], self.out_features)
            return DTensor.from_local(local, self.mesh, [Shard(local.ndim - 1)], run_check=False,
                                      shape=torch.Size(shape), stride=_contiguous_strides(shape))
        return _GatherVocab.apply(local, self.group, self.out_features, self.start)[..., :self.out_features]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# Splitting a model --------------------------------------------------------------------------

def _path_of(model: nn.Module, module: nn.Module) -> Optional[str]:
    return next((name for name, candidate in model.named_modules() if candidate is module and name), None)


def _plain_embedding(module: Optional[nn.Module]) -> bool:
    """An ``nn.Embedding``, or one of transformers' ``*ScaledWordEmbedding`` (the lookup times ``embed_scale``)."""
    if not isinstance(module, nn.Embedding) or module.max_norm is not None:
        return False
    return type(module) is nn.Embedding or (type(module).__name__.endswith("ScaledWordEmbedding")
                                            and hasattr(module, "embed_scale"))


_TIED_KEPT_WHOLE = "_merak_tied_vocabulary_kept_whole"
"""Attribute :func:`keep_tied_vocabulary_whole` sets on a whole model: why its tied pair stays whole (or absent)."""


def _found_vocabulary(model: nn.Module) -> dict[str, Optional[nn.Module]]:
    return {
        "embedding": model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None,
        "head": model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None,
    }


def _describe(module: nn.Module) -> str:
    return type(module).__name__ + (" with a PEFT adapter" if is_tuner_layer(module) else "")


def keep_tied_vocabulary_whole(model: nn.Module) -> bool:
    """Decide on the whole ``model``, before pipeline stages are cut from it, whether its tied embedding and LM head
    stay whole (one of them cannot split by vocabulary, e.g. it carries an adapter), and record it on ``model``.

    A stage holds only one of the pair, so it cannot see the tie; its copy of ``model`` carries the record, and
    :func:`vocabulary_modules` keeps both sides whole alike instead of splitting one side's copy only.
    """
    found = _found_vocabulary(model)
    weights = [getattr(module, "weight", None) for module in found.values()]
    unsplittable = [_describe(module) for key, module in found.items()
                    if module is not None and not _splittable(key, module)]
    keep_whole = weights[0] is not None and weights[0] is weights[1] and bool(unsplittable)
    if keep_whole:
        setattr(model, _TIED_KEPT_WHOLE, f"tied to {', '.join(unsplittable)}")
    elif hasattr(model, _TIED_KEPT_WHOLE):
        delattr(model, _TIED_KEPT_WHOLE)
    return keep_whole


def _splittable(key: str, module: Optional[nn.Module]) -> bool:
    return _plain_embedding(module) if key == "embedding" else type(module) is nn.Linear


def vocabulary_modules(model: nn.Module) -> tuple[Optional[str], Optional[str], list[str]]:
    """Paths of ``model``'s input embedding and LM head where they are plain ``nn.Embedding`` / ``nn.Linear``,
    and the types of those left whole (a module of another pipeline stage is neither).

    A tied pair splits together or not at all: decided here where both sit in ``model``, or for a stage by
    :func:`keep_tied_vocabulary_whole` on the whole model it was cut from.
    """
    found = _found_vocabulary(model)
    splits = {key: _splittable(key, module) for key, module in found.items()}
    weights = [getattr(module, "weight", None) for module in found.values()]
    tied_whole: Optional[str] = getattr(model, _TIED_KEPT_WHOLE, None)
    if weights[0] is not None and weights[0] is weights[1] and not all(splits.values()):
        tied_whole = tied_whole or "tied"
    if tied_whole is not None:
        splits = {key: False for key in splits}
    paths = {key: _path_of(model, module) if splits[key] else None for key, module in found.items()}
    whole = [_describe(module) + (f" ({tied_whole})" if tied_whole is not None and _splittable(key, module) else "")
             for key, module in found.items()
             if module is not None and not splits[key] and not isinstance(module, RemovedModule)]
    return paths["embedding"], paths["head"], whole


def split_vocabulary(parts: Sequence[nn.Module], mesh: DeviceMesh, sequence_parallel: bool = False,
                     local_rows: Optional[LocalRows] = None) -> dict[int, nn.Parameter]:
    """Split the input embedding and LM head of each of ``parts`` (a model, or a rank's pipeline stages) by
    vocabulary rows over the 1-D ``mesh``; a part keeps what it lacks (another stage's) or cannot split.

    With ``sequence_parallel`` their sums over the ranks run as a reduce-scatter and an all-gather
    over the sequence (dimension 1, divisible by the ranks).

    Parts are transformers models or stages holding one under ``net``. Returns the new parameters
    by ``id`` of those they replace, so tied-parameter bookkeeping can follow them. Parts still on the
    meta device need ``local_rows``: each rank then materialises only its rows, never the whole table.
    """
    replaced: dict[int, nn.Parameter] = {}
    for part in parts:
        model = getattr(part, "net", part)
        embedding_path, head_path, whole = vocabulary_modules(model)
        if whole:
            rank_zero_info(f"merak3d: vocab_parallel leaves {', '.join(whole)} of {type(model).__name__} whole "
                           "(it splits nn.Embedding, transformers' scaled word embeddings and nn.Linear layers)")
        for path in (embedding_path, head_path):
            if path is None:
                continue
            module = model.get_submodule(path)
            old = module.weight
            shared = replaced.get(id(old))
            rows = None
            others = [t for key, t in (*module._parameters.items(), *module._buffers.items()) if key != "weight"]
            if local_rows is not None and (shared is None or any(t is not None and t.is_meta for t in others)):
                rows = local_rows(module, path, *vocab_shard_range(old.shape[0], mesh.size(), mesh.get_local_rank()))
            split = (VocabParallelEmbedding(module, mesh, shared, sequence_parallel, rows) if path == embedding_path
                     else VocabParallelLMHead(module, mesh, shared, sequence_parallel, rows))
            replaced[id(old)] = split.weight
            if isinstance(module, nn.Linear) and module.bias is not None:
                replaced[id(module.bias)] = split.bias
            model.set_submodule(path, split)
    return replaced


def _heads(model: nn.Module) -> list[VocabParallelLMHead]:
    return [module for module in model.modules() if isinstance(module, VocabParallelLMHead)]


class _VocabParallelLoss:
    """``loss_fn(logits, targets)`` run on vocabulary-sharded logits, returning a plain tensor."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self._told = False

    def __call__(self, logits: Any, targets: Any) -> torch.Tensor:
        if not isinstance(logits, DTensor):
            return self.loss_fn(logits, targets)
        _enter_loss_parallel()
        left = False

        def leave(grad: torch.Tensor) -> None:
            nonlocal left
            if not left:
                left = True
                _leave_loss_parallel()

        if logits.requires_grad:
            logits.register_hook(leave)
        backward_follows = False
        try:
            try:
                loss = self.loss_fn(logits, targets)
            except (RuntimeError, TypeError, ValueError, NotImplementedError) as error:
                if not self._told:
                    self._told = True
                    rank_zero_info(f"merak3d: the loss cannot take vocabulary-sharded logits "
                                   f"({str(error).splitlines()[0][:160]}); it gets gathered full logits instead, "
                                   "which costs memory, not accuracy")
                loss = self.loss_fn(logits.full_tensor(), targets)
            backward_follows = logits.requires_grad and loss.requires_grad
        finally:
            if not backward_follows:  # no backward will pass the logits' hook
                leave(logits)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        # a view of the DTensor's local value; pipeline schedules detach their losses in place, which views refuse
        return loss.clone() if loss._is_view() else loss


def vocab_parallel_loss(loss_fn: Callable[[Any, Any], torch.Tensor],
                        model: nn.Module) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn`` (a module's ``loss_from_logits``) taking the vocabulary-sharded logits of ``model``'s heads.

    Turns on ``shard_logits`` of every :class:`VocabParallelLMHead` in ``model``; ``loss_fn``
    unchanged where there is none. A loss that cannot run on the sharded DTensor gets the
    gathered logits (told once).
    """
    heads = _heads(model)
    if not heads:
        return loss_fn
    for head in heads:
        head.shard_logits = True
    return _VocabParallelLoss(loss_fn)
