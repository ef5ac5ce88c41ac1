"""Proxy graph of an unmodified model by execution-order recording (no torch.fx, no HF tracer).

A causal LM — a transformers v5 model or a plain ``nn.Module`` a user wrote — is a
*prefix* (embeddings, masks, rotary tables), a *trunk* (an ``nn.ModuleList`` of repeated
blocks, each called as ``hidden = block(hidden, *side_args, **side_kwargs)``) and a
*head* (final norm, LM head, logit scaling or soft-capping). One recorded forward pass
finds all three:

* the trunk is the ``ModuleList`` of same-class blocks holding the most parameters;
* forward pre-hooks capture what the model passes to its blocks; tensors among those
  arguments (attention masks, position ids, rotary tables: values computed before the
  blocks) become *side tensors* a pipeline carries from stage to stage, and the rest
  (``None``, flags) are kept as constants. Blocks may read different side tensors (a
  sliding-window mask on some layers, a global one on others): the pipeline carries the
  union and hands each block its own;
* a block argument that an earlier block returned (a value-residual model's first-layer
  values, a U-Net's long skip) is a *skip value*: the pipeline carries it from the stage
  of the block that made it to the stages of the blocks that read it, through the stages
  between, and its gradient back (:class:`~.recording.SkipValue`);
* the head is every module call and tensor operation that the logits depend on after
  the last block, recorded in order and replayed on the last stage.

The split is then verified: the side tensors gathered without running any block, the
blocks called one by one (each handed the skip values it reads) and the head replayed must
reproduce the model's logits. Each
node is finally measured on its recorded inputs (forward and backward time, bytes saved
for backward), giving the :class:`BlockCost` list the partitioner balances.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lightning_merak.parallel.fast_blocks import FastBlocks
from lightning_merak.parallel.materialize import Materializer, init_owners
from lightning_merak.parallel.pipeline import meta_trace
from lightning_merak.parallel.pipeline.costs import BlockCost, with_trainable_nodes
from lightning_merak.parallel.pipeline.recording import (
    ModelTrace,
    TraceError,
    block_signatures,
    check_chained_blocks,
    find_trunk,
    head_steps,
    measure,
    param_bytes,
    prefix_output,
    record_forward,
    same_tensor,
    saved_bytes,
    tensor_bytes,
)
from lightning_merak.util.model_outputs import logits_of
from lightning_merak.util.module_mode import hooks_removed_after, modules_in_mode

__all__ = ["ModelTrace", "TraceError", "find_trunk", "saved_bytes", "trace_model"]


def trace_model(
    model: nn.Module,
    sample_inputs: torch.Tensor,
    call_model: Callable[[nn.Module, torch.Tensor], Any] = lambda model, ids: model(ids),
    profile: bool = True,
    profile_repeats: int = 5,
    materialize_with: Callable[[nn.Module], Callable[..., None]] | None = None,
    fast_blocks: FastBlocks = FastBlocks(),
) -> ModelTrace:
    """Record ``model`` on ``sample_inputs`` (one micro-batch) and, with ``profile``, measure every node.

    Returns the trace with ``costs`` = [prefix, block 0 … block n−1, suffix]. The random
    number generators are left as they were, so tracing does not change a run's dropout masks.
    A model on the meta device is traced by :mod:`~lightning_merak.parallel.pipeline.meta_trace`
    and stays there; ``materialize_with(copy)`` gives the function materialising the pieces of a
    copy it needs real (default: a :class:`~lightning_merak.parallel.materialize.Materializer`
    seeded with the current seed). Each block is timed as ``fast_blocks`` makes it train (fp8 layers, compiled:
    :meth:`~lightning_merak.parallel.fast_blocks.FastBlocks.profiled`).
    """
    with torch.random.fork_rng(devices=[]):
        if any(param.is_meta for param in model.parameters()):
            if materialize_with is None:
                materialize_with = default_materializer(model, sample_inputs.device)
            trace = meta_trace.trace_meta_model(model, sample_inputs, call_model, profile, profile_repeats,
                                                materialize_with, fast_blocks)
        else:
            trace = _trace(model, sample_inputs, call_model, profile, profile_repeats, fast_blocks)
    if profile:
        trace.costs = _marked_trainable(model, trace)
    return trace


def _marked_trainable(model: nn.Module, trace: ModelTrace) -> list[BlockCost]:
    """The trace's costs with which nodes (and vocabulary tables) take gradients, so no pipeline stage is cut
    where its optimizer would get no parameter (frozen embeddings, adapters on some layers)."""
    return with_trainable_nodes(trace.costs, trace.node_parameters(model),
                                _table_parameters(model, "get_input_embeddings"),
                                _table_parameters(model, "get_output_embeddings"))


def _table_parameters(model: nn.Module, getter: str) -> list[nn.Parameter]:
    """The parameters of the vocabulary table ``model.<getter>()`` returns; none where it has no such table
    (transformers raises NotImplementedError for a model whose embedding it cannot find)."""
    try:
        table = getattr(model, getter)() if hasattr(model, getter) else None
    except NotImplementedError:
        return []
    return [] if table is None else list(table.parameters())


def default_materializer(model: nn.Module, device: torch.device) -> Callable[[nn.Module], Callable[..., None]]:
    """``materialize_with`` for :func:`trace_model` of ``model``: Materializers on ``device`` with the current seed."""
    seed, owners = torch.initial_seed(), init_owners(model)
    return lambda copy_: Materializer(device, seed, owners).materialize


def _trace(model: nn.Module, sample_inputs: torch.Tensor, call_model: Callable[[nn.Module, torch.Tensor], Any],
           profile: bool, profile_repeats: int, fast_blocks: FastBlocks) -> ModelTrace:
    trunk_path, trunk = find_trunk(model)
    recording = record_forward(model, call_model, sample_inputs, trunk)
    block_calls = recording["blocks"]
    if len(block_calls) != len(trunk):
        raise TraceError(
            f"{trunk_path} holds {len(trunk)} blocks but {len(block_calls)} ran in one forward pass; "
            "merak3d needs every block to run exactly once per forward"
        )
    first_args, _, first_output = block_calls[0]
    hidden_in = first_args[0] if first_args else None
    if not isinstance(hidden_in, torch.Tensor):
        raise TraceError(f"blocks of {trunk_path} must take the hidden state as their first positional argument")
    signatures, side, skips, skip_samples = block_signatures(trunk_path, block_calls, getattr(model, "config", None))
    if isinstance(first_output, torch.Tensor):
        output_index = None
    else:
        next_hidden = block_calls[1][0][0] if len(block_calls) > 1 else None
        candidates = [i for i, item in enumerate(first_output) if isinstance(item, torch.Tensor)
                      and (next_hidden is None or same_tensor(item, next_hidden))]
        if not candidates:
            raise TraceError(f"cannot find the hidden state in the outputs of {trunk_path} blocks")
        output_index = candidates[0]
    check_chained_blocks(model, trunk_path, block_calls,
                         lambda output: output if output_index is None else output[output_index])
    last_output = block_calls[-1][2]
    last_hidden = last_output if output_index is None else last_output[output_index]

    trace = ModelTrace(
        trunk_path=trunk_path,
        num_blocks=len(trunk),
        block_signatures=signatures,
        side_tensor_count=len(side),
        block_output_index=output_index,
        head=head_steps(recording["after_trunk"], last_hidden, recording["logits"], block_calls,
                        recording["from_inputs"]),
        sample_hidden=hidden_in.detach(),
        sample_side_tensors=tuple(tensor.detach() for tensor in side),
        block_output_template=None if output_index is None else tuple(
            None if isinstance(item, torch.Tensor) else item for item in first_output),
        skips=tuple(skips),
        sample_skips=tuple(tensor.detach() for tensor in skip_samples),
        prefix_paths=recording["before_trunk"],
    )
    _verify_split(model, trace, trunk, call_model, sample_inputs)
    if profile:
        trace.costs = _profile(model, trace, trunk, call_model, sample_inputs, hidden_in,
                               trace.sample_side_tensors, last_hidden, profile_repeats, fast_blocks)
    return trace


def _verify_split(model: nn.Module, trace: ModelTrace, trunk: nn.ModuleList,
                  call_model: Callable[[nn.Module, torch.Tensor], Any], inputs: torch.Tensor) -> None:
    """Gathering the side tensors with every block skipped, calling the blocks one by one and replaying the
    head must give the model's logits, as a pipeline does. A value a block reads that the model derived
    from another block's output would differ. Run in eval mode, so dropout draws nothing."""
    side: dict[int, torch.Tensor] = {}
    first_hidden: list[torch.Tensor] = []

    def gather(index: int) -> Callable[[nn.Module, tuple, dict], None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            first_hidden.append(args[0])
            side.update(trace.side_tensors_of(index, args[1:], kwargs))
        return hook

    def skip(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        return trace.output_with_hidden(args[0])

    with modules_in_mode(model, training=False), torch.no_grad():
        expected = logits_of(call_model(model, inputs))
        handles = []
        for index, block in enumerate(trunk):
            handles.append(block.register_forward_pre_hook(gather(index), with_kwargs=True))
            handles.append(block.register_forward_hook(skip, with_kwargs=True))
        with hooks_removed_after(handles):
            call_model(model, inputs)
        side_tensors = tuple(side[slot] for slot in range(trace.side_tensor_count))
        hidden = first_hidden[0]
        skip_values: dict[int, torch.Tensor] = {}
        for index, block in enumerate(trunk):
            args, kwargs = trace.block_arguments(side_tensors, index, skip_values)
            output = block(hidden, *args, **kwargs)
            skip_values.update(trace.produced_skips(index, output))
            hidden = trace.hidden_of(output)
        logits = trace.run_head(model, hidden)
    scale = expected.abs().max().item() if expected.numel() else 0.0
    if logits.shape != expected.shape or not torch.allclose(logits, expected, rtol=1e-4, atol=1e-5 * max(scale, 1.0)):
        raise TraceError(
            f"the blocks of {trace.trunk_path} called one by one with the values the model computed before them and "
            "the earlier blocks' outputs they read do not reproduce its logits: a block reads something the model "
            "derived from another block's output outside the blocks (a skip connection mixed in the model's forward?); "
            "merak3d carries block outputs as they are, so compute the mix inside the block that reads it"
        )


def _profile(model: nn.Module, trace: ModelTrace, trunk: nn.ModuleList, call_model: Callable,
             sample_inputs: torch.Tensor, hidden_in: torch.Tensor, side_tensors: tuple, last_hidden: torch.Tensor,
             repeats: int, fast_blocks: FastBlocks) -> list[BlockCost]:
    suffix = [model.get_submodule(path) for path in trace.suffix_paths]
    prefix_params, suffix_params = trace.outside_parameters(model)
    seen: set[int] = set()
    output_bytes = tensor_bytes((hidden_in, side_tensors))

    def run_prefix() -> torch.Tensor:
        return prefix_output(model, trunk, call_model, sample_inputs)

    prefix_fwd, prefix_bwd, prefix_saved = measure(run_prefix, prefix_params, repeats, hidden_in.device)
    prefix_bytes = sum(p.numel() * p.element_size() for p in prefix_params)
    seen.update(id(p) for p in prefix_params)
    costs = [BlockCost("prefix", prefix_fwd, prefix_bwd, prefix_bytes, output_bytes, prefix_saved, is_embedding=True)]

    for index, block in enumerate(trunk):
        block_input = hidden_in.detach().clone().requires_grad_(True)
        args, kwargs = trace.block_arguments(side_tensors, index)

        timed, runner = fast_blocks.profiled(block, f"{trace.trunk_path}.{index}")

        def run_block(runner: Callable[..., Any] = runner, block_input: torch.Tensor = block_input,
                      args: tuple = args, kwargs: dict = kwargs) -> torch.Tensor:
            return trace.hidden_of(runner(block_input, *args, **kwargs))

        fwd, bwd, saved = measure(run_block, list(timed.parameters()), repeats, hidden_in.device)
        costs.append(BlockCost(f"{trace.trunk_path}.{index}", fwd, bwd, param_bytes([block], seen),
                               trace.boundary_bytes(index + 1), saved))

    suffix_input = last_hidden.detach().clone().requires_grad_(True)

    def run_suffix() -> torch.Tensor:
        return trace.run_head(model, suffix_input)

    fwd, bwd, saved = measure(run_suffix, suffix_params, repeats, hidden_in.device)
    costs.append(BlockCost("suffix", fwd, bwd, param_bytes(suffix, seen),
                           last_hidden.numel() * last_hidden.element_size(), saved))
    return costs
