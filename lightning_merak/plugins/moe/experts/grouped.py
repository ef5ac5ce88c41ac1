"""Dropless grouped expert computation over transformers' fused 3D expert tensors (pure core).

transformers 5 keeps a family's experts as one ``gate_up_proj`` ``[E, 2I, H]`` (or ``up_proj``) and one
``down_proj`` ``[E, H, I]`` per layer, and its eager forward loops over experts in Python. Here every
token copy (token, k-th choice) is sorted by expert so each expert's rows are one contiguous segment,
and each projection is one grouped matmul over all segments: ``torch.nn.functional.grouped_mm`` where
this torch has it and it runs for these tensors (probed once per device and dtype, alignment checked per
call), one matmul per non-empty segment otherwise. Nothing is dropped, so any top-k works and the result
is the eager loop's up to summation order. Plain torch: no process groups (``parallel`` adds those).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_merak.distributed.collectives import plainly_saved_tensors

__all__ = [
    "EXPERT_TENSORS",
    "combine_routes",
    "expert_mlp",
    "gather_token_copies",
    "grouped_experts_forward",
    "grouped_linear",
    "grouped_mm_applies",
    "inverse_permutation",
    "permute_rows",
    "restore_route_order",
    "route_counts",
    "route_positions",
    "sort_routes",
]

_PROBES: dict[tuple[str, int | None, torch.dtype], bool] = {}


def _grouped_mm_fn() -> Callable[..., torch.Tensor] | None:
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Run a tiny grouped matmul forward and backward once: some builds list it but lack a kernel.

    Apart from the caller's autograd state: the first call may come under ``no_grad``, or inside a checkpointed
    block, whose recomputation a backward through the block's saved-tensor hooks would start mid-forward.
    """
    key = (device.type, device.index, dtype)
    if key not in _PROBES:
        fn = _grouped_mm_fn()
        ok = fn is not None
        if ok:
            try:
                with torch.enable_grad(), plainly_saved_tensors():
                    x = torch.ones(8, 16, device=device, dtype=dtype, requires_grad=True)
                    w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
                    offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
                    y = fn(x, w, offs=offs)
                    grads = torch.autograd.grad(y, [x, w], torch.ones_like(y))
                ok = all(bool(torch.isfinite(grad).all()) for grad in grads)
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _PROBES[key] = ok
    return _PROBES[key]


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride() if s != 1)


