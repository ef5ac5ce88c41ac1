"""One recorded forward of a model, and what both tracers build from it.

:mod:`.trace` (a model with real weights) and :mod:`.meta_trace` (a model on the meta device) share
this: the :class:`ModelTrace` record, :func:`find_trunk`, one forward recorded with hooks
(:func:`record_forward`), the blocks' signatures and the head's steps read from it, and the timing of one
node (:func:`measure`). See :mod:`.trace` for what the prefix, trunk and head are.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_merak.parallel.pipeline.costs import BlockCost
from lightning_merak.util.model_outputs import logits_of
from lightning_merak.util.module_mode import hooks_removed_after
from lightning_merak.util.timing import mean_call_time

__all__ = ["BlockSignature", "HeadStep", "ModelTrace", "SkipValue", "TraceError", "block_signatures",
           "declared_block_argument_problem", "find_trunk", "head_steps", "measure", "param_bytes", "prefix_output",
           "record_forward", "same_tensor", "saved_bytes", "tensor_bytes"]


class TraceError(ValueError):
    """The model does not have the prefix / trunk / head shape merak3d can split."""


@dataclass
class _SideSlot:
    """Placeholder for the i-th side tensor inside recorded block arguments."""

    index: int


@dataclass
class _SkipSlot:
    """Placeholder for the i-th skip value (:class:`SkipValue`) inside recorded block arguments."""

    index: int


@dataclass(frozen=True)
class SkipValue:
    """A tensor blocks read that an earlier block produced, beside the hidden state it hands on.

    A value-residual model's first-layer values (every block reads block 0's), a U-Net's long skips (block
    n-1-i reads block i's output), a block fed several earlier outputs. ``producer`` is the block that returned
    it, ``leaf`` its position among the tensors of that block's flattened output, ``consumers`` the blocks
    reading it (ascending). A pipeline carries it over every stage boundary between its producer and its last
    consumer, and its gradient back (:meth:`crosses`).
    """

    producer: int
    leaf: int
    consumers: tuple[int, ...]

    def crosses(self, block: int) -> bool:
        """Whether a stage boundary in front of block ``block`` (``num_blocks``: in front of the head) must carry it."""
        return self.producer < block <= self.consumers[-1]


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the tensors in ``tensors`` (any pytree; meta tensors count by shape and dtype)."""
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_flatten(tensors)[0]
               if isinstance(leaf, torch.Tensor))


@dataclass
class _HeadValue:
    """Placeholder for a tensor the head computed: 0 is the last block's hidden state, k the k-th step's output."""

    index: int


