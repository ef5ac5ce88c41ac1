"""One recorded forward of a model, and what both tracers build from it.

:mod:`.trace` (a model with real weights) and :mod:`.meta_trace` (a model on the meta device) share
this: :func:`find_trunk`, one forward recorded with hooks (:func:`record_forward`), the blocks' signatures and the
head's steps read from it, and the timing of one node (:func:`measure`). The record they fill, :class:`ModelTrace`
and its parts, lives in :mod:`.trace_record` (importable from here too). See :mod:`.trace` for what the prefix,
trunk and head are.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_merak.parallel.pipeline.trace_record import (
    BlockSignature,
    HeadStep,
    HeadValue,
    InputDim,
    ModelTrace,
    SideSlot,
    SkipSlot,
    SkipValue,
    TraceError,
    tensor_bytes,
)
from lightning_merak.util.model_outputs import logits_of
from lightning_merak.util.module_mode import hooks_removed_after
from lightning_merak.util.timing import mean_call_time

__all__ = ["BlockSignature", "HeadStep", "ModelTrace", "SkipValue", "TraceError", "block_signatures",
           "check_chained_blocks", "declared_block_argument_problem", "find_trunk", "head_steps", "measure",
           "mixed_blocks_note", "param_bytes", "prefix_output", "record_forward", "same_tensor", "saved_bytes",
           "tensor_bytes"]


def find_trunk(model: nn.Module) -> tuple[str, nn.ModuleList | nn.Sequential]:
    """``(path, blocks)`` of the container of same-class blocks holding the most parameters: an ``nn.ModuleList``
    the model's forward loops over, or an ``nn.Sequential`` of at least two blocks (called as one module, each
    block taking the previous one's output) other than the model itself."""
    best: tuple[int, str, nn.ModuleList | nn.Sequential] | None = None
    for name, module in model.named_modules():
        if not _holds_repeated_blocks(module) or (not name and isinstance(module, nn.Sequential)):
            continue
        params = sum(p.numel() for p in module.parameters())
        if best is None or params > best[0]:
            best = (params, name, module)
    if best is None:
        raise TraceError(
            f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of repeated blocks; merak3d splits "
            f"models whose transformer blocks live in one such container{mixed_blocks_note(model)}"
        )
    return best[1], best[2]


def mixed_blocks_note(model: nn.Module) -> str:
    """For a refusal that found no trunk: ``model``'s ``nn.ModuleList``s and ``nn.Sequential``s of at least two
    modules of several classes (blocks :func:`find_trunk` does not take, which a user may have meant as the trunk),
    each named with its classes; empty where there is none."""
    return "".join(f"; {name or type(module).__name__} holds blocks of several classes "
                   f"({', '.join(sorted({type(block).__name__ for block in module}))}): its blocks must be one class"
                   for name, module in model.named_modules()
                   if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2
                   and len({type(block) for block in module}) > 1)


def check_chained_blocks(model: nn.Module, trunk_path: str, block_calls: list, hidden_of: Callable[[Any], Any]
                         ) -> None:
    """Refuse a trunk :func:`find_trunk` chose among several containers whose recorded blocks (``block_calls``:
    ``(args, kwargs, output)`` in call order) were not called one after another on the hidden state (each taking the
    previous one's, ``hidden_of`` its output): a bigger list of output heads or of per-layer side modules than the
    blocks'. The refusal names the other candidates; a lone trunk is left to the trace's own checks."""
    others = [name for name, module in model.named_modules() if name != trunk_path and _holds_repeated_blocks(module)
              and not name.startswith(f"{trunk_path}.") and not trunk_path.startswith(f"{name}.")]
    if not others:
        return
    for previous, (args, kwargs, _) in zip(block_calls, block_calls[1:]):
        hidden = hidden_of(previous[2])
        if isinstance(hidden, torch.Tensor) and hidden.is_meta:
            return  # no values to compare
        given = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)]  # by position or name
        if not (isinstance(hidden, torch.Tensor)
                and any(value.shape == hidden.shape and torch.equal(value, hidden) for value in given)):
            raise TraceError(
                f"merak3d takes {trunk_path}, the nn.ModuleList or nn.Sequential of same-class modules holding the "
                "most parameters, for the model's blocks, but its forward does not call them one after another on "
                f"the hidden state (each on the previous one's output); the other candidates: {', '.join(others)}; "
                "hold the modules that are not blocks inside the blocks, or in an nn.ModuleDict, so the blocks' "
                "container is the one found")


