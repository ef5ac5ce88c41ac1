"""Per-block costs of the proxy graph and the stage split built from them.

A :class:`BlockCost` is one node of the proxy graph (spec 1.1) in execution order; the
partitioners only ever see these records, so they work the same whether the costs came
from measurement, FLOP counts or a test.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_BACKWARD_RATIO = 2.0
"""Backward time as a multiple of forward time when a block has no measured backward (b = 2f)."""


@dataclass(frozen=True)
class BlockCost:
    """One node of the proxy graph, in execution order."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int
    output_bytes: int
    """Bytes a stage boundary right after this node sends per micro-batch (and their gradients back): the
    hidden state, the side tensors and the skip values crossing it."""
    saved_bytes: int
    is_embedding: bool = False
    consumes: tuple[int, ...] = ()
    fan_out_values: tuple[str, ...] = ()
    optimizer_s: float = 0.0
    """Seconds this rank's optimizer step spends on the node's parameters beyond elementwise work (Muon's
    Newton–Schulz iterations), after the pipeline's flush: a stage with more of it starts the next step later."""
    no_backward: bool = False
    """The node's backward work is priced elsewhere (the split embedding's lookup, whose table gradient every
    stage shares), so a ``backward_s`` of 0 means none rather than "not measured"."""
    trainable: bool = True
    """Whether any of the node's parameters (each counted in the first node holding it) takes gradients: a pipeline
    stage without such a node leaves its rank's optimizer nothing to train, so the partitioners avoid one."""
    table_trainable: bool | None = None
    """For the input embedding (the first node) and the LM head (the last): whether the vocabulary table that
    ``vocab_stages`` splits over every stage (its adapters included) takes gradients; None: as :attr:`trainable`."""

    def __post_init__(self) -> None:
        for field_name in ("forward_s", "backward_s", "param_bytes", "output_bytes", "saved_bytes", "optimizer_s"):
            if getattr(self, field_name) < 0:
                raise ValueError(f"block {self.name!r}: {field_name} must be >= 0, got {getattr(self, field_name)}")

    def resolved_backward_s(self, backward_ratio: float = DEFAULT_BACKWARD_RATIO) -> float:
        """The measured backward time, or ``backward_ratio * forward_s`` when none was measured (0)."""
        if self.no_backward:
            return 0.0
        return self.backward_s if self.backward_s > 0 else backward_ratio * self.forward_s


