"""Configuration of QA-HiRA (QA-BLoRA in v2 of arXiv 2407.17029)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import PooledAdapterConfig

QAHIRA_PEFT_TYPE = "QAHIRA"


@dataclass
class QAHiRAConfig(PooledAdapterConfig):
    """QA-HiRA: ``y = W x + s * E_out(H P_in(x))`` with one high-rank matrix ``H``.

    Parameters per layer: ``d_in * d_out / (lambda_in * lambda_out)``. On an INT4 base, ``lambda_in``
    must be a multiple of the quantization group size so the merge is an exact zero-point shift
    (``lambda_in = group_size`` is the natural choice). ``init="zero"`` starts from the base model;
    ``init="kaiming"`` reproduces the authors' code, which perturbs the model at step 0.
    """

    lambda_in: int = 32
    lambda_out: int = 1
    method_name = "QA-HiRA"
    init_choices = ("zero", "kaiming")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.peft_type = QAHIRA_PEFT_TYPE
