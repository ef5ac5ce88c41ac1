"""Proxy graph of an unmodified model by execution-order recording (no torch.fx, no HF tracer).

A causal LM — a transformers v5 model or a plain ``nn.Module`` a user wrote — is a
*prefix* (embeddings, masks, rotary tables), a *trunk* (an ``nn.ModuleList`` of repeated
blocks, each called as ``hidden = block(hidden, *side_args, **side_kwargs)``) and a
*suffix* (final norm, LM head). One recorded forward pass finds all three:

* the trunk is the ``ModuleList`` of same-class blocks holding the most parameters;
* forward pre-hooks capture what the model passes to its blocks; tensors among those
  arguments (attention masks, position ids, rotary tables: the high-fan-out values every
  block reads) become *side tensors* a pipeline carries from stage to stage, and the
  rest (``None``, flags) are kept as constants;
* the suffix is the chain of modules that maps the last block's output to the logits,
  followed by tensor identity, and it is verified to reproduce the logits exactly.

Each node is then measured on its recorded inputs (forward and backward time, bytes
saved for backward), giving the :class:`BlockCost` list the partitioner balances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_merak.models import logits_of
from lightning_merak.strategies.pipeline.costs import BlockCost
from lightning_merak.timing import mean_call_time

__all__ = ["ModelTrace", "TraceError", "find_trunk", "trace_model"]


class TraceError(ValueError):
    """The model does not have the prefix / trunk / suffix shape merak3d can split."""


@dataclass
class _SideSlot:
    """Placeholder for the i-th side tensor inside the recorded block arguments."""

    index: int


@dataclass
class ModelTrace:
    """What the runtime needs to rebuild the model as pipeline stages."""

    trunk_path: str
    num_blocks: int
    block_args_spec: Any
    block_args_leaves: list[Any]
    side_tensor_count: int
    block_output_index: int | None
    suffix_paths: list[str]
    sample_hidden: torch.Tensor
    sample_side_tensors: tuple[torch.Tensor, ...]
    costs: list[BlockCost] = field(default_factory=list)

    def block_arguments(self, side_tensors: tuple[torch.Tensor, ...]) -> tuple[tuple, dict]:
        """The ``(args[1:], kwargs)`` a block is called with, filled with ``side_tensors``."""
        leaves = [side_tensors[leaf.index] if isinstance(leaf, _SideSlot) else leaf for leaf in self.block_args_leaves]
        args, kwargs = tree_unflatten(leaves, self.block_args_spec)
        return args, kwargs

    def hidden_of(self, block_output: Any) -> torch.Tensor:
        """The hidden state inside a block's output (a tensor, or one element of a tuple)."""
        return block_output if self.block_output_index is None else block_output[self.block_output_index]

    def outside_parameters(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(prefix, suffix)``: ``model``'s parameters before the blocks and those of the suffix modules.

        A weight tied between the embedding and the head belongs to the suffix, as the costs count it.
        """
        trunk_ids = {id(p) for p in model.get_submodule(self.trunk_path).parameters()}
        suffix = list({id(p): p for path in self.suffix_paths for p in model.get_submodule(path).parameters()}.values())
        suffix_ids = {id(p) for p in suffix}
        prefix = [p for p in model.parameters() if id(p) not in trunk_ids and id(p) not in suffix_ids]
        return prefix, suffix


def find_trunk(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(path, blocks)`` of the ModuleList of same-class blocks holding the most parameters."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 1:
            continue
        if len({type(block) for block in module}) != 1:
            continue
        params = sum(p.numel() for p in module.parameters())
        if best is None or params > best[0]:
            best = (params, name, module)
    if best is None:
        raise TraceError(
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks; merak3d splits models "
            "whose transformer blocks live in one ModuleList"
        )
    return best[1], best[2]


def _same_tensor(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
    )


def _module_paths(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


def _record(model: nn.Module, call_model: Callable[[nn.Module, torch.Tensor], Any], inputs: torch.Tensor,
            trunk: nn.ModuleList) -> dict[str, Any]:
    """One forward pass with hooks: block arguments and outputs, and module calls after the trunk."""
    block_calls: list[tuple[tuple, dict, Any]] = []
    after_trunk: list[tuple[str, tuple, Any]] = []
    paths = _module_paths(model)
    state = {"trunk_done": False}
    handles = []

    def pre_block(module: nn.Module, args: tuple, kwargs: dict) -> None:
        block_calls.append((args, kwargs, None))

    def post_block(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        args_, kwargs_, _ = block_calls[-1]
        block_calls[-1] = (args_, kwargs_, output)
        if module is trunk[len(trunk) - 1]:
            state["trunk_done"] = True

    def post_any(module: nn.Module, args: tuple, output: Any) -> None:
        if state["trunk_done"] and module is not model:
            after_trunk.append((paths[id(module)], args, output))

    for block in trunk:
        handles.append(block.register_forward_pre_hook(pre_block, with_kwargs=True))
        handles.append(block.register_forward_hook(post_block, with_kwargs=True))
    for module in model.modules():
        if module is not trunk and not any(module is block for block in trunk):
            handles.append(module.register_forward_hook(post_any))
    try:
        with torch.no_grad():
            logits = logits_of(call_model(model, inputs))
    finally:
        for handle in handles:
            handle.remove()
    return {"blocks": block_calls, "after_trunk": after_trunk, "logits": logits}


def _check_blocks_share_arguments(trunk_path: str, block_calls: list[tuple[tuple, dict, Any]]) -> None:
    """Every block must read the same side values; a block that reads another block's output
    (a skip connection across blocks) cannot be cut into stages that carry only shared values."""
    first_leaves, first_spec = tree_flatten((tuple(block_calls[0][0][1:]), dict(block_calls[0][1])))
    for index, (args, kwargs, _) in enumerate(block_calls[1:], start=1):
        leaves, spec = tree_flatten((tuple(args[1:]), dict(kwargs)))
        same = spec == first_spec and all(
            (a is b) or (isinstance(a, torch.Tensor) and _same_tensor(a, b)) or (
                not isinstance(a, torch.Tensor) and a == b)
            for a, b in zip(leaves, first_leaves)
        )
        if not same:
            raise TraceError(
                f"block {index} of {trunk_path} receives arguments block 0 does not (a skip connection "
                "across blocks?); merak3d carries only the hidden state and values shared by all blocks"
            )


def _suffix_chain(after_trunk: list[tuple[str, tuple, Any]], hidden: torch.Tensor, logits: torch.Tensor) -> list[str]:
    chain: list[str] = []
    current = hidden
    for path, args, output in after_trunk:
        if args and _same_tensor(args[0], current) and isinstance(output, torch.Tensor):
            if any(path.startswith(prefix + ".") for prefix in chain):
                continue
            chain.append(path)
            current = output
            if _same_tensor(current, logits):
                return chain
    raise TraceError(
        "could not follow the last block's output to the logits through a chain of modules "
        f"(followed {chain or 'nothing'}); merak3d needs the model's head to be modules applied in sequence"
    )


def _measure(run: Callable[[], torch.Tensor], params: list[nn.Parameter], repeats: int) -> tuple[float, float, int]:
    """(forward seconds, backward seconds, bytes saved for backward) of one node."""
    saved = {"bytes": 0}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved["bytes"] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.no_grad():
        forward_s = mean_call_time(run, repeats)

    def forward_backward() -> None:
        out = run()
        if out.requires_grad:
            out.backward(torch.ones_like(out))

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    total_s = mean_call_time(forward_backward, repeats)
    for param in params:
        param.grad = None
    return forward_s, max(total_s - forward_s, 0.0), saved["bytes"]


def _param_bytes(modules: list[nn.Module], seen: set[int]) -> int:
    total = 0
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total


def trace_model(
    model: nn.Module,
    sample_inputs: torch.Tensor,
    call_model: Callable[[nn.Module, torch.Tensor], Any] = lambda model, ids: model(ids),
    profile: bool = True,
    profile_repeats: int = 5,
) -> ModelTrace:
    """Record ``model`` on ``sample_inputs`` (one micro-batch) and, with ``profile``, measure every node.

    Returns the trace with ``costs`` = [prefix, block 0 … block n−1, suffix]. The random
    number generators are left as they were, so tracing does not change a run's dropout masks.
    """
    with torch.random.fork_rng(devices=[]):
        return _trace(model, sample_inputs, call_model, profile, profile_repeats)


def _trace(model: nn.Module, sample_inputs: torch.Tensor, call_model: Callable[[nn.Module, torch.Tensor], Any],
           profile: bool, profile_repeats: int) -> ModelTrace:
    trunk_path, trunk = find_trunk(model)
    recording = _record(model, call_model, sample_inputs, trunk)
    block_calls = recording["blocks"]
    if len(block_calls) != len(trunk):
        raise TraceError(
            f"{trunk_path} holds {len(trunk)} blocks but {len(block_calls)} ran in one forward pass; "
            "merak3d needs every block to run exactly once per forward"
        )
    first_args, first_kwargs, first_output = block_calls[0]
    _check_blocks_share_arguments(trunk_path, block_calls)
    hidden_in = first_args[0] if first_args else None
    if not isinstance(hidden_in, torch.Tensor):
        raise TraceError(f"blocks of {trunk_path} must take the hidden state as their first positional argument")
    leaves, spec = tree_flatten((tuple(first_args[1:]), dict(first_kwargs)))
    side_leaves: list[Any] = []
    side_count = 0
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            side_leaves.append(_SideSlot(side_count))
            side_count += 1
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            side_leaves.append(leaf)
        else:
            raise TraceError(
                f"blocks of {trunk_path} receive a {type(leaf).__name__} argument, which cannot cross pipeline "
                "stages; for transformers models disable the KV cache (model.config.use_cache = False)"
            )
    if isinstance(first_output, torch.Tensor):
        output_index = None
    else:
        next_hidden = block_calls[1][0][0] if len(block_calls) > 1 else None
        candidates = [i for i, item in enumerate(first_output) if isinstance(item, torch.Tensor)
                      and (next_hidden is None or _same_tensor(item, next_hidden))]
        if not candidates:
            raise TraceError(f"cannot find the hidden state in the outputs of {trunk_path} blocks")
        output_index = candidates[0]
    last_output = block_calls[-1][2]
    last_hidden = last_output if output_index is None else last_output[output_index]
    suffix_paths = _suffix_chain(recording["after_trunk"], last_hidden, recording["logits"])

    trace = ModelTrace(
        trunk_path=trunk_path,
        num_blocks=len(trunk),
        block_args_spec=spec,
        block_args_leaves=side_leaves,
        side_tensor_count=side_count,
        block_output_index=output_index,
        suffix_paths=suffix_paths,
        sample_hidden=hidden_in.detach(),
        sample_side_tensors=tuple(leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor)),
    )
    if profile:
        trace.costs = _profile(model, trace, trunk, call_model, sample_inputs, hidden_in,
                               trace.sample_side_tensors, last_hidden, profile_repeats)
    return trace


def _profile(model: nn.Module, trace: ModelTrace, trunk: nn.ModuleList, call_model: Callable, sample_inputs: torch.Tensor,
             hidden_in: torch.Tensor, side_tensors: tuple, last_hidden: torch.Tensor, repeats: int) -> list[BlockCost]:
    suffix = [model.get_submodule(path) for path in trace.suffix_paths]
    prefix_params, suffix_params = trace.outside_parameters(model)
    seen: set[int] = set()
    output_bytes = hidden_in.numel() * hidden_in.element_size() + sum(t.numel() * t.element_size() for t in side_tensors)

    def run_prefix() -> torch.Tensor:
        return _prefix_output(model, trunk, call_model, sample_inputs)

    prefix_fwd, prefix_bwd, prefix_saved = _measure(run_prefix, prefix_params, repeats)
    prefix_bytes = sum(p.numel() * p.element_size() for p in prefix_params)
    seen.update(id(p) for p in prefix_params)
    costs = [BlockCost("prefix", prefix_fwd, prefix_bwd, prefix_bytes, output_bytes, prefix_saved, is_embedding=True)]

    args, kwargs = trace.block_arguments(side_tensors)
    for index, block in enumerate(trunk):
        block_input = hidden_in.detach().clone().requires_grad_(True)

        def run_block(block: nn.Module = block, block_input: torch.Tensor = block_input) -> torch.Tensor:
            return trace.hidden_of(block(block_input, *args, **kwargs))

        fwd, bwd, saved = _measure(run_block, list(block.parameters()), repeats)
        costs.append(BlockCost(f"{trace.trunk_path}.{index}", fwd, bwd, _param_bytes([block], seen), output_bytes, saved))

    suffix_input = last_hidden.detach().clone().requires_grad_(True)

    def run_suffix() -> torch.Tensor:
        out = suffix_input
        for module in suffix:
            out = module(out)
        return out

    fwd, bwd, saved = _measure(run_suffix, suffix_params, repeats)
    costs.append(BlockCost("suffix", fwd, bwd, _param_bytes(suffix, seen),
                           last_hidden.numel() * last_hidden.element_size(), saved))
    return costs


class _StopAtTrunk(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def _prefix_output(model: nn.Module, trunk: nn.ModuleList, call_model: Callable, inputs: torch.Tensor) -> torch.Tensor:
    def stop(module: nn.Module, args: tuple) -> None:
        raise _StopAtTrunk(args[0])

    handle = trunk[0].register_forward_pre_hook(stop)
    try:
        call_model(model, inputs)
    except _StopAtTrunk as stopped:
        return stopped.hidden
    finally:
        handle.remove()
    raise TraceError("the model finished its forward pass without reaching its first block")
