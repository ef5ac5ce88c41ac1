"""The settings every node of a run must share, and the message when one node's differ.

Why: each node composes its own configuration from its own command line. A node started with another
``data.seed`` trained another generated language to the end with status 0; one with another ``data.vocab_size``
died in gloo's "Received data size doesn't match expected size", which names no setting. The checked rendezvous
(:mod:`lightning_merak.cli.elastic`) compares each rank's :func:`run_settings` with rank 0's before the process
group exists, and every rank refuses with :func:`describe_differences`.

Pure: flattening and comparing plain values; :func:`run_settings` alone reads a configuration object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import OmegaConf

__all__ = ["PER_NODE_KEYS", "SettingsDiffer", "comparable_settings", "describe_differences", "run_settings",
           "setting_differences"]

PER_NODE_KEYS = frozenset({"output_dir"})
"""Settings a node may legitimately set on its own: where its files go (Hydra's run directory, by default a
timestamp that differs between nodes). Which node a process is (``NODE_RANK``) is not a setting."""


class SettingsDiffer(ValueError):
    """Ranks were started with different settings; the message names the keys and each side's value."""


def comparable_settings(resolved: Mapping[str, Any]) -> dict[str, Any]:
    """``resolved`` (a resolved configuration as plain values) flattened to dotted keys, without
    :data:`PER_NODE_KEYS`, and with each per-node value written as its key where another value embeds it (a
    logger's ``save_dir: ${output_dir}``); lists stay whole values."""
    flat = _flatten(resolved, "")
    per_node = {key: flat.pop(key) for key in PER_NODE_KEYS if key in flat}
    for key, value in flat.items():
        for name, node_value in per_node.items():
            if isinstance(value, str) and isinstance(node_value, str) and node_value:
                value = value.replace(node_value, f"<{name}>")
        flat[key] = value
    return flat


def _flatten(resolved: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in resolved.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def setting_differences(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[list[Any]]:
    """``[key, my value, their value]`` for every key whose values differ (a key one side lacks: ``None``)."""
    return [[key, mine.get(key), theirs.get(key)] for key in sorted(set(mine) | set(theirs))
            if mine.get(key) != theirs.get(key) or (key in mine) != (key in theirs)]


def describe_differences(differing: Mapping[str, list[list[Any]]]) -> str:
    """The refusal every rank prints: per differing rank (``where`` it runs), each key with its value there and on
    rank 0."""
    lines = ["the nodes were started with different settings, so they would train different runs:"]
    for where, differences in sorted(differing.items()):
        for key, theirs, rank0 in differences:
            lines.append(f"  {key}: {theirs!r} on {where}, {rank0!r} on rank 0")
    lines.append("Start every node with the same command line (only NODE_RANK, and hydra.run.dir if each node "
                 "writes its own files, may differ); see docs/guides/multi-node.md")
    return "\n".join(lines)


def run_settings(config: Any) -> dict[str, Any]:
    """A ``merak-train`` configuration (a structured ``TrainConfig``) resolved, as :func:`comparable_settings`."""
    resolved = OmegaConf.to_container(OmegaConf.structured(config), resolve=True, enum_to_str=True)
    assert isinstance(resolved, dict)
    return comparable_settings({str(key): value for key, value in resolved.items()})
