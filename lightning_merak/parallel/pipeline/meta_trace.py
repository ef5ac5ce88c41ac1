"""Tracing a model built on the meta device, materialising one piece at a time.

The prefix of a transformers model (embeddings, masks, rotary tables) runs data-dependent code
(mask shortcuts read tensor values), so it cannot run on meta tensors; the blocks and the head
can. One recorded forward therefore runs on a copy of the model whose prefix modules are
materialised the moment they are called on real tensors, while every block receives its inputs
moved to the meta device: the side tensors and the hidden state entering the first block are
real (the samples the planner, the tensor-parallel check and the pipeline need), everything after
is shapes only. A pipeline needs each block to read the previous block's output, values
computed before the blocks and earlier blocks' outputs as they returned them (skip values): on meta
that is checked by identity (a side tensor left on the meta device, or a block input that is not the
previous block's output, was derived from a block outside the blocks).

An embedding table (an ``nn.Embedding`` or a subclass, e.g. Gemma's scaled one) is never
materialised whole: its lookups on real ids are answered by a stand-in of the same class holding only
the rows looked up, initialised by the model's own init, so every rank reads a few rows where the
table is vocabulary × hidden (2.4 GB at 150k × 4096 in fp32). Values differ from the full table's
draws, not their distribution, shape or dtype; a padding row stays zero.

Profiling materialises one node at a time, times it on real samples and frees it: the prefix (its
tables as stand-ins, plus an estimate of the full table's dense gradient), one block of each distinct
signature (repeated blocks share its figures) and the head, a large LM head as a slice of its
vocabulary rows whose times are scaled by the fraction: no piece of the vocabulary's size is ever whole.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_merak.parallel.fast_blocks import FastBlocks
from lightning_merak.parallel.pipeline.costs import BlockCost
from lightning_merak.parallel.pipeline.recording import (
    ModelTrace,
    TraceError,
    block_signatures,
    find_trunk,
    head_steps,
    measure,
    param_bytes,
    prefix_output,
    record_forward,
    saved_bytes,
    tensor_bytes,
)
from lightning_merak.util.module_mode import hooks_removed_after
from lightning_merak.util.timing import mean_call_time

__all__ = ["HEAD_SLICE_BYTES", "materialized_copy", "row_stand_in", "trace_meta_model"]

Materialize = Callable[..., None]
"""``(module, unsplit name, recurse=True) -> None``: storage and initial values for ``module`` (a Materializer's)."""


def materialized_copy(module: nn.Module, name: str, materialize_with: Callable[[nn.Module], Materialize]) -> nn.Module:
    """A real copy of the meta ``module`` (for timing or a split check); ``module`` stays on meta."""
    real = copy.deepcopy(module)
    materialize_with(real)(real, name)
    return real


def row_stand_in(module: nn.Module, rows: torch.Tensor) -> nn.Module:
    """A meta copy of the embedding or linear ``module`` holding only rows ``rows`` (sorted ids) of its weight
    (and bias): the same class, so the model's init treats it alike, and its padding row, if kept, still
    the padding row. Its other tensors (Gemma's ``embed_scale``) stay as they are."""
    stand_in = copy.deepcopy(module)
    for name in ("weight", "bias"):
        whole = module._parameters.get(name)
        if whole is not None:
            stand_in._parameters[name] = nn.Parameter(
                torch.empty((len(rows), *whole.shape[1:]), dtype=whole.dtype, device="meta"),
                requires_grad=whole.requires_grad)
    if isinstance(stand_in, nn.Embedding):
        padding = (rows == module.padding_idx).nonzero() if module.padding_idx is not None else rows[:0]
        stand_in.num_embeddings, stand_in.padding_idx = len(rows), int(padding[0]) if len(padding) else None
    elif isinstance(stand_in, nn.Linear):
        stand_in.out_features = len(rows)
    return stand_in


def _to_meta(value: Any) -> Any:
    return tree_map(lambda leaf: leaf.to("meta") if isinstance(leaf, torch.Tensor) and not leaf.is_meta else leaf,
                    value)


def _on_meta(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return forward(*_to_meta(args), **_to_meta(kwargs))


def _embedding_arguments(input: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None,
                         max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                         sparse: bool = False) -> tuple:
    return input, weight, (max_norm, norm_type, scale_grad_by_freq, sparse)


_GROUPED_MM = getattr(torch, "_grouped_mm", None)


class _MetaGroupedMatmul(TorchFunctionMode):
    """Runs torch's grouped matmul on meta tensors of any floating dtype.

    torch 2.13's meta kernel of ``_grouped_mm`` applies CUDA's bf16-only rule, while the CPU kernel the blocks run
    after the trace takes fp32 too, so a model whose experts use ``grouped_mm`` (transformers 5's choice where
    torch has it) failed its meta trace. Shapes do not depend on the dtype: the meta call runs in bf16 and its
    result is cast back (autograd goes through both casts).
    """

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is _GROUPED_MM and len(args) >= 2 and _meta_float(args[0]) and args[0].dtype != torch.bfloat16:
            out_dtype = kwargs.pop("out_dtype", None) or args[0].dtype
            if _meta_float(kwargs.get("bias")):
                kwargs["bias"] = kwargs["bias"].to(torch.bfloat16)
            operands = [a.to(torch.bfloat16) if _meta_float(a) else a for a in args]
            return func(*operands, **kwargs).to(out_dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _peft_expert_factors_on_meta() -> Iterator[None]:
    """PEFT's LoRA on fused expert weights (``target_parameters``) folds its factors into the weight in a
    parametrization that opens ``torch.autocast`` on the weight's device, which torch refuses for ``meta``
    ("unsupported scalarType"): meanwhile it folds meta weights without the autocast (no dtype changes on meta).
    Feature-detected: nothing to do where PEFT, or that proxy of its, is not loaded."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    proxy = getattr(layer, "_LoraFactorsProxy", None)
    if proxy is None or not callable(getattr(proxy, "forward", None)):
        yield
        return
    folded = proxy.forward

    def forward(self: Any, weight: torch.Tensor) -> torch.Tensor:
        if weight.is_meta:
            return torch.baddbmm(weight, self.lhs, self.rhs, alpha=self.scaling)
        return folded(self, weight)

    proxy.forward = forward
    try:
        yield
    finally:
        proxy.forward = folded


def _meta_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta and value.dtype.is_floating_point


class _TableRows(TorchFunctionMode):
    """Answers ``F.embedding`` on a meta table with real ids from a stand-in holding only the rows looked up.

    ``tables`` maps each table's weight (by id) to its module and unsplit name. A stand-in is a deep
    copy of the module (same class, so the model's ``_init_weights`` treats it alike) with a weight of
    those rows; it is kept for later lookups of the same rows (profiling repeats the prefix). Ids filling
    most of a range from 0 (positions) keep the table's first rows, so an init that depends on the row (a
    sinusoidal table) is reproduced; scattered ids (tokens) keep only theirs, as random inits draw every
    row alike. The table's other tensors (Gemma's ``embed_scale``) are taken from the stand-in.
    """

    def __init__(self, tables: dict[int, tuple[str, nn.Embedding]],
                 materialize_with: Callable[[nn.Module], Materialize]) -> None:
        super().__init__()
        self.tables = tables
        self.materialize_with = materialize_with
        self.stand_ins: dict[int, tuple[torch.Tensor, nn.Embedding]] = {}

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            ids, weight, options = _embedding_arguments(*args, **kwargs)
            if id(weight) in self.tables and weight.is_meta and not ids.is_meta:
                rows, stand_in = self._stand_in(weight, ids)
                return F.embedding(torch.searchsorted(rows, ids), stand_in.weight, stand_in.padding_idx, *options)
        return func(*args, **kwargs)

    def weights(self) -> list[nn.Parameter]:
        """The stand-ins' weights (their gradients are cleared after timing)."""
        return [stand_in.weight for _, stand_in in self.stand_ins.values()]

    def missing_bytes(self) -> int:
        """Bytes of the full tables that train (with dense gradients) but that the stand-ins leave out."""
        total = 0
        for key, (_, stand_in) in self.stand_ins.items():
            table = self.tables[key][1]  # materialised whole if its forward read the weight otherwise
            if table.weight.is_meta and stand_in.weight.requires_grad and not stand_in.sparse:
                total += (table.weight.numel() - stand_in.weight.numel()) * stand_in.weight.element_size()
        return total

    def _stand_in(self, weight: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, nn.Embedding]:
        name, table = self.tables[id(weight)]
        wanted = torch.unique(ids)
        outside = wanted[(wanted < 0) | (wanted >= weight.shape[0])]
        if outside.numel():
            raise IndexError(f"{name} looks up id {int(outside[0])} in a table of {weight.shape[0]} rows")
        cached = self.stand_ins.get(id(weight))
        if cached is not None and bool(torch.isin(wanted, cached[0]).all()):
            return cached
        if cached is not None:
            wanted = torch.unique(torch.cat([cached[0], wanted]))
        top = int(wanted[-1]) + 1 if wanted.numel() else 0
        contiguous = top <= 2 * wanted.numel() and top < weight.shape[0]  # positions, not a vocabulary's ids
        rows = torch.arange(top, device=wanted.device) if contiguous else wanted
        stand_in = row_stand_in(table, rows)
        self.materialize_with(stand_in)(stand_in, name)
        for store, own in ((stand_in._parameters, table._parameters), (stand_in._buffers, table._buffers)):
            for key, tensor in own.items():
                if key != "weight" and tensor is not None and tensor.is_meta:
                    own[key] = store[key]
        self.stand_ins[id(weight)] = rows, stand_in
        return rows, stand_in


def _tables(model: nn.Module, trunk_path: str) -> dict[int, tuple[str, nn.Embedding]]:
    """The meta embedding tables outside the trunk, by their weight's id."""
    return {id(module.weight): (name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Embedding) and module.weight.is_meta and not name.startswith(trunk_path + ".")}


def _real(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) and not leaf.is_meta for leaf in tree_flatten(value)[0])


def _meta(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) and leaf.is_meta for leaf in tree_flatten(value)[0])


