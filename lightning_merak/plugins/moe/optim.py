"""Optimizer parameter groups for models with MoE layers, as DeepSpeed's ZeRO-1/2 expects them.

ZeRO partitions and reduces each parameter group over one process group. Expert
parameters (``allreduce=False``, with a ``group_name``) must sit in their own groups marked
``moe=True`` so that ZeRO reduces them over their expert-data-parallel group instead of the
whole data-parallel group; the engine refuses a model with MoE layers otherwise.
"""

from __future__ import annotations

from typing import Any, Iterable, Union

from torch import nn

__all__ = ["moe_param_groups"]

ParamGroups = Union[nn.Module, Iterable[nn.Parameter], Iterable[dict[str, Any]]]


def moe_param_groups(params: ParamGroups, **group_options: Any) -> list[dict[str, Any]]:
    """Split ``params`` (a module, parameters or param-group dicts) into dense and per-expert-group groups.

    ``group_options`` (lr, weight_decay, ...) apply to groups given without them. Frozen
    parameters are left out, as an optimizer would never step them.
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    if isinstance(params, nn.Module):
        params = params.parameters()
    items = list(params)
    if not items:
        raise ValueError("moe_param_groups got no parameters; pass the model or its parameter groups")
    if all(isinstance(item, dict) for item in items):
        groups = [{**group_options, **item} for item in items]
    elif any(isinstance(item, dict) for item in items):
        raise ValueError("moe_param_groups got a mix of parameters and param-group dicts; pass one kind")
    else:
        groups = [{**group_options, "params": items}]
    for index, group in enumerate(groups):
        group["params"] = [p for p in group["params"] if p.requires_grad]
        group.setdefault("name", f"dense{index}" if len(groups) > 1 else "dense")
    split = split_params_into_different_moe_groups_for_optimizer(groups)
    return [group for group in split if group["params"]]
