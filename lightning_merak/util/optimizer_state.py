"""A saved optimizer state in either of the formats a checkpoint holds (pure: plain dicts).

torch's ``state_dict`` numbers one ``state`` by the optimizer's parameter order; a composite optimizer
(:class:`~lightning_merak.modules.muon.MuonWithAdamW`) saves ``{"parts": [...]}``, each part torch's own, numbered
from 0, its groups after the parts before it in the composite's ``param_groups``. Code that reads or rewrites
entries by parameter position goes through :func:`entry_slots`, so both formats read alike.
"""

from __future__ import annotations

from typing import Any

__all__ = ["entry_slots", "joined_parts", "state_parts"]


def state_parts(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """``saved``'s parts, each in torch's format: a composite's, else ``saved`` itself as the one part."""
    return saved["parts"] if "parts" in saved else [saved]


def entry_slots(saved: dict[str, Any]) -> dict[int, tuple[dict[Any, Any], Any]]:
    """Where each parameter's entry of ``saved`` lives, by the parameter's position in the optimizer's
    ``param_groups``: ``(state dict, key)`` (the entry may be absent: a parameter not stepped yet)."""
    slots: dict[int, tuple[dict[Any, Any], Any]] = {}
    for part in state_parts(saved):
        state = part.setdefault("state", {})
        for group in part["param_groups"]:
            for key in group["params"]:
                slots[len(slots)] = (state, key)
    return slots


def joined_parts(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` in torch's format: a composite's as one state over all the parts' groups in order, each part's
    entries numbered after the parts before it; torch's own unchanged."""
    if "parts" not in saved:
        return saved
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    first = 0
    for part in state_parts(saved):
        state.update({first + index: entry for index, entry in part["state"].items()})
        groups.extend({**group, "params": [first + index for index in group["params"]]}
                      for group in part["param_groups"])
        first += sum(len(group["params"]) for group in part["param_groups"])
    return {"state": state, "param_groups": groups}
