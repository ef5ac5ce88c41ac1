"""A forward run as ``k`` overlapped sub-batches, for unmodified models.

A micro-batch is split into ``k`` sub-batches along the batch dimension and each runs the
whole forward (all blocks of the model or stage) as a coroutine on its own thread, taking
turns (:mod:`~lightning_merak.distributed.turns`) at every collective
(:mod:`~lightning_merak.distributed.collectives`), so one sub-batch's communication hides behind
the others' computation.

Backward mirrors this: the sub-batches' autograd graphs are separate, and their backward
passes run as the same kind of coroutines, switching at every gradient collective. The
region is one autograd node whose inputs include the module's parameters, so a caller's
``torch.autograd.grad(outputs, inputs)`` (pipeline shape inference) leaves parameter
gradients untouched, exactly as without the region.

The model code is not changed: the region wraps a module's ``forward``; tensors whose first
dimension is the batch are split, the others are passed to every sub-batch whole.

On CUDA the sub-batch threads compute on the caller's stream (carried into them by
:func:`~lightning_merak.distributed.turns.caller_state`) and their collectives run on NCCL's stream; the
overlap is between the two, and each collective's ``wait`` orders the sub-batch's later kernels after it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_merak.distributed.turns import caller_state, run_in_turns

__all__ = ["SubBatchForward", "mark_sub_batch_share", "run_sub_batches"]


_SHARE_FLAG = "_merak_sub_batch_share"


def mark_sub_batch_share(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as this sub-batch's additive share of a value of the whole batch.

    A region returns the sum of its sub-batches' marked outputs (not the first of equal
    ones), and the gradient of that sum reaches every share.
    """
    setattr(tensor, _SHARE_FLAG, True)
    return tensor


def _split(value: Any, batch: int, parts: int) -> list[Any]:
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == batch:
        return list(value.chunk(parts))
    return [value] * parts


def _merge(outputs: list[Any], sub_batch: int) -> tuple[Any, str]:
    """One output from the sub-batches' outputs, and how: "cat", "sum" (of shares) or "same"."""
    first = outputs[0]
    if not isinstance(first, torch.Tensor):
        return first, "same"
    if len(outputs) > 1 and all(getattr(output, _SHARE_FLAG, False) for output in outputs):
        total = outputs[0]
        for share in outputs[1:]:
            total = total + share
        return total, "sum"
    if first.ndim > 0 and first.shape[0] == sub_batch and len(outputs) > 1:
        return torch.cat(outputs), "cat"
    if not first.is_meta and any(not torch.equal(first, other) for other in outputs[1:]):
        raise ValueError(
            f"an output of shape {tuple(first.shape)} differs between sub-batches but its first dimension is "
            f"not the batch; tp_overlap needs batch-first outputs (or set tp_overlap=1)"
        )
    return first, "same"


