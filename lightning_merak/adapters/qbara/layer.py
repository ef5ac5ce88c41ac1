"""The Q-BaRA tuner layer: a factored ``B A`` on pooled inputs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..base import PooledAdapterLayer
from ..pooling import qbara_rank
from .config import QBaRAConfig


class QBaRALinear(PooledAdapterLayer):
    """Q-BaRA around a linear base (float, bitsandbytes 4/8-bit or INT4)."""

    adapter_layer_names = ("qbara_A", "qbara_B")
    method_name = "Q-BaRA"

    def _create_adapter_weights(self, adapter_name: str, config: QBaRAConfig) -> None:
        lambda_in, lambda_out = self.lambda_in[adapter_name], self.lambda_out[adapter_name]
        rank = qbara_rank(config.r, self.in_features, self.out_features, lambda_in, lambda_out)
        weight_a = torch.empty(rank, self.in_features // lambda_in)
        nn.init.kaiming_uniform_(weight_a, a=math.sqrt(5))
        self.qbara_A[adapter_name] = nn.Parameter(weight_a)
        self.qbara_B[adapter_name] = nn.Parameter(torch.zeros(self.out_features // lambda_out, rank))

    def rank(self, adapter_name: str) -> int:
        """The raised rank r' of an adapter (``lambda * r`` when both lambdas agree)."""
        return self.qbara_A[adapter_name].shape[0]

    def pooled_matrix(self, adapter_name: str) -> torch.Tensor:
        return self.qbara_B[adapter_name] @ self.qbara_A[adapter_name]

    def pooled_product(self, adapter_name: str, pooled: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(pooled, self.qbara_A[adapter_name]), self.qbara_B[adapter_name])
