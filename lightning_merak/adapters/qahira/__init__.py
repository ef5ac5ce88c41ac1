from .config import QAHIRA_PEFT_TYPE, QAHiRAConfig
from .layer import QAHiRAExperts, QAHiRALinear
from .model import QAHIRA_PREFIX, QAHiRAModel

__all__ = ["QAHIRA_PEFT_TYPE", "QAHIRA_PREFIX", "QAHiRAConfig", "QAHiRALinear", "QAHiRAExperts", "QAHiRAModel"]
