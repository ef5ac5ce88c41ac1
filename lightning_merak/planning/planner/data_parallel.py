"""What data parallelism costs a rank: the model state each sharding mode keeps, and the exposed gradient
communication of each mode (pure functions of the layout's degrees and the profiles)."""

from __future__ import annotations

import math

from lightning_merak.planning.planner.profile import ModelProfile, NetworkProfile, SearchSpace


def model_state_bytes(mode: str, shards: int, pipelined: bool, parameter_bytes: float, in_flight_bytes: float,
                      bucket_bytes: float | None, profile: ModelProfile,
                      trainable_bytes: float | None = None) -> dict[str, float]:
    """Peak bytes of parameters, gradients and optimizer state on a rank holding ``parameter_bytes`` of a stage
    (its 1/(pp·tp)), its state sharded over ``shards`` data-parallel ranks by ``mode``.

    With P the parameter bytes, T the part of them that trains (``trainable_bytes``; None: all), S the
    shards, g, o, c the profile's gradient, optimizer-state and compute-copy bytes per parameter byte, B a
    gradient bucket (None: one of all gradients) and U ``in_flight_bytes`` (what FSDP2 holds gathered at once
    without pipelining: two blocks, the one computing and the one prefetched, plus the stage root's embedding
    and head, which it keeps for the whole step):

    - parameters: (1 + c)·P; ``"full"``: P/S + (1 + c)·G, G = P with several stages (gathered
      parameters stay from a micro-batch's forward to the last backward), else min(P, U).
    - gradients: g·T for ``"none"``/``"optimizer"`` and for any mode with several stages (they
      accumulate whole over the micro-batches); ``"gradients"``: min(g·T, g·T/S + 2B) (its slice
      and two buckets, one filling, one in its reduce-scatter); ``"full"``: g·(T/S + min(T, U·T/P)).
    - optimizer state: o·T, divided by S in every sharded mode.

    Frozen parameters (a frozen base under adapters) take no gradient and no optimizer state.

    One shard (``shards=1``) splits nothing: every mode costs what ``"none"`` does. Under
    ``*-mixed`` precision P is the fp32 master weights and c·P their 16-bit compute copies.
    """
    P, S = parameter_bytes, shards
    T = P if trainable_bytes is None else trainable_bytes
    gradient, optimizer, copy = (profile.gradient_bytes_per_parameter_byte,
                                 profile.optimizer_bytes_per_parameter_byte,
                                 profile.compute_copy_bytes_per_parameter_byte)
    if S == 1 or mode == "none":
        mode, S = "none", 1
    if mode == "full":
        gathered = P if pipelined else min(P, in_flight_bytes)
        parameters = P / S + (1 + copy) * gathered
    else:
        parameters = (1 + copy) * P
    if pipelined or mode in ("none", "optimizer"):
        gradients = gradient * T
    elif mode == "gradients":
        gradients = min(gradient * T, gradient * T / S + 2 * (gradient * T if bucket_bytes is None else bucket_bytes))
    else:
        gradients = gradient * (T / S + min(T, in_flight_bytes * T / P if P else 0.0))
    return {"parameters": parameters, "gradients": gradients, "optimizer_state": optimizer * T / S}


def exposed_comm_s(comm_s: float, window_s: float, last_fraction: float) -> float:
    """What stays exposed of ``comm_s`` started piece by piece during ``window_s`` of computation: what exceeds
    the window, and at least the last piece (``last_fraction`` of it), which is ready only when the window ends."""
    return max(comm_s - window_s, comm_s * min(1.0, last_fraction))


def data_parallel_s(ranks: int, sharding: str, pipelined: bool, space: SearchSpace, network: NetworkProfile,
                    parameter_bytes: float, block_bytes: float, units: int, forward_s: float,
                    backward_s: float) -> float:
    """Exposed data-parallel communication of a stage holding ``parameter_bytes`` in ``units`` FSDP2 modules
    (its blocks and its root), after its last micro-batch's ``forward_s`` and ``backward_s``, over the layout's
    ``ranks`` data-parallel ranks (batch replicas x context ranks) sharding by ``sharding``, with several
    pipeline stages where ``pipelined``.

    ``"none"``: the gradient all-reduce. ``"optimizer"``/``"gradients"``: a reduce-scatter and an
    all-gather, together the bytes of a ring all-reduce over the shard group (each half of it),
    plus with hybrid sharding an all-reduce of the 1/S slices across the replicas; the all-gather
    of the updated parameters follows the optimizer step, exposed. These run one collective per
    bucket of ``space.grad_bucket_bytes`` (each paying its latency); with ``space.overlap_grad_reduce``
    the reduction runs bucket by bucket during the last backward (:func:`exposed_comm_s`).
    ``"full"`` (FSDP2, always overlapped, one collective per unit, prefetched): a parameter
    all-gather in the forward and one more with the reduce-scatter in the backward; with several
    stages the gathered parameters stay, so one all-gather (first forward) and one reduce-scatter
    (last backward).
    """
    shards = space.shards(sharding, ranks)
    if ranks == 1 or parameter_bytes == 0:
        return 0.0
    bucket = parameter_bytes if space.grad_bucket_bytes is None else min(parameter_bytes, space.grad_bucket_bytes)
    pieces = units if sharding == "full" and shards > 1 else math.ceil(parameter_bytes / bucket)

    def collectives_s(nbytes: float, ranks: int) -> float:
        """``nbytes`` synchronised over ``ranks`` in ``pieces`` collectives."""
        return pieces * network.gradient_sync_s(nbytes / pieces, ranks) if ranks > 1 else 0.0

    def reduced_s(reduce_s: float) -> float:
        """What the bucketed gradient reduction leaves exposed."""
        if not space.overlap_grad_reduce:
            return reduce_s
        return exposed_comm_s(reduce_s, backward_s, bucket / parameter_bytes)

    if shards == 1:
        return reduced_s(collectives_s(parameter_bytes, ranks))
    ring_s = collectives_s(parameter_bytes, shards)
    reduce_s = ring_s / 2 + collectives_s(parameter_bytes / shards, ranks // shards)
    gather_s = ring_s / 2
    if sharding != "full":
        return reduced_s(reduce_s) + gather_s
    block_fraction = block_bytes / parameter_bytes
    backward_comm_s = reduce_s if pipelined else gather_s + reduce_s
    return (exposed_comm_s(gather_s, forward_s, block_fraction)
            + exposed_comm_s(backward_comm_s, backward_s, block_fraction))