def _materialize_prefix_on_call(model: nn.Module, trunk_path: str, materialize: Materialize,
                                tables: dict[int, tuple[str, nn.Embedding]]) -> list[Any]:
    """Hooks materialising, when first called on a real tensor, each module that does not hold the trunk
    (everything under it but the ``tables``, which :class:`_TableRows` answers).

    A table whose forward reads its weight other than by ``F.embedding`` gives a meta output on
    real ids: it is then materialised whole and called again, as before stand-ins existed.
    """
    def holds_trunk(name: str) -> bool:
        return (name == "" or trunk_path == name or trunk_path.startswith(name + ".")
                or name.startswith(trunk_path + "."))

    table_modules = {id(module) for _, module in tables.values()}

    def on_call(name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if _real((args, kwargs)):
            for path, sub in module.named_modules(prefix=name):
                if id(sub) not in table_modules and _meta((sub._parameters, sub._buffers)):
                    materialize(sub, path, False)

    def whole_table(name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if _real((args, kwargs)) and _meta(output):
            materialize(module, name)
            return module.forward(*args, **kwargs)
        return None

    for name, module in model.named_modules():
        if holds_trunk(name) and not name.startswith(trunk_path):
            materialize(module, name, False)  # what the trunk's containers hold themselves
    handles = [module.register_forward_pre_hook(functools.partial(on_call, name), with_kwargs=True)
               for name, module in model.named_modules() if not holds_trunk(name)]
    return handles + [module.register_forward_hook(functools.partial(whole_table, name), with_kwargs=True)
                      for name, module in tables.values()]


def trace_meta_model(model: nn.Module, sample_inputs: torch.Tensor,
                     call_model: Callable[[nn.Module, torch.Tensor], Any], profile: bool, profile_repeats: int,
                     materialize_with: Callable[[nn.Module], Materialize], fast_blocks: FastBlocks = FastBlocks(),
                     ) -> ModelTrace:
    """:func:`~lightning_merak.parallel.pipeline.trace.trace_model` of a meta ``model``; ``model`` stays on meta.

    ``materialize_with(copy)`` returns the function that materialises modules of ``copy`` (a copy of
    ``model``), initialised as the run will initialise them.
    """
    work = copy.deepcopy(model)
    trunk_path, trunk = find_trunk(work)
    tables = _tables(work, trunk_path)
    handles = _materialize_prefix_on_call(work, trunk_path, materialize_with(work), tables)
    table_rows = _TableRows(tables, materialize_with)
    for block in trunk:
        block.forward = functools.partial(_on_meta, block.forward)
    try:
        with hooks_removed_after(handles), table_rows, _MetaGroupedMatmul(), _peft_expert_factors_on_meta():
            recording = record_forward(work, call_model, sample_inputs, trunk)
    except RuntimeError as error:
        if "meta" not in str(error):
            raise
        # a value computed before the blocks (real) met a block's output (meta) outside any block
        raise TraceError(
            f"the model combines the output of a block of {trunk_path} with values computed before the blocks, "
            "outside its blocks (a skip connection mixed in the model's forward?); merak3d carries block outputs "
            "as they are, so compute the mix inside the block that reads it "
            f"({str(error).splitlines()[0]})") from error
    block_calls = recording["blocks"]
    if len(block_calls) != len(trunk):
        raise TraceError(f"{trunk_path} holds {len(trunk)} blocks but {len(block_calls)} ran in one forward pass; "
                         "merak3d needs every block to run exactly once per forward")
    hidden_in = block_calls[0][0][0] if block_calls[0][0] else None
    if not isinstance(hidden_in, torch.Tensor) or hidden_in.is_meta:
        raise TraceError(f"blocks of {trunk_path} must take the hidden state as their first positional argument")
    signatures, side, skips, skip_samples = block_signatures(trunk_path, block_calls, getattr(work, "config", None))
    output_index = _output_index(block_calls, trunk_path)
    _check_chain(block_calls, output_index, side, trunk_path)
    last_output = block_calls[-1][2]
    last_hidden = last_output if output_index is None else last_output[output_index]
    head = head_steps(recording["after_trunk"], last_hidden, recording["logits"], block_calls,
                      recording["from_inputs"])
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
        skips=tuple(skips),
        sample_skips=tuple(_real_sample(tensor, hidden_in.device) for tensor in skip_samples),
        prefix_paths=recording["before_trunk"],
    )
    if profile:
        prefix = _profile_prefix(model, work, trace, call_model, sample_inputs, profile_repeats, table_rows)
        del work, trunk, recording, block_calls, table_rows, tables  # the prefix goes before a block is
        trace.costs = [prefix, *_profile_rest(model, trace, profile_repeats, materialize_with, fast_blocks)]
    return trace


def _real_sample(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Random values of a meta ``tensor``'s shape and dtype on ``device`` (a skip value the blocks made on meta)."""
    if not tensor.is_meta:
        return tensor.detach()
    if tensor.dtype.is_floating_point:
        return torch.randn(tensor.shape, dtype=tensor.dtype, device=device)
    return torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)


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
            f"the blocks of {trunk_path} called one by one with the values the model computed before them and "
            "the earlier blocks' outputs they read do not reproduce its logits: a block reads something the model "
            "derived from another block's output outside the blocks (a skip connection mixed in the model's forward?); "
            "merak3d carries block outputs as they are, so compute the mix inside the block that reads it"
        )


