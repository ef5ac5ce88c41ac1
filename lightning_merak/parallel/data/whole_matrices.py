"""Whole matrices put together from the slices data-parallel sharding leaves on each rank, for work that needs a
matrix whole (Muon's Newton–Schulz orthogonalisation) under ZeRO-1/2.

Sharding flattens the replicated parameters into buckets and gives each rank one contiguous part of each bucket,
so a matrix ends up cut into flat pieces on one or more ranks. :class:`MatrixPieces` names one owner rank per
matrix (:func:`~lightning_merak.parallel.data.owners.assign_owners`: the work divides over the shard group instead
of repeating on every rank), sends each piece to its matrix's owner, lets the owner compute on the whole matrix,
and sends each rank back its pieces of the result. The matrices go in rounds: every round's gather is started at
once, and while an owner computes on one round's matrices the next rounds are still arriving and the finished
ones already travel back.

With tensor parallelism a matrix's "whole" is this rank's tensor-parallel shard; :func:`whole_matrix` gives the
owner a DTensor over it, whose operations run the tensor-parallel collectives with the owner's peers (who own the
same matrix: the assignment depends on shapes only, equal on every tensor-parallel rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.parallel.data.owners import ROUND_BYTES, assign_owners, orthogonalisation_cost, plan_rounds

__all__ = ["MatrixPieces", "Piece", "composite_parts", "pieces_in_buckets", "whole_matrix"]

class Piece(NamedTuple):
    """Elements ``[start, stop)`` of a matrix's flattened local tensor, held by ``rank`` of the shard group."""

    rank: int
    start: int
    stop: int


