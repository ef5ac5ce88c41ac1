"""The Q-BaRA PEFT tuner."""

from __future__ import annotations

from ..base import PooledAdapterModel
from .layer import QBaRAExperts, QBaRALinear

QBARA_PREFIX = "qbara_"


class QBaRAModel(PooledAdapterModel):
    prefix = QBARA_PREFIX
    tuner_layer_cls = (QBaRALinear, QBaRAExperts)  # type: ignore[assignment]  # isinstance takes both
    layer_cls = QBaRALinear
    experts_layer_cls = QBaRAExperts
