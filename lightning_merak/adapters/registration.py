"""Register Q-BaRA and QA-HiRA with PEFT, without forking it.

``peft.register_peft_method`` only accepts names that are already ``PeftType`` members, so the
plain string keys go straight into PEFT's three lookup tables; this works because ``PeftType`` is a
``str`` enum and every lookup is a dict access by value (the route the spec prefers).
"""

from __future__ import annotations

from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_PREFIX_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils import PeftType

from .qahira import QAHIRA_PEFT_TYPE, QAHIRA_PREFIX, QAHiRAConfig, QAHiRAModel
from .qbara import QBARA_PEFT_TYPE, QBARA_PREFIX, QBaRAConfig, QBaRAModel

METHODS = (
    (QBARA_PEFT_TYPE, QBaRAConfig, QBaRAModel, QBARA_PREFIX),
    (QAHIRA_PEFT_TYPE, QAHiRAConfig, QAHiRAModel, QAHIRA_PREFIX),
)


def register_peft_methods() -> None:
    """Make ``QBARA`` and ``QAHIRA`` known to PEFT (idempotent; refuses to shadow a PEFT method)."""
    own_types = {peft_type for peft_type, *_ in METHODS}
    taken_prefixes = {prefix for key, prefix in PEFT_TYPE_TO_PREFIX_MAPPING.items() if key not in own_types}
    for peft_type, config_cls, model_cls, prefix in METHODS:
        if peft_type in PeftType.__members__:
            raise RuntimeError(f"PEFT now defines {peft_type} itself; lightning_merak's {peft_type} would shadow it")
        if prefix in taken_prefixes:
            raise RuntimeError(f"the parameter prefix {prefix!r} is already used by another PEFT method")
        PEFT_TYPE_TO_CONFIG_MAPPING[peft_type] = config_cls
        PEFT_TYPE_TO_TUNER_MAPPING[peft_type] = model_cls
        PEFT_TYPE_TO_PREFIX_MAPPING[peft_type] = prefix
