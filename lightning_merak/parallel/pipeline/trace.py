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
* the head is every module call and tensor operation that the logits depend on after
  the last block, recorded in order and replayed on the last stage.

The split is then verified: the side tensors gathered without running any block, the
blocks called one by one and the head replayed must reproduce the model's logits. Each
node is finally measured on its recorded inputs (forward and backward time, bytes saved
for backward), giving the :class:`BlockCost` list the partitioner balances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_merak.parallel.pipeline.costs import BlockCost
from lightning_merak.util.model_outputs import logits_of
from lightning_merak.util.module_mode import hooks_removed_after, modules_in_mode
from lightning_merak.util.timing import mean_call_time

__all__ = ["ModelTrace", "TraceError", "find_trunk", "saved_bytes", "trace_model"]


class TraceError(ValueError):
    """The model does not have the prefix / trunk / head shape merak3d can split."""


@dataclass
class _SideSlot:
    """Placeholder for the i-th side tensor inside recorded block arguments."""

    index: int


@dataclass
class _HeadValue:
    """Placeholder for a tensor the head computed: 0 is the last block's hidden state, k the k-th step's output."""

    index: int


@dataclass(frozen=True)
class BlockSignature:
    """How one block is called: the pytree of ``(args[1:], kwargs)``, side tensors as :class:`_SideSlot` leaves."""

    spec: Any
    leaves: tuple[Any, ...]


