"""Context parallelism inside a transformers model: its forward sees one rank's shard of every sequence.

:func:`install_context_parallel` swaps two things and nothing else (``generate`` runs the model as before):

* **Attention**: the model's attention implementation becomes ``merak_context_parallel``, registered with
  transformers' ``AttentionInterface``, which runs :func:`~.ring.ring_attention` or :func:`~.ulysses.ulysses_attention`
  over the context-parallel group. transformers builds no mask for an implementation it has no mask function for,
  so causality, sliding windows and document boundaries come from the tokens' global positions instead.
* **The forward**: the model is called with the whole sequence, as a ``training_step`` written for one device calls
  it. :class:`ContextParallelForward` keeps this rank's load-balanced shard of the inputs, gives the model the
  shard's global position ids and the document ids of the rows (:func:`segment_ids`: transformers' own rule),
  shifts ``labels`` on the whole sequence (a chunk's next token lives on another rank) and divides the loss by the
  whole batch's target count. ``generate`` and a call with a key/value cache (``use_cache=True``) run unsplit on
  this rank with the model's own attention: decoding is no split-sequence workload. A transformers MoE model
with ``output_router_logits=True`` adds its router aux loss over the whole batch's tokens, not this rank's: the
routers' logits are recorded during the forward, gathered over the group (with the padding mask, in one order),
and the family's own ``load_balancing_loss_func`` runs on them (``outputs.aux_loss``; weighted into the loss
with labels).

The returned loss is the whole batch's on every rank of the group, and its backward scales this rank's part by
``cp``: the data-parallel average over ``dp x cp`` replicas then sums the group's partial gradients (the ranks of
a context-parallel group hold the same parameters and see the same samples). Without ``labels`` the logits are
gathered to the whole sequence (memory ``vocab x sequence`` per rank), so a loss computed outside the model is
unchanged; with ``labels`` only this rank's logits exist.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_merak.distributed.collectives import as_in_forward
from lightning_merak.distributed.sub_batches import SubBatchForward
from lightning_merak.distributed.turns import in_sub_batch_region, sub_batch_index
from lightning_merak.parallel.context.blockwise import visibility_mask
from lightning_merak.parallel.context.ring import ring_attention
from lightning_merak.parallel.context.sharding import LoadBalancedLayout
from lightning_merak.parallel.context.ulysses import check_heads_divisible, ulysses_attention
from lightning_merak.parallel.pipeline.recording import find_trunk
from lightning_merak.parallel.pipeline.router_aux import RouterAux, RouterRecorder, router_aux_of

__all__ = ["ATTENTION_NAME", "CONTEXT_ATTENTION_METHODS", "ContextParallelForward", "SumOverGroup", "attention_shape",
           "check_context_parallel_model", "check_padding_mask", "gather_sequence", "install_context_parallel",
           "next_token_labels", "segment_ids", "trace_as_context_parallel"]

ATTENTION_NAME = "merak_context_parallel"
CONTEXT_ATTENTION_METHODS = ("ring", "all_to_all")
ContextAttention = Literal["ring", "all_to_all"]
IGNORE_INDEX = -100


@dataclass
class ContextShard:
    """What every attention call of the current forward needs: the ranks' global positions and document ids."""

    rank_positions: Tensor
    document_ids: Optional[Tensor]

    def documents_of(self, batch: int) -> Optional[Tensor]:
        """The document ids of the ``batch`` rows an attention call sees: all of them, or, inside a ``tp_overlap``
        sub-batch (:mod:`~lightning_merak.distributed.sub_batches`), that sub-batch's rows."""
        documents = self.document_ids
        if documents is None or documents.shape[0] == batch:
            return documents
        if not in_sub_batch_region() or batch == 0 or documents.shape[0] % batch:
            raise ValueError(f"an attention call over {batch} rows in a forward of {documents.shape[0]} rows, not as "
                             "one of its tp_overlap sub-batches")
        return documents.chunk(documents.shape[0] // batch)[sub_batch_index()]


class ContextState:
    """Shared by the forward and every attention module of one model: the group, the method, the current shard.

    The shard stays set after the forward, so recomputed attention (activation checkpointing runs the forward
    again inside the backward) finds the same one.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], method: ContextAttention) -> None:
        self.group = group
        self.method = method
        self.shard: Optional[ContextShard] = None
        self.local = False
        """Whether the current forward runs a whole sequence on this rank alone (plain causal attention)."""
        self.unsplit = False
        """Whether the model runs whole sequences with its own attention (:func:`_running_unsplit`: generation)."""


def _attention_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "get_text_config", lambda: config)() if config is not None else None


def attention_shape(model: nn.Module) -> Optional[tuple[int, int, int, int]]:
    """``(hidden_size, heads, key_value_heads, head_dim)`` of a transformers model's attention, None without them."""
    config = _attention_config(model)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads < 1:
        return None
    key_value_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return hidden, heads, int(key_value_heads), int(head_dim)


def check_context_parallel_model(model: nn.Module, context_parallel: int, method: str,
                                 tensor_parallel: int = 1) -> None:
    """Refuse, before launch, a model context parallelism cannot run exactly, naming the reason and the fix
    (``tensor_parallel``: the ranks each attention's heads are split over first)."""
    if method not in CONTEXT_ATTENTION_METHODS:
        raise ValueError(f"context_attention={method!r} is not supported; choose one of "
                         f"{', '.join(CONTEXT_ATTENTION_METHODS)}")
    from transformers import PreTrainedModel

    model = attention_model(model)

    if not isinstance(model, PreTrainedModel) or not getattr(model, "_supports_attention_backend", False):
        raise ValueError(
            f"context_parallel={context_parallel} swaps the attention of a transformers model that calls it through "
            f"its attention interface (config._attn_implementation); {type(model).__name__} does not, so its "
            "attention cannot see the other ranks' keys: use context_parallel=1 for it")
    config = _attention_config(model)
    for name in _ATTENTION_DROPOUT_NAMES:
        dropout = float(getattr(config, name, 0.0) or 0.0)
        if dropout > 0:
            raise ValueError(
                f"context parallelism computes attention in blocks, which attention dropout would mask differently "
                f"from one device ({name}={dropout}); set the model's {name}=0 (model.config.{name}=0) or "
                "context_parallel=1")
    for name in ("attn_logit_softcapping", "attention_sink", "use_sink"):
        if getattr(config, name, None):
            raise ValueError(f"context parallelism has no {name} (config.{name}={getattr(config, name)!r}); "
                             "use context_parallel=1 for this model")
    if method == "all_to_all":
        heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None)
        if isinstance(heads, int):
            check_heads_divisible(heads, context_parallel, tensor_parallel)


