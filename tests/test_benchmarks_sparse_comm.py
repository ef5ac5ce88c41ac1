"""The sparse-communication benchmark: its baseline is torch's own sparse path, ours runs at the callback's
default, the ranks get the launcher's heap, and each goal is the worst configuration's figure."""

from __future__ import annotations

import inspect

import pytest

from benchmarks.sparse_comm import (
    AUTO_OVER_ALLGATHER,
    BASELINE,
    METHODS,
    S2_OVER_ALLGATHER,
    Row,
    Workload,
    _build_model,
    compute_goals,
    rank_env,
)
from lightning_merak.callbacks.sparse_comm import SparseCommunication
from lightning_merak.distributed.host_memory import HEAP_TUNABLES


def _row(ranks: int, network: str, method: str, step_ms: float, auto_picks: dict[str, int] | None = None) -> Row:
    return Row(ranks=ranks, network=network, method=method, step_ms=step_ms, emb_mb_per_step=0.1,
               dense_mb_per_step=0.1, emb_bytes_vs_dense=0.01, speedup_vs_dense=1.0, final_loss=1.0,
               loss_vs_dense=0.0, needed_rows_ms=None, all_rows_ms=None, auto_picks=auto_picks)


def _config(ranks: int, network: str, allgather_ms: float, s2_ms: float, auto_ms: float,
            auto_picks: dict[str, int]) -> list[Row]:
    return [_row(ranks, network, "dense", 2000.0), _row(ranks, network, "allgather", allgather_ms),
            _row(ranks, network, "s2", s2_ms), _row(ranks, network, "auto", auto_ms, auto_picks)]


def test_baseline_is_torch_sparse_embedding_and_ours_is_the_callback_default():
    assert BASELINE == "allgather" and BASELINE in METHODS
    tiny = Workload(vocab=64, dim=8, seq_len=4, batch=2, steps=1)
    assert _build_model(tiny, sparse=BASELINE == "allgather").embed.sparse
    assert not _build_model(tiny, sparse=False).embed.sparse
    assert inspect.signature(SparseCommunication).parameters["method"].default == "auto"
    assert "auto" in METHODS


def test_ranks_start_with_the_launchers_heap_tunables():
    tunables = dict(item.split("=") for item in rank_env()["GLIBC_TUNABLES"].split(":"))
    assert HEAP_TUNABLES.items() <= tunables.items()


def test_auto_goal_is_the_worst_configuration():
    rows = [*_config(2, "1Gbit", allgather_ms=1000.0, s2_ms=1200.0, auto_ms=900.0, auto_picks={"allgather": 12}),
            *_config(4, "1Gbit", allgather_ms=1000.0, s2_ms=1100.0, auto_ms=1250.0, auto_picks={"allgather": 12})]
    auto_goal, s2_goal = compute_goals(rows)
    assert auto_goal["key"] == AUTO_OVER_ALLGATHER.key
    assert auto_goal["value"] == pytest.approx(1000.0 / 1250.0)
    assert auto_goal["worst_config"] == "4 ranks, 1Gbit" and auto_goal["met"] is False
    # auto never picked s2_exact: the S2 goal has no configuration and is met vacuously, S2's ratios in its note
    assert s2_goal["key"] == S2_OVER_ALLGATHER.key
    assert (s2_goal["value"], s2_goal["met"], s2_goal["by_config"]) == (None, True, {})
    assert "0.833" in s2_goal["note"]


def test_s2_goal_counts_only_configurations_where_auto_picked_s2():
    rows = [*_config(2, "1Gbit", allgather_ms=1000.0, s2_ms=2000.0, auto_ms=1000.0, auto_picks={"allgather": 12}),
            *_config(4, "1Gbit", allgather_ms=1000.0, s2_ms=1250.0, auto_ms=1000.0,
                     auto_picks={"allgather": 10, "s2_exact": 2}),
            *_config(4, "10Gbit", allgather_ms=1000.0, s2_ms=800.0, auto_ms=1000.0, auto_picks={"s2_exact": 12})]
    _, s2_goal = compute_goals(rows)
    assert set(s2_goal["by_config"]) == {"4 ranks, 1Gbit", "4 ranks, 10Gbit"}
    assert s2_goal["value"] == pytest.approx(0.8) and s2_goal["worst_config"] == "4 ranks, 1Gbit"
    assert s2_goal["met"] is False