def declared_block_argument_problem(model: nn.Module) -> str | None:
    """Why ``model``'s blocks cannot be traced, read from what their forward declares before any forward runs, or
    None: a ``KVSharingDict`` parameter (Gemma 4 passes one whatever its config). None too without a trunk, which
    the trace refuses itself."""
    try:
        trunk_path, trunk = find_trunk(model)
    except TraceError:
        return None
    for name, parameter in inspect.signature(trunk[0].forward).parameters.items():
        if "KVSharingDict" in str(parameter.annotation):  # a string under postponed annotations
            model_type = getattr(getattr(model, "config", None), "model_type", None)
            return _unsendable_argument_problem(model_type, trunk_path, name, "KVSharingDict")
    return None


def _holds_repeated_blocks(module: nn.Module) -> bool:
    if isinstance(module, nn.ModuleList):
        minimum = 1
    elif isinstance(module, nn.Sequential):
        minimum = 2
    else:
        return False
    return len(module) >= minimum and len({type(block) for block in module}) == 1


def trunk_like(trunk: nn.ModuleList | nn.Sequential, blocks: list[nn.Module]) -> nn.ModuleList | nn.Sequential:
    """``blocks`` in a container of ``trunk``'s kind, so that the model's forward calls them as it called the
    trunk (a Sequential runs its blocks in its own forward)."""
    return nn.Sequential(*blocks) if isinstance(trunk, nn.Sequential) else nn.ModuleList(blocks)


def same_tensor(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.is_meta or b.is_meta):
        return a is b  # meta tensors have no storage to compare
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        and a.data_ptr() == b.data_ptr() and a.dtype == b.dtype
    )


