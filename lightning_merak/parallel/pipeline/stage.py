"""Cut a traced model into pipeline stages without editing it.

Every stage keeps the *original* model object, pruned to what it owns, under the
attribute ``net``: its parameter names are the original names prefixed by ``net.``, so
checkpoints, gradients and optimizer groups map back to the unsplit model.

* The first stage runs the model's own forward (embeddings, masks, rotary tables —
  whatever the model computes before its blocks) with its local blocks in place and the
  others skipped; it leaves the forward once its last block ran and every side tensor
  the blocks read has been seen, handing back the hidden state and the side tensors.
* Later stages call their blocks directly, each with its own side tensors.
* The last stage replays the recorded head (final norm, LM head, logit scaling) to get logits. A head module the
  prefix calls too (:attr:`~.recording.ModelTrace.shared_paths`: nanochat's norm) stays on the first stage as well.

Stage inputs and outputs are ``(hidden, *side_tensors, *skip_values)``, each sent contiguous (a model may hand its
blocks a transposed view, as a patch embedding's ``flatten(2).transpose(1, 2)``, which no send or receive buffer
takes); the last stage outputs logits. The
skip values at a boundary are those an earlier block produced and a later one reads
(:meth:`~.recording.ModelTrace.skips_across`): each is carried through every stage between its producer and
its last reader, a stage that does not read it handing it on as received, so every stage still talks to its
neighbours only and any schedule (one stage per rank or interleaved) runs it; its gradient comes back the same
way, the pass-through stages' autograd adding nothing. Sending it straight to its readers would save the hops
but needs sends between stages that are not neighbours, which torch's pipeline stages do not make. A stage given a
:class:`~lightning_merak.parallel.pipeline.router_aux.RouterAux` also carries the router logits of every
layer so far as one more tensor (its last input and output; the last stage outputs ``(logits, router logits)``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_merak.parallel.pipeline.recording import trunk_like
from lightning_merak.parallel.pipeline.router_aux import (
    RouterAux,
    RouterRecorder,
    carried_router_logits,
    routers_per_block,
)
from lightning_merak.parallel.pipeline.trace import ModelTrace, TraceError

__all__ = ["PipelineStageModule", "RankStages", "RemovedModule", "StageParts", "build_stage_module", "rank_part",
           "tied_parameter_names"]

_NET_PREFIX = "net."


class RemovedModule(nn.Module):
    """Stands where a module lives on another pipeline stage."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.path} lives on another pipeline stage and cannot run here")


