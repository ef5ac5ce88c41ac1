"""Lightning's model summary with a FLOP count that means something for a language model.

Lightning counts FLOPs by running ``example_input_array`` through the model and prints "0 Total Flops" when the
module has none (the usual case, and impossible once merak3d has cut the model into stages). :class:`ModelSummary`
prints the table without that line (and the column of zeros) and, for a model whose config
:mod:`~lightning_merak.planning.flops` can count, the training FLOPs of one token at the run's sequence length
instead.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_summary import get_human_readable_count

from lightning_merak.planning.flops import frozen_weight_fraction, training_flops_per_token, transformer_shape

__all__ = ["ModelSummary"]

_TOTAL_FLOPS_LINE = "Total Flops"


class ModelSummary(LightningModelSummary):
    """Lightning's ``ModelSummary`` (same ``max_depth``), with ``Training FLOPs per token at seq_len tokens`` (from
    ``pl_module.model.config``; forward and backward, attention included, frozen weights' gradients left out) in
    place of a zero "Total Flops"; a model the count does not know gets a warning saying why, and no line.

    ``seq_len``: the tokens per sample the count assumes (``None``: the line is left out).
    """

    def __init__(self, max_depth: int = 1, seq_len: Optional[int] = None, **summarize_kwargs: Any) -> None:
        if seq_len is not None and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
            raise ValueError(f"seq_len must be at least 1 (an integer: tokens per sample), or None to leave the "
                             f"FLOPs line out; got {seq_len!r}")
        if not isinstance(max_depth, int) or isinstance(max_depth, bool) or max_depth < -1:
            raise ValueError(f"max_depth={max_depth!r} must be an integer >= -1 (-1: every layer, 0: no summary)")
        super().__init__(max_depth=max_depth, **summarize_kwargs)
        self.seq_len = seq_len
        self._flops_line = ""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        config = getattr(getattr(pl_module, "model", None), "config", None)
        self._flops_line = ""
        if self.seq_len is not None and config is not None:
            try:
                flops = training_flops_per_token(transformer_shape(config), self.seq_len,
                                                 frozen_weight_fraction(pl_module))
            except ValueError as error:
                flops = None  # a model the count does not know: no line rather than a wrong one
                rank_zero_warn(f"ModelSummary prints no training FLOPs per token: {error}")
            if flops is not None:
                self._flops_line = f"{get_human_readable_count(int(flops)):<10}Training FLOPs per token at " \
                                   f"{self.seq_len} tokens"
        super().on_fit_start(trainer, pl_module)

    def summarize(self, summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        if total_flops:
            LightningModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                            total_training_modes, total_flops, **summarize_kwargs)
            return
        summary_data = [column for column in summary_data if column[0] != "FLOPs"]  # zeros, as the total
        captured: list[str] = []
        lightning_log = logging.getLogger(LightningModelSummary.__module__)
        capture = _Capture(captured)
        lightning_log.addFilter(capture)
        try:
            LightningModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                            total_training_modes, total_flops, **summarize_kwargs)
        finally:
            lightning_log.removeFilter(capture)
        for table in captured:
            lines = [line for line in table.split("\n") if not line.rstrip().endswith(_TOTAL_FLOPS_LINE)]
            if self._flops_line:
                lines.append(self._flops_line)
            lightning_log.info("\n".join(lines))  # where Lightning's own summary goes


class _Capture(logging.Filter):
    """Takes Lightning's summary table out of its log (to print it without the zero line)."""

    def __init__(self, captured: list[str]) -> None:
        super().__init__()
        self.captured = captured

    def filter(self, record: logging.LogRecord) -> bool:
        self.captured.append(record.getMessage())
        return False
