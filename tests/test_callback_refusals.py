"""Callback arguments refused in the constructor, naming the value and the fix, where they used to be taken.

From a hostile-input sweep: float or bool counts, NaN and infinite numbers, a string for a list of names, an
unknown compile backend. Each one used to crash every rank after step 1, spin a thread, silently switch a check
off or fail only at fit start with a bare ``OSError``. Each case refuses a bad value with its message and accepts
the nearest good one (single process: the objects are constructed, no rank is launched).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch

from lightning_merak.callbacks import (
    FaultWatch,
    ModelSummary,
    NonFiniteGuard,
    RegionalCompile,
    StepProgressBar,
    TrainingMetrics,
)
from lightning_merak.callbacks.delta import Budget, DeltaMemory
from lightning_merak.callbacks.delta.budget import parse_budget
from lightning_merak.callbacks.delta.swap_tiers import DiskTier
from lightning_merak.callbacks.profiler import MerakTraceProfiler
from lightning_merak.callbacks.sparse_comm import SparseCommunication
from lightning_merak.callbacks.sparse_comm.sketch import CountSketch
from lightning_merak.callbacks.sparse_comm.wire_cost_model import NetworkModel, sketch_columns
from lightning_merak.distributed.watchdog import PulseClock, StallClock, Watchdog

NAN, INF = math.nan, math.inf


def _refused_then_accepted(build: Callable[..., Any], bad: dict[str, Any], match: str,
                           good: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=match):
        build(**bad)
    build(**good)


SPARSE_COMM = [
    ({"method": "s2", "mode": "sketch", "sketch_rows": 3.0}, r"sketch_rows=3\.0 must be an odd positive integer",
     {"method": "s2", "mode": "sketch", "sketch_rows": 1}),
    ({"method": "s2", "sketch_rows": True}, "sketch_rows=True must be an odd", {"method": "s2", "sketch_rows": 5}),
    ({"method": "s2", "seed": 1.5}, r"seed=1\.5 must be an integer in \[-2\*\*63, 2\*\*64 - 1\]",
     {"method": "s2", "seed": -1}),
    ({"method": "s2", "seed": 2**64}, "seed=18446744073709551616 must be an integer",
     {"method": "s2", "seed": 2**64 - 1}),
    ({"method": "s2", "column_factor": NAN}, "column_factor=nan must be a finite number > 0",
     {"method": "s2", "column_factor": 1e-9}),
    ({"method": "s2", "column_factor": INF}, "column_factor=inf must be a finite number",
     {"method": "s2", "column_factor": 8}),
    ({"latency_us": -5}, r"latency_us=-5 must be a finite number of microseconds >= 0", {"latency_us": 0}),
    ({"latency_us": NAN}, "latency_us=nan must be a finite number of microseconds", {"latency_us": 0.5}),
    ({"bandwidth_gbit": NAN}, "bandwidth_gbit=nan must be a finite number of Gbit/s > 0.*or None",
     {"bandwidth_gbit": 0.1}),
    ({"bandwidth_gbit": INF}, "bandwidth_gbit=inf", {"bandwidth_gbit": None}),
    ({"method": "embrace", "mode": "sketch"}, "mode='sketch' is only used with method='s2'",
     {"method": "embrace", "mode": "exact"}),
    ({"min_table_rows": 1024.0}, r"min_table_rows=1024\.0 must be an integer >= 1", {"min_table_rows": 1}),
    ({"freeze_dense_after": 1.5}, r"freeze_dense_after=1\.5 must be an integer >= 1", {"freeze_dense_after": 1}),
    ({"rows_from_ids": "no"}, "rows_from_ids='no' must be True or False", {"rows_from_ids": False}),
    ({"method": "embrace", "priority": True, "priority_ids": 5}, "priority_ids=5 must be a function",
     {"method": "embrace", "priority": True, "priority_ids": lambda batch: batch[0]}),
    ({"tables": ["embed", 3]}, r"tables=\['embed', 3\] must be module names", {"tables": ("embed", "head")}),
]


@pytest.mark.parametrize(("bad", "match", "good"), SPARSE_COMM)
def test_sparse_communication_refuses_in_the_constructor(bad: dict, match: str, good: dict) -> None:
    _refused_then_accepted(SparseCommunication, bad, match, good)


def test_sparse_communication_takes_one_table_name_as_a_string() -> None:
    assert SparseCommunication("s2", tables="model.embed").table_names == ["model.embed"]
    assert SparseCommunication("s2", tables=("a", "b")).table_names == ["a", "b"]


def test_sparse_communication_core_refuses_what_a_checkpoint_or_caller_could_hand_it() -> None:
    with pytest.raises(ValueError, match=r"sketch_rows=3\.0"):
        CountSketch(3.0, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seed=1\.5"):
        CountSketch(3, 1.5)  # type: ignore[arg-type]
    assert CountSketch(3, 2**64 - 1).encode(torch.tensor([1, 2]), torch.ones(2, 4), 4).shape == (3, 4, 4)
    with pytest.raises(ValueError, match="column_factor must be finite and positive, got nan"):
        sketch_columns(10, NAN)
    assert sketch_columns(10, 0.5) == 5
    with pytest.raises(ValueError, match="latency must be finite"):
        NetworkModel.from_gbit(10.0, NAN)
    with pytest.raises(ValueError, match="bandwidth must be finite"):
        NetworkModel.from_gbit(NAN, 50.0)
    assert NetworkModel.from_gbit(10.0, 0.0).latency_s == 0.0


@pytest.mark.parametrize("name", ["poll_s", "timeout_s", "dead_after_s"])
@pytest.mark.parametrize("value", [NAN, INF, "30", True])
def test_fault_watch_needs_finite_positive_seconds(name: str, value: Any) -> None:
    accepted = {name: 0.01} if name != "dead_after_s" else {name: 0.01, "poll_s": 0.005}
    _refused_then_accepted(FaultWatch, {name: value}, rf"{name}={value!r} must be a finite number of seconds > 0",
                           accepted)


def test_watchdog_clocks_refuse_nan_durations() -> None:
    with pytest.raises(ValueError, match="timeout_s=nan"):
        StallClock(NAN)
    with pytest.raises(ValueError, match="dead_after_s=nan"):
        PulseClock(NAN, start=0.0)
    with pytest.raises(ValueError, match="poll_s=nan"):
        Watchdog(poll_s=NAN)
    assert Watchdog(timeout_s=1, dead_after_s=1.5, poll_s=1).poll_s == 1
    with pytest.raises(ValueError, match="poll_s=1 must be below dead_after_s=1, or a live peer"):
        Watchdog(timeout_s=1, dead_after_s=1, poll_s=1)


def test_delta_budget_refuses_an_overflowing_size() -> None:
    with pytest.raises(ValueError, match="memory budget '1e400' is too large to be a number of bytes"):
        DeltaMemory("1e400")
    assert parse_budget("1e18").nbytes == 10**18


@pytest.mark.parametrize(("bad", "match"), [
    ({"nbytes": -5}, r"Budget\(nbytes=-5\) must be a positive integer of bytes"),
    ({"nbytes": 1.5}, r"Budget\(nbytes=1\.5\) must be a positive integer"),
    ({"nbytes": True}, r"Budget\(nbytes=True\)"),
    ({"fraction": 3.0}, r"Budget\(fraction=3\.0\) must lie in \(0, 1\]"),
    ({"fraction": NAN}, r"Budget\(fraction=nan\) must lie in \(0, 1\]"),
    ({}, "must set exactly one of nbytes, fraction or auto=True"),
    ({"nbytes": 5, "fraction": 0.5}, "must set exactly one of"),
    ({"auto": True, "fraction": 0.5}, "must set exactly one of"),
])
def test_budget_built_by_hand_is_checked(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Budget(**bad)
    assert DeltaMemory(Budget(nbytes=1)).budget.nbytes == 1
    assert DeltaMemory(Budget(fraction=1.0)).budget.fraction == 1.0
    assert DeltaMemory(Budget(auto=True)).budget.auto


@pytest.mark.parametrize(("bad", "match", "good"), [
    ({"host_pool_bytes": 0.5}, r"host_pool_bytes must be a positive integer of bytes.*got 0\.5",
     {"host_pool_bytes": 1}),
    ({"host_pool_bytes": NAN}, "host_pool_bytes must be a positive integer.*got nan", {"host_pool_bytes": None}),
    ({"prefetch_depth": True}, "prefetch_depth must be an integer >= 1, got True", {"prefetch_depth": 1}),
    ({"plot": "yes"}, "plot must be True or False, got 'yes'", {"plot": False}),
])
def test_delta_options_refuse_non_integers_and_non_bools(bad: dict, match: str, good: dict) -> None:
    _refused_then_accepted(lambda **settings: DeltaMemory("1GiB", **settings), bad, match, good)


def test_delta_swap_dir_that_is_a_file_is_refused_at_construction(tmp_path) -> None:
    a_file = tmp_path / "swap"
    a_file.write_text("")
    for swap_dir in (a_file, a_file / "below"):
        with pytest.raises(ValueError, match=rf"swap_dir '{swap_dir}' cannot be a directory: '{a_file}' is a file"):
            DeltaMemory("1GiB", swap_dir=str(swap_dir))
    missing = tmp_path / "new" / "swap"
    DeltaMemory("1GiB", swap_dir=str(missing))
    assert not missing.exists()  # created by the disk tier at fit start, not by the check


def test_disk_tier_names_a_swap_dir_it_cannot_create(tmp_path) -> None:
    a_file = tmp_path / "swap"
    a_file.write_text("")
    with pytest.raises(ValueError, match=f"swap_dir '{a_file}': the disk tier cannot create its directory there"):
        DiskTier(torch.device("cpu"), str(a_file))
    DiskTier(torch.device("cpu"), str(tmp_path / "dir")).close()


@pytest.mark.parametrize(("build", "bad", "match", "good"), [
    (NonFiniteGuard, {"max_skipped": NAN}, "max_skipped=nan must be an integer >= 1, or None", {"max_skipped": 1}),
    (NonFiniteGuard, {"max_skipped": 1.5}, r"max_skipped=1\.5 must be an integer", {"max_skipped": None}),
    (StepProgressBar, {"log_every_n_steps": NAN, "quiet_console": False}, "log_every_n_steps=nan must be an integer",
     {"log_every_n_steps": 1, "quiet_console": False}),
    (StepProgressBar, {"log_every_n_steps": 2.5, "quiet_console": False}, r"log_every_n_steps=2\.5 must be an "
     r"integer >= 1", {"log_every_n_steps": 3, "quiet_console": False}),
    (MerakTraceProfiler, {"steps": NAN}, "steps=nan must be an integer >= 1", {"steps": 1}),
    (MerakTraceProfiler, {"steps": 1.5}, r"steps=1\.5 must be an integer >= 1", {"steps": 2}),
    (MerakTraceProfiler, {"skip_steps": 0.5}, r"skip_steps=0\.5 must be an integer >= 0", {"skip_steps": 0}),
    (MerakTraceProfiler, {"untraced_steps": True}, "untraced_steps=True must be an integer >= 0",
     {"untraced_steps": 0}),
    (TrainingMetrics, {"ranks_per_rank_metrics": 1.5}, r"ranks_per_rank_metrics=1\.5 must be an integer >= 0",
     {"ranks_per_rank_metrics": 0}),
    (TrainingMetrics, {"ranks_per_rank_metrics": NAN}, "ranks_per_rank_metrics=nan must be an integer",
     {"ranks_per_rank_metrics": 1}),
    (TrainingMetrics, {"ranks_per_rank_metrics": "4"}, "ranks_per_rank_metrics='4' must be an integer",
     {"ranks_per_rank_metrics": 4}),
    (ModelSummary, {"seq_len": NAN}, r"seq_len must be at least 1 \(an integer: tokens per sample\).*got nan",
     {"seq_len": 1}),
    (ModelSummary, {"seq_len": 2.5}, r"seq_len must be at least 1.*got 2\.5", {"seq_len": None}),
    (ModelSummary, {"max_depth": -5}, "max_depth=-5 must be an integer >= -1", {"max_depth": -1}),
    (RegionalCompile, {"backend": "nope"}, r"RegionalCompile\(backend='nope'\) is not a torch.compile backend; "
     r"choose one torch knows \(.*inductor.*\)", {"backend": "aot_eager"}),
])
def test_callback_constructors_refuse_nan_and_non_integers(build: Callable[..., Any], bad: dict, match: str,
                                                          good: dict) -> None:
    _refused_then_accepted(build, bad, match, good)