def grouped_mm_applies(x: torch.Tensor, weight_t: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs ``x [S, in] @ weight_t [E, in, out]`` here.

    Its kernels need 16-byte aligned strides (CPU and CUDA) and SM80+ on CUDA; the probe catches builds
    whose kernel is missing for this dtype.
    """
    if x.dtype != weight_t.dtype or x.shape[0] == 0:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    return _aligned(x) and _aligned(weight_t) and _probe(x.device, x.dtype)


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    counts: Sequence[int],
    *,
    transposed: bool = False,
    bias_rows: torch.Tensor | None = None,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """Rows ``x`` sorted by expert (``counts[e]`` rows for expert ``e``) through expert ``e``'s ``weight``.

    ``weight`` is ``[E, out, in]`` (``transposed``: ``[E, in, out]``), as the family stores it.
    ``bias_rows`` is each row's bias, already gathered. The graph always reaches ``x`` and ``weight``,
    even with no rows, so a rank with nothing to compute still runs the collectives of the backward.
    """
    weight_t = weight if transposed else weight.transpose(-2, -1)
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_applies(x, weight_t)
    if use_grouped_mm:
        offs = torch.tensor(list(counts), device=x.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out = _grouped_mm_fn()(x, weight_t, offs=offs)  # type: ignore[misc]
        if out.requires_grad:
            out.register_hook(_contiguous_grad)  # the CPU kernel's backward rejects expanded gradients
    else:
        pieces, start = [], 0
        for expert, n in enumerate(counts):
            if n:
                pieces.append(x[start:start + n] @ weight_t[expert])
            start += n
        out = torch.cat(pieces) if pieces else x @ weight_t[0]
    return out if bias_rows is None else out + bias_rows


def sort_routes(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The route order that groups token copies by expert (stable), and each expert's route count.

    Routes are numbered ``token * k + choice``; ids at or above ``num_experts`` (transformers' own
    expert-parallel sentinels) sort last and are not counted.
    """
    flat = top_k_index.reshape(-1)
    return torch.sort(flat, stable=True).indices, route_counts(flat, num_experts)


def route_counts(flat_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes per expert; sentinel ids (``>= num_experts``) land past the end and are cut off."""
    return torch.bincount(flat_index, minlength=num_experts)[:num_experts]


def inverse_permutation(index: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[index[i]] == i``."""
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device, dtype=index.dtype)
    return inverse


class _GatherRows(torch.autograd.Function):
    """Rows gathered by ``index`` where each source row lands at most once, so the backward is a gather by
    ``back_index`` too, not autograd's scatter into a zero-filled buffer (``index_select``'s backward, measured
    as the largest bookkeeping cost on CPU). An index longer than its source (padding) reads the index
    ``len(source)`` as a zero row."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor, back_index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back_index)
        return _take(rows, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (back_index,) = ctx.saved_tensors
        return _take(grad, back_index), None, None


def _take(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if index.numel() > rows.shape[0]:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, 1))
    return rows.index_select(0, index)


def permute_rows(rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor | None = None) -> torch.Tensor:
    """``rows[index]`` for a permutation ``index`` of ``rows``' first dimension (``inverse`` if already known)."""
    if index.numel() != rows.shape[0]:
        raise ValueError(f"permute_rows needs a permutation of {rows.shape[0]} rows, got {index.numel()} indices")
    return _GatherRows.apply(rows, index, inverse_permutation(index) if inverse is None else inverse)


def route_positions(order: torch.Tensor, num_computed: int) -> torch.Tensor:
    """Each route's position among the first ``num_computed`` routes of ``order``; ``num_computed`` for routes past
    them (sentinel ids, never computed), which :class:`_GatherRows` reads as a zero row."""
    return inverse_permutation(order).clamp_(max=num_computed)


def restore_route_order(sorted_out: torch.Tensor, order: torch.Tensor,
                        positions: torch.Tensor | None = None) -> torch.Tensor:
    """Outputs of the first ``len(sorted_out)`` routes of ``order`` put back in route order.

    Routes past them (sentinel ids, never computed) get zeros. One gather each way (``positions`` from
    :func:`route_positions`, if already known).
    """
    computed = sorted_out.shape[0]
    if positions is None:
        positions = route_positions(order, computed)
    return _GatherRows.apply(sorted_out, positions, order[:computed])


class _GatherTokenCopies(torch.autograd.Function):
    """Token rows copied once per computed route, in sorted route order. autograd's backward of that gather is a
    scatter-add into a zero-filled ``[tokens, hidden]`` buffer; here the route gradients are gathered back into
    route order (never-computed routes read zeros) and summed over each token's ``k`` routes."""

    @staticmethod
    def forward(ctx: Any, hidden_states: torch.Tensor, token_rows: torch.Tensor, positions: torch.Tensor,
                k: int) -> torch.Tensor:
        ctx.save_for_backward(positions)
        ctx.k = k
        return hidden_states.index_select(0, token_rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (positions,) = ctx.saved_tensors
        routes = _take(grad, positions)
        return routes.view(-1, ctx.k, routes.shape[-1]).sum(1), None, None, None


def gather_token_copies(hidden_states: torch.Tensor, order: torch.Tensor, num_computed: int, positions: torch.Tensor,
                        k: int) -> torch.Tensor:
    """``hidden_states`` rows of the routes ``order[:num_computed]`` (route ``r`` is token ``r // k``);
    ``positions`` is :func:`route_positions` of the same ``order`` and ``num_computed``."""
    return _GatherTokenCopies.apply(hidden_states, order[:num_computed] // k, positions, k)


EXPERT_TENSORS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")
"""The per-expert tensors an experts module may hold, each ``[E, ...]``."""


def expert_mlp(module: nn.Module, rows: torch.Tensor, counts: Sequence[int], expert_ids: torch.Tensor | None = None,
               use_grouped_mm: bool | None = None, tensors: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The family's expert MLP on rows sorted by (local) expert, using the module's own layout flags.

    ``module`` is a ``@use_experts_implementation`` experts module (or one sliced to local experts):
    its ``has_gate``, ``has_bias``, ``is_transposed``, ``_apply_gate``, ``act_fn`` and
    ``post_expert_norm`` decide the computation, exactly as in transformers' own implementations.
    ``tensors`` replaces the module's expert tensors by name (e.g. local experts plus replicas).
    ``expert_ids`` (each row's expert) is only read for biases; left out, it follows from ``counts``.
    """
    def tensor(name: str) -> torch.Tensor | None:
        return tensors[name] if tensors is not None and name in tensors else getattr(module, name, None)

    transposed = bool(getattr(module, "is_transposed", False))
    has_bias = bool(getattr(module, "has_bias", False))
    gated = getattr(module, "has_gate", True)
    weight, bias = (tensor("gate_up_proj"), tensor("gate_up_proj_bias")) if gated else \
        (tensor("up_proj"), tensor("up_proj_bias"))
    rows = rows.to(weight.dtype)
    if has_bias and expert_ids is None:
        expert_ids = torch.arange(len(counts), device=rows.device).repeat_interleave(
            torch.tensor(list(counts), device=rows.device), output_size=rows.shape[0])
    hidden = grouped_linear(rows, weight, counts, transposed=transposed,
                            bias_rows=bias[expert_ids] if has_bias else None, use_grouped_mm=use_grouped_mm)
    hidden = module._apply_gate(hidden) if gated else module.act_fn(hidden)
    down_bias = tensor("down_proj_bias")
    out = grouped_linear(hidden, tensor("down_proj"), counts, transposed=transposed,
                         bias_rows=down_bias[expert_ids] if has_bias else None, use_grouped_mm=use_grouped_mm)
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out


def combine_routes(route_out: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's router-weighted sum of its ``k`` expert outputs (``route_out`` in route order)."""
    num_tokens, k = top_k_weights.shape
    weighted = route_out * top_k_weights.reshape(-1, 1)
    return weighted.view(num_tokens, k, -1).sum(1).to(dtype)


def grouped_experts_forward(
    module: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """Single-process dropless grouped forward: the ``merak_grouped`` experts implementation."""
    k = top_k_index.size(-1)
    order, counts = sort_routes(top_k_index, module.num_experts)
    counts_list = counts.tolist()
    num_computed = sum(counts_list)
    positions = route_positions(order, num_computed)
    out = expert_mlp(module, gather_token_copies(hidden_states, order, num_computed, positions, k), counts_list)
    return combine_routes(restore_route_order(out, order, positions), top_k_weights, hidden_states.dtype)