def attention_model(model: nn.Module) -> nn.Module:
    """The transformers model whose attention context parallelism swaps: ``model``, or a PEFT model's base model
    (its adapters wrap the layers, not the attention call, and its forward calls the base model's)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


_ATTENTION_DROPOUT_NAMES = ("attention_dropout", "attn_pdrop", "attn_dropout", "attention_probs_dropout_prob")
"""The config keys transformers' families name their attention dropout by (Llama's, GPT-2's and GPT-J's, ...)."""


def _context_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
    dropout: float = 0.0, scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention signature: ``(batch, heads, seq_local, head_dim)`` in, ``(batch, seq_local, heads,
    head_dim)`` out, over the whole sequence of the context-parallel group."""
    state: Optional[ContextState] = getattr(module, "_merak_context", None)
    # a recomputed block attends with its own micro-batch's shard, not the one a later micro-batch's forward set
    local, shard, group = (False, None, None) if state is None else as_in_forward(
        ("merak-context-shard", id(state)), lambda: (state.local, state.shard, state.group))
    if local:
        return _local_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    if state is None or shard is None:
        raise RuntimeError(f"{type(module).__name__} runs merak's context-parallel attention outside a "
                           "context-parallel forward; install it with install_context_parallel")
    if attention_mask is not None:
        raise ValueError("context parallelism computes the mask from token positions; this call passed a "
                         f"{tuple(attention_mask.shape)} mask (a 4-D mask of its own?): pass a 2-D padding mask "
                         "or position ids restarting per document instead")
    if dropout and module.training:
        raise ValueError(f"context parallelism has no attention dropout (dropout={dropout}); set it to 0")
    for unsupported in ("softcap", "s_aux", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"context parallelism cannot apply {unsupported!r} in {type(module).__name__}; "
                             "use context_parallel=1 for this model")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    attend = ring_attention if state.method == "ring" else ulysses_attention
    out = attend(query, key, value, group, positions=shard.rank_positions,
                 document_ids=shard.documents_of(query.shape[0]), causal=causal,
                 sliding_window=kwargs.get("sliding_window"), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _local_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                     dropout: float, scaling: Optional[float], is_causal: Optional[bool],
                     **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' SDPA attention on one whole, unpadded sequence (transformers built no mask for it). A layer's
    sliding window becomes the mask transformers builds for it: a query sees the keys ``0 <= q - k < window``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        raise ValueError("a sequence run on one rank of a context-parallel group takes no mask; use "
                         "context_parallel_degree='fixed' for this model")
    window = kwargs.pop("sliding_window", None)
    if window is not None:
        positions = torch.arange(query.shape[-2])
        attention_mask = visibility_mask(positions, positions, True, window, None, None, query.device)
        is_causal = False
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _context_attention)


