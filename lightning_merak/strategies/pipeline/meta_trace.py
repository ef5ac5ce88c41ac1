"""Tracing a model built on the meta device, materialising one piece at a time.

The prefix of a transformers model (embeddings, masks, rotary tables) runs data-dependent code
(mask shortcuts read tensor values), so it cannot run on meta tensors; the blocks and the head
can. One recorded forward therefore runs on a copy of the model whose prefix modules are
materialised the moment they are called on real tensors, while every block receives its inputs
moved to the meta device: the side tensors and the hidden state entering the first block are
real (the samples the planner, the tensor-parallel check and the pipeline need), everything after
is shapes only. A pipeline needs each block to read the previous block's output and values
computed before the blocks: on meta that is checked by identity (a side tensor left on the meta
device, or a block input that is not the previous block's output, was derived from a block).

Profiling materialises one node at a time, times it on real samples and frees it: the prefix,
one block of each distinct signature (repeated blocks share its figures) and the head.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from lightning_merak.strategies.pipeline.costs import BlockCost
from lightning_merak.strategies.pipeline.trace import (
    ModelTrace,
    TraceError,
    _block_signatures,
    _head_steps,
    _measure,
    _param_bytes,
    _prefix_output,
    _record,
    find_trunk,
)

__all__ = ["materialized_copy", "trace_meta_model"]

Materialize = Callable[..., None]
"""``(module, unsplit name, recurse=True) -> None``: storage and initial values for ``module`` (a Materializer's)."""


def materialized_copy(module: nn.Module, name: str, materialize_with: Callable[[nn.Module], Materialize]) -> nn.Module:
    """A real copy of the meta ``module`` (for timing or a split check); ``module`` stays on meta."""
    real = copy.deepcopy(module)
    materialize_with(real)(real, name)
    return real


def _to_meta(value: Any) -> Any:
    return tree_map(lambda leaf: leaf.to("meta") if isinstance(leaf, torch.Tensor) and not leaf.is_meta else leaf,
                    value)


def _on_meta(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*_to_meta(args), **_to_meta(kwargs))


def _materialize_prefix_on_call(model: nn.Module, trunk_path: str, materialize: Materialize) -> list[Any]:
    """Hooks materialising, when first called on a real tensor, each module that does not hold the trunk."""
    def holds_trunk(name: str) -> bool:
        return (name == "" or trunk_path == name or trunk_path.startswith(name + ".")
                or name.startswith(trunk_path + "."))

    def hook(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        leaves = tree_flatten((args, kwargs))[0]
        if any(isinstance(leaf, torch.Tensor) and not leaf.is_meta for leaf in leaves):
            if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
                materialize(module, name)

    for name, module in model.named_modules():
        if holds_trunk(name) and not name.startswith(trunk_path):
            materialize(module, name, False)  # what the trunk's containers hold themselves
    return [module.register_forward_pre_hook(functools.partial(hook, name), with_kwargs=True)
            for name, module in model.named_modules() if not holds_trunk(name)]


def trace_meta_model(model: nn.Module, sample_inputs: torch.Tensor,
                     call_model: Callable[[nn.Module, torch.Tensor], Any], profile: bool, profile_repeats: int,
                     materialize_with: Callable[[nn.Module], Materialize]) -> ModelTrace:
    """:func:`~lightning_merak.strategies.pipeline.trace.trace_model` of a meta ``model``; ``model`` stays on meta.

    ``materialize_with(copy)`` returns the function that materialises modules of ``copy`` (a copy of
    ``model``), initialised as the run will initialise them.
    """
    work = copy.deepcopy(model)
    trunk_path, trunk = find_trunk(work)
    handles = _materialize_prefix_on_call(work, trunk_path, materialize_with(work))
    for block in trunk:
        block.forward = functools.partial(_on_meta, block.forward)
    try:
        recording = _record(work, call_model, sample_inputs, trunk)
    except RuntimeError as error:
        if "meta" not in str(error):
            raise
        # a value computed before the blocks (real) met a block's output (meta) outside any block
        raise TraceError(
            f"the model combines the output of a block of {trunk_path} with values computed before the blocks, "
            "outside its blocks (a skip connection across blocks?); merak3d carries only the hidden state and "
            f"values computed before the blocks ({str(error).splitlines()[0]})") from error
    finally:
        for handle in handles:
            handle.remove()
    block_calls = recording["blocks"]
    if len(block_calls) != len(trunk):
        raise TraceError(f"{trunk_path} holds {len(trunk)} blocks but {len(block_calls)} ran in one forward pass; "
                         "merak3d needs every block to run exactly once per forward")
    hidden_in = block_calls[0][0][0] if block_calls[0][0] else None
    if not isinstance(hidden_in, torch.Tensor) or hidden_in.is_meta:
        raise TraceError(f"blocks of {trunk_path} must take the hidden state as their first positional argument")
    signatures, side = _block_signatures(trunk_path, block_calls)
    output_index = _output_index(block_calls, trunk_path)
    _check_chain(block_calls, output_index, side, trunk_path)
    last_output = block_calls[-1][2]
    last_hidden = last_output if output_index is None else last_output[output_index]
    head = _head_steps(recording["after_trunk"], last_hidden, recording["logits"])
    if any(isinstance(leaf, torch.Tensor) and leaf.is_meta for step in head for leaf in step.leaves):
        raise TraceError("the head uses a tensor computed from the last block's output outside a module call; "
                         "build the model without the meta device (no empty_init) to pipeline it")
    first_output = block_calls[0][2]
    trace = ModelTrace(
        trunk_path=trunk_path, num_blocks=len(trunk), block_signatures=signatures, side_tensor_count=len(side),
        block_output_index=output_index, head=head, sample_hidden=hidden_in.detach(),
        sample_side_tensors=tuple(tensor.detach() for tensor in side),
        block_output_template=None if output_index is None else tuple(
            None if isinstance(item, torch.Tensor) else item for item in first_output),
        logits_shape=tuple(recording["logits"].shape),
    )
    if profile:
        prefix = _profile_prefix(model, work, trace, call_model, sample_inputs, profile_repeats)
        del work, trunk, recording, block_calls  # the materialised prefix goes before a block is
        trace.costs = [prefix, *_profile_rest(model, trace, profile_repeats, materialize_with)]
    return trace


def _output_index(block_calls: list[tuple], trunk_path: str) -> int | None:
    first_output = block_calls[0][2]
    if isinstance(first_output, torch.Tensor):
        return None
    next_hidden = block_calls[1][0][0] if len(block_calls) > 1 else None
    candidates = [i for i, item in enumerate(first_output) if isinstance(item, torch.Tensor)
                  and (next_hidden is None or item is next_hidden)]
    if not candidates:
        raise TraceError(f"cannot find the hidden state in the outputs of {trunk_path} blocks")
    return candidates[0]


def _check_chain(block_calls: list[tuple], output_index: int | None, side: list[torch.Tensor], trunk_path: str) -> None:
    """Each block reads the previous block's output and values computed before the blocks (real tensors)."""
    derived = any(tensor.is_meta for tensor in side)
    for index in range(1, len(block_calls)):
        previous = block_calls[index - 1][2]
        hidden = previous if output_index is None else previous[output_index]
        derived = derived or block_calls[index][0][0] is not hidden
    if derived:
        raise TraceError(
            f"the blocks of {trunk_path} called one by one with the values the model computed before them do "
            "not reproduce its logits: a block reads something derived from another block's output (a skip "
            "connection across blocks?); merak3d carries only the hidden state and values computed before the blocks"
        )


def _output_bytes(trace: ModelTrace) -> int:
    return sum(t.numel() * t.element_size() for t in (trace.sample_hidden, *trace.sample_side_tensors))


def _profile_prefix(model: nn.Module, work: nn.Module, trace: ModelTrace, call_model: Callable,
                    sample_inputs: torch.Tensor, repeats: int) -> BlockCost:
    """The prefix's cost, timed on ``work`` (whose prefix the recording materialised)."""
    prefix_params, _ = trace.outside_parameters(model)
    work_trunk = work.get_submodule(trace.trunk_path)
    fwd, bwd, saved = _measure(lambda: _prefix_output(work, work_trunk, call_model, sample_inputs),
                               trace.outside_parameters(work)[0], repeats)
    return BlockCost("prefix", fwd, bwd, sum(p.numel() * p.element_size() for p in prefix_params),
                     _output_bytes(trace), saved, is_embedding=True)


def _profile_rest(model: nn.Module, trace: ModelTrace, repeats: int,
                  materialize_with: Callable[[nn.Module], Materialize]) -> list[BlockCost]:
    """Costs of the blocks and the head, each materialised on its own."""
    trunk: nn.ModuleList = model.get_submodule(trace.trunk_path)
    hidden, side = trace.sample_hidden, trace.sample_side_tensors
    output_bytes = _output_bytes(trace)
    seen = {id(p) for p in trace.outside_parameters(model)[0]}
    costs = []
    figures: dict[Any, tuple[float, float, int]] = {}
    block_output = None
    for index, block in enumerate(trunk):
        args, kwargs = trace.block_arguments(side, index)
        kind = (repr(trace.block_signatures[index]), tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))
        if kind not in figures:
            real = materialized_copy(block, f"{trace.trunk_path}.{index}", materialize_with)
            block_input = hidden.detach().clone().requires_grad_(True)
            figures[kind] = _measure(lambda: trace.hidden_of(real(block_input, *args, **kwargs)),
                                     list(real.parameters()), repeats)
            if block_output is None:
                with torch.no_grad():
                    block_output = trace.hidden_of(real(hidden, *args, **kwargs))
            del real
        fwd, bwd, saved = figures[kind]
        costs.append(BlockCost(f"{trace.trunk_path}.{index}", fwd, bwd, _param_bytes([block], seen), output_bytes,
                               saved))
    head_model = copy.deepcopy(model)
    materialize = materialize_with(head_model)
    for path in trace.suffix_paths:
        materialize(head_model.get_submodule(path), path)
    _, head_params = trace.outside_parameters(head_model)
    suffix_input = block_output.detach().clone().requires_grad_(True)
    fwd, bwd, saved = _measure(lambda: trace.run_head(head_model, suffix_input), head_params, repeats)
    costs.append(BlockCost("suffix", fwd, bwd, _param_bytes([model.get_submodule(p) for p in trace.suffix_paths], seen),
                           block_output.numel() * block_output.element_size(), saved))
    return costs
