"""Attention of a query block against one key/value block, as ``(out, lse)``, and the merge of such partials.

Context parallelism sees a query shard meet the key/value shards one at a time. Each meeting returns the
attention output over that block's keys and the log-sum-exp of the scores per query row (float32; float64 for
float64 inputs); :func:`merge_attention` combines two partials into the attention over the union of their keys,
so merging every block in any order gives the full attention.

Masks come from the tokens' global positions (and, for packed sequences, their document ids): a block entirely
in the future is skipped, a block entirely in the past runs without a mask, and a block whose queries and keys
share the same increasing positions (the diagonal) runs with the kernels' own causal mask.
:func:`plan_blocks` cuts a block along its runs of consecutive positions so that, in the load-balanced layout,
every piece is one of those three. The pieces run on the SDPA kernels that return the log-sum-exp:

* CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its ``_backward``);
* CUDA: ``aten._scaled_dot_product_flash_attention`` where ``torch.backends.cuda.can_use_flash_attention``
  allows it (fp16/bf16), else ``aten._scaled_dot_product_efficient_attention`` with ``compute_log_sumexp``.

Only masks the kernels cannot take (document ids, a sliding window that cuts through a block, causal masks
between blocks whose positions do not line up) and inputs no kernel accepts fall back to an explicit
matmul/softmax over the block, which holds the block's ``(queries x keys)`` scores in memory.

Grouped-query attention (fewer key/value heads than query heads) repeats each key/value head for its query
heads before a kernel runs; gradients are summed back onto the key/value heads. Everything here is pure: no
process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend

__all__ = [
    "AttentionKernel",
    "BlockPiece",
    "BlockVisibility",
    "attend_block",
    "attend_block_backward",
    "classify_block",
    "merge_attention",
    "plan_blocks",
    "select_kernel",
    "visibility_mask",
]

_aten = torch.ops.aten
_EFFICIENT_LSE_ALIGNMENT = 32
"""The efficient kernel pads its log-sum-exp to a multiple of this many queries."""


class BlockVisibility(Enum):
    """Which (query, key) pairs of a block are visible, as far as choosing a kernel call goes."""

    SKIP = "skip"  # no query sees any key: nothing to compute
    FULL = "full"  # every query sees every key: no mask
    CAUSAL = "causal"  # queries and keys share the same increasing positions: the kernels' causal mask
    MASKED = "masked"  # anything else: an explicit mask


class AttentionKernel(Enum):
    """The op a block piece runs on (the value names it)."""

    CPU_FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"
    CUDA_FLASH = "aten._scaled_dot_product_flash_attention"
    CUDA_EFFICIENT = "aten._scaled_dot_product_efficient_attention"
    EXPLICIT = "explicit matmul + softmax"


@dataclass(frozen=True)
class BlockPiece:
    """One kernel call of a block: the queries at ``query`` against the keys at ``key`` (sequence slices)."""

    query: slice
    key: slice
    visibility: BlockVisibility


def _check_window(causal: bool, sliding_window: int | None) -> None:
    if sliding_window is not None and (not causal or sliding_window < 1):
        raise ValueError(
            f"sliding_window={sliding_window} needs causal=True and a window of at least 1 token "
            "(a query sees the keys at positions q - sliding_window < k <= q)"
        )


def classify_block(
    query_positions: Tensor,
    key_positions: Tensor,
    *,
    causal: bool,
    sliding_window: int | None = None,
    has_documents: bool = False,
) -> BlockVisibility:
    """How the keys at ``key_positions`` are visible to the queries at ``query_positions`` (1-D global positions).

    Keep positions on the CPU: this reads their bounds, which on a device would wait for it.
    """
    _check_window(causal, sliding_window)
    query_first, query_last = int(query_positions.min()), int(query_positions.max())
    key_first, key_last = int(key_positions.min()), int(key_positions.max())
    if causal and key_first > query_last:
        return BlockVisibility.SKIP
    if sliding_window is not None and query_first - key_last >= sliding_window:
        return BlockVisibility.SKIP
    if has_documents or (sliding_window is not None and query_last - key_first >= sliding_window):
        return BlockVisibility.MASKED
    if not causal or key_last <= query_first:
        return BlockVisibility.FULL
    increasing = bool((query_positions[1:] > query_positions[:-1]).all())
    if increasing and torch.equal(query_positions, key_positions):
        return BlockVisibility.CAUSAL
    return BlockVisibility.MASKED


def _runs(positions: Tensor) -> list[slice]:
    """The maximal stretches of consecutive positions, as slices of the sequence."""
    breaks = ((positions[1:] - positions[:-1]) != 1).nonzero().flatten().add(1).tolist()
    bounds = [0, *breaks, len(positions)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


def plan_blocks(
    query_positions: Tensor,
    key_positions: Tensor,
    *,
    causal: bool,
    sliding_window: int | None = None,
    has_documents: bool = False,
) -> list[BlockPiece]:
    """Cut a block into pieces that each run on a kernel where possible; skipped pieces are left out.

    The whole block is one piece when it is visible in one way; otherwise it is cut along the runs of consecutive
    positions, first on one side, then (where still mixed) on the other, whichever order needs fewer explicit masks
    and pieces. In the load-balanced layout every step of the ring then takes one kernel call.
    """
    mask_options = {"causal": causal, "sliding_window": sliding_window, "has_documents": has_documents}
    everything_query, everything_key = slice(0, len(query_positions)), slice(0, len(key_positions))

    def piece(query: slice, key: slice) -> BlockPiece:
        visibility = classify_block(query_positions[query], key_positions[key], **mask_options)
        return BlockPiece(query, key, visibility)

    whole = piece(everything_query, everything_key)
    if whole.visibility is not BlockVisibility.MASKED:
        return [] if whole.visibility is BlockVisibility.SKIP else [whole]
    query_runs, key_runs = _runs(query_positions), _runs(key_positions)

    def cut(queries_first: bool) -> list[BlockPiece]:
        pieces = []
        for outer in query_runs if queries_first else key_runs:
            coarse = piece(outer, everything_key) if queries_first else piece(everything_query, outer)
            if coarse.visibility is not BlockVisibility.MASKED:
                pieces.append(coarse)
                continue
            for inner in key_runs if queries_first else query_runs:
                pieces.append(piece(outer, inner) if queries_first else piece(inner, outer))
        return [each for each in pieces if each.visibility is not BlockVisibility.SKIP]

    def cost(pieces: list[BlockPiece]) -> tuple[int, int]:
        return sum(each.visibility is BlockVisibility.MASKED for each in pieces), len(pieces)

    return min(cut(queries_first=True), cut(queries_first=False), key=cost)


def select_kernel(query: Tensor, key: Tensor, value: Tensor, *, causal: bool) -> AttentionKernel:
    """The SDPA kernel that returns a log-sum-exp for these inputs (heads already matched), or EXPLICIT."""
    if query.device.type == "cpu":
        choice = torch._fused_sdp_choice(query, key, value, None, 0.0, causal, scale=None)
        if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu") and choice == int(
            SDPBackend.FLASH_ATTENTION
        ):
            return AttentionKernel.CPU_FLASH
    elif query.device.type == "cuda":
        params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, causal, False)
        if torch.backends.cuda.can_use_flash_attention(params):
            return AttentionKernel.CUDA_FLASH
        if torch.backends.cuda.can_use_efficient_attention(params):
            return AttentionKernel.CUDA_EFFICIENT
    return AttentionKernel.EXPLICIT


def _kernel_forward(
    kernel: AttentionKernel, query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    if kernel is AttentionKernel.CPU_FLASH:
        return _aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
    if kernel is AttentionKernel.CUDA_FLASH:
        out, lse = _aten._scaled_dot_product_flash_attention(query, key, value, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    out, lse = _aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scale
    )[:2]
    return out, lse[..., : query.shape[2]]


def _kernel_backward(
    kernel: AttentionKernel,
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' backward from any ``(out, lse)``: given the merged ones, a block's share of the gradients."""
    if kernel is AttentionKernel.CPU_FLASH:
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, causal, scale=scale
        )
    device = query.device
    if kernel is AttentionKernel.CUDA_FLASH:
        # Dropout is 0: the kernel never reads the random-number state, so an unused one of its layout does.
        rng_state = torch.zeros(2, dtype=torch.uint64, device=device)
        rng_offset = torch.zeros((), dtype=torch.uint64, device=device)
        return _aten._scaled_dot_product_flash_attention_backward(
            grad_out, query, key, value, out, lse, None, None, query.shape[2], key.shape[2], 0.0, causal,
            rng_state, rng_offset, scale=scale,
        )
    padded = math.ceil(query.shape[2] / _EFFICIENT_LSE_ALIGNMENT) * _EFFICIENT_LSE_ALIGNMENT
    seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    grad_query, grad_key, grad_value, _ = _aten._scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, None, out, F.pad(lse, (0, padded - query.shape[2])), seed, offset, 0.0,
        [True, True, True, False], causal, scale=scale,
    )
    return grad_query, grad_key, grad_value


