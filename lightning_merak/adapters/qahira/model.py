"""The QA-HiRA PEFT tuner."""

from __future__ import annotations

from ..base import PooledAdapterModel
from .layer import QAHiRAExperts, QAHiRALinear

QAHIRA_PREFIX = "qahira_"


class QAHiRAModel(PooledAdapterModel):
    prefix = QAHIRA_PREFIX
    tuner_layer_cls = (QAHiRALinear, QAHiRAExperts)  # type: ignore[assignment]  # isinstance takes both
    layer_cls = QAHiRALinear
    experts_layer_cls = QAHiRAExperts