@dataclass
class HeadStep:
    """One call of the head: a submodule (``module``, a path) or a tensor operation (``function``).

    Arguments are a pytree whose tensors computed by the head are :class:`_HeadValue` leaves;
    other leaves (scalars, slices, constant buffers) are kept as recorded.
    """

    module: str | None
    function: Callable[..., Any] | None
    spec: Any
    leaves: list[Any]

    def run(self, model: nn.Module, values: list[torch.Tensor]) -> torch.Tensor:
        device = values[0].device
        leaves = [values[leaf.index] if isinstance(leaf, _HeadValue)
                  else leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        call = model.get_submodule(self.module) if self.module is not None else self.function
        return call(*args, **kwargs)


@dataclass
class ModelTrace:
    """What the runtime needs to rebuild the model as pipeline stages."""

    trunk_path: str
    num_blocks: int
    block_signatures: list[BlockSignature]
    side_tensor_count: int
    block_output_index: int | None
    head: list[HeadStep]
    sample_hidden: torch.Tensor
    sample_side_tensors: tuple[torch.Tensor, ...]
    block_output_template: tuple[Any, ...] | None = None
    costs: list[BlockCost] = field(default_factory=list)
    logits_shape: tuple[int, ...] | None = None

    @property
    def suffix_paths(self) -> list[str]:
        """The head's modules in call order: they live on the last stage."""
        return [step.module for step in self.head if step.module is not None]

    def block_arguments(self, side_tensors: tuple[torch.Tensor, ...], block_index: int = 0) -> tuple[tuple, dict]:
        """The ``(args[1:], kwargs)`` block ``block_index`` is called with, filled with ``side_tensors``."""
        signature = self.block_signatures[block_index]
        leaves = [side_tensors[leaf.index] if isinstance(leaf, _SideSlot) else leaf for leaf in signature.leaves]
        args, kwargs = tree_unflatten(leaves, signature.spec)
        return args, kwargs

    def side_tensors_of(self, block_index: int, args: tuple, kwargs: dict) -> dict[int, torch.Tensor]:
        """The side tensors (by slot) in one call of block ``block_index``; ``args`` excludes the hidden state."""
        leaves, _ = tree_flatten((tuple(args), dict(kwargs)))
        signature = self.block_signatures[block_index]
        if len(leaves) != len(signature.leaves):
            raise TraceError(
                f"block {block_index} of {self.trunk_path} received {len(leaves)} arguments, {len(signature.leaves)} "
                "when traced; merak3d needs the same block arguments at every step (fixed shapes and options)"
            )
        return {slot.index: leaf for slot, leaf in zip(signature.leaves, leaves) if isinstance(slot, _SideSlot)}

    def hidden_of(self, block_output: Any) -> torch.Tensor:
        """The hidden state inside a block's output (a tensor, or one element of a tuple)."""
        return block_output if self.block_output_index is None else block_output[self.block_output_index]

    def output_with_hidden(self, hidden: torch.Tensor) -> Any:
        """A block output carrying ``hidden`` where the model reads it (for a block that is skipped)."""
        if self.block_output_index is None:
            return hidden
        output = list(self.block_output_template)
        output[self.block_output_index] = hidden
        return tuple(output)

    def run_head(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """The logits from the last block's hidden state, replaying the recorded head on ``model``."""
        values = [hidden]
        for step in self.head:
            values.append(step.run(model, values))
        return values[-1]

    def outside_parameters(self, model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """``(prefix, suffix)``: ``model``'s parameters before the blocks and those of the head's modules.

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
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.is_meta or b.is_meta):
        return a is b  # meta tensors have no storage to compare
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
    )


def _module_paths(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


class _HeadOperations(TorchFunctionMode):
    """Records tensor operations made outside any module call once the trunk has finished."""

    def __init__(self, state: dict[str, Any], events: list[tuple]) -> None:
        super().__init__()
        self.state, self.events = state, events

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if self.state["trunk_done"] and self.state["depth"] == 0 and isinstance(output, torch.Tensor):
            self.events.append((None, func, args, kwargs, output))
        return output


def _record(model: nn.Module, call_model: Callable[[nn.Module, torch.Tensor], Any], inputs: torch.Tensor,
            trunk: nn.ModuleList) -> dict[str, Any]:
    """One forward pass with hooks: block arguments and outputs, then the outermost module calls and the
    tensor operations between them after the trunk (the head's candidates)."""
    block_calls: list[tuple[tuple, dict, Any]] = []
    after_trunk: list[tuple] = []
    paths = _module_paths(model)
    state: dict[str, Any] = {"trunk_done": False, "depth": 0}
    started_after_trunk: list[bool] = []
    handles = []

    def pre_block(module: nn.Module, args: tuple, kwargs: dict) -> None:
        block_calls.append((args, kwargs, None))

    def post_block(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        args_, kwargs_, _ = block_calls[-1]
        block_calls[-1] = (args_, kwargs_, output)
        if module is trunk[len(trunk) - 1]:
            state["trunk_done"] = True

    def pre_any(module: nn.Module, args: tuple, kwargs: dict) -> None:
        started_after_trunk.append(state["trunk_done"])
        state["depth"] += state["trunk_done"]

    def post_any(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if started_after_trunk.pop():
            state["depth"] -= 1
            if state["depth"] == 0:
                after_trunk.append((paths[id(module)], None, args, kwargs, output))

    for block in trunk:
        handles.append(block.register_forward_pre_hook(pre_block, with_kwargs=True))
        handles.append(block.register_forward_hook(post_block, with_kwargs=True))
    for module in model.modules():
        if module is not model and module is not trunk and not any(module is block for block in trunk):
            handles.append(module.register_forward_pre_hook(pre_any, with_kwargs=True))
            handles.append(module.register_forward_hook(post_any, with_kwargs=True))
    with hooks_removed_after(handles), torch.no_grad(), _HeadOperations(state, after_trunk):
        logits = logits_of(call_model(model, inputs))
    return {"blocks": block_calls, "after_trunk": after_trunk, "logits": logits}


def _block_signatures(trunk_path: str, block_calls: list[tuple[tuple, dict, Any]]
                      ) -> tuple[list[BlockSignature], list[torch.Tensor]]:
    """Each block's call with its tensors replaced by slots of the union of side tensors (in first-use order).

    A block reading another block's output (a skip connection across blocks) is refused: stages
    carry only the hidden state and values the model computed before its blocks.
    """
    block_outputs = {id(leaf) for _, _, output in block_calls for leaf in tree_flatten(output)[0]
                     if isinstance(leaf, torch.Tensor)}
    side: list[torch.Tensor] = []
    signatures: list[BlockSignature] = []
    for index, (args, kwargs, _) in enumerate(block_calls):
        leaves, spec = tree_flatten((tuple(args[1:]), dict(kwargs)))
        template: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if id(leaf) in block_outputs:
                    raise TraceError(
                        f"block {index} of {trunk_path} receives another block's output (a skip connection across "
                        "blocks?); merak3d carries only the hidden state and values computed before the blocks"
                    )
                slot = next((i for i, known in enumerate(side) if known is leaf or _same_tensor(known, leaf)), None)
                if slot is None:
                    slot = len(side)
                    side.append(leaf)
                template.append(_SideSlot(slot))
            elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                template.append(leaf)
            else:
                raise TraceError(
                    f"blocks of {trunk_path} receive a {type(leaf).__name__} argument, which cannot cross pipeline "
                    "stages; for transformers models disable the KV cache (model.config.use_cache = False)"
                )
        signatures.append(BlockSignature(spec, tuple(template)))
    return signatures, side


def _head_steps(after_trunk: list[tuple], hidden: torch.Tensor, logits: torch.Tensor) -> list[HeadStep]:
    """The module calls and tensor operations that take the last block's hidden state to the logits, in order."""
    value_of: dict[int, int] = {id(hidden): 0}
    from_parameters: set[int] = set()
    steps: list[HeadStep] = []
    inputs_of: list[set[int]] = []

    def of_parameter(leaf: Any) -> bool:
        return isinstance(leaf, torch.Tensor) and (
            isinstance(leaf, nn.Parameter) or isinstance(leaf._base, nn.Parameter) or id(leaf) in from_parameters)

    for module, function, args, kwargs, output in after_trunk:
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        inputs = {value_of[id(leaf)] for leaf in leaves if isinstance(leaf, torch.Tensor) and id(leaf) in value_of}
        if not isinstance(output, torch.Tensor):
            continue
        if not inputs:
            if module is None and any(of_parameter(leaf) for leaf in leaves):
                from_parameters.add(id(output))
            continue
        template = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and id(leaf) in value_of:
                template.append(_HeadValue(value_of[id(leaf)]))
            elif of_parameter(leaf):
                raise TraceError(
                    f"the head uses a parameter of shape {tuple(leaf.shape)} outside a module call "
                    f"({getattr(function, '__name__', function)}); merak3d places parameters on stages by module, "
                    "so call the module that owns it"
                )
            else:
                template.append(leaf.detach() if isinstance(leaf, torch.Tensor) else leaf)
        steps.append(HeadStep(module, None if module is not None else function, spec, template))
        inputs_of.append(inputs)
        value_of[id(output)] = len(steps)
        if output is logits:
            return _prune(steps, inputs_of)
    followed = [step.module or getattr(step.function, "__name__", str(step.function)) for step in steps]
    raise TraceError(
        "could not follow the last block's output to the logits through module calls and tensor operations "
        f"(followed {followed or 'nothing'}); merak3d needs the logits computed from the last block's output"
    )


def _prune(steps: list[HeadStep], inputs_of: list[set[int]]) -> list[HeadStep]:
    """Only the steps the last one (the logits) depends on, their value slots renumbered."""
    needed = {len(steps)}
    for value in range(len(steps), 0, -1):
        if value in needed:
            needed |= inputs_of[value - 1]
    renumber = {old: new for new, old in enumerate(sorted(needed | {0}))}
    kept = []
    for value, step in enumerate(steps, start=1):
        if value in needed:
            leaves = [_HeadValue(renumber[leaf.index]) if isinstance(leaf, _HeadValue) else leaf
                      for leaf in step.leaves]
            kept.append(HeadStep(step.module, step.function, step.spec, leaves))
    return kept


def saved_bytes(run: Callable[[], Any]) -> int:
    """Bytes ``run``'s forward saves for backward (a forward never differentiated). The hook keeps a detached
    alias: a node saving its own output as is would hold itself, a cycle through C++ that Python's collector
    never frees (with the parameters)."""
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return saved


def _measure(run: Callable[[], torch.Tensor], params: list[nn.Parameter], repeats: int) -> tuple[float, float, int]:
    """(forward seconds, backward seconds, bytes saved for backward) of one node."""
    with torch.no_grad():
        forward_s = mean_call_time(run, repeats)

    def forward_backward() -> None:
        out = run()
        if out.requires_grad:
            out.backward(torch.ones_like(out))

    saved = saved_bytes(run)
    total_s = mean_call_time(forward_backward, repeats)
    for param in params:
        param.grad = None
    return forward_s, max(total_s - forward_s, 0.0), saved


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
    materialize_with: Callable[[nn.Module], Callable[..., None]] | None = None,
) -> ModelTrace:
    """Record ``model`` on ``sample_inputs`` (one micro-batch) and, with ``profile``, measure every node.

    Returns the trace with ``costs`` = [prefix, block 0 … block n−1, suffix]. The random
    number generators are left as they were, so tracing does not change a run's dropout masks.
    A model on the meta device is traced by :mod:`~lightning_merak.parallel.pipeline.meta_trace`
    and stays there; ``materialize_with(copy)`` gives the function materialising the pieces of a
    copy it needs real (default: a :class:`~lightning_merak.parallel.materialize.Materializer`
    seeded with the current seed).
    """
    with torch.random.fork_rng(devices=[]):
        if any(param.is_meta for param in model.parameters()):
            from lightning_merak.parallel.pipeline.meta_trace import trace_meta_model

            if materialize_with is None:
                materialize_with = default_materializer(model, sample_inputs.device)
            return trace_meta_model(model, sample_inputs, call_model, profile, profile_repeats, materialize_with)
        return _trace(model, sample_inputs, call_model, profile, profile_repeats)


def default_materializer(model: nn.Module, device: torch.device) -> Callable[[nn.Module], Callable[..., None]]:
    """``materialize_with`` for :func:`trace_model` of ``model``: Materializers on ``device`` with the current seed."""
    from lightning_merak.parallel.materialize import Materializer, init_owners

    seed, owners = torch.initial_seed(), init_owners(model)
    return lambda copy_: Materializer(device, seed, owners).materialize


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
    first_args, _, first_output = block_calls[0]
    hidden_in = first_args[0] if first_args else None
    if not isinstance(hidden_in, torch.Tensor):
        raise TraceError(f"blocks of {trunk_path} must take the hidden state as their first positional argument")
    signatures, side = _block_signatures(trunk_path, block_calls)
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

    trace = ModelTrace(
        trunk_path=trunk_path,
        num_blocks=len(trunk),
        block_signatures=signatures,
        side_tensor_count=len(side),
        block_output_index=output_index,
        head=_head_steps(recording["after_trunk"], last_hidden, recording["logits"]),
        sample_hidden=hidden_in.detach(),
        sample_side_tensors=tuple(tensor.detach() for tensor in side),
        block_output_template=None if output_index is None else tuple(
            None if isinstance(item, torch.Tensor) else item for item in first_output),
    )
    _verify_split(model, trace, trunk, call_model, sample_inputs)
    if profile:
        trace.costs = _profile(model, trace, trunk, call_model, sample_inputs, hidden_in,
                               trace.sample_side_tensors, last_hidden, profile_repeats)
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
        for index, block in enumerate(trunk):
            args, kwargs = trace.block_arguments(side_tensors, index)
            hidden = trace.hidden_of(block(hidden, *args, **kwargs))
        logits = trace.run_head(model, hidden)
    scale = expected.abs().max().item() if expected.numel() else 0.0
    if logits.shape != expected.shape or not torch.allclose(logits, expected, rtol=1e-4, atol=1e-5 * max(scale, 1.0)):
        raise TraceError(
            f"the blocks of {trace.trunk_path} called one by one with the values the model computed before them do "
            "not reproduce its logits: a block reads something derived from another block's output (a skip "
            "connection across blocks?); merak3d carries only the hidden state and values computed before the blocks"
        )


def _profile(model: nn.Module, trace: ModelTrace, trunk: nn.ModuleList, call_model: Callable,
             sample_inputs: torch.Tensor, hidden_in: torch.Tensor, side_tensors: tuple, last_hidden: torch.Tensor,
             repeats: int) -> list[BlockCost]:
    suffix = [model.get_submodule(path) for path in trace.suffix_paths]
    prefix_params, suffix_params = trace.outside_parameters(model)
    seen: set[int] = set()
    output_bytes = (hidden_in.numel() * hidden_in.element_size()
                    + sum(t.numel() * t.element_size() for t in side_tensors))

    def run_prefix() -> torch.Tensor:
        return _prefix_output(model, trunk, call_model, sample_inputs)

    prefix_fwd, prefix_bwd, prefix_saved = _measure(run_prefix, prefix_params, repeats)
    prefix_bytes = sum(p.numel() * p.element_size() for p in prefix_params)
    seen.update(id(p) for p in prefix_params)
    costs = [BlockCost("prefix", prefix_fwd, prefix_bwd, prefix_bytes, output_bytes, prefix_saved, is_embedding=True)]

    for index, block in enumerate(trunk):
        block_input = hidden_in.detach().clone().requires_grad_(True)
        args, kwargs = trace.block_arguments(side_tensors, index)

        def run_block(block: nn.Module = block, block_input: torch.Tensor = block_input, args: tuple = args,
                      kwargs: dict = kwargs) -> torch.Tensor:
            return trace.hidden_of(block(block_input, *args, **kwargs))

        fwd, bwd, saved = _measure(run_block, list(block.parameters()), repeats)
        costs.append(BlockCost(f"{trace.trunk_path}.{index}", fwd, bwd, _param_bytes([block], seen), output_bytes,
                               saved))

    suffix_input = last_hidden.detach().clone().requires_grad_(True)

    def run_suffix() -> torch.Tensor:
        return trace.run_head(model, suffix_input)

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

    with hooks_removed_after([trunk[0].register_forward_pre_hook(stop)]):
        try:
            call_model(model, inputs)
        except _StopAtTrunk as stopped:
            return stopped.hidden
    raise TraceError("the model finished its forward pass without reaching its first block")