class _TrunkExit(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _SkippedBlock(nn.Module):
    """Stands for a block of another stage inside the first stage's forward: notes its side tensors and hands
    the hidden state on unchanged."""

    def __init__(self, index: int, stage: "PipelineStageModule") -> None:
        super().__init__()
        self.index = index
        self._stage = [stage]  # in a list, so the stage is not registered as this module's child (a cycle)

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        stage = self._stage[0]
        stage.note_block_call(self.index, args, kwargs)
        stage.exit_if_done(self.index, hidden)
        return stage.trace.output_with_hidden(hidden)


def tied_parameter_names(model: nn.Module) -> list[tuple[str, ...]]:
    """Groups of names that refer to one ``Parameter`` object (tied embeddings and LM heads)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


class PipelineStageModule(nn.Module):
    """Stage ``stage_index`` of ``num_stages`` holding nodes ``node_range`` of the trace.

    Node 0 is the prefix, nodes 1..n are the blocks, node n+1 the suffix (head). With ``router_aux``, the stage
    records its routers and carries the router logits on (see the module docstring).
    """

    def __init__(
        self,
        model: nn.Module,
        trace: ModelTrace,
        node_range: range,
        stage_index: int,
        num_stages: int,
        call_model: Callable[[nn.Module, torch.Tensor], Any],
        router_aux: RouterAux | None = None,
    ) -> None:
        super().__init__()
        _check_shared_modules(model, trace)
        self.trace = trace
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self._call_model = call_model
        self.head_stop: int | None = None
        """With the LM head split over the pipeline ranks (:mod:`.vocab_stages`), the head step the last stage
        stops before: it outputs that step's input (the final norm's output) instead of logits."""
        num_blocks = trace.num_blocks
        self.block_indices = [node - 1 for node in node_range if 1 <= node <= num_blocks]
        self.skips_in = trace.skips_across(min(max(node_range.start - 1, 0), num_blocks))
        """The skip values this stage receives (indices into ``trace.skips``), after the side tensors."""
        self.skips_out = trace.skips_across(min(max(node_range.stop - 1, 0), num_blocks))
        """The skip values this stage sends on (received or made by its blocks)."""
        trunk: nn.ModuleList = model.get_submodule(trace.trunk_path)
        self.routers: RouterRecorder | None = None
        self.carries_router_logits_in = False
        if router_aux is not None:
            routers = [module for index in self.block_indices for module in trunk[index].modules()
                       if isinstance(module, router_aux.router_class)]
            before = sum(routers_per_block(trunk[:max(node_range.start - 1, 0)], router_aux.router_class))
            self.carries_router_logits_in = before > 0
            if before + len(routers) > 0:
                self.routers = RouterRecorder(routers, router_aux.output_index)
        model.set_submodule(trace.trunk_path, trunk_like(trunk, [
            trunk[i] if i in self.block_indices else RemovedModule(f"{trace.trunk_path}.{i}")
            for i in range(num_blocks)
        ]))
        if self.is_first:
            self._install_exit(model.get_submodule(trace.trunk_path))
        if not self.is_last:
            for path in trace.suffix_paths:
                if not (self.is_first and path in trace.shared_paths):
                    model.set_submodule(path, RemovedModule(path))
        if not self.is_first:
            self._remove_prefix(model)
        self.net = model

    def _install_exit(self, trunk: nn.ModuleList) -> None:
        """Skip the blocks of other stages; end the forward once the last local block ran and every
        side tensor has been seen (blocks of different kinds may read different ones)."""
        self._last_local_block = self.block_indices[-1] if self.block_indices else -1
        self._seen_side: dict[int, dict[int, torch.Tensor]] = {}
        self._made_skips: dict[int, dict[int, torch.Tensor]] = {}
        for index in range(len(trunk)):
            if index not in self.block_indices:
                trunk[index] = _SkippedBlock(index, self)
                continue

            def note(module: nn.Module, args: tuple, kwargs: dict, index: int = index) -> None:
                self.note_block_call(index, args[1:], kwargs)

            def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any, index: int = index) -> None:
                made = self._made_skips.get(threading.get_ident())
                if made is not None:
                    made.update(self.trace.produced_skips(index, output))
                self.exit_if_done(index, self.trace.hidden_of(output))

            trunk[index].register_forward_pre_hook(note, with_kwargs=True)
            trunk[index].register_forward_hook(leave, with_kwargs=True)

    def note_block_call(self, index: int, args: tuple, kwargs: dict) -> None:
        """Record the side tensors block ``index`` is called with, inside this stage's forward (per thread, as
        sub-batches run it in threads of their own); a block called from anywhere else is left alone."""
        seen = self._seen_side.get(threading.get_ident())
        if seen is not None:
            seen.update(self.trace.side_tensors_of(index, args, kwargs))

    def exit_if_done(self, index: int, hidden: torch.Tensor) -> None:
        """Leave the model's forward after block ``index`` if nothing more is needed from it."""
        seen = self._seen_side.get(threading.get_ident())
        if seen is not None and index >= self._last_local_block and len(seen) == self.trace.side_tensor_count:
            raise _TrunkExit(hidden)

    def _remove_prefix(self, model: nn.Module) -> None:
        """Replace every module with state that neither the trunk nor the suffix needs."""
        keep = (self.trace.trunk_path, *self.trace.suffix_paths)
        removed: list[str] = []
        for name, child in list(model.named_modules()):
            if not name or any(name.startswith(done + ".") for done in removed):
                continue
            if any(name == k or name.startswith(k + ".") or k.startswith(name + ".") for k in keep):
                continue
            if next(child.parameters(), None) is not None or next(child.buffers(), None) is not None:
                model.set_submodule(name, RemovedModule(name))
                removed.append(name)

    def original_name(self, stage_name: str) -> str:
        """The name a parameter of this stage has in the unsplit model."""
        return stage_name[len(_NET_PREFIX):] if stage_name.startswith(_NET_PREFIX) else stage_name

    def _run_first(self, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        thread = threading.get_ident()
        self._seen_side[thread] = seen = {}
        self._made_skips[thread] = made = {}
        try:
            if model_kwargs:  # e.g. position_ids of packed rows (micro_batching=pack)
                self.net(input_ids, **model_kwargs)
            else:
                self._call_model(self.net, input_ids)
        except _TrunkExit as exit_:
            return (exit_.hidden, *(seen[slot] for slot in range(self.trace.side_tensor_count)),
                    *(made[index] for index in self.skips_out))
        finally:
            del self._seen_side[thread], self._made_skips[thread]
        raise TraceError("the model's forward finished without reaching the pipeline exit")

    def forward(self, *inputs: torch.Tensor, **model_kwargs: Any) -> Any:
        """``model_kwargs`` go to the first stage's model call; later stages get them as side tensors."""
        if self.routers is None:
            hidden, side = self._run_blocks(inputs, model_kwargs)
            return (hidden.contiguous(), *map(_own_copy, side)) if not self.is_last else self._run_head(hidden)
        carried = None
        if self.carries_router_logits_in:
            *inputs, carried = inputs
        with self.routers.recording() as recorded:
            hidden, side = self._run_blocks(tuple(inputs), model_kwargs)
        batch, sequence = inputs[0].shape[:2]  # token ids [batch, sequence] or hidden [batch, sequence, width]
        router_logits = carried_router_logits(carried, recorded, batch, sequence)
        if not self.is_last:
            return (hidden.contiguous(), *map(_own_copy, side), router_logits)
        return self._run_head(hidden), router_logits

    def _run_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.trace.run_head(self.net, hidden, self.head_stop)

    def _run_blocks(self, inputs: tuple[torch.Tensor, ...], model_kwargs: dict[str, Any]
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(hidden, side tensors and skip values to send on)`` after this stage's blocks."""
        if self.is_first:
            hidden, *carried = self._run_first(inputs[0], model_kwargs)
            return hidden, tuple(carried)
        count = self.trace.side_tensor_count
        hidden, side, received = inputs[0], tuple(inputs[1:1 + count]), inputs[1 + count:]
        if len(received) != len(self.skips_in):
            raise TraceError(f"pipeline stage {self.stage_index} received {len(inputs)} tensors; it takes the hidden "
                             f"state, {count} side tensors and {len(self.skips_in)} skip values")
        values = dict(zip(self.skips_in, received))
        trunk = self.net.get_submodule(self.trace.trunk_path)
        for index in self.block_indices:
            args, kwargs = self.trace.block_arguments(side, index, values)
            output = trunk[index](hidden, *args, **kwargs)
            values.update(self.trace.produced_skips(index, output))
            hidden = self.trace.hidden_of(output)
        return hidden, (*side, *(values[index] for index in self.skips_out))


def _check_shared_modules(model: nn.Module, trace: ModelTrace) -> None:
    """Refuse a head module with parameters that the prefix calls too: the first and the last stage would each
    train a copy of them. The stages sum the gradients of tied parameters only, those the model registers under
    several names (:func:`tied_parameter_names`), which a module called twice under one name is not."""
    tied = {name for group in tied_parameter_names(model) for name in group}
    for path in trace.shared_paths:
        names = [f"{path}.{name}" for name, _ in model.get_submodule(path).named_parameters()]
        names = [name for name in names if name not in tied]
        if names:
            raise TraceError(
                f"{path} runs both before the first block of {trace.trunk_path} and after its last one, so the first "
                f"and the last pipeline stage would each hold and train a copy of its parameters ({', '.join(names)}); "
                "merak3d shares between stages only weights tied under two names (an embedding and its LM head), "
                "so use pipeline_parallel=1")


def _own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A side tensor or skip value this stage computed, as a copy of its own for sending.

    The zero-bubble schedules detach a stage's outputs in place once their input gradients are computed, and a
    block of the stage may have saved the same tensor for its weight gradients (block 0's values, which the next
    local block multiplies by a weight): the copy keeps what it saved intact. Received tensors handed on as they
    are have no graph behind them and go as they are, made contiguous (an expanded one, such as position ids
    broadcast over the batch, cannot be sent).
    """
    return tensor.clone() if tensor.grad_fn is not None else tensor.contiguous()


def build_stage_module(
    model: nn.Module,
    trace: ModelTrace,
    boundaries: tuple[int, ...],
    stage_index: int,
    call_model: Callable[[nn.Module, torch.Tensor], Any],
    router_aux: RouterAux | None = None,
) -> PipelineStageModule:
    """Prune ``model`` in place to stage ``stage_index`` of the partition ``boundaries``.

    ``boundaries`` are the first node index of each stage over the nodes
    [prefix, block 0 … block n−1, suffix] (the order of ``trace.costs``).
    """
    num_nodes = trace.num_blocks + 2
    ends = list(boundaries[1:]) + [num_nodes]
    node_range = range(boundaries[stage_index], ends[stage_index])
    return PipelineStageModule(model, trace, node_range, stage_index, len(boundaries), call_model, router_aux)


class RankStages(nn.ModuleList):
    """The pipeline stages one rank runs: one, or several with an interleaved schedule.

    Parameter names are ``<k>.net.<original name>``; :meth:`original_name` maps them back. ``router_aux``:
    the router aux loss the last stage's loss adds, if the stages carry router logits.

    The stages stand where the network was (``self.model``), so a submodule or tensor of the network read by name
    (``self.model.blocks``, ``self.model.head.weight`` in ``configure_optimizers``) is this rank's part of it
    (:func:`rank_part`): a module that lives on other ranks stands there without parameters (a :class:`RemovedModule`,
    or a block the first stage skips).
    """

    def __init__(self, stages: list[PipelineStageModule], router_aux: RouterAux | None = None) -> None:
        super().__init__(stages)
        self.router_aux = router_aux
        self.vocabulary: Any = None
        """The :class:`~.vocab_stages.VocabularyExchange` when the LM head is split over the pipeline ranks."""
        self.embedding: Any = None
        """The :class:`~.embedding_stages.EmbeddingExchange` when the input embedding is split with it."""
        self.rows_data_parallel_group: Any = None
        """Under FSDP2, the data-parallel group the split vocabulary's rows average their gradients over."""

    @property
    def is_first(self) -> bool:
        return any(stage.is_first for stage in self)

    @property
    def is_last(self) -> bool:
        return any(stage.is_last for stage in self)

    def original_name(self, name: str) -> str:
        index, _, rest = name.partition(".")
        return self[int(index)].original_name(rest)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or "_modules" not in self.__dict__:
                raise
            return rank_part([getattr(stage.net, name, None) for stage in self], name)


def rank_part(parts: list[Any], name: str) -> Any:
    """This rank's part of the network's attribute ``name``, given its value in each stage's network (None: the
    network has no such attribute): a module or tensor, as one module where several stages hold pieces of it."""
    present = [part for part in parts if part is not None]
    if not present or not all(isinstance(part, (nn.Module, torch.Tensor)) for part in present):
        raise AttributeError(f"the pipeline stages that stand for the network have no module or tensor {name!r}")
    held = list({id(part): part for part in present if not isinstance(part, (RemovedModule, _SkippedBlock))}.values())
    if not held:
        return present[0]
    if len(held) == 1:
        return held[0]
    if all(isinstance(part, nn.Module) for part in held):
        return StageParts(held, name)
    raise AttributeError(f"each pipeline stage of this rank holds its own {name!r}; read it from one stage's "
                         "network (`self.model[k].net`)")


class StageParts(nn.Module):
    """One module of the network of which several stages of this rank hold pieces (an interleaved schedule's
    ``blocks``): its parameters are theirs, and its attributes, items and iteration are this rank's parts of theirs."""

    def __init__(self, parts: list[nn.Module], name: str) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self._name = name

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return rank_part([getattr(part, name, None) for part in self.parts], f"{self._name}.{name}")

    def __getitem__(self, index: int) -> Any:
        return rank_part([part[index] for part in self.parts], f"{self._name}[{index}]")

    def __len__(self) -> int:
        return len(self.parts[0])

    def __iter__(self) -> Iterator[Any]:
        return (self[index] for index in range(len(self)))
