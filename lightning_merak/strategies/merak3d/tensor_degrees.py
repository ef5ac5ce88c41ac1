"""The tensor-parallel degrees a planned merak3d layout may take, and why the planner leaves the others out.

Known from the model's config and the arguments alone, so ``tensor_parallel="auto"`` with no degree left to
take at the user's fixed degrees is refused before launch (:func:`check_tensor_parallel_search`), not after
the planner has profiled.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning_merak.parallel.float8 import float8_layout_problem
from lightning_merak.parallel.pipeline.router_aux import router_aux_loss_problem
from lightning_merak.parallel.tensor.families import check_tensor_parallel_degree
from lightning_merak.parallel.tensor.sequence import check_sequence_length
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments

__all__ = ["check_tensor_parallel_search", "describe_left_out", "left_out_tensor_parallel",
           "tensor_parallel_candidates", "tensor_parallel_problem", "tensor_parallel_room"]


def tensor_parallel_problem(arguments: Merak3DArguments, config: Any, degree: int, num_processes: int,
                            sequence: Optional[int]) -> Optional[str]:
    """Why the planner leaves ``tensor_parallel=degree`` out, or None: more ranks than a node's ``num_processes``,
    the model's heads and widths (:func:`check_tensor_parallel_degree`), a ``sequence`` (None: not known yet) that
    sequence parallelism cannot split over it, routers that would see a share of the tokens, or fp8 layers."""
    if degree > num_processes:
        return f"tensor_parallel={degree} would span more than a node's {num_processes} processes"
    try:
        check_tensor_parallel_degree(config, degree)
        if arguments.sequence_parallel and sequence is not None:
            check_sequence_length(sequence, degree)
    except ValueError as error:
        return str(error)
    router_aux = router_aux_loss_problem(getattr(config, "output_router_logits", False), None,
                                         sequence_parallel=arguments.sequence_parallel, tensor_parallel=degree)
    if router_aux is not None:
        return router_aux
    return None if arguments.float8 is None else float8_layout_problem(arguments.float8, degree)


def tensor_parallel_candidates(arguments: Merak3DArguments, config: Any, world_size: int, num_processes: int,
                               sequence: int) -> tuple[int, ...]:
    """The tensor-parallel degrees the planner may choose: the one given; else each degree dividing the world
    that :func:`tensor_parallel_problem` finds nothing against."""
    if arguments.tensor_parallel != "auto":
        return (arguments.tensor_parallel,)
    return tuple(d for d in range(1, world_size + 1) if world_size % d == 0
                 and tensor_parallel_problem(arguments, config, d, num_processes, sequence) is None)


def tensor_parallel_room(arguments: Merak3DArguments, world_size: int) -> list[int]:
    """The tensor-parallel degrees that the fixed data-, pipeline- and context-parallel degrees leave room for on
    ``world_size`` ranks: the quotient where all three are fixed, else each divisor of it."""
    others = (arguments.data_parallel, arguments.pipeline_parallel, arguments.context_parallel)
    fixed = [degree for degree in others if degree != "auto"]
    if world_size % math.prod(fixed):
        return []
    room = world_size // math.prod(fixed)
    return [room] if len(fixed) == len(others) else [d for d in range(1, room + 1) if room % d == 0]


def left_out_tensor_parallel(arguments: Merak3DArguments, config: Any, world_size: int, num_processes: int,
                             sequence: Optional[int]) -> dict[int, str]:
    """Why the planner leaves out each degree of :func:`tensor_parallel_room` that it does (empty where
    ``tensor_parallel`` is fixed)."""
    if arguments.tensor_parallel != "auto":
        return {}
    problems = {d: tensor_parallel_problem(arguments, config, d, num_processes, sequence)
                for d in tensor_parallel_room(arguments, world_size)}
    return {degree: problem for degree, problem in problems.items() if problem is not None}


def check_tensor_parallel_search(arguments: Merak3DArguments, config: Any, world_size: int,
                                 sequence: Optional[int] = None) -> None:
    """Refuse, before launch, ``tensor_parallel="auto"`` where the planner would leave out every degree the fixed
    ones leave room for, naming each and why. Before launch a node's processes are not known: every rank counts
    as one node's, so only what the config rules out is refused here (the planner names the rest)."""
    room = tensor_parallel_room(arguments, world_size)
    left_out = left_out_tensor_parallel(arguments, config, world_size, world_size, sequence)
    if arguments.tensor_parallel == "auto" and room and len(left_out) == len(room):
        raise ValueError(f"tensor_parallel='auto' has no degree to choose at the fixed degrees {arguments.degrees} "
                         f"and context_parallel={arguments.context_parallel} on {world_size} processes: "
                         f"{describe_left_out(left_out)}; set more of the degrees to 'auto', or fix them so that "
                         "tensor_parallel can take a degree the model splits into")


def describe_left_out(left_out: dict[int, str]) -> str:
    """``left_out`` (:func:`left_out_tensor_parallel`) in words, for an error."""
    return "; ".join(f"tensor_parallel={degree} is left out ({problem})" for degree, problem in left_out.items())
