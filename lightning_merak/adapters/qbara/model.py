"""The Q-BaRA PEFT tuner."""

from __future__ import annotations

from ..base import PooledAdapterModel
from .layer import QBaRALinear

QBARA_PREFIX = "qbara_"


class QBaRAModel(PooledAdapterModel):
    prefix = QBARA_PREFIX
    tuner_layer_cls = QBaRALinear
    layer_cls = QBaRALinear
