"""Expert-parallel groups carved from a set of data-parallel ranks, registered with DeepSpeed.

EP groups are consecutive runs of ``ep_size`` data-parallel ranks and expert-data-
parallel (EDP) groups take the same position in every EP group — DeepSpeed's own
layout — so DeepSpeed's engine and its ``groups`` API find them by name. A 3D
strategy hands over its data-parallel ranks; a plain DDP run uses the whole world.
Every process calls these functions in the same order (``new_group`` is collective).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist

from lightning_merak.distributed.deepspeed_comm import init_deepspeed_comm
from lightning_merak.distributed.process_groups import new_group
from lightning_merak.protocols.layout_aware import data_parallel_groups_from_mesh

__all__ = ["ExpertGroups", "carve_expert_groups", "data_parallel_groups_from_mesh", "ensure_expert_groups"]

_TRANSFER_GROUPS: dict[tuple[int, ...], Any] = {}


def carve_expert_groups(data_parallel_ranks: Sequence[int], ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, EDP groups) over ``data_parallel_ranks``."""
    ranks = list(data_parallel_ranks)
    if ep_size < 1 or len(ranks) % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide the {len(ranks)} data-parallel ranks; "
            f"choose an ep_size that divides {len(ranks)}"
        )
    ep_groups = [ranks[i: i + ep_size] for i in range(0, len(ranks), ep_size)]
    edp_groups = [[group[pos] for group in ep_groups] for pos in range(ep_size)]
    return ep_groups, edp_groups


@dataclass
class ExpertGroups:
    """This rank's EP, EDP and transfer groups, with their global ranks."""

    name: str
    ep_group: Any
    ep_ranks: list[int]
    edp_group: Any
    edp_ranks: list[int]
    transfer_group: Any


def ensure_expert_groups(
    ep_size: int, group_name: str, data_parallel_groups: Sequence[Sequence[int]] | None = None
) -> ExpertGroups:
    """Create (or look up) DeepSpeed's EP/EDP groups named ``group_name`` and our transfer group.

    ``data_parallel_groups`` lists every data-parallel group of the world (one per
    pipeline/tensor position of a 3D layout); default: one group, the whole world.
    """
    from deepspeed.utils import groups

    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; MoE layers with ep_size > 1 need a process group "
            "(run under Lightning/DeepSpeed, or call deepspeed.init_distributed() first)"
        )
    init_deepspeed_comm()
    rank = dist.get_rank()
    dp_groups = ([list(g) for g in data_parallel_groups] if data_parallel_groups
                 else [list(range(dist.get_world_size()))])
    all_ep: list[list[int]] = []
    if group_name not in groups._get_expert_parallel_group_dict():
        for dp_ranks in dp_groups:
            ep_groups, edp_groups = carve_expert_groups(dp_ranks, ep_size)
            all_ep += ep_groups
            for ranks in edp_groups:
                handle = new_group(ranks)
                if rank in ranks:
                    groups._EXPERT_DATA_PARALLEL_GROUP[group_name] = handle
                    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name] = ranks
            for ranks in ep_groups:
                handle = new_group(ranks)
                if rank in ranks:
                    groups._EXPERT_PARALLEL_GROUP[group_name] = handle
                    groups._EXPERT_PARALLEL_GROUP_RANKS[group_name] = ranks
    else:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, list(groups._get_expert_parallel_group_ranks(group_name)))
        all_ep = sorted({tuple(g) for g in gathered})  # type: ignore[arg-type]
    ep_ranks = list(groups._get_expert_parallel_group_ranks(group_name))
    key = tuple(ep_ranks)
    if key not in _TRANSFER_GROUPS:
        for ranks in all_ep:
            handle = new_group(list(ranks))
            if rank in ranks:
                _TRANSFER_GROUPS[tuple(ranks)] = handle
    return ExpertGroups(
        name=group_name,
        ep_group=groups._get_expert_parallel_group(group_name),
        ep_ranks=ep_ranks,
        edp_group=groups._get_expert_data_parallel_group(group_name),
        edp_ranks=list(groups._get_expert_data_parallel_group_ranks(group_name)),
        transfer_group=_TRANSFER_GROUPS[key],
    )


