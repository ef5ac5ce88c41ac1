"""A checkpoint of Mixtral blocks swapped for DeepSpeed's MoE layer (``moe.experts=deepspeed``), read under Mixtral's
names for ``merak-export``.

The swap (:mod:`~lightning_merak.plugins.moe.block_replacement`) copies Mixtral's router ``gate.weight [E, H]`` to
the layer's gate ``moe.deepspeed_moe.gate.wg.weight`` and expert ``e``'s slices of the fused ``experts.gate_up_proj
[E, 2I, H]`` and ``experts.down_proj [E, H, I]`` to ``…deepspeed_experts.<e>.gate_up.weight`` and ``….down.weight``
unchanged; checkpoints number the experts globally. :class:`SwappedExpertsSource` presents those tensors as the
router and the stacked fused tensors again, so the export writes the transformers model the run started from.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["SwappedExpertsSource", "holds_swapped_experts"]

_SWAPPED = re.compile(r"^(?P<block>.+)\.moe\.deepspeed_moe\.(?:experts\.deepspeed_experts\.(?P<expert>\d+)\."
                      r"(?P<part>gate_up|down)|gate\.wg)\.weight$")
_FUSED = {"gate_up": "gate_up_proj", "down": "down_proj"}
"""A swapped expert's layer → the Mixtral fused tensor its weight is one expert's slice of."""


def holds_swapped_experts(keys: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor ``keys`` hold DeepSpeed-swapped Mixtral blocks."""
    return any(_SWAPPED.match(key) for key in keys)


class SwappedExpertsSource:
    """``source`` (a checkpoint's tensors read one at a time: ``entries`` and ``read``) with each swapped block's gate
    as Mixtral's ``<block>.gate.weight`` and its experts' weights as ``<block>.experts.gate_up_proj`` and
    ``<block>.experts.down_proj``, stacked in expert order when read."""

    def __init__(self, source: Any) -> None:
        self.source, self.path, self.metadata = source, source.path, source.metadata
        entries = dict(source.entries)
        self.renamed: dict[str, str] = {}
        self.stacked: dict[str, list[str]] = {}
        experts: dict[str, dict[int, str]] = {}
        for key in list(entries):
            match = _SWAPPED.match(key)
            if match is None:
                continue
            entry = entries.pop(key)
            if match["expert"] is None:
                self.renamed[f"{match['block']}.gate.weight"] = key
                entries[f"{match['block']}.gate.weight"] = entry
            else:
                experts.setdefault(f"{match['block']}.experts.{_FUSED[match['part']]}", {})[int(match["expert"])] = key
        for name, by_number in experts.items():
            if sorted(by_number) != list(range(len(by_number))):
                raise ValueError(f"{source.path} holds experts {sorted(by_number)} of {name}, not every expert from 0; "
                                 "the checkpoint is incomplete")
            keys = [by_number[number] for number in range(len(by_number))]
            shape, dtype = source.entries[keys[0]]
            entries[name] = ((len(keys), *shape), dtype)
            self.stacked[name] = keys
        self.entries = entries

    def read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` names: a fused expert tensor stacked from its experts, any other as stored."""
        if key in self.stacked:
            import torch

            return torch.stack([self.source.read(part) for part in self.stacked[key]])
        return self.source.read(self.renamed.get(key, key))