class _KernelAttention(torch.autograd.Function):
    """A kernel call whose ``out`` and ``lse`` both take gradients, so merged partials differentiate exactly."""

    @staticmethod
    def forward(ctx, query, key, value, kernel, causal, scale):
        out, lse = _kernel_forward(kernel, query, key, value, causal, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.kernel, ctx.causal, ctx.scale = kernel, causal, scale
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        grad_query = grad_key = grad_value = None
        if grad_out is not None:
            grad_query, grad_key, grad_value = _kernel_backward(
                ctx.kernel, grad_out.contiguous(), query, key, value, out, lse, ctx.causal, ctx.scale
            )
        if grad_lse is not None:
            # d lse / d scores = softmax P, so the lse's share is dS = P * g. The kernels compute
            # dS = P * (dO V^T - rowsum(dO * O)); with V = 0, dO = e_0 and O = -g e_0 that is exactly P * g.
            unit = torch.zeros_like(out)
            unit[..., 0] = 1
            carrier = torch.zeros_like(out)
            carrier[..., 0] = -grad_lse.to(out.dtype)
            lse_grad_query, lse_grad_key, _ = _kernel_backward(
                ctx.kernel, unit, query, key, torch.zeros_like(value), carrier, lse, ctx.causal, ctx.scale
            )
            grad_query = lse_grad_query if grad_query is None else grad_query + lse_grad_query
            grad_key = lse_grad_key if grad_key is None else grad_key + lse_grad_key
        return grad_query, grad_key, grad_value, None, None, None


def visibility_mask(
    query_positions: Tensor,
    key_positions: Tensor,
    causal: bool,
    sliding_window: int | None,
    query_document_ids: Tensor | None,
    key_document_ids: Tensor | None,
    device: torch.device,
) -> Tensor:
    """Boolean ``(batch or 1, 1, queries, keys)``: True where the query sees the key."""
    queries = query_positions.to(device)[:, None]
    keys = key_positions.to(device)[None, :]
    visible = torch.ones(len(query_positions), len(key_positions), dtype=torch.bool, device=device)
    if causal:
        visible &= keys <= queries
    if sliding_window is not None:
        visible &= queries - keys < sliding_window
    visible = visible[None, None]
    if query_document_ids is not None and key_document_ids is not None:
        same_document = query_document_ids.to(device)[:, :, None] == key_document_ids.to(device)[:, None, :]
        visible = visible & same_document[:, None]
    return visible


def _compute_dtype(tensor: Tensor) -> torch.dtype:
    return torch.promote_types(tensor.dtype, torch.float32)


def _explicit_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, scale: float):
    """Softmax attention with an explicit mask; rows that see no key give ``out = 0``, ``lse = -inf``, no NaN."""
    dtype = _compute_dtype(query)
    scores = query.to(dtype) @ key.to(dtype).transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    sees_a_key = total > 0
    safe_total = torch.where(sees_a_key, total, torch.ones_like(total))
    out = (weights @ value.to(dtype)) / safe_total
    lse = torch.where(sees_a_key, torch.log(safe_total) + row_max, torch.full_like(total, -math.inf))
    return out.to(query.dtype), lse.squeeze(-1)