def whole_matrix(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` (a matrix's local elements) as the tensor ``like`` is: a DTensor over the same mesh and
    placements when ``like`` is one, ``local`` itself otherwise."""
    if isinstance(like, DTensor):
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())
    return local


class MatrixPieces:
    """``matrices`` cut into ``pieces`` (by matrix: which rank of ``group`` holds which elements), each with one
    owner rank. A collective-free constructor: every rank of ``group`` computes the same plan."""

    def __init__(self, matrices: Sequence[nn.Parameter], pieces: Sequence[Sequence[Piece]],
                 group: dist.ProcessGroup, round_bytes: int = ROUND_BYTES) -> None:
        if len(matrices) != len(pieces):
            raise ValueError(f"{len(matrices)} matrices but pieces for {len(pieces)}")
        self.matrices = list(matrices)
        self.pieces = [sorted(held, key=lambda piece: (piece.start, piece.rank)) for held in pieces]
        for matrix, held in zip(self.matrices, self.pieces):
            numel = local_tensor(matrix).numel()
            if len({piece.rank for piece in held}) != len(held):
                raise ValueError("a rank holds two pieces of one matrix; merge them into one")
            if sum(piece.stop - piece.start for piece in held) != numel:
                raise ValueError(f"the pieces of a matrix of {numel} elements cover "
                                 f"{sum(piece.stop - piece.start for piece in held)}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.owners = assign_owners([orthogonalisation_cost(matrix.shape) for matrix in self.matrices], self.size)
        self.index = {id(matrix): index for index, matrix in enumerate(self.matrices)}
        self._piece_of = [{piece.rank: piece for piece in held} for held in self.pieces]
        """By matrix: the piece each rank holds."""
        locals_ = [local_tensor(matrix) for matrix in self.matrices]
        self.rounds = plan_rounds([tensor.numel() for tensor in locals_], [tensor.element_size() for tensor in locals_],
                                  round_bytes)
        self._counts = [self._round_counts(indices) for indices in self.rounds]
        """By round: ``[sender][owner]``, the elements ``sender`` holds of the matrices ``owner`` owns."""

    def owned(self) -> list[int]:
        """Indices of the matrices this rank puts together and computes on."""
        return [index for index, owner in enumerate(self.owners) if owner == self.rank]

    def _round_counts(self, indices: Sequence[int]) -> list[list[int]]:
        counts = [[0] * self.size for _ in range(self.size)]
        for index in indices:
            for piece in self.pieces[index]:
                counts[piece.rank][self.owners[index]] += piece.stop - piece.start
        return counts

    def _owned_pieces(self, indices: Sequence[int], owner: int, holder: int) -> list[tuple[int, Piece]]:
        """The pieces ``holder`` has of the matrices among ``indices`` that ``owner`` owns, by matrix index: the
        order they travel in."""
        return [(index, self._piece_of[index][holder]) for index in indices
                if self.owners[index] == owner and holder in self._piece_of[index]]

    def _gather(self, round_: int, held: dict[int, torch.Tensor], dtype: torch.dtype
                ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Start sending this rank's pieces of round ``round_``'s matrices to their owners: the work, the receive
        buffer and the send buffer (held by the caller until the wait: NCCL reads it on its own stream)."""
        indices, counts = self.rounds[round_], self._counts[round_]
        outgoing = [held[index].reshape(-1) for owner in range(self.size)
                    for index, _ in self._owned_pieces(indices, owner, self.rank)]
        device = local_tensor(self.matrices[indices[0]]).device
        send = torch.cat(outgoing) if outgoing else torch.empty(0, dtype=dtype, device=device)
        receive_splits = [counts[sender][self.rank] for sender in range(self.size)]
        receive = torch.empty(sum(receive_splits), dtype=dtype, device=device)
        send = send.to(dtype)
        work = dist.all_to_all_single(receive, send, receive_splits, counts[self.rank], group=self.group,
                                      async_op=True)
        return work, receive, send

    def _assemble(self, indices: Sequence[int], receive: torch.Tensor) -> dict[int, torch.Tensor]:
        """The whole (local) matrices this rank owns among ``indices``, from the pieces received."""
        wholes = {index: torch.empty_like(local_tensor(self.matrices[index]), dtype=receive.dtype)
                  for index in indices if self.owners[index] == self.rank}
        offset = 0
        for sender in range(self.size):
            for index, piece in self._owned_pieces(indices, self.rank, sender):
                numel = piece.stop - piece.start
                wholes[index].view(-1)[piece.start:piece.stop] = receive[offset:offset + numel]
                offset += numel
        return wholes

    def _scatter(self, round_: int, results: dict[int, torch.Tensor], dtype: torch.dtype
                 ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Start sending each rank its pieces of the results this rank computed for round ``round_`` (returned as
        :meth:`_gather`'s are)."""
        indices, counts = self.rounds[round_], self._counts[round_]
        outgoing = [results[index].reshape(-1)[piece.start:piece.stop] for receiver in range(self.size)
                    for index, piece in self._owned_pieces(indices, self.rank, receiver)]
        device = local_tensor(self.matrices[indices[0]]).device
        send = torch.cat(outgoing).to(dtype) if outgoing else torch.empty(0, dtype=dtype, device=device)
        send_splits = [counts[receiver][self.rank] for receiver in range(self.size)]
        receive = torch.empty(sum(counts[self.rank]), dtype=dtype, device=device)
        work = dist.all_to_all_single(receive, send, counts[self.rank], send_splits, group=self.group, async_op=True)
        return work, receive, send

    def _unpack(self, indices: Sequence[int], receive: torch.Tensor) -> dict[int, torch.Tensor]:
        """This rank's pieces of the results for ``indices``, by matrix."""
        mine: dict[int, torch.Tensor] = {}
        offset = 0
        for owner in range(self.size):
            for index, piece in self._owned_pieces(indices, owner, self.rank):
                numel = piece.stop - piece.start
                mine[index] = receive[offset:offset + numel]
                offset += numel
        return mine

    def map_whole(self, compute: Callable[[int, torch.Tensor], torch.Tensor], held: dict[int, torch.Tensor]
                  ) -> dict[int, torch.Tensor]:
        """``compute(index, whole)`` on every matrix by its owner, where ``whole`` is put together from the pieces
        each rank passes in ``held`` (by matrix index: this rank's piece of that matrix, flat); returns this rank's
        pieces of the results, by matrix index. A collective: every rank of the group calls it, with a piece for
        every matrix it holds one of."""
        started = []
        for round_, indices in enumerate(self.rounds):
            dtype = local_tensor(self.matrices[indices[0]]).dtype
            started.append((round_, dtype, self._gather(round_, held, dtype)))
        returning = []
        for round_, dtype, (work, receive, _sent) in started:
            work.wait()
            wholes = self._assemble(self.rounds[round_], receive)
            results = {index: local_tensor(compute(index, whole_matrix(whole, self.matrices[index])))
                       for index, whole in wholes.items()}
            returning.append((round_, self._scatter(round_, results, dtype)))
        mine: dict[int, torch.Tensor] = {}
        for round_, (work, receive, _sent) in returning:
            work.wait()
            mine.update(self._unpack(self.rounds[round_], receive))
        return mine


def composite_parts(optimizer: Any) -> list[Any]:
    """The optimizers that step ``optimizer``'s parameters: the parts of a composite (one with ``parts``, as
    ``MuonWithAdamW`` is), or itself (unwrapped from a ``LightningOptimizer``)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return list(getattr(inner, "parts", [inner]))


def pieces_in_buckets(buckets: Sequence[Any], matrices: Sequence[nn.Parameter], group: dist.ProcessGroup
                      ) -> MatrixPieces:
    """Where sharded gradient buckets (:class:`~lightning_merak.distributed.gradient_buffer.Bucket`, split over
    ``group``) put each of ``matrices`` they hold (those they do not hold are left out)."""
    pieces: dict[int, list[Piece]] = {}
    for bucket in buckets:
        for rank in range(bucket.shards):
            for piece in bucket.shard_slices(rank):
                pieces.setdefault(id(piece.param), []).append(Piece(rank, piece.start, piece.stop))
    held = [matrix for matrix in matrices if id(matrix) in pieces]
    return MatrixPieces(held, [pieces[id(matrix)] for matrix in held], group)