def segment_ids(attention_mask: Optional[Tensor], position_ids: Optional[Tensor], batch: int,
                length: int) -> Optional[Tensor]:
    """Per-token segment ids ``(batch, length)`` of the whole rows, or None when every row is one sequence.

    As transformers decides, so a split sequence attends as in one process: packed documents (position ids
    restarting at 0) are kept apart only without an ``attention_mask``; with one, leading or trailing padding is a
    segment of its own (real tokens see only real ones before them; the padding's own outputs differ from one
    process's, so no target is scored from them) and padding between real tokens is refused
    (:func:`check_padding_mask`).
    """
    starts = torch.zeros(batch, length, dtype=torch.bool)
    if attention_mask is not None:
        mask = check_padding_mask(attention_mask)
        starts[:, 1:] = mask[:, 1:] != mask[:, :-1]
    elif position_ids is not None:
        starts |= position_ids.detach().cpu().expand(batch, length) == 0
    starts[:, 0] = True
    if int(starts.sum()) == batch:
        return None
    return starts.long().cumsum(dim=-1) - 1


def check_padding_mask(attention_mask: Tensor) -> Tensor:
    """``attention_mask`` as a boolean CPU tensor, after refusing what context parallelism cannot mask exactly: a
    mask that is not 2-D, or a row whose zeros are not only leading or trailing padding (transformers hides the
    masked keys alone, which document ids cannot express)."""
    if attention_mask.dim() != 2:
        raise ValueError(f"context parallelism takes a 2-D padding mask (batch, sequence), got "
                         f"{tuple(attention_mask.shape)}; pass position ids restarting per document for packing")
    mask = attention_mask.detach().cpu().bool()
    count = mask.sum(dim=-1, keepdim=True)
    first = mask.long().argmax(dim=-1, keepdim=True)
    index = torch.arange(mask.shape[1])
    gapped = (mask != ((index >= first) & (index < first + count))).any(dim=-1).nonzero().flatten().tolist()
    if gapped:
        row = gapped[0]
        hidden = (~mask[row, int(first[row]):int(first[row] + count[row])]).nonzero().flatten() + int(first[row])
        raise ValueError(
            f"context parallelism supports an attention_mask whose zeros are leading or trailing padding only; row "
            f"{row} has padding between real tokens (positions {hidden.tolist()[:8]}). Move the padding to the row's "
            "start or end, pack documents by position ids restarting at 0 without an attention_mask, or use "
            "context_parallel=1")
    return mask