@dataclass(frozen=True)
class Partition:
    """A contiguous split of the proxy graph into pipeline stages, with the per-stage totals."""

    boundaries: tuple[int, ...]
    stage_forward_s: tuple[float, ...]
    stage_backward_s: tuple[float, ...]
    stage_param_bytes: tuple[int, ...]
    method: str
    stage_recompute_s: tuple[float, ...] | None = None
    stage_memory_bytes: tuple[int, ...] | None = None
    boundary_bytes: tuple[int, ...] | None = None
    """Bytes each stage boundary sends per micro-batch (one fewer than the stages), each way."""
    vocab_stages: bool = False
    """Whether the LM head is split by vocabulary rows over every stage (its share is in each stage's totals)."""
    stage_optimizer_s: tuple[float, ...] | None = None
    """Each stage's priced optimizer work per step (:attr:`BlockCost.optimizer_s`), None where none was priced."""

    def __post_init__(self) -> None:
        if not self.boundaries or self.boundaries[0] != 0:
            raise ValueError(f"boundaries must start at 0, got {self.boundaries}")
        if any(later <= earlier for earlier, later in zip(self.boundaries, self.boundaries[1:])):
            raise ValueError(f"boundaries must be strictly increasing, got {self.boundaries}")
        per_stage = [self.stage_forward_s, self.stage_backward_s, self.stage_param_bytes]
        per_stage += [values for values in (self.stage_recompute_s, self.stage_memory_bytes, self.stage_optimizer_s)
                      if values is not None]
        if any(len(values) != self.num_stages for values in per_stage):
            raise ValueError(f"every per-stage field needs {self.num_stages} entries, one per boundary")
        if self.boundary_bytes is not None and len(self.boundary_bytes) != self.num_stages - 1:
            raise ValueError(f"boundary_bytes needs {self.num_stages - 1} entries, one per cut between stages")

    @property
    def num_stages(self) -> int:
        return len(self.boundaries)

    def stage_of(self, block_index: int) -> int:
        """The stage that runs block ``block_index``."""
        if block_index < 0:
            raise ValueError(f"block_index must be >= 0, got {block_index}")
        return bisect_right(self.boundaries, block_index) - 1

    def blocks_of(self, stage: int, num_blocks: int) -> range:
        """Indices of the blocks stage ``stage`` runs, for a graph of ``num_blocks`` blocks."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage must be in [0, {self.num_stages}), got {stage}")
        end = self.boundaries[stage + 1] if stage + 1 < self.num_stages else num_blocks
        return range(self.boundaries[stage], end)


@dataclass(frozen=True)
class VocabularyShare:
    """What every stage runs per micro-batch when the LM head is split by vocabulary rows over the stages.

    Each of ``num_stages`` ranks computes the logits of ``V / num_stages`` rows for every micro-batch (and their
    softmax cross-entropy pieces), so the head's time, parameters and saved bytes divide by the stages; on top
    comes the exchange of the last hidden state (a broadcast in forward, a reduce of its gradient in backward).
    """

    forward_s: float
    backward_s: float
    param_bytes: int
    saved_bytes: int
    exchange_bytes: int
    """Bytes of the last hidden state each stage receives in forward (and sends back as its gradient)."""
    trainable: bool = False
    """Whether every stage's rows take gradients (the head's table does, or the split embedding's), so every stage
    has something to train whatever nodes it holds."""


def split_vocabulary_head(
    blocks: Sequence[BlockCost], num_stages: int, backward_ratio: float = DEFAULT_BACKWARD_RATIO,
    exchange_s: float = 0.0, exchange_s_per_byte: float = 0.0, split_embedding: bool = True,
) -> tuple[list[BlockCost], VocabularyShare]:
    """``blocks`` with the head (the last node) priced as what stays on the last stage, and every stage's share.

    The last node is the suffix: final norm, LM head, logit scaling, measured as one. Under the split the
    last stage keeps the norm, whose time is small beside a vocabulary-wide matmul, so the whole node is priced
    as the split head: its cost divided by ``num_stages`` lands on every stage, plus the hidden state's
    exchange (``exchange_s`` + ``exchange_s_per_byte`` per byte, once each way) on all but nobody else.

    With ``split_embedding`` the input embedding (the first node) splits alike: its parameters, and its backward
    (the table's gradient), divide over the stages, each of which also exchanges up to a micro-batch's hidden
    state of looked-up rows each way (:mod:`.embedding_stages`); the first stage keeps the lookup's forward.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not blocks:
        raise ValueError("the proxy graph has no blocks")
    head = blocks[-1]
    exchange = head.output_bytes if num_stages > 1 else 0
    exchange_time = (exchange_s + exchange_s_per_byte * exchange) if num_stages > 1 else 0.0
    forward_s = head.forward_s / num_stages + exchange_time
    backward_s = head.resolved_backward_s(backward_ratio) / num_stages + exchange_time
    param_bytes = head.param_bytes // num_stages
    kept_blocks = list(blocks[:-1])
    trainable_rows = _table_trainable(head)
    if split_embedding and len(blocks) > 1 and num_stages > 1:
        embedding = blocks[0]
        trainable_rows = trainable_rows or _table_trainable(embedding)
        rows_time = exchange_s + exchange_s_per_byte * embedding.output_bytes
        forward_s += rows_time
        backward_s += embedding.resolved_backward_s(backward_ratio) / num_stages + rows_time
        param_bytes += embedding.param_bytes // num_stages
        kept_blocks[0] = replace(embedding, backward_s=0.0, param_bytes=0, no_backward=True)
    share = VocabularyShare(
        forward_s=forward_s,
        backward_s=backward_s,
        param_bytes=param_bytes,
        saved_bytes=head.saved_bytes // num_stages,
        exchange_bytes=exchange,
        trainable=trainable_rows,
    )
    kept = BlockCost(head.name, 0.0, 0.0, 0, head.output_bytes, 0, head.is_embedding, head.consumes,
                     head.fan_out_values, head.optimizer_s, trainable=head.trainable)
    return [*kept_blocks, kept], share


def _table_trainable(node: BlockCost) -> bool:
    return node.trainable if node.table_trainable is None else node.table_trainable


def boundary_bytes(blocks: Sequence[BlockCost], boundaries: Sequence[int]) -> tuple[int, ...]:
    """Bytes each cut of ``boundaries`` sends per micro-batch: the ``output_bytes`` of the node in front of it."""
    return tuple(blocks[start - 1].output_bytes for start in boundaries[1:])


def build_partition(
    blocks: Sequence[BlockCost],
    boundaries: Sequence[int],
    method: str,
    backward_ratio: float = DEFAULT_BACKWARD_RATIO,
    stage_recompute_s: Sequence[float] | None = None,
    stage_memory_bytes: Sequence[int] | None = None,
    vocabulary: VocabularyShare | None = None,
) -> Partition:
    """Sum the block costs of each stage of ``boundaries`` into a :class:`Partition`.

    With ``vocabulary`` (the head split over the stages: :func:`split_vocabulary_head` gave ``blocks``), every
    stage also carries that share.
    """
    ends = list(boundaries[1:]) + [len(blocks)]
    stages = [blocks[start:end] for start, end in zip(boundaries, ends)]
    share = vocabulary or VocabularyShare(0.0, 0.0, 0, 0, 0)
    return Partition(
        boundaries=tuple(boundaries),
        stage_forward_s=tuple(share.forward_s + sum(block.forward_s for block in stage) for stage in stages),
        stage_backward_s=tuple(share.backward_s + sum(block.resolved_backward_s(backward_ratio) for block in stage)
                               for stage in stages),
        stage_param_bytes=tuple(share.param_bytes + sum(block.param_bytes for block in stage) for stage in stages),
        method=method,
        vocab_stages=vocabulary is not None,
        stage_recompute_s=None if stage_recompute_s is None else tuple(stage_recompute_s),
        stage_memory_bytes=None if stage_memory_bytes is None else tuple(stage_memory_bytes),
        boundary_bytes=boundary_bytes(blocks, boundaries),
        stage_optimizer_s=(tuple(sum(block.optimizer_s for block in stage) for stage in stages)
                           if any(block.optimizer_s for block in blocks) else None),
    )


def optimizer_delays_s(stage_forward_s: Sequence[float], stage_backward_s: Sequence[float],
                       stage_optimizer_s: Sequence[float]) -> list[float]:
    """Seconds each stage's optimizer step delays the next 1F1B step after the flush. Stage ``s`` finishes its
    last backward ``sum(backward_s[:s])`` before the first stage does, and its next forward is needed
    ``sum(forward_s[:s])`` after the first stage's, so its optimizer step hides behind that much; the largest
    remainder is the step's optimizer tail."""
    delays, slack = [], 0.0
    for forward_s, backward_s, optimizer_s in zip(stage_forward_s, stage_backward_s, stage_optimizer_s, strict=True):
        delays.append(max(optimizer_s - slack, 0.0))
        slack += forward_s + backward_s
    return delays


def with_optimizer_seconds(costs: Sequence[BlockCost], node_parameters: Sequence[Sequence[Any]],
                           seconds: Mapping[int, float], ranks: int = 1) -> list[BlockCost]:
    """``costs`` with each node's ``optimizer_s``: its parameters' ``seconds`` (by ``id``; a parameter two nodes
    share counts in the first) over the ``ranks`` a stage's optimizer work divides over (its data-parallel
    replicas, when each matrix has one owner among them)."""
    if len(node_parameters) != len(costs):
        raise ValueError(f"{len(node_parameters)} nodes' parameters for {len(costs)} nodes")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return [replace(cost, optimizer_s=sum(seconds.get(id(param), 0.0) for param in fresh) / ranks)
            for cost, fresh in zip(costs, _first_holders(node_parameters))]


def with_trainable_nodes(costs: Sequence[BlockCost], node_parameters: Sequence[Sequence[Any]],
                         embedding_table: Sequence[Any] = (), head_table: Sequence[Any] = ()) -> list[BlockCost]:
    """``costs`` with each node's ``trainable``: whether any of its parameters (a parameter two nodes share counts
    in the first) has ``requires_grad``; and the first and last node's ``table_trainable`` from the parameters of
    the input embedding (``embedding_table``) and the LM head (``head_table``), where given."""
    if len(node_parameters) != len(costs):
        raise ValueError(f"{len(node_parameters)} nodes' parameters for {len(costs)} nodes")
    marked = [replace(cost, trainable=any(param.requires_grad for param in fresh))
              for cost, fresh in zip(costs, _first_holders(node_parameters))]
    for index, table in ((0, embedding_table), (-1, head_table)):
        if table:
            marked[index] = replace(marked[index], table_trainable=any(param.requires_grad for param in table))
    return marked


def _first_holders(node_parameters: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Each node's parameters that no earlier node holds (a tied weight belongs to the first node listing it)."""
    seen: set[int] = set()
    fresh_per_node = []
    for params in node_parameters:
        fresh = [param for param in params if id(param) not in seen]
        seen.update(id(param) for param in fresh)
        fresh_per_node.append(fresh)
    return fresh_per_node
