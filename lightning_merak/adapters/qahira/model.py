"""The QA-HiRA PEFT tuner."""

from __future__ import annotations

from ..base import PooledAdapterModel
from .layer import QAHiRALinear

QAHIRA_PREFIX = "qahira_"


class QAHiRAModel(PooledAdapterModel):
    prefix = QAHIRA_PREFIX
    tuner_layer_cls = QAHiRALinear
    layer_cls = QAHiRALinear
