"""``strategy.micro_batching``: what merak3d does with variable-length global batches (plain Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

__all__ = ["MODES", "MicroBatching", "check_packing_attention"]

MODES = ("none", "pad", "pack", "dynamic")
DEFAULT_TOKENS = 4096


@dataclass(frozen=True)
class MicroBatching:
    """``mode``; ``tokens``: the padded tokens one micro-batch may hold (dynamic's memory limit, pack's row
    length; default 4096, at least the longest sample); ``cost``: ``(per_token, per_token², per_micro_batch)``
    seconds for dynamic's planner (default: FLOP ratios of the model's shape)."""

    mode: str = "none"
    tokens: Optional[int] = None
    cost: Optional[tuple[float, float, float]] = None
    context_rounds: bool = False
    """Whether the global batches run as rounds of per-sample context-parallel degrees instead
    (``context_parallel_degree='per_micro_batch'``, at one pipeline stage)."""

    @classmethod
    def of(cls, mode: str, tokens: Optional[int], cost: Optional[Sequence[float]], *, pipeline_parallel: Any,
           tp_overlap: Any, schedule: str, multi_stage_schedules: Sequence[str],
           context_rounds: bool = False) -> "MicroBatching":
        """Checked options, refused with the fix before any process starts."""
        if mode not in MODES:
            raise ValueError(f"micro_batching={mode!r}; choose one of {', '.join(MODES)}")
        if tokens is not None and (not isinstance(tokens, int) or tokens < 8):
            raise ValueError(f"micro_batch_tokens={tokens!r} must be an integer of at least 8")
        if cost is not None:
            cost = tuple(float(value) for value in cost)
            if len(cost) != 3 or min(cost) < 0:
                raise ValueError(f"micro_batching_cost={cost!r} must be three non-negative seconds: "
                                 "[per token, per token², per micro-batch]")
        if mode != "none":
            if pipeline_parallel == 1:
                raise ValueError(f"micro_batching={mode} runs its micro-batches through the pipeline schedule; set "
                                 "strategy.pipeline_parallel>=2 (or micro_batching=none)")
            if tp_overlap != 1:
                raise ValueError(f"micro_batching={mode} makes micro-batches of any sample count, which tp_overlap "
                                 "sub-batches cannot split; set strategy.tp_overlap=1")
            if schedule in multi_stage_schedules:
                raise ValueError(f"micro_batching={mode} needs one stage per rank; use schedule=1f1b, gpipe or "
                                 f"shifted_critical_path instead of {schedule}")
        return cls(mode, tokens, cost, context_rounds)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def packs(self) -> bool:
        """Whether a row may hold several samples (documents kept apart by restarting positions)."""
        return self.mode == "pack"

    @property
    def consumes_global_batches(self) -> bool:
        """Whether the strategy reads variable-length global batches (pipelined micro-batches or context rounds)."""
        return self.enabled or self.context_rounds

    def token_limit(self, longest: int) -> int:
        """The tokens a micro-batch may hold: the option (or the default), but never below one longest sample."""
        return max(self.tokens or DEFAULT_TOKENS, longest)


def check_packing_attention(config: Any) -> None:
    """Refuse packed rows for a model whose blocks would not keep their documents apart between pipeline stages:
    transformers builds the mask from the restarting position ids, and sdpa and flash attention skip it on a plain
    causal batch, so the traced stages would carry none (context parallelism keeps documents itself)."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in (None, "eager"):
        raise ValueError(f"micro_batching=pack needs a model whose blocks take an attention mask on every batch; "
                         f"this one uses attn_implementation={implementation!r}: set the model config's "
                         "attn_implementation=eager (model.config.attn_implementation=eager), or use "
                         "micro_batching=dynamic or pad, which need no mask, or context_parallel>1")
