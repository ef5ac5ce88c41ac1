"""The QA-HiRA tuner layers: one matrix ``H`` on pooled inputs, of a Linear or of every fused expert."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..base import PooledAdapterLayer
from ..pooled_experts import PooledExpertsLayer
from .config import QAHiRAConfig


class QAHiRALinear(PooledAdapterLayer):
    """QA-HiRA around a linear base; on INT4 bases the pooling must align with the quantization groups."""

    adapter_layer_names = ("qahira_H",)
    method_name = "QA-HiRA"
    requires_group_alignment = True

    def _create_adapter_weights(self, adapter_name: str, config: QAHiRAConfig) -> None:
        shape = (self.out_features // self.lambda_out[adapter_name], self.in_features // self.lambda_in[adapter_name])
        weight = torch.zeros(shape)
        if config.init == "kaiming":
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        self.qahira_H[adapter_name] = nn.Parameter(weight)

    def pooled_matrix(self, adapter_name: str) -> torch.Tensor:
        return self.qahira_H[adapter_name]

    def pooled_product(self, adapter_name: str, pooled: torch.Tensor) -> torch.Tensor:
        return F.linear(pooled, self.qahira_H[adapter_name])


class QAHiRAExperts(PooledExpertsLayer):
    """QA-HiRA on a fused expert tensor: one ``H_e`` per expert; on INT4 experts the pooling must align with the
    quantization groups so the merge is an exact zero-point shift."""

    adapter_layer_names = ("qahira_H",)
    method_name = "QA-HiRA"
    requires_group_alignment = True

    def _create_adapter_weights(self, adapter_name: str, config: QAHiRAConfig) -> None:
        shape = (self.out_features // self.lambda_out[adapter_name], self.in_features // self.lambda_in[adapter_name])
        weight = torch.zeros(self.num_experts, *shape)
        if config.init == "kaiming":
            for expert in weight:
                nn.init.kaiming_uniform_(expert, a=math.sqrt(5))
        self.qahira_H[adapter_name] = nn.Parameter(weight)

    def pooled_matrix(self, adapter_name: str) -> torch.Tensor:
        return self.qahira_H[adapter_name]