def _output_bytes(trace: ModelTrace) -> int:
    return tensor_bytes((trace.sample_hidden, trace.sample_side_tensors))


def _profile_prefix(model: nn.Module, work: nn.Module, trace: ModelTrace, call_model: Callable,
                    sample_inputs: torch.Tensor, repeats: int, table_rows: _TableRows) -> BlockCost:
    """The prefix's cost, timed on ``work`` (whose prefix the recording materialised, its tables as stand-ins).

    A full table's backward also writes a dense gradient of the whole table (and adds it to the
    accumulated one): that part is timed on a bounded slice and scaled, see :func:`_dense_gradient_s`.
    """
    prefix_params, _ = trace.outside_parameters(model)
    work_trunk = work.get_submodule(trace.trunk_path)
    params = [p for p in trace.outside_parameters(work)[0] if not p.is_meta] + table_rows.weights()
    with table_rows:
        fwd, bwd, saved = measure(lambda: prefix_output(work, work_trunk, call_model, sample_inputs), params,
                                   repeats, trace.sample_hidden.device)
    bwd += _dense_gradient_s(table_rows.missing_bytes(), trace.sample_hidden.device, repeats)
    return BlockCost("prefix", fwd, bwd, sum(p.numel() * p.element_size() for p in prefix_params),
                     _output_bytes(trace), saved, is_embedding=True)