def _explicit_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The explicit path's gradients from the merged ``(out, lse)``, like the kernels' backward."""
    dtype = _compute_dtype(query)
    query, key, value, grad_out, out = (each.to(dtype) for each in (query, key, value, grad_out, out))
    scores = query @ key.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    # A row that sees no key at all has lse = -inf; +inf there makes its probabilities 0 instead of NaN.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf)).to(dtype)
    probabilities = torch.exp(scores - safe_lse[..., None])
    row_dot = (grad_out * out).sum(dim=-1, keepdim=True)
    grad_scores = probabilities * (grad_out @ value.transpose(-1, -2) - row_dot) * scale
    return grad_scores @ key, grad_scores.transpose(-1, -2) @ query, probabilities.transpose(-1, -2) @ grad_out


def _repeat_heads(tensor: Tensor, query_heads: int) -> Tensor:
    groups = query_heads // tensor.shape[1]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)


def _sum_heads(grad: Tensor, key_heads: int) -> Tensor:
    """Fold a gradient over repeated heads back onto the key/value heads (the inverse of ``_repeat_heads``)."""
    heads = grad.shape[1]
    return grad if heads == key_heads else grad.unflatten(1, (key_heads, heads // key_heads)).sum(dim=2)


def _check_block(query: Tensor, key: Tensor, value: Tensor, query_positions: Tensor, key_positions: Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError("query, key and value must be (batch, heads, seq, head_dim), the transformers layout")
    if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
        raise ValueError(
            f"{query.shape[1]} query heads cannot share {key.shape[1]} key / {value.shape[1]} value heads: "
            "grouped-query attention needs as many key as value heads, dividing the query heads"
        )
    if query_positions.shape != (query.shape[2],) or key_positions.shape != (key.shape[2],):
        raise ValueError(
            f"positions {tuple(query_positions.shape)} / {tuple(key_positions.shape)} do not match the "
            f"{query.shape[2]} queries / {key.shape[2]} keys (1-D global positions, one per token)"
        )


def _default_scale(query: Tensor, scale: float | None) -> float:
    return query.shape[-1] ** -0.5 if scale is None else scale


def _piece_inputs(
    piece: BlockPiece, query: Tensor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    heads = query.shape[1]
    return (
        query[:, :, piece.query],
        _repeat_heads(key[:, :, piece.key], heads),
        _repeat_heads(value[:, :, piece.key], heads),
    )


def _piece_kernel(piece: BlockPiece, query: Tensor, key: Tensor, value: Tensor) -> AttentionKernel:
    if piece.visibility is BlockVisibility.MASKED:
        return AttentionKernel.EXPLICIT
    return select_kernel(query, key, value, causal=piece.visibility is BlockVisibility.CAUSAL)


@dataclass(frozen=True)
class _BlockMask:
    """Who sees whom in one block: what both the forward and the backward plan and mask from."""

    query_positions: Tensor
    key_positions: Tensor
    causal: bool
    sliding_window: int | None
    query_document_ids: Tensor | None
    key_document_ids: Tensor | None

    def plan(self) -> list[BlockPiece]:
        has_documents = self.query_document_ids is not None and self.key_document_ids is not None
        return plan_blocks(
            self.query_positions, self.key_positions, causal=self.causal, sliding_window=self.sliding_window,
            has_documents=has_documents,
        )

    def explicit_mask(self, piece: BlockPiece, device: torch.device) -> Tensor | None:
        """The boolean mask of an explicit piece; None where it sees everything."""
        if piece.visibility is BlockVisibility.FULL:
            return None
        query_documents, key_documents = self.query_document_ids, self.key_document_ids
        return visibility_mask(
            self.query_positions[piece.query], self.key_positions[piece.key], self.causal, self.sliding_window,
            None if query_documents is None else query_documents[:, piece.query],
            None if key_documents is None else key_documents[:, piece.key], device,
        )


def attend_block(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    query_positions: Tensor,
    key_positions: Tensor,
    causal: bool = True,
    sliding_window: int | None = None,
    query_document_ids: Tensor | None = None,
    key_document_ids: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``query`` over the keys of one block: ``(out, lse)``, both differentiable.

    ``query`` is ``(batch, heads, queries, head_dim)``, ``key``/``value`` ``(batch, key_heads, keys, head_dim)``
    (``key_heads`` dividing ``heads``); positions are each token's global position (1-D, CPU), document ids
    ``(batch, tokens)`` restrict attention to the same document. ``lse`` is ``(batch, heads, queries)``; a row
    that sees no key of the block has ``out = 0`` and ``lse = -inf``.
    """
    _check_block(query, key, value, query_positions, key_positions)
    scale = _default_scale(query, scale)
    mask = _BlockMask(query_positions, key_positions, causal, sliding_window, query_document_ids, key_document_ids)
    pieces = mask.plan()
    results = []
    for piece in pieces:
        piece_query, piece_key, piece_value = _piece_inputs(piece, query, key, value)
        kernel = _piece_kernel(piece, piece_query, piece_key, piece_value)
        if kernel is AttentionKernel.EXPLICIT:
            explicit_mask = mask.explicit_mask(piece, query.device)
            results.append(_explicit_attention(piece_query, piece_key, piece_value, explicit_mask, scale))
        else:
            is_causal = piece.visibility is BlockVisibility.CAUSAL
            contiguous = (each.contiguous() for each in (piece_query, piece_key, piece_value))
            results.append(_KernelAttention.apply(*contiguous, kernel, is_causal, scale))
    if len(pieces) == 1 and pieces[0].query == slice(0, query.shape[2]):
        return results[0]
    return _assemble(query, value, pieces, results)


