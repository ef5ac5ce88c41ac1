"""Checkpoints that keep every rank's experts: global expert numbering on save, local on load.

Each EP rank holds ``experts_per_rank`` experts numbered from 0, so a checkpoint written by
one rank alone would keep only its experts. On save the local experts of a layer are
gathered over its EP group and stored under their global numbers (expert ``e`` of EP rank
``r`` becomes ``r · experts_per_rank + e``), which also makes the checkpoint loadable with
another EP size. On load each rank keeps its own slice and renumbers it from 0. A state
numbered locally (DeepSpeed's own engine checkpoints load that way) passes through untouched.
Expert optimizer state is per rank too: it is gathered per parameter index and each rank
takes back its EP rank's entries.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["EXPERTS_KEY", "expert_indices", "expert_param_positions", "gather_expert_state", "select_local_experts",
           "split_expert_key"]

EXPERTS_KEY = "deepspeed_moe.experts.deepspeed_experts."


def split_expert_key(key: str, prefix: str) -> tuple[int, str] | None:
    """``(expert number, rest of the key)`` of a key under ``prefix``, or None for any other key."""
    if not key.startswith(prefix):
        return None
    match = re.match(r"(\d+)\.(.+)", key[len(prefix):])
    return (int(match.group(1)), match.group(2)) if match else None


def expert_indices(state_dict: dict[str, Any], prefix: str) -> list[int]:
    """The expert numbers present under ``prefix`` (``<module>.deepspeed_moe.experts.deepspeed_experts.``)."""
    return sorted({found[0] for key in state_dict if (found := split_expert_key(key, prefix)) is not None})


def select_local_experts(
    state_dict: dict[str, Any], prefix: str, ep_rank: int, experts_per_rank: int, num_experts: int
) -> bool:
    """Keep EP rank ``ep_rank``'s experts of a globally numbered state, renumbered from 0 (in place).

    Returns False (and changes nothing) for a state already numbered locally; raises on a
    state holding another count of experts than either.
    """
    present = expert_indices(state_dict, prefix)
    if not present or present == list(range(experts_per_rank)):
        return False
    if present != list(range(num_experts)):
        raise ValueError(
            f"checkpoint holds experts {present} under {prefix!r}, but this layer expects either all {num_experts} "
            f"(a gathered checkpoint) or its {experts_per_rank} local ones; was it saved with another num_experts?"
        )
    first = ep_rank * experts_per_rank
    for key in [k for k in state_dict if split_expert_key(k, prefix) is not None]:
        index, rest = split_expert_key(key, prefix)  # type: ignore[misc]
        value = state_dict.pop(key)
        if first <= index < first + experts_per_rank:
            state_dict[f"{prefix}{index - first}.{rest}"] = value
    return True


def gather_expert_state(
    state_dict: dict[str, Any], prefix: str, experts_per_rank: int, ep_size: int, group: Any
) -> None:
    """Replace the local expert entries under ``prefix`` by every EP rank's, globally numbered (collective)."""
    local_keys = [key for key in state_dict if split_expert_key(key, prefix) is not None]
    present = expert_indices(state_dict, prefix)
    if present != list(range(experts_per_rank)):
        raise ValueError(f"expected local experts 0..{experts_per_rank - 1} under {prefix!r}, found {present}")
    for key in local_keys:
        index, rest = split_expert_key(key, prefix)  # type: ignore[misc]
        local = state_dict.pop(key).detach().contiguous()
        pieces = [torch.empty_like(local) for _ in range(ep_size)]
        dist.all_gather(pieces, local, group=group)
        for rank, piece in enumerate(pieces):
            state_dict[f"{prefix}{rank * experts_per_rank + index}.{rest}"] = piece


def expert_param_positions(param_groups: Sequence[dict[str, Any]]) -> list[int]:
    """Positions (optimizer state-dict indices) of expert parameters (``allreduce=False``)."""
    params = [p for group in param_groups for p in group["params"]]
    return [i for i, p in enumerate(params) if getattr(p, "allreduce", True) is False]
