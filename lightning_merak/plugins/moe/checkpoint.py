"""Checkpoints that keep every rank's experts: global expert numbering on save, local on load.

Each EP rank holds ``experts_per_rank`` experts numbered from 0, so a checkpoint written by
one rank alone would keep only its experts. On save the local experts of a layer are
gathered over its EP group and stored under their global numbers (expert ``e`` of EP rank
``r`` becomes ``r · experts_per_rank + e``), which also makes the checkpoint loadable with
another EP size. On load each rank keeps its own slice and renumbers it from 0. A state
numbered locally (DeepSpeed's own engine checkpoints load that way) passes through untouched.
Expert optimizer state is per rank too: it is gathered per parameter index and each rank
takes back its EP rank's entries.

A strategy whose checkpoints are keyed by parameter name (merak3d's sharded checkpointer)
renames instead of gathering: :class:`ExpertNumbering` turns a local expert number in a name
into the global one and back, so the strategy needs to know nothing of MoE key formats.
``merak_ep``'s fused expert tensors keep their name and change shape instead: :class:`FusedExpertSlices`
presents each rank's ``[E/ep, ...]`` as its slice of the ``[E, ...]`` whole.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.plugins.moe.experts.grouped import EXPERT_TENSORS
from lightning_merak.plugins.moe.experts.parallel import SHARD_ATTRIBUTE
from lightning_merak.plugins.moe.groups import carve_expert_groups
from lightning_merak.protocols.experts import ExpertParallelLayer
from lightning_merak.util.optimizer_state import entry_slots

__all__ = ["EXPERTS_KEY", "ExpertNumbering", "FusedExpertSlices", "expert_indices", "expert_param_positions",
           "gather_expert_state", "select_local_experts", "slice_entries", "split_expert_key"]

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


def slice_entries(saved: dict[str, Any], names: Sequence[str], sliced: Callable[[str, torch.Tensor], torch.Tensor]
                  ) -> None:
    """Each tensor of a saved optimizer state's entries replaced in place by ``sliced(name, tensor)``, ``names`` the
    parameters' names by their position in the optimizer (:func:`~lightning_merak.util.optimizer_state.entry_slots`)."""
    for position, (entries, key) in entry_slots(saved).items():
        if key in entries:
            name = names[position] if position < len(names) else ""
            entries[key] = {field: sliced(name, value) if isinstance(value, torch.Tensor) else value
                            for field, value in entries[key].items()}


DataParallelRanks = Callable[[], tuple[int, Sequence[int]]]
"""``() -> (this rank, the global ranks of its data-parallel group)``; expert groups are carved from them."""


class ExpertNumbering:
    """Expert numbers in parameter names: local (each EP rank numbers its experts from 0) ↔ global.

    Args:
        layers: the key prefix of each expert-parallel layer's experts → ``(ep_size, experts per rank)``.
        data_parallel_ranks: where this rank sits, asked only when a name is renumbered (it may raise
            while the layout is not known yet).
    """

    def __init__(self, layers: dict[str, tuple[int, int]], data_parallel_ranks: DataParallelRanks) -> None:
        self.layers = layers
        self._data_parallel_ranks = data_parallel_ranks

    @classmethod
    def of(cls, model: nn.Module, data_parallel_ranks: DataParallelRanks) -> ExpertNumbering:
        """The numbering of ``model``'s expert-parallel layers (read on the unsplit model, before pruning)."""
        layers = {
            f"{name}.{module.local_experts_key}": (module.ep_size, module.num_local_experts)
            for name, module in model.named_modules() if isinstance(module, ExpertParallelLayer) and module.ep_size > 1
        }
        return cls(layers, data_parallel_ranks)

    def _expert_rank(self, ep_size: int) -> int:
        """This rank's place in its expert-parallel group, carved from its data-parallel ranks as the layers do."""
        rank, data_parallel_ranks = self._data_parallel_ranks()
        ep_groups, _ = carve_expert_groups(data_parallel_ranks, ep_size)
        return next(group.index(rank) for group in ep_groups if rank in group)

    def renamed(self, name: str, to_global: bool) -> str:
        """``name`` with an expert's local number made global, or (``to_global=False``) a global number of this
        rank's expert made local again; other names unchanged."""
        for prefix, (ep_size, per_rank) in self.layers.items():
            found = split_expert_key(name, prefix)
            if found is not None:
                number, rest = found
                first = self._expert_rank(ep_size) * per_rank
                return f"{prefix}{number + first if to_global else number - first}.{rest}"
        return name