class _SubBatchRegion(torch.autograd.Function):
    """Forward of ``k`` sub-batches with separate graphs; backward runs them in turns too."""

    @staticmethod
    def forward(ctx: Any, call: dict[str, Any], *inputs_and_parameters: torch.Tensor) -> Any:
        parts, batch = call["parts"], call["batch"]
        inputs = inputs_and_parameters[: call["input_count"]]
        ctx.parameters = inputs_and_parameters[call["input_count"]:]
        leaves = [[None] * len(inputs) for _ in range(parts)]
        split_inputs = []
        for position, tensor in enumerate(inputs):
            pieces = _split(tensor, batch, parts)
            split_inputs.append(pieces[0] is not tensor)
            for index, piece in enumerate(pieces):
                leaf = piece.detach()
                if tensor.requires_grad:
                    leaf.requires_grad_(True)
                leaves[index][position] = leaf

        def task(index: int) -> Callable[[], list[Any]]:
            return lambda: tree_flatten(call["run"](leaves[index]))

        results = run_in_turns([task(i) for i in range(parts)], caller_state(grad=True))
        flat_outputs = [flat for flat, _ in results]
        call["spec"] = results[0][1]
        merged, merges = [], []
        for position in range(len(flat_outputs[0])):
            value, how = _merge([flat[position] for flat in flat_outputs], batch // parts)
            merged.append(value.detach() if isinstance(value, torch.Tensor) else value)
            merges.append(how)
        ctx.parts, ctx.leaves, ctx.split_inputs = parts, leaves, split_inputs
        ctx.sub_outputs, ctx.merges = flat_outputs, merges
        ctx.set_materialize_grads(False)
        call["non_tensor"] = {i: v for i, v in enumerate(merged) if not isinstance(v, torch.Tensor)}
        return tuple(v for v in merged if isinstance(v, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:
        tensor_positions = [i for i, v in enumerate(ctx.sub_outputs[0]) if isinstance(v, torch.Tensor)]
        per_part: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(ctx.parts)]
        for grad, position in zip(grads, tensor_positions):
            if grad is None:
                continue
            how = ctx.merges[position]
            pieces = (grad.chunk(ctx.parts) if how == "cat" else [grad] * ctx.parts if how == "sum"
                      else [grad] + [None] * (ctx.parts - 1))
            for index, piece in enumerate(pieces):
                output = ctx.sub_outputs[index][position]
                if piece is not None and output.requires_grad:
                    per_part[index][0].append(output)
                    per_part[index][1].append(piece)

        parameters = [p for p in ctx.parameters if p.requires_grad]

        def wanted(index: int) -> list[torch.Tensor]:
            return [leaf for leaf in ctx.leaves[index] if leaf.requires_grad] + parameters

        def gradients(outputs: list[torch.Tensor], output_grads: list[torch.Tensor],
                      inputs: list[torch.Tensor]) -> Sequence[Optional[torch.Tensor]]:
            if not outputs:
                return [None] * len(inputs)
            return torch.autograd.grad(outputs, inputs, output_grads, allow_unused=True)

        def task(index: int) -> Callable[[], Sequence[Optional[torch.Tensor]]]:
            return lambda: gradients(*per_part[index], wanted(index))

        if any(output.is_cuda for outputs, _ in per_part for output in outputs):
            # CUDA nodes run on the autograd device thread, which must not block on other threads:
            # one reentrant backward over all sub-batches lets the engine interleave them instead.
            everything = [t for index in range(ctx.parts) for t in wanted(index)]
            flat = gradients([o for part, _ in per_part for o in part], [g for _, part in per_part for g in part],
                             everything)
            sizes = [len(wanted(index)) for index in range(ctx.parts)]
            results = [flat[sum(sizes[:i]): sum(sizes[: i + 1])] for i in range(ctx.parts)]
        else:
            results = run_in_turns([task(i) for i in range(ctx.parts)], caller_state(grad=False))
        leaf_grads: list[dict[int, torch.Tensor]] = []
        parameter_grads: list[Optional[torch.Tensor]] = [None] * len(parameters)
        for index, grads_of_part in enumerate(results):
            leaves = [leaf for leaf in ctx.leaves[index] if leaf.requires_grad]
            leaf_grads.append({id(leaf): grad for leaf, grad in zip(leaves, grads_of_part) if grad is not None})
            for position, grad in enumerate(grads_of_part[len(leaves):]):
                if grad is not None:
                    total = parameter_grads[position]
                    parameter_grads[position] = grad if total is None else total + grad
        input_grads: list[Optional[torch.Tensor]] = []
        for position, split in enumerate(ctx.split_inputs):
            pieces = [grads.get(id(leaves[position])) for grads, leaves in zip(leaf_grads, ctx.leaves)]
            if all(piece is None for piece in pieces):
                input_grads.append(None)
            elif split:
                input_grads.append(torch.cat([
                    piece if piece is not None else torch.zeros_like(leaves[position])
                    for piece, leaves in zip(pieces, ctx.leaves)
                ]))
            else:
                input_grads.append(sum(piece for piece in pieces if piece is not None))
        by_parameter = dict(zip(map(id, parameters), parameter_grads))
        ctx.sub_outputs = ctx.leaves = None
        return (None, *input_grads, *(by_parameter.get(id(p)) for p in ctx.parameters))


def _mark_loss_share(outputs: Any, kwargs: dict[str, Any]) -> Any:
    """A transformers model given ``num_items_in_batch`` returns its tokens' summed loss divided by the whole batch's
    count (not the sub-batch's): the sub-batches' losses are shares of the whole batch's, to be summed."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else None
    if kwargs.get("num_items_in_batch") is not None and isinstance(loss, torch.Tensor) and loss.ndim == 0:
        mark_sub_batch_share(loss)
    return outputs


def run_sub_batches(
    forward: Callable[..., Any],
    parts: int,
    args: tuple = (),
    kwargs: Optional[dict[str, Any]] = None,
    parameters: Sequence[torch.Tensor] = (),
) -> Any:
    """``forward(*args, **kwargs)`` computed as ``parts`` overlapped sub-batches.

    Tensors whose first dimension is the batch (that of the first tensor argument) are
    split; outputs whose first dimension is the sub-batch are concatenated back, and a model's
    loss normalised by ``num_items_in_batch`` is summed over the sub-batches.
    ``parameters`` are those ``forward`` uses: their gradients flow through the region.
    """
    leaves, spec = tree_flatten((args, kwargs or {}))
    tensor_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if parts == 1 or not tensor_positions:
        return forward(*args, **(kwargs or {}))
    batch = leaves[tensor_positions[0]].shape[0]
    if batch % parts:
        raise ValueError(
            f"a micro-batch of {batch} samples cannot be split into tp_overlap={parts} sub-batches; "
            f"choose a tp_overlap that divides the micro-batch size"
        )

    def run(tensors: list[torch.Tensor]) -> Any:
        values = list(leaves)
        for position, tensor in zip(tensor_positions, tensors):
            values[position] = tensor
        call_args, call_kwargs = tree_unflatten(values, spec)
        return _mark_loss_share(forward(*call_args, **call_kwargs), call_kwargs)

    inputs = [leaves[i] for i in tensor_positions]
    if not torch.is_grad_enabled():
        pieces = [_split(tensor, batch, parts) for tensor in inputs]
        results = run_in_turns(
            [lambda index=index: tree_flatten(run([p[index] for p in pieces])) for index in range(parts)],
            caller_state(grad=False),
        )
        flat = [_merge([r[0][position] for r in results], batch // parts)[0] for position in range(len(results[0][0]))]
        return tree_unflatten(flat, results[0][1])
    call: dict[str, Any] = {"parts": parts, "batch": batch, "run": run, "input_count": len(inputs)}
    tensors = iter(_SubBatchRegion.apply(call, *inputs, *parameters))
    non_tensor = call["non_tensor"]
    count = call["spec"].num_leaves
    flat = [non_tensor[i] if i in non_tensor else next(tensors) for i in range(count)]
    return tree_unflatten(flat, call["spec"])


class SubBatchForward:
    """A module's ``forward`` run as overlapped sub-batches while the module trains;
    install with ``module.forward = SubBatchForward(module, k)``.

    In eval mode (validation, prediction) the forward runs on the whole batch: there is no backward to overlap,
    and an evaluation batch of any size works. The mode, not whether autograd records, decides, so a region that
    checkpointing runs first without gradients and again with them splits the same way both times (the same
    dropout masks).
    """

    def __init__(self, module: torch.nn.Module, parts: int) -> None:
        self.module, self.parts, self.forward = module, parts, module.forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.forward, *args, **kwargs)

    def run(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``forward`` (a function around the module's own, :attr:`forward`) run as this region's sub-batches, for
        a caller that needs what happens inside each sub-batch returned as one of its outputs."""
        if not self.module.training:
            return forward(*args, **kwargs)
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        return run_sub_batches(forward, self.parts, args, kwargs, parameters)