def _assemble(
    query: Tensor, value: Tensor, pieces: list[BlockPiece], results: list[tuple[Tensor, Tensor]]
) -> tuple[Tensor, Tensor]:
    """Merge the pieces' partials over each stretch of queries they share, and lay the stretches end to end."""
    length = query.shape[2]
    bounds = sorted({0, length, *(each.query.start for each in pieces), *(each.query.stop for each in pieces)})
    outs, lses = [], []
    for start, stop in zip(bounds, bounds[1:]):
        out = query.new_zeros(*query.shape[:2], stop - start, value.shape[-1])
        lse = query.new_full((*query.shape[:2], stop - start), -math.inf, dtype=_compute_dtype(query))
        for piece, (piece_out, piece_lse) in zip(pieces, results):
            if piece.query.start <= start and stop <= piece.query.stop:
                stretch = slice(start - piece.query.start, stop - piece.query.start)
                out, lse = merge_attention(out, lse, piece_out[:, :, stretch], piece_lse[..., stretch])
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def attend_block_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    query_positions: Tensor,
    key_positions: Tensor,
    causal: bool = True,
    sliding_window: int | None = None,
    query_document_ids: Tensor | None = None,
    key_document_ids: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of the query, key and value gradients, from the attention output merged over all blocks.

    ``out`` and ``lse`` are the final (merged) ones, as flash attention's backward wants: the probabilities
    ``exp(scores - lse)`` are then the global ones, so summing every block's share gives the exact gradients. The
    shares come back in float32 (float64 for float64 inputs) so a caller summing blocks rounds once; key and value
    gradients are on the key/value heads.
    """
    _check_block(query, key, value, query_positions, key_positions)
    scale = _default_scale(query, scale)
    mask = _BlockMask(query_positions, key_positions, causal, sliding_window, query_document_ids, key_document_ids)
    dtype = _compute_dtype(query)
    grad_query = torch.zeros_like(query, dtype=dtype)
    grad_key = torch.zeros_like(key, dtype=dtype)
    grad_value = torch.zeros_like(value, dtype=dtype)
    for piece in mask.plan():
        piece_query, piece_key, piece_value = _piece_inputs(piece, query, key, value)
        piece_grad_out, piece_out = grad_out[:, :, piece.query], out[:, :, piece.query]
        piece_lse = lse[..., piece.query]
        kernel = _piece_kernel(piece, piece_query, piece_key, piece_value)
        if kernel is AttentionKernel.EXPLICIT:
            explicit_mask = mask.explicit_mask(piece, query.device)
            grads = _explicit_backward(
                piece_grad_out, piece_query, piece_key, piece_value, piece_out, piece_lse, explicit_mask, scale
            )
        else:
            tensors = (piece_grad_out, piece_query, piece_key, piece_value, piece_out)
            grads = _kernel_backward(
                kernel, *(each.to(query.dtype).contiguous() for each in tensors), piece_lse.contiguous(),
                piece.visibility is BlockVisibility.CAUSAL, scale,
            )
        piece_grad_query, piece_grad_key, piece_grad_value = grads
        grad_query[:, :, piece.query] += piece_grad_query
        grad_key[:, :, piece.key] += _sum_heads(piece_grad_key, key.shape[1])
        grad_value[:, :, piece.key] += _sum_heads(piece_grad_value, key.shape[1])
    return grad_query, grad_key, grad_value


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """The attention over the union of two disjoint key sets from each one's ``(out, lse)``; differentiable.

    Weights ``exp(lse_x - lse)`` are taken against the larger lse, so nothing overflows; a row neither side sees
    (both lse ``-inf``) stays ``out = 0``, ``lse = -inf`` with zero gradients, never NaN. The result has
    ``out_a``'s dtype, so a float32 running accumulator stays float32.
    """
    dtype = torch.promote_types(_compute_dtype(out_a), lse_a.dtype)
    lse_a, lse_b = lse_a.to(dtype), lse_b.to(dtype)
    top = torch.maximum(lse_a, lse_b).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    seen = total > 0
    safe_total = torch.where(seen, total, torch.ones_like(total))
    out = (out_a.to(dtype) * weight_a[..., None] + out_b.to(dtype) * weight_b[..., None]) / safe_total[..., None]
    lse = torch.where(seen, torch.log(safe_total) + top, torch.full_like(total, -math.inf))
    return out.to(out_a.dtype), lse