class SumOverGroup(torch.autograd.Function):
    """Forward: the sum over the group (the whole batch's loss); backward: this rank's gradient times the group
    size, which the average over ``dp x cp`` replicas turns into the sum of the group's parts."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.size = dist.get_world_size(group)
        total = local.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.size, None


class _GatherSequence(torch.autograd.Function):
    """Forward: every rank's shard put back into the whole sequence; backward: this rank's shard of the gradient
    (every rank computes the same loss from the whole tensor) times the group size (see :class:`SumOverGroup`)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup, layout: LoadBalancedLayout, rank: int) -> Tensor:
        ctx.layout, ctx.rank, ctx.size = layout, rank, dist.get_world_size(group)
        shards = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(shards, local.contiguous(), group=group)
        return ctx.layout.unshard(shards, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.layout.shard(grad, ctx.rank, dim=1) * ctx.size, None, None, None


def gather_sequence(local: Tensor, group: dist.ProcessGroup, layout: LoadBalancedLayout) -> Tensor:
    """Every rank's shard of ``local`` (this rank's, along dim 1) put back into the whole sequence; differentiable."""
    return _GatherSequence.apply(local, group, layout, dist.get_rank(group))


class _GatherRows(torch.autograd.Function):
    """Forward: every rank's rows, concatenated in rank order; backward: this rank's rows of the gradient times
    the group size (every rank computes the same loss from the whole tensor; see :class:`SumOverGroup`)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.rank, ctx.size, ctx.rows = dist.get_rank(group), dist.get_world_size(group), local.shape[0]
        pieces = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows] * ctx.size, None


class _RouterAux:
    """The whole batch's router aux loss of a MoE model whose shards run on the ranks of ``group``."""

    def __init__(self, model: nn.Module, aux: RouterAux, group: dist.ProcessGroup) -> None:
        self.aux = aux
        routers = [module for module in model.modules() if isinstance(module, self.aux.router_class)]
        self.recorder = RouterRecorder(routers, self.aux.output_index)
        self.group = group

    def loss(self, recorded: list[Tensor], mask_shard: Optional[Tensor]) -> Tensor:
        """The unweighted aux loss over every rank's tokens, from this rank's ``recorded`` router logits (one
        ``[tokens, experts]`` per router call, batch-major) and its shard of the padding mask."""
        layers = tuple(_GatherRows.apply(logits.reshape(-1, logits.shape[-1]), self.group) for logits in recorded)
        mask = None
        if mask_shard is not None:  # [ranks x batch, shard]: the gathered rows' order, rank by rank
            pieces = [torch.empty_like(mask_shard) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(pieces, mask_shard.contiguous(), group=self.group)
            mask = torch.cat(pieces)
        return self.aux.loss_function(layers, self.aux.num_experts, self.aux.top_k, mask)


class ContextParallelForward:
    """The model's forward for whole sequences, running on this rank's shard (see the module docstring)."""

    scores_shards = True
    """Called with ``labels``, the loss is computed on each rank's shard of the logits, never gathered."""
    replica_tokens: Optional[Any] = None
    """With several batch replicas, what counts the global batch's scored tokens per replica
    (:class:`~lightning_merak.parallel.data.token_mean.ReplicaTokens`): the loss divides by that count instead of
    this replica's own, so the replicas' average is the global token mean."""

    def __init__(self, model: nn.Module, state: ContextState, group: Optional[dist.ProcessGroup] = None) -> None:
        self._model = model
        self._forward = model.forward
        self._state = state
        self._group = state.group if group is None else group
        self._rank = dist.get_rank(self._group)
        self._size = dist.get_world_size(self._group)
        self._has_shifted_loss = _takes_shifted_labels(model)
        self._model_name = type(model).__name__
        config = getattr(model, "config", None)
        aux = router_aux_of(model, find_trunk(model)[1]) if getattr(config, "output_router_logits", False) else None
        self._router_aux = None if aux is None else _RouterAux(model, aux, self._group)  # None: the model adds none

    def over(self, group: dist.ProcessGroup) -> "ContextParallelForward":
        """The same forward over another group sharing the model's attention state (a subgroup of ranks that split
        some samples among fewer ranks); each call points the state at its own group."""
        other = ContextParallelForward(self._model, self._state, group)
        other._forward = self._forward
        return other

    def local(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own forward on whole sequences on this rank alone: plain causal attention, no exchange."""
        self._state.local = True
        try:
            return self._forward(*args, **kwargs)
        finally:
            self._state.local = False

    def __call__(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                 position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                 inputs_embeds: Optional[Tensor] = None, **kwargs: Any) -> Any:
        if self._state.unsplit or _caches(kwargs):
            return self._unsplit(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 labels=labels, inputs_embeds=inputs_embeds, **kwargs)
        kwargs.pop("use_cache", None)  # False: a split sequence keeps no cache
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens is None:
            raise ValueError("a context-parallel forward needs input_ids or inputs_embeds")
        batch, length = tokens.shape[0], tokens.shape[1]
        self._state.group = self._group
        layout = LoadBalancedLayout(length, self._size)
        documents = segment_ids(attention_mask, position_ids, batch, length)
        shard = self._shard(layout)
        self._state.shard = ContextShard(layout.rank_positions(),
                                         None if documents is None else shard(documents).to(tokens.device))
        if position_ids is None:
            local_positions = layout.positions(self._rank).to(tokens.device)[None].expand(batch, -1)
        else:
            local_positions = shard(position_ids.expand(batch, length))
        inputs = {"input_ids": None if input_ids is None else shard(input_ids),
                  "inputs_embeds": None if inputs_embeds is None else shard(inputs_embeds),
                  "position_ids": local_positions, "use_cache": False}
        if self._router_aux is not None:  # the model's own aux loss would be over this rank's tokens only
            kwargs["output_router_logits"] = False
        if labels is None:
            outputs = self._run(inputs, kwargs, attention_mask, shard)
            outputs["logits"] = _GatherSequence.apply(outputs["logits"], self._group, layout, self._rank)
            return outputs
        if not self._has_shifted_loss:
            raise ValueError(
                f"{self._model_name} computes its loss without transformers' ForCausalLMLoss, which context "
                "parallelism needs to score a shard (labels shifted on the whole sequence); call the model without "
                "labels and compute the loss from its logits (gathered to the whole sequence)")
        shifted = next_token_labels(labels)
        targets = kwargs.pop("num_items_in_batch", None)
        if targets is None:
            targets = (shifted != IGNORE_INDEX).sum()
            if self.replica_tokens is not None:  # the global batch's token mean, over the replicas' average
                targets = self.replica_tokens.per_replica(targets).float()
        outputs = self._run({**inputs, "labels": shard(labels), "shift_labels": shard(shifted),
                             "num_items_in_batch": targets}, kwargs, attention_mask, shard)
        outputs["loss"] = SumOverGroup.apply(outputs["loss"], self._group)
        if self._router_aux is not None:
            outputs["loss"] = outputs["loss"] + self._router_aux.aux.coefficient * outputs["aux_loss"]
        return outputs

    def _unsplit(self, **inputs: Any) -> Any:
        """The model's own forward, with its own attention, on whole sequences on this rank: ``generate`` and a
        key/value cache decode a token at a time, which no rank splits; training keeps no cache."""
        if self._model.training and not self._state.unsplit:
            raise ValueError(f"context parallelism splits each sequence over ranks and keeps no key/value cache while "
                             f"training; call {self._model_name} with use_cache=False (or without use_cache) and no "
                             "cache, or switch to eval mode (model.eval()) to decode with a cache")
        with _running_unsplit(self._model, self._state):
            return self._forward(**inputs)

    def _run(self, inputs: dict[str, Any], kwargs: dict[str, Any], attention_mask: Optional[Tensor],
             shard: Any) -> Any:
        """The model's forward on this rank's shard, with the whole batch's router aux loss where it has one."""
        if self._router_aux is None:
            return self._forward(**inputs, **kwargs)
        forward = self._forward
        if isinstance(forward, SubBatchForward):  # each sub-batch's router logits leave its region as outputs
            outputs = forward.run(functools.partial(self._recording_routers, forward.forward), **inputs, **kwargs)
        else:
            outputs = self._recording_routers(forward, **inputs, **kwargs)
        recorded = [logits.reshape(-1, logits.shape[-1]) for logits in outputs["router_logits"]]
        mask = None if attention_mask is None or attention_mask.ndim != 2 else shard(attention_mask)
        outputs["aux_loss"] = self._router_aux.loss(recorded, mask)
        return outputs

    def _recording_routers(self, forward: Any, **inputs: Any) -> Any:
        """``forward``'s outputs with its routers' logits as ``router_logits``, batch-first ``[rows, tokens,
        experts]`` per router (in the model's own call they are its aux loss's inputs, over this rank's tokens)."""
        assert self._router_aux is not None
        with self._router_aux.recorder.recording() as recorded:
            outputs = forward(**inputs)
        tokens = inputs["input_ids"] if inputs.get("input_ids") is not None else inputs["inputs_embeds"]
        outputs["router_logits"] = tuple(logits.reshape(tokens.shape[0], -1, logits.shape[-1]) for logits in recorded)
        return outputs

    def _shard(self, layout: LoadBalancedLayout) -> Any:
        return lambda tensor: layout.shard(tensor, self._rank, dim=1)


def next_token_labels(labels: Tensor) -> Tensor:
    """``labels`` ``[batch, sequence]`` shifted on the whole sequence: position ``t`` holds the token at ``t + 1``
    (the last ignored), so each context rank's shard scores its own positions' next tokens."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def _takes_shifted_labels(model: nn.Module) -> bool:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return getattr(model, "loss_function", None) is ForCausalLMLoss


def trace_as_context_parallel(model: nn.Module) -> None:
    """Make ``model`` (a transformers model) attend as it will under context parallelism, on whole sequences on this
    rank: transformers then builds the masks it will build (none) for a trace taken before the split, whose side
    values (what the blocks receive besides the hidden state) travel between pipeline stages. An eager or
    sliding-window model's own mask would be one of them, which the split forward never computes. A PEFT model
    attends through its base model (:func:`attention_model`). :func:`install_context_parallel` replaces the state
    set here."""
    from transformers import PreTrainedModel

    model = attention_model(model)
    if not isinstance(model, PreTrainedModel):
        return  # install_context_parallel refuses it, naming why
    _use_context_attention(model)
    state = ContextState(None, "ring")
    state.local = True
    _point_at(model, state)


def _use_context_attention(model: nn.Module) -> None:
    """Switch ``model``'s attention to context parallelism's, remembering its own for :func:`_running_unsplit`."""
    if model.config._attn_implementation != ATTENTION_NAME:
        model._merak_model_attention = model.config._attn_implementation
    _register_attention()
    model.set_attn_implementation(ATTENTION_NAME)


def _caches(kwargs: dict[str, Any]) -> bool:
    """Whether a forward's ``kwargs`` ask for a key/value cache or pass one (``cache``; ``past_key_values``)."""
    return bool(kwargs.get("use_cache")) or any(kwargs.get(name) is not None for name in ("cache", "past_key_values"))


@contextlib.contextmanager
def _running_unsplit(model: nn.Module, state: ContextState) -> Iterator[None]:
    """Inside, ``model`` runs whole sequences with its own attention implementation (transformers builds its
    masks); re-entered (a cached forward inside ``generate``), it changes nothing."""
    if state.unsplit:
        yield
        return
    model.set_attn_implementation(getattr(model, "_merak_model_attention", "sdpa"))
    state.unsplit = True
    try:
        yield
    finally:
        state.unsplit = False
        model.set_attn_implementation(ATTENTION_NAME)


def _generating_unsplit(model: nn.Module, state: ContextState) -> None:
    """``model.generate`` runs unsplit (:func:`_running_unsplit`): decoding is no split-sequence workload."""
    generate = model.generate

    @functools.wraps(generate)
    def generate_unsplit(*args: Any, **kwargs: Any) -> Any:
        with _running_unsplit(model, state):
            return generate(*args, **kwargs)

    model.generate = generate_unsplit


def _point_at(model: nn.Module, state: ContextState) -> None:
    """Every attention module of ``model`` reads ``state``; split blocks' own config copies attend the same way."""
    from transformers import PretrainedConfig

    for module in model.modules():
        module._merak_context = state
        config = getattr(module, "config", None)  # a split block may hold a copy of the model's config
        if isinstance(config, PretrainedConfig) and config is not model.config:
            config._attn_implementation = ATTENTION_NAME


def install_context_parallel(model: nn.Module, group: dist.ProcessGroup,
                             method: ContextAttention = "ring") -> ContextState:
    """Make ``model`` (a transformers model, checked by :func:`check_context_parallel_model`) run every forward as
    this rank's part of a sequence split over ``group``; the state its attention reads is returned."""
    check_context_parallel_model(model, dist.get_world_size(group), method)
    model = attention_model(model)
    _use_context_attention(model)
    state = ContextState(group, method)
    _point_at(model, state)
    model.forward = ContextParallelForward(model, state)
    if callable(getattr(model, "generate", None)):
        _generating_unsplit(model, state)
    return state