DENSE_GRADIENT_SLICE_BYTES = 64 << 20
"""Size of the slice on which the dense gradient of the table rows a stand-in leaves out is timed: above
glibc's largest mmap threshold (32 MiB), so each fresh slice page-faults as a table-sized gradient does
(a 16 MiB slice, served from the heap, gave half the full table's time on CPU)."""


def _dense_gradient_s(num_bytes: int, device: torch.device, repeats: int) -> float:
    """Seconds to create a zero gradient of ``num_bytes`` and add it to the accumulated one: the part of an
    embedding backward that grows with the table, not with the ids (memory-bound, so timed on a slice of
    at most :data:`DENSE_GRADIENT_SLICE_BYTES` and scaled by bytes)."""
    if num_bytes <= 0:
        return 0.0
    size = max(min(num_bytes, DENSE_GRADIENT_SLICE_BYTES) // 4, 1)
    accumulated = torch.zeros(size, device=device)

    def create_and_add() -> None:
        accumulated.add_(torch.zeros(size, device=device))

    return mean_call_time(create_and_add, repeats, device) * num_bytes / (4 * size)


def _profile_rest(model: nn.Module, trace: ModelTrace, repeats: int,
                  materialize_with: Callable[[nn.Module], Materialize], fast_blocks: FastBlocks) -> list[BlockCost]:
    """Costs of the blocks and the head, each materialised on its own."""
    trunk: nn.ModuleList = model.get_submodule(trace.trunk_path)
    hidden, side = trace.sample_hidden, trace.sample_side_tensors
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
            timed, runner = fast_blocks.profiled(real, f"{trace.trunk_path}.{index}")
            figures[kind] = measure(lambda: trace.hidden_of(runner(block_input, *args, **kwargs)),
                                     list(timed.parameters()), repeats, hidden.device)
            if block_output is None:
                with torch.no_grad():
                    block_output = trace.hidden_of(real(hidden, *args, **kwargs))
            del real
        fwd, bwd, saved = figures[kind]
        costs.append(BlockCost(f"{trace.trunk_path}.{index}", fwd, bwd, param_bytes([block], seen),
                               trace.boundary_bytes(index + 1), saved))
    fwd, bwd, saved = _profile_head(model, trace, block_output, repeats, materialize_with)
    costs.append(BlockCost("suffix", fwd, bwd, param_bytes([model.get_submodule(p) for p in trace.suffix_paths], seen),
                           block_output.numel() * block_output.element_size(), saved))
    return costs


HEAD_SLICE_BYTES = 64 << 20
"""Weight bytes of the slice of an LM head's vocabulary rows timed in place of a larger head (see
:func:`_profile_head`): its weight and gradient exceed glibc's largest mmap threshold (32 MiB), so they
page-fault as the whole head's do. On this CPU a 32k × 512 head scaled from 32 or 16 MiB slices agrees
with the whole head within noise; from 8 MiB it over-reads (docs/design/scale.md)."""


def _head_rows(model: nn.Module, trace: ModelTrace) -> tuple[str, int, int] | None:
    """``(path, rows to time, all rows)`` of an ``nn.Linear`` LM head whose weight exceeds :data:`HEAD_SLICE_BYTES`,
    else None (timed whole)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return None
    path = next((name for name, module in model.named_modules() if module is head), None)
    rows = max(HEAD_SLICE_BYTES // (head.in_features * head.weight.element_size()), 2)
    return (path, rows, head.out_features) if path in trace.suffix_paths and rows < head.out_features else None


def _sliced_head(model: nn.Module, trace: ModelTrace, materialize_with: Callable[[nn.Module], Materialize],
                 rows: tuple[str, int] | None) -> tuple[nn.Module, list[nn.Parameter]]:
    """A copy of ``model`` whose head alone is materialised (its LM head cut to ``rows = (path, count)`` rows),
    and the head's parameters."""
    head_model = copy.deepcopy(model)
    if rows is not None:
        path, count = rows
        head_model.set_submodule(path, row_stand_in(head_model.get_submodule(path), torch.arange(count)))
    materialize = materialize_with(head_model)
    for path in trace.suffix_paths:
        materialize(head_model.get_submodule(path), path)
    return head_model, trace.outside_parameters(head_model)[1]


def _replay(steps: list[Any], model: nn.Module, values: list[torch.Tensor]) -> torch.Tensor:
    """Run head ``steps`` after the head's values so far (``values[0]`` is the last block's output)."""
    values = list(values)
    for step in steps:
        values.append(step.run(model, values))
    return values[-1]


def _profile_head(model: nn.Module, trace: ModelTrace, hidden: torch.Tensor, repeats: int,
                  materialize_with: Callable[[nn.Module], Materialize]) -> tuple[float, float, int]:
    """``(forward s, backward s, saved bytes)`` of the head (final norm, LM head, what follows the logits).

    An LM head larger than :data:`HEAD_SLICE_BYTES` is never materialised whole (152k × 4096 rows are
    2.5 GB of weight, as much of gradient, and logits of the vocabulary's width): the steps before it (the
    final norm) are timed as they are, the LM head and what follows it (elementwise work on the logits)
    on its first rows, their times scaled by the fraction of rows. Scaling the norm too over-read by its
    whole time times the fraction (on this CPU an RMSNorm over 512 × 512 takes 10 % of a 32k-row head).
    Saved bytes are affine in the rows (input fixed, weight and logits per row): counted at two slice
    widths and extrapolated.
    """
    sliced = _head_rows(model, trace)
    if sliced is None:
        head_model, params = _sliced_head(model, trace, materialize_with, None)
        block_output = hidden.detach().clone().requires_grad_(True)
        return measure(lambda: trace.run_head(head_model, block_output), params, repeats, hidden.device)
    path, rows, total = sliced
    first = next(index for index, step in enumerate(trace.head) if step.module == path)
    pre, post, values = _time_head_slice(model, trace, hidden, repeats, materialize_with, (path, rows), first)
    half_model, _ = _sliced_head(model, trace, materialize_with, (path, rows // 2))
    post_half = saved_bytes(lambda: _replay(trace.head[first:], half_model, values))
    scale = total / rows
    saved = post[2] + (post[2] - post_half) / (rows - rows // 2) * (total - rows)
    return pre[0] + post[0] * scale, pre[1] + post[1] * scale, pre[2] + round(saved)


def _time_head_slice(model: nn.Module, trace: ModelTrace, hidden: torch.Tensor, repeats: int,
                     materialize_with: Callable[[nn.Module], Materialize], rows: tuple[str, int],
                     first: int) -> tuple[tuple[float, float, int], tuple[float, float, int], list[torch.Tensor]]:
    """``measure`` figures of the head's steps before its LM head (``trace.head[:first]``) and of the rest on
    ``rows`` of the LM head, and the values the first steps compute (inputs of the rest)."""
    before, after = trace.head[:first], trace.head[first:]
    head_model, params = _sliced_head(model, trace, materialize_with, rows)
    values = [hidden.detach().clone().requires_grad_(True)]
    with torch.no_grad():
        for step in before:
            values.append(step.run(head_model, values))
    values = [value.detach().requires_grad_(value.is_floating_point()) for value in values]
    pre = (measure(lambda: _replay(before, head_model, values[:1]), params, repeats, hidden.device) if before
           else (0.0, 0.0, 0))
    return pre, measure(lambda: _replay(after, head_model, values), params, repeats, hidden.device), values
