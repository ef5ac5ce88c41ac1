from .config import QBARA_PEFT_TYPE, QBaRAConfig
from .layer import QBaRAExperts, QBaRALinear
from .model import QBARA_PREFIX, QBaRAModel

__all__ = ["QBARA_PEFT_TYPE", "QBARA_PREFIX", "QBaRAConfig", "QBaRALinear", "QBaRAExperts", "QBaRAModel"]
