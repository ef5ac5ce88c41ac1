"""The record of one traced forward (:class:`ModelTrace`) and its parts, which :mod:`.recording` fills.

A block's call is kept as a pytree whose tensors are slots (:class:`SideSlot` for the side tensors every block
shares, :class:`SkipSlot` for an earlier block's output, :class:`SkipValue`); the head as the steps that take the
last block's hidden state to the logits (:class:`HeadStep`, their values :class:`HeadValue`). The runtime rebuilds
the model as pipeline stages from it (:mod:`.stage`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_merak.parallel.pipeline.costs import BlockCost

__all__ = ["BlockSignature", "HeadStep", "HeadValue", "InputDim", "ModelTrace", "SideSlot", "SkipSlot", "SkipValue",
           "TraceError", "tensor_bytes"]


class TraceError(ValueError):
    """The model does not have the prefix / trunk / head shape merak3d can split."""


@dataclass
class SideSlot:
    """Placeholder for the i-th side tensor inside recorded block arguments."""

    index: int


@dataclass
class SkipSlot:
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
class HeadValue:
    """Placeholder for a tensor the head computed: 0 is the last block's hidden state, k the k-th step's output."""

    index: int


@dataclass
class InputDim:
    """Placeholder for a size argument of a reshape in the head that the model read off a head value's shape (GPT-2's
    ``hidden_states.view(-1, seq_len, hidden)``): dimension ``dim`` of value ``value`` at replay, so a micro-batch of
    another batch size or length replays it with its own."""

    value: int
    dim: int


@dataclass(frozen=True)
class BlockSignature:
    """How one block is called: the pytree of ``(args[1:], kwargs)``, side tensors as :class:`SideSlot` leaves
    and earlier blocks' outputs as :class:`SkipSlot` leaves."""

    spec: Any
    leaves: tuple[Any, ...]


@dataclass
class HeadStep:
    """One call of the head: a submodule (``module``, a path) or a tensor operation (``function``).

    Arguments are a pytree whose tensors computed by the head are :class:`HeadValue` leaves and whose sizes read off
    their shapes :class:`InputDim` leaves; other leaves (scalars, slices, constant buffers) are kept as recorded.
    ``fixed_lengths``: the traced hidden state's ``(batch, sequence)`` sizes where the step's recorded sizes hold them
    in a way the replay cannot re-derive (a reshape to their product): it then replays at those sizes only.
    """

    module: str | None
    function: Callable[..., Any] | None
    spec: Any
    leaves: list[Any]
    fixed_lengths: tuple[int, ...] | None = None

    def run(self, model: nn.Module, values: list[torch.Tensor]) -> torch.Tensor:
        if self.fixed_lengths is not None and tuple(values[0].shape[:2]) != self.fixed_lengths:
            raise TraceError(
                f"{type(model).__name__}'s head calls {getattr(self.function, '__name__', self.function)} with sizes "
                f"fixed to the traced (batch, sequence) {self.fixed_lengths}, and a micro-batch of "
                f"{tuple(values[0].shape[:2])} reached it; merak3d replays the head as recorded, so compute those "
                "sizes as -1 or from the tensor's shape, or train with micro_batching='none' and fixed lengths")
        device = values[0].device
        args, kwargs = tree_unflatten([leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf
                                       for leaf in self._live_leaves(values)], self.spec)
        call = model.get_submodule(self.module) if self.module is not None else self.function
        return call(*args, **kwargs)

    def input_of(self, values: list[torch.Tensor]) -> torch.Tensor:
        """The first argument this step would be called with: the input of a head module (``vocab_stages``)."""
        args, kwargs = tree_unflatten(self._live_leaves(values), self.spec)
        return args[0] if args else next(iter(kwargs.values()))

    def _live_leaves(self, values: list[torch.Tensor]) -> list[Any]:
        """The recorded leaves with the head's values and the sizes read off them filled in from ``values``."""
        return [values[leaf.index] if isinstance(leaf, HeadValue)
                else values[leaf.value].shape[leaf.dim] if isinstance(leaf, InputDim) else leaf
                for leaf in self.leaves]


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
        leaves = [side_tensors[leaf.index] if isinstance(leaf, SideSlot)
                  else skip_values[leaf.index] if isinstance(leaf, SkipSlot) else leaf for leaf in signature.leaves]
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
        return {slot.index: leaf for slot, leaf in zip(signature.leaves, leaves) if isinstance(slot, SideSlot)}

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


def _within(path: str, container: str) -> bool:
    """Whether module ``path`` is ``container`` or inside it."""
    return path == container or path.startswith(container + ".")
