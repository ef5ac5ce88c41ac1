"""The Q-BaRA tuner layers: a factored ``B A`` on pooled inputs, of a Linear or of every fused expert."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..base import PooledAdapterLayer
from ..pooled_experts import PooledExpertsLayer
from ..pooling import qbara_rank
from .config import QBaRAConfig


def qbara_factors(config: QBaRAConfig, in_features: int, out_features: int, lambda_in: int, lambda_out: int,
                  experts: tuple[int, ...] = ()) -> tuple[nn.Parameter, nn.Parameter]:
    """``A`` (Kaiming-uniform per matrix) and ``B = 0`` at the raised rank, with ``experts`` leading dimensions."""
    rank = qbara_rank(config.r, in_features, out_features, lambda_in, lambda_out)
    weight_a = torch.empty(*experts, rank, in_features // lambda_in)
    for matrix in weight_a.reshape(-1, rank, in_features // lambda_in):
        nn.init.kaiming_uniform_(matrix, a=math.sqrt(5))
    return nn.Parameter(weight_a), nn.Parameter(torch.zeros(*experts, out_features // lambda_out, rank))


class QBaRALinear(PooledAdapterLayer):
    """Q-BaRA around a linear base (float, bitsandbytes 4/8-bit or INT4)."""

    adapter_layer_names = ("qbara_A", "qbara_B")
    method_name = "Q-BaRA"

    def _create_adapter_weights(self, adapter_name: str, config: QBaRAConfig) -> None:
        self.qbara_A[adapter_name], self.qbara_B[adapter_name] = qbara_factors(
            config, self.in_features, self.out_features, self.lambda_in[adapter_name], self.lambda_out[adapter_name])

    def rank(self, adapter_name: str) -> int:
        """The raised rank r' of an adapter (``lambda * r`` when both lambdas agree)."""
        return self.qbara_A[adapter_name].shape[0]

    def pooled_matrix(self, adapter_name: str) -> torch.Tensor:
        return self.qbara_B[adapter_name] @ self.qbara_A[adapter_name]

    def pooled_product(self, adapter_name: str, pooled: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(pooled, self.qbara_A[adapter_name]), self.qbara_B[adapter_name])


class QBaRAExperts(PooledExpertsLayer):
    """Q-BaRA on a fused expert tensor: ``B_e A_e`` per expert, each at LoRA-``r``'s parameter count per expert."""

    adapter_layer_names = ("qbara_A", "qbara_B")
    method_name = "Q-BaRA"

    def _create_adapter_weights(self, adapter_name: str, config: QBaRAConfig) -> None:
        self.qbara_A[adapter_name], self.qbara_B[adapter_name] = qbara_factors(
            config, self.in_features, self.out_features, self.lambda_in[adapter_name], self.lambda_out[adapter_name],
            experts=(self.num_experts,))

    def pooled_matrix(self, adapter_name: str) -> torch.Tensor:
        return self.qbara_B[adapter_name] @ self.qbara_A[adapter_name]
