"""Refusals of ``SparseCommunication``'s arguments, raised in its constructor (``sketch_rows`` and
``seed`` are checked by :class:`~.sketch.CountSketch`, which the constructor builds).

A bad value otherwise surfaces only after fit starts, on every rank: a float ``sketch_rows``
or ``seed`` in step 1's backward hook, a NaN ``column_factor`` when the sketch is sized, a
negative latency after the bandwidth probe's all-reduce, and a NaN latency or bandwidth not
at all (``auto`` then compares NaN costs). A merak3d layout a method cannot run under is refused by
:func:`check_merak3d_layout`, at the callback's setup and by ``merak-train`` before launch. Plain Python: nothing
here needs a process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_merak.util.values import is_count as is_integer
from lightning_merak.util.values import is_finite_number

METHODS = ("s2", "embrace", "auto")
MODES = ("exact", "sketch")
EMBRACE_NEEDS_ONE_STAGE = (
    "method='embrace' under merak3d needs pipeline_parallel=1: with pipeline stages the layout trace runs the first "
    "stage on rank 0 alone, which a sharded table cannot; set pipeline_parallel=1 (merak-train: "
    "strategy.pipeline_parallel=1) or use method='s2' (merak-train: comm=s2)")
"""Why EmbRace refuses a merak3d layout with pipeline stages."""
S2_NEEDS_NO_TENSOR_PARALLEL = (
    "method='{method}' under merak3d needs tensor_parallel=1, got tensor_parallel={degree}: with tensor-parallel "
    "ranks a table's gradient is a tensor-parallel DTensor, which S2 does not reduce; set tensor_parallel=1 "
    "(merak-train: strategy.tensor_parallel=1) or leave the tables to merak3d's dense reduction (drop "
    "SparseCommunication; merak-train: comm=dense)")
"""Why S2 and ``auto`` refuse a merak3d layout with tensor-parallel ranks (``"auto"``: the planner may choose some)."""


def table_names(tables: str | Sequence[str] | None) -> list[str] | None:
    """``tables`` as a list of module names; a single string is one name (``"embed"`` means ``["embed"]``)."""
    if tables is None:
        return None
    names = [tables] if isinstance(tables, str) else list(tables)
    not_names = [name for name in names if not isinstance(name, str) or not name]
    if not_names:
        raise ValueError(
            f"tables={tables!r} must be module names such as ['model.embed_tokens'], got {not_names!r}; "
            "omit it to pick tables by min_table_rows"
        )
    return names


def check_arguments(
    *,
    method: Any,
    mode: Any,
    column_factor: Any,
    min_table_rows: Any,
    bandwidth_gbit: Any,
    latency_us: Any,
    freeze_dense_after: Any,
    rows_from_ids: Any,
    priority: Any,
    priority_ids: Any,
) -> None:
    """Raise ``ValueError`` naming the first argument ``SparseCommunication`` cannot run with, and its fix."""
    if method not in METHODS:
        raise ValueError(f"method must be 's2', 'embrace' or 'auto', got {method!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be 'exact' or 'sketch', got {mode!r}")
    if method == "auto" and mode == "sketch":
        raise ValueError("mode='sketch' is lossy and only used with method='s2'; auto picks among exact methods")
    if method == "embrace" and mode == "sketch":
        raise ValueError(
            "mode='sketch' is only used with method='s2'; EmbRace exchanges exact rows, so drop mode or use "
            "method='s2'"
        )
    if not is_finite_number(column_factor) or column_factor <= 0:
        raise ValueError(
            f"column_factor={column_factor!r} must be a finite number > 0 (sketch columns per union row), e.g. 2.0"
        )
    for name, count in (("min_table_rows", min_table_rows), ("freeze_dense_after", freeze_dense_after)):
        if not is_integer(count) or count < 1:
            raise ValueError(f"{name}={count!r} must be an integer >= 1")
    if bandwidth_gbit is not None and (not is_finite_number(bandwidth_gbit) or bandwidth_gbit <= 0):
        raise ValueError(
            f"bandwidth_gbit={bandwidth_gbit!r} must be a finite number of Gbit/s > 0, e.g. 10.0, or None to "
            "measure it at fit start"
        )
    if not is_finite_number(latency_us) or latency_us < 0:
        raise ValueError(
            f"latency_us={latency_us!r} must be a finite number of microseconds >= 0 (per-message latency "
            "for the cost model), e.g. 50.0"
        )
    for name, flag in (("rows_from_ids", rows_from_ids), ("priority", priority)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r} must be True or False")
    if priority and method != "embrace":
        raise ValueError("priority=True orders EmbRace's row exchange; use it with method='embrace'")
    if priority_ids is not None and not callable(priority_ids):
        raise ValueError(
            f"priority_ids={priority_ids!r} must be a function from a batch to its token ids, or None "
            "(pl_module.split_batch(batch)[0])"
        )


def check_merak3d_layout(method: str | None, degrees: Any) -> None:
    """Raise ``ValueError`` naming the fix when ``method`` cannot run under a merak3d layout with ``degrees``'
    ``pipeline_parallel`` and ``tensor_parallel`` (a strategy, or merak-train's strategy options, where they may
    be ``"auto"``); other methods (merak-train's ``comm=dense``: ``None`` or ``"dense"``) pass. EmbRace's
    ``pipeline_parallel="auto"`` is checked once the planner has chosen it; a ``tensor_parallel="auto"`` is refused
    for S2, since a planner choosing more than 1 would crash the first backward pass on every rank."""
    pipeline_parallel = getattr(degrees, "pipeline_parallel", 1)
    tensor_parallel = getattr(degrees, "tensor_parallel", 1)
    if method == "embrace" and isinstance(pipeline_parallel, int) and pipeline_parallel > 1:
        raise ValueError(EMBRACE_NEEDS_ONE_STAGE)
    if method in ("s2", "auto") and (tensor_parallel == "auto" or (isinstance(tensor_parallel, int)
                                                                  and tensor_parallel > 1)):
        raise ValueError(S2_NEEDS_NO_TENSOR_PARALLEL.format(method=method, degree=tensor_parallel))