@dataclass(frozen=True)
class BlockSignature:
    """How one block is called: the pytree of ``(args[1:], kwargs)``, side tensors as :class:`_SideSlot` leaves
    and earlier blocks' outputs as :class:`_SkipSlot` leaves."""

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

    def input_of(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The first argument this step would be called with: the input of a head module (``vocab_stages``)."""
        args, kwargs = tree_unflatten([values[leaf.index] if isinstance(leaf, _HeadValue) else leaf
                                       for leaf in self.leaves], self.spec)
        return args[0] if args else next(iter(kwargs.values()))


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
    skips: tuple[SkipValue, ...] = ()
    sample_skips: tuple[torch.Tensor, ...] = ()
    """One sample of each skip value (random values of the recorded shape and dtype for a model on meta)."""
    prefix_paths: tuple[str, ...] = ()
    """The modules whose calls ended before the first block began: the prefix's (:attr:`shared_paths`)."""

    @property
    def suffix_paths(self) -> list[str]:
        """The head's modules in call order: they live on the last stage."""
        return [step.module for step in self.head if step.module is not None]

    @property
    def shared_paths(self) -> list[str]:
        """The head's modules the prefix calls too, or a part of (nanochat's parameterless norm, after the
        embedding and after the last block): the first stage keeps them as well as the last."""
        return [path for path in self.suffix_paths
                if any(_within(path, called) or _within(called, path) for called in self.prefix_paths)]

    def block_arguments(self, side_tensors: tuple[torch.Tensor, ...], block_index: int = 0,
                        skip_values: dict[int, torch.Tensor] | None = None) -> tuple[tuple, dict]:
        """The ``(args[1:], kwargs)`` block ``block_index`` is called with, filled with ``side_tensors`` and the
        skip values it reads (``skip_values`` by skip index; default: the samples)."""
        skip_values = dict(enumerate(self.sample_skips)) if skip_values is None else skip_values
        signature = self.block_signatures[block_index]
        leaves = [side_tensors[leaf.index] if isinstance(leaf, _SideSlot)
                  else skip_values[leaf.index] if isinstance(leaf, _SkipSlot) else leaf for leaf in signature.leaves]
        args, kwargs = tree_unflatten(leaves, signature.spec)
        return args, kwargs

    def skips_across(self, block: int) -> tuple[int, ...]:
        """Indices of the skip values a stage boundary in front of block ``block`` carries, in order."""
        return tuple(index for index, skip in enumerate(self.skips) if skip.crosses(block))

    def boundary_bytes(self, block: int) -> int:
        """Bytes one micro-batch sends over a stage boundary in front of block ``block`` (1..``num_blocks``): the
        hidden state, the side tensors and the skip values crossing it."""
        return tensor_bytes((self.sample_hidden, self.sample_side_tensors,
                             [self.sample_skips[index] for index in self.skips_across(block)]))

    def skip_bytes_per_sample(self) -> tuple[int, ...]:
        """Skip-value bytes per sample a cut in front of each block position (0..``num_blocks``) sends; empty
        without skip values. Per sample of the traced micro-batch, skip values being batch-first."""
        if not self.skips:
            return ()
        samples = max(self.sample_hidden.shape[0], 1)
        return tuple(tensor_bytes([self.sample_skips[index] for index in self.skips_across(block)]) // samples
                     for block in range(self.num_blocks + 1))

    def produced_skips(self, block_index: int, output: Any) -> dict[int, torch.Tensor]:
        """The skip values (by index) in block ``block_index``'s ``output``."""
        leaves = None
        produced = {}
        for index, skip in enumerate(self.skips):
            if skip.producer == block_index:
                leaves = tree_flatten(output)[0] if leaves is None else leaves
                produced[index] = leaves[skip.leaf]
        return produced

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

    def run_head(self, model: nn.Module, hidden: torch.Tensor, stop_before: int | None = None) -> torch.Tensor:
        """The logits from the last block's hidden state, replaying the recorded head on ``model``; with
        ``stop_before``, the input of that head step instead (the LM head's, when the pipeline ranks split it)."""
        values = [hidden]
        for index, step in enumerate(self.head):
            if index == stop_before:
                return step.input_of(values)
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

    def node_parameters(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """The parameters of each node of :attr:`costs`, in order: the prefix, each block, the suffix."""
        prefix, suffix = self.outside_parameters(model)
        blocks = [list(block.parameters()) for block in model.get_submodule(self.trunk_path)]
        return [prefix, *blocks, suffix]


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
            "models whose transformer blocks live in one such container"
        )
    return best[1], best[2]


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


def _within(path: str, container: str) -> bool:
    """Whether module ``path`` is ``container`` or inside it."""
    return path == container or path.startswith(container + ".")


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
    with hooks_removed_after(handles), torch.no_grad(), _HeadOperations(state, after_trunk):
        logits = logits_of(call_model(model, inputs))
    return {"blocks": block_calls, "before_trunk": tuple(dict.fromkeys(before_trunk)), "after_trunk": after_trunk,
            "logits": logits}


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
                    template.append(_SkipSlot(skip))
                    continue
                slot = next((i for i, known in enumerate(side) if known is leaf or same_tensor(known, leaf)), None)
                if slot is None:
                    slot = len(side)
                    side.append(leaf)
                template.append(_SideSlot(slot))
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
               block_calls: list[tuple[tuple, dict, Any]] = ()) -> list[HeadStep]:
    """The module calls and tensor operations that take the last block's hidden state to the logits, in order.

    A step reading another tensor one of ``block_calls`` returned is refused: the pipeline carries skip values
    to blocks, and the head would replay it as a constant.
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
                template.append(_HeadValue(value_of[id(leaf)]))
            elif isinstance(leaf, torch.Tensor) and id(leaf) in block_of:
                raise TraceError(
                    f"the head reads an output of block {block_of[id(leaf)]} besides the last block's hidden state; "
                    "merak3d carries earlier blocks' outputs to blocks only, so pass it to the last block and "
                    "combine it there")
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
