"""Pure-torch math shared by Q-BaRA and QA-HiRA: pooling, expansion and the dense update.

Both adapters compute ``y = s * E_out(M @ P_in(x))`` where ``P_in`` averages consecutive groups of
``lambda_in`` inputs, ``M`` is ``B @ A`` (Q-BaRA) or ``H`` (QA-HiRA) and ``E_out`` repeats every
output ``lambda_out`` times. Everything merge-related is derived from that forward pass here, so the
PEFT glue never re-implements it.
"""

from __future__ import annotations

import torch


def pool_inputs(x: torch.Tensor, lambda_in: int) -> torch.Tensor:
    """Mean over consecutive groups of ``lambda_in`` features of the last dimension (any input rank)."""
    if lambda_in == 1:
        return x
    *leading, features = x.shape
    return x.reshape(*leading, features // lambda_in, lambda_in).mean(dim=-1)


def expand_outputs(y: torch.Tensor, lambda_out: int) -> torch.Tensor:
    """Repeat each feature of the last dimension ``lambda_out`` times consecutively."""
    if lambda_out == 1:
        return y
    *leading, features = y.shape
    return y.unsqueeze(-1).expand(*leading, features, lambda_out).reshape(*leading, features * lambda_out)


def tiled_delta_weight(pooled_matrix: torch.Tensor, lambda_in: int, lambda_out: int, scaling: float) -> torch.Tensor:
    """The dense ``(d_out, d_in)`` update equivalent to the pooled adapter.

    ``delta[o, i] = scaling / lambda_in * M[o // lambda_out, i // lambda_in]``: the ``1/lambda_in``
    comes from the pool being a mean. Leading dimensions are batch dimensions (one ``M`` per fused expert).
    """
    factor = scaling / lambda_in
    return factor * pooled_matrix.repeat_interleave(lambda_out, dim=-2).repeat_interleave(lambda_in, dim=-1)


def per_group_delta(
    pooled_matrix: torch.Tensor, lambda_in: int, lambda_out: int, scaling: float, group_size: int
) -> torch.Tensor:
    """The constant the update adds to every quantization group of ``group_size`` inputs, ``(d_out, d_in/G)``.

    Leading dimensions of ``pooled_matrix`` are batch dimensions (one ``M`` per fused expert). Only defined
    when every group lies inside one tile of the update (``lambda_in % group_size == 0``).
    """
    if lambda_in % group_size != 0:
        raise ValueError(
            f"lambda_in={lambda_in} is not a multiple of the quantization group size {group_size}: "
            "a group would straddle two adapter tiles and no zero-point shift can represent the update"
        )
    factor = scaling / lambda_in
    groups_per_tile = lambda_in // group_size
    return factor * pooled_matrix.repeat_interleave(lambda_out, dim=-2).repeat_interleave(groups_per_tile, dim=-1)


def qbara_rank(r: int, in_features: int, out_features: int, lambda_in: int, lambda_out: int) -> int:
    """The raised rank r' giving Q-BaRA LoRA-r's parameter count: exactly ``lambda * r`` when both lambdas agree."""
    lora_parameters = r * (in_features + out_features)
    per_rank = in_features // lambda_in + out_features // lambda_out
    return max(1, round(lora_parameters / per_rank))