class FusedExpertSlices:
    """``merak_ep``'s fused expert tensors (``[E/ep, ...]`` on each rank) seen as slices of their ``[E, ...]`` whole.

    A tensor is wrapped as a DTensor sharded on dim 0 over its expert group, so torch distributed checkpoint writes
    each expert group's slice at its global offset under the unsplit name (the ranks holding the same slice in
    other expert groups once: DCP drops duplicate chunks) and reads back whatever slice another layout holds — its
    resharding, rather than a file format of our own. Optimizer state shaped like an expert tensor is sliced the
    same way.

    Args:
        shards: unsplit name of each fused expert tensor → the ``ExpertShard`` of its experts module.
    """

    def __init__(self, shards: dict[str, Any]) -> None:
        self.shards = shards
        self._meshes: dict[int, Any] = {}

    @classmethod
    def of(cls, model: nn.Module) -> FusedExpertSlices:
        """The fused expert tensors of ``model`` (unsplit, experts already cut by ``enable_expert_parallel``)."""
        shards = {}
        for name, module in model.named_modules():
            shard = getattr(module, SHARD_ATTRIBUTE, None)
            if shard is None:
                continue
            for tensor in EXPERT_TENSORS:
                if isinstance(getattr(module, tensor, None), torch.Tensor):
                    shards[f"{name}.{tensor}" if name else tensor] = shard
        return cls(shards)

    def __contains__(self, name: str) -> bool:
        return name in self.shards

    def _mesh(self, shard: Any, device_type: str) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        group = dist.group.WORLD if shard.group is None else shard.group  # DDP's callback: None is the world
        key = id(group)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(group, device_type)
        return self._meshes[key]

    def _split_shard(self, name: str, local: torch.Tensor) -> Any:
        """The ``ExpertShard`` ``local`` is this rank's slice of (shaped like its local experts, more than one
        expert group), else ``None``."""
        shard = self.shards.get(name)
        if shard is None or shard.ep_size == 1 or local.ndim == 0 or local.shape[0] != len(shard.experts):
            return None
        return shard

    def global_view(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` (this rank's experts of ``name``, or optimizer state shaped so) as a slice of the whole;
        unchanged for any other tensor and where one rank holds every expert."""
        shard = self._split_shard(name, local)
        if shard is None:
            return local
        from torch.distributed.tensor import DTensor, Shard

        whole = (shard.num_experts, *local.shape[1:])
        stride = torch.empty(whole, device="meta").stride()
        return DTensor.from_local(local, self._mesh(shard, local.device.type), [Shard(0)], run_check=False,
                                  shape=whole, stride=stride)

    def read_target(self, name: str, saved_shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        """Where a saved ``[E, ...]`` tensor of ``name`` is read to: ``like`` (this rank's slice shape) seen as a
        slice of the whole; ``like`` unchanged for any other tensor."""
        shard = self.shards.get(name)
        if shard is None or len(saved_shape) == 0 or saved_shape[0] != shard.num_experts:
            return like
        if tuple(like.shape) == tuple(saved_shape):  # one rank holds every expert
            return like
        return self.global_view(name, like)

    # Whole tensors, for strategies that write one file from rank 0 (Lightning's DDP) --------------------------

    def gathered(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """``local`` gathered over its expert group into its ``[E, ...]`` whole (collective over that group)."""
        shard = self._split_shard(name, local)
        if shard is None:
            return local
        pieces = [torch.empty_like(local) for _ in range(shard.ep_size)]
        dist.all_gather(pieces, local.detach().contiguous(), group=shard.group)
        return torch.cat(pieces)

    def sliced(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a saved ``[E, ...]`` tensor of ``name``; any other tensor unchanged."""
        shard = self.shards.get(name)
        if shard is None or whole.ndim == 0 or whole.shape[0] != shard.num_experts or shard.ep_size == 1:
            return whole
        return whole[shard.experts.start:shard.experts.stop].clone()

    def whole_checkpoint(self, checkpoint: dict[str, Any], module: nn.Module,
                         optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Every fused expert tensor of a Lightning checkpoint of ``module`` (these slices keyed by its names) and
        its optimizer state made whole, in place, on every rank (collective): rank 0's file then holds every
        expert, at any ``ep``."""
        state = checkpoint.get("state_dict", {})
        for key in list(state):
            state[key] = self.gathered(key, state[key])
        names = {id(param): name for name, param in module.named_parameters()}
        for optimizer, saved in zip(optimizers, checkpoint.get("optimizer_states", [])):
            params = [param for group in optimizer.param_groups for param in group["params"]]
            for position, (entries, key) in entry_slots(saved).items():
                if key in entries:
                    name = names.get(id(params[position]), "")
                    entries[key] = {field: self.gathered(name, value) if isinstance(value, torch.Tensor) else value
                                    for field, value in entries[key].items()}

    def local_checkpoint(self, checkpoint: dict[str, Any], module: nn.Module) -> None:
        """The inverse of :meth:`whole_checkpoint` on load, in place: this rank's experts of each whole tensor.
        Optimizer state is matched by the parameters' order in ``module`` (an optimizer over its parameters)."""
        state = checkpoint.get("state_dict", {})
        for key in list(state):
            state[key] = self.sliced(key, state[key])
        names = [name for name, _ in module.named_parameters()]
        for saved in checkpoint.get("optimizer_states", []):
            slice_entries(saved, names, self.sliced)
