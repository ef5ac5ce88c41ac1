"""Configuration of Q-BaRA (Q-BLoRA in v2 of arXiv 2407.17029)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import PooledAdapterConfig

QBARA_PEFT_TYPE = "QBARA"


@dataclass
class QBaRAConfig(PooledAdapterConfig):
    """Q-BaRA: ``y = W x + s * E_out(B A P_in(x))`` with the rank raised so parameters equal LoRA-``r``.

    With ``lambda_in == lambda_out == lambda`` the adapter rank is ``lambda * r``, and the parameter
    count and matmul FLOPs equal LoRA's with rank ``r`` on every layer. ``init="zero"`` draws ``A``
    Kaiming-uniform and sets ``B = 0`` so training starts from the base model.
    """

    method_name = "Q-BaRA"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = QBARA_PEFT_TYPE