def _module_paths(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


class _HeadOperations(TorchFunctionMode):
    """Records tensor operations made outside any module call once the trunk has finished, and which tensors are
    computed from the model's inputs alone (no parameter, no hidden state: a mask, a row's last non-pad token)."""

    def __init__(self, state: dict[str, Any], events: list[tuple], inputs: Any) -> None:
        super().__init__()
        self.state, self.events = state, events
        self.from_inputs: dict[int, torch.Tensor] = {
            id(leaf): leaf for leaf in tree_flatten(inputs)[0] if isinstance(leaf, torch.Tensor)}
        """Tensors computed from the inputs by id, held so that no id is reused while recording."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if self.state["trunk_done"] and self.state["depth"] == 0 and isinstance(output, torch.Tensor):
            self.events.append((None, func, args, kwargs, output))
        leaves = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)]
        if any(id(leaf) in self.from_inputs for leaf in leaves) and not any(
                isinstance(leaf, nn.Parameter) or isinstance(leaf._base, nn.Parameter) for leaf in leaves):
            self.from_inputs.update((id(leaf), leaf) for leaf in tree_flatten(output)[0]
                                    if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point())
        return output


def record_forward(model: nn.Module, call_model: Callable[[nn.Module, torch.Tensor], Any], inputs: torch.Tensor,
            trunk: nn.ModuleList) -> dict[str, Any]:
    """One forward pass with hooks: the module calls that ended before the first block (the prefix's), block
    arguments and outputs, then the outermost module calls and the tensor operations between them after the
    trunk (the head's candidates)."""
    block_calls: list[tuple[tuple, dict, Any]] = []
    before_trunk: list[str] = []
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
        if not block_calls:
            before_trunk.append(paths[id(module)])
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
    operations = _HeadOperations(state, after_trunk, inputs)
    with hooks_removed_after(handles), torch.no_grad(), operations:
        logits = logits_of(call_model(model, inputs))
    return {"blocks": block_calls, "before_trunk": tuple(dict.fromkeys(before_trunk)), "after_trunk": after_trunk,
            "logits": logits, "from_inputs": frozenset(operations.from_inputs)}


def block_signatures(trunk_path: str, block_calls: list[tuple[tuple, dict, Any]], config: Any = None
                      ) -> tuple[list[BlockSignature], list[torch.Tensor], list[SkipValue], list[torch.Tensor]]:
    """Each block's call with its tensors replaced by slots: ``(signatures, side tensors, skip values, their
    samples)``.

    A tensor argument one of the earlier blocks returned (not one it was given) is a skip value
    (:class:`SkipValue`), found by identity; any other is a side tensor, the union in first-use order.
    A value the model derived from a block's output outside the blocks is neither: the tracers' split
    check refuses it. ``config`` (the model's, if it has one) names the model in a refusal.
    """
    produced: dict[int, tuple[int, int]] = {}
    skip_of: dict[tuple[int, int], int] = {}
    consumers: list[list[int]] = []
    skip_samples: list[torch.Tensor] = []
    side: list[torch.Tensor] = []
    signatures: list[BlockSignature] = []
    for index, (args, kwargs, output) in enumerate(block_calls):
        leaves, spec = tree_flatten((tuple(args[1:]), dict(kwargs)))
        template: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                source = produced.get(id(leaf))
                if source is not None:
                    skip = skip_of.setdefault(source, len(consumers))
                    if skip == len(consumers):
                        consumers.append([])
                        skip_samples.append(leaf)
                    if index not in consumers[skip]:
                        consumers[skip].append(index)
                    template.append(SkipSlot(skip))
                    continue
                slot = next((i for i, known in enumerate(side) if known is leaf or same_tensor(known, leaf)), None)
                if slot is None:
                    slot = len(side)
                    side.append(leaf)
                template.append(SideSlot(slot))
            elif leaf is None or isinstance(leaf, (bool, int, float, str)):
                template.append(leaf)
            else:
                raise _unsendable_argument(trunk_path, leaf, kwargs, config)
        signatures.append(BlockSignature(spec, tuple(template)))
        given = {id(leaf) for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, torch.Tensor)}
        for position, leaf in enumerate(tree_flatten(output)[0]):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in given:
                produced.setdefault(id(leaf), (index, position))
    sources = sorted(skip_of, key=skip_of.get)
    skips = [SkipValue(producer, leaf, tuple(consumers[skip_of[(producer, leaf)]])) for producer, leaf in sources]
    return signatures, side, skips, skip_samples


def _unsendable_argument(trunk_path: str, leaf: Any, kwargs: dict, config: Any) -> TraceError:
    """The refusal of a block argument that is neither a tensor nor a constant, naming what it is."""
    kind = type(leaf).__name__
    if _is_kv_cache(leaf) and getattr(config, "use_cache", False):
        return TraceError(f"blocks of {trunk_path} receive a {kind} argument (the KV cache), which cannot cross "
                          "pipeline stages; for transformers models disable the KV cache "
                          "(model.config.use_cache = False)")
    keyword = next((name for name, value in kwargs.items() if value is leaf), None)
    return TraceError(_unsendable_argument_problem(getattr(config, "model_type", None), trunk_path, keyword, kind))


def _is_kv_cache(value: Any) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # a plain model without transformers installed
        return False
    return isinstance(value, Cache)


def _unsendable_argument_problem(model_type: str | None, trunk_path: str, argument: str | None, kind: str) -> str:
    """Why the blocks of ``trunk_path`` cannot be traced when they take ``argument``, an object of class ``kind``
    that is neither a tensor nor a constant: merak3d traces them for ``pipeline_parallel>1`` and
    ``tensor_parallel>1``. A ``KVSharingDict`` (Gemma 4) is key/value state the blocks share with each other."""
    owner = f"{model_type}'s blocks ({trunk_path})" if model_type else f"the blocks of {trunk_path}"
    named = f"{argument} (a {kind})" if argument else f"a {kind} argument"
    if kind == "KVSharingDict":
        cause, fix = f"{owner} share key/value states through {named}", ""
    else:
        cause, fix = f"{owner} receive {named}, neither a tensor nor a constant", "pass the blocks tensors instead or "
    return (f"{cause}, which cannot cross pipeline stages; merak3d traces the blocks to split them over pipeline "
            f"stages or tensor-parallel ranks, so {fix}use pipeline_parallel=1 and tensor_parallel=1")


def head_steps(after_trunk: list[tuple], hidden: torch.Tensor, logits: torch.Tensor,
               block_calls: list[tuple[tuple, dict, Any]] = (), from_inputs: frozenset[int] = frozenset()
               ) -> list[HeadStep]:
    """The module calls and tensor operations that take the last block's hidden state to the logits, in order.

    A step reading another tensor one of ``block_calls`` returned is refused: the pipeline carries skip values
    to blocks, and the head would replay it as a constant. So is one reading a tensor computed from the model's
    inputs (``from_inputs``, by id: a sequence classifier's last non-pad token per row), which would be the traced
    batch's at every micro-batch.
    """
    value_of: dict[int, int] = {id(hidden): 0}
    block_of = {id(leaf): index for index, (args, kwargs, output) in enumerate(block_calls)
                for leaf in tree_flatten(output)[0] if isinstance(leaf, torch.Tensor)
                and not any(leaf is given for given in tree_flatten((args, kwargs))[0])}
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
                template.append(HeadValue(value_of[id(leaf)]))
            elif isinstance(leaf, torch.Tensor) and id(leaf) in block_of:
                raise TraceError(
                    f"the head reads an output of block {block_of[id(leaf)]} besides the last block's hidden state; "
                    "merak3d carries earlier blocks' outputs to blocks only, so pass it to the last block and "
                    "combine it there")
            elif isinstance(leaf, torch.Tensor) and id(leaf) in from_inputs:
                raise TraceError(
                    f"the head reads a tensor of shape {tuple(leaf.shape)} computed from the model's inputs "
                    f"({getattr(function, '__name__', function) if module is None else module}; e.g. a sequence "
                    "classifier's last non-pad token per row), which the last pipeline stage does not receive and "
                    "would replay as the traced batch's; use pipeline_parallel=1, or return the per-token logits and "
                    "pool them in training_step")
            elif of_parameter(leaf):
                raise TraceError(
                    f"the head uses a parameter of shape {tuple(leaf.shape)} outside a module call "
                    f"({getattr(function, '__name__', function)}); merak3d places parameters on stages by module, "
                    "so call the module that owns it"
                )
            else:
                template.append(leaf.detach() if isinstance(leaf, torch.Tensor) else leaf)
        if module is None and function in _RESHAPES:
            steps.append(_reshape_step(function, spec, template, leaves, hidden))
        else:
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


_RESHAPES = (torch.Tensor.view, torch.Tensor.reshape, torch.reshape)


def _reshape_step(function: Callable, spec: Any, template: list[Any], leaves: list[Any],
                  hidden: torch.Tensor) -> HeadStep:
    """A view or reshape of a head value whose sizes follow its input's shape at replay.

    A size the model read off the input (equal to the input's dimension at the same position, in the leading run
    of such sizes, and of -1s where the sizes have the input's rank) becomes an :class:`InputDim`: GPT-2, GPT-Neo,
    GPT-BigCode and OpenAI-GPT end their forward with ``view(output_shape)`` of the traced batch and length, which
    micro-batches of other shapes replay with theirs. Where the input's batch and sequence dimensions are not both
    followed so, a size equal to the traced batch, length or their product (one the replay cannot re-derive) pins
    the step to the traced ``(batch, sequence)`` (:attr:`HeadStep.fixed_lengths`).
    """
    source = leaves[0]
    sizes = [index for index, leaf in enumerate(template) if index > 0 and not isinstance(leaf, bool)
             and isinstance(leaf, int)]
    if not isinstance(template[0], HeadValue) or len(sizes) != len(template) - 1:
        return HeadStep(None, function, spec, template)  # view(dtype), or sizes given as tensors
    live = list(template)
    for dim, index in enumerate(sizes[:source.ndim]):
        if template[index] == source.shape[dim]:
            live[index] = InputDim(template[0].index, dim)
        elif template[index] != -1 or len(sizes) != source.ndim:  # past a -1, sizes align only rank for rank
            break
    traced = tuple(hidden.shape[:2])
    follows = tuple(source.shape[:2]) == traced and {0, 1} <= {leaf.dim for leaf in live if isinstance(leaf, InputDim)}
    fixed = {*traced, math.prod(traced)}
    pinned = len(traced) == 2 and not follows and any(isinstance(leaf, int) and leaf in fixed for leaf in live[1:])
    return HeadStep(None, function, spec, live, traced if pinned else None)


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
            leaves = [HeadValue(renumber[leaf.index]) if isinstance(leaf, HeadValue)
                      else InputDim(renumber[leaf.value], leaf.dim) if isinstance(leaf, InputDim) else leaf
                      for leaf in step.leaves]
            kept.append(HeadStep(step.module, step.function, step.spec, leaves, step.fixed_lengths))
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


def measure(run: Callable[[], torch.Tensor], params: list[nn.Parameter], repeats: int,
            device: torch.device) -> tuple[float, float, int]:
    """(forward seconds, backward seconds, bytes saved for backward) of one node, timed on ``device``.

    A forward and backward of the node runs before anything is timed: the first calls of a process's first node
    (the prefix) pay one-off costs that a warm-up of the forward alone does not absorb (measured: single calls of
    10-15 ms in the first timed forwards of a 0.3 ms embedding lookup), and a mean over a few calls charged them to
    that node, pricing the first stage up to 8x its cost."""

    def forward_backward() -> None:
        out = run()
        if out.requires_grad:
            out.backward(torch.ones_like(out))

    forward_backward()
    with torch.no_grad():
        forward_s = mean_call_time(run, repeats, device)
    saved = saved_bytes(run)
    total_s = mean_call_time(forward_backward, repeats, device)
    for param in params:
        param.grad = None
    return forward_s, max(total_s - forward_s, 0.0), saved


def param_bytes(modules: list[nn.Module], seen: set[int]) -> int:
    total = 0
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total


class _StopAtTrunk(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def prefix_output(model: nn.Module, trunk: nn.ModuleList, call_model: Callable, inputs: torch.Tensor) -> torch.Tensor:
    def stop(module: nn.Module, args: tuple) -> None:
        raise _StopAtTrunk(args[0])

    with hooks_removed_after([trunk[0].register_forward_pre_hook(stop)]):
        try:
            call_model(model, inputs)
        except _StopAtTrunk as stopped:
            return stopped.hidden
    raise TraceError("the model finished its forward pass without reaching its first block")
