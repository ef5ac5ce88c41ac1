"""The MoE placement benchmark's settings and statistics: baselines at their defaults, goals at the worst case."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks._moe_routing import Routing
from benchmarks._moe_worker import BASELINE_LABELS, BASELINES, Config, deepspeed_kwargs, policy_options
from benchmarks._table_moe import moe as moe_table
from benchmarks.moe import (
    OURS_OVER_BEST,
    SIMULATED_OURS_OVER_BEST,
    SIMULATED_WORST_STEP,
    WORST_STEP,
    configs,
    dropless_meets_balance,
    goal_records,
    rank_cpu_record,
    rank_env,
    rank_quota,
    run_clusters,
    simulated_note,
    step_max_over_mean,
    summarise,
)
from lightning_merak.distributed.host_memory import HEAP_TUNABLES, with_heap_tunables
from lightning_merak.plugins.moe.options import MoEOptions
from lightning_merak.testing import cpu_quota, netem
from lightning_merak.testing.cpu_quota import CpuQuota, QuotaCheck

CONFIG = Config(name="base/x", routing=Routing("rotate", 1), rate_mbit=400, hidden=8, ffn=16, tokens_per_rank=20,
                layers=2, experts=4, warmup_steps=0, steps=3)


def test_ours_is_the_placement_feature_with_every_other_option_at_its_default():
    ours = MoEOptions(**policy_options("ours"))
    assert (ours.dispatch, ours.placement) == ("dropless", "auto")
    default = MoEOptions()
    changed = {f.name for f in fields(MoEOptions) if getattr(ours, f.name) != getattr(default, f.name)}
    assert changed == {"dispatch", "placement"}


def test_baselines_are_deepspeed_dropless_and_one_chunk_shadowing_at_their_defaults():
    assert BASELINES == ("deepspeed", "dropless", "shadowing")
    assert deepspeed_kwargs("deepspeed") == {"drop_tokens": False}
    dropless, shadowing = MoEOptions(**policy_options("dropless")), MoEOptions(**policy_options("shadowing"))
    assert (dropless.dispatch, dropless.placement) == ("dropless", "none")
    assert (shadowing.dispatch, shadowing.placement, shadowing.lancet_chunks) == ("dropless", "shadowing", 1)
    assert shadowing.lancet_chunks == MoEOptions().lancet_chunks
    assert "FasterMoE-style shadowing, lancet_chunks=1" in BASELINE_LABELS["shadowing"]


def test_every_configuration_runs_four_unpinned_ranks():
    for quick in (True, False):
        plan = configs(quick)
        assert plan and all(c.world_size == 4 for c in plan)
        assert all("pin_ranks" not in asdict(c) for c in plan)
        assert all(set(BASELINES + ("ours",)) <= set(c.policies) for c in plan)


def test_ranks_start_with_the_launchers_heap_settings():
    env = rank_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == with_heap_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    for name, setting in HEAP_TUNABLES.items():
        assert f"{name}={setting}" in env["GLIBC_TUNABLES"]


def _machine(monkeypatch: pytest.MonkeyPatch, cores: int, quotas: bool) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(cpu_quota, "quota_available", lambda: quotas)


def test_four_ranks_on_two_cores_get_half_a_core_each_and_the_json_says_so(monkeypatch):
    _machine(monkeypatch, cores=2, quotas=True)
    quota = rank_quota(4)
    assert isinstance(quota, CpuQuota) and (quota.ranks, quota.share, quota.quota_us) == (4, 0.5, 1000)
    record = rank_cpu_record(quota, 4, checks=[0.49])
    assert (record["quota_us"], record["core_share_per_rank"], record["compute_threads_per_rank"]) == (1000, 0.5, 1)
    assert record["lone_rank_burst_cpu_share_per_cluster"] == [0.49]
    assert "quota" in simulated_note(record) and "NONE" not in simulated_note(record)
    assert rank_quota(2) is None  # one core per rank: nothing to lend
    assert rank_env({})["OMP_NUM_THREADS"] == "1"


def test_the_json_says_whether_a_lone_rank_still_computed_faster_than_a_sharing_one():
    held = {"a": {"expert_tokens_per_s": 100.0, "expert_tokens_per_s_alone": None},
            "b": {"expert_tokens_per_s": 100.0, "expert_tokens_per_s_alone": 110.0}}
    record = rank_cpu_record(None, 4, cost_models=held)
    assert record["lone_over_shared_expert_rate"] == {"a": 1.0, "b": 1.1} and record["no_lending_at_call_scale"]
    lent = {**held, "c": {"expert_tokens_per_s": 100.0, "expert_tokens_per_s_alone": 228.0}}
    assert rank_cpu_record(None, 4, cost_models=lent)["no_lending_at_call_scale"] is False


def test_without_quotas_the_json_says_ranks_could_lend_cores(monkeypatch):
    _machine(monkeypatch, cores=2, quotas=False)
    assert rank_quota(4) is None
    record = rank_cpu_record(None, 4)
    assert record["emulation"].startswith("NONE") and "quota_us" not in record
    assert "without a CPU quota" in simulated_note(record)


class _Quota(CpuQuota):
    def check(self, seconds: float = 0.5, bursts: int = 5, burst_cpu_s: float = 0.01,
              gap_s: float = 0.05) -> QuotaCheck:
        return QuotaCheck(0.5, 0.5, self.share)


class _Cluster:
    """Records what the benchmark asks of a cluster and answers as rank 0 would."""

    made: list[_Cluster] = []

    def __init__(self, world_size: int, link: netem.LinkSpec, cpu_quota: CpuQuota | None = None) -> None:
        self.world_size, self.link, self.cpu_quota = world_size, link, cpu_quota
        self.configs: list[dict[str, Any]] = []
        _Cluster.made.append(self)

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def run(self, argv: list[str], **kwargs: Any) -> None:
        self.configs = json.loads(Path(argv[-2]).read_text())
        Path(argv[-1]).write_text(json.dumps([{"config": c} for c in self.configs]))


def test_ours_and_every_baseline_run_in_clusters_under_one_quota(monkeypatch):
    monkeypatch.setattr(netem, "EmulatedCluster", _Cluster)
    _Cluster.made = []
    quota = _Quota(4, cores=2)
    plan = [replace(CONFIG, world_size=4), replace(CONFIG, name="rate/x", rate_mbit=1000, world_size=4)]
    results, checks = run_clusters(plan, quota)
    assert [c.link.rate_mbit for c in _Cluster.made] == [400, 1000]
    assert all(c.cpu_quota is quota and c.world_size == 4 for c in _Cluster.made)
    for cluster in _Cluster.made:  # every policy of a configuration takes its turns in that cluster's ranks
        assert all(set(BASELINES + ("ours",)) <= set(c["policies"]) for c in cluster.configs)
    assert [r["config"]["name"] for r in results] == ["base/x", "rate/x"] and checks == [0.5, 0.5]


def _layer(counts: list[list[int]]) -> dict[str, Any]:
    return {"counts": counts, "plan": [], "kind": "none", "timing": "current"}


BALANCED = [[5, 5, 5, 5], [5, 5, 5, 5]]
SKEWED = [[15, 5, 5, 5], [15, 5, 5, 5]]  # two experts per rank: rank 0 computes 40 tokens, rank 1 20


def test_a_steps_load_is_its_worst_layer_not_the_mean_of_its_layers():
    step = {"step_s": 1.0, "layers": [_layer(BALANCED), _layer(SKEWED)]}
    assert step_max_over_mean(step, experts=4) == pytest.approx(40 / 30)


def _result(step_s: dict[str, list[float]], skewed_step: int) -> dict[str, Any]:
    def steps(times: list[float]) -> list[dict[str, Any]]:
        return [{"step_s": t, "layers": [_layer(SKEWED if i == skewed_step else BALANCED), _layer(BALANCED)]}
                for i, t in enumerate(times)]

    return {"config": asdict(CONFIG), "steps": {policy: steps(times) for policy, times in step_s.items()}}


def test_summary_keeps_the_worst_step_and_pairs_each_baseline_step_with_ours():
    result = _result({"deepspeed": [3.0, 3.0, 3.0], "dropless": [1.2, 1.1, 1.3], "shadowing": [0.9, 1.0, 0.8],
                      "ours": [1.0, 1.0, 1.0]}, skewed_step=1)
    row, _ = summarise(result)
    ours = row["policies"]["ours"]
    assert ours["max_over_mean_per_step"] == [1.0, pytest.approx(40 / 30, abs=1e-4), 1.0]
    assert ours["max_over_mean_worst_step"] == pytest.approx(40 / 30)
    assert row["best_baseline"] == "shadowing"
    assert row["ours_over_best_baseline"] == pytest.approx(0.9)


def _row(name: str, worst_step: float, dropless_step: float, ours_over_best: float) -> dict[str, Any]:
    policies = {"ours": {"max_over_mean_worst_step": worst_step, "kinds": {"none/current": 2}},
                "dropless": {"max_over_mean_worst_step": dropless_step}}
    return {"config": name, "policies": policies, "ours_over_best_baseline": ours_over_best,
            "best_baseline": "dropless", "ours_over_baseline": {"deepspeed": 2.0, "dropless": ours_over_best}}


def _simulated(ranks: int, worst_step: float, ours_ms: float) -> dict[str, Any]:
    return {"ranks": ranks, "routing": "rotate1", "deepspeed_ms": 3.0, "dropless_ms": 2.0, "shadowing_ms": 1.0,
            "ours_ms": ours_ms, "ours_over_best_baseline": 1.0 / ours_ms, "ours_worst_step_max_over_mean": worst_step,
            "dropless_worst_step_max_over_mean": 1.5, "ours_kinds": {"shadowing/current": 4}}


ROWS = [_row("a", 1.1, 1.2, 1.3), _row("b", 1.4, 1.3, 0.9), _row("c", 1.2, 1.26, 1.1)]
SIMULATED = [_simulated(8, 1.1, 0.8), _simulated(64, 1.3, 1.25)]


def test_each_goal_is_its_worst_configuration_and_needs_two_runs():
    goals = {g["key"]: g for g in goal_records(ROWS, SIMULATED)}
    assert (goals[WORST_STEP.key]["value"], goals[WORST_STEP.key]["worst_config"]) == (1.4, "b")
    assert (goals[OURS_OVER_BEST.key]["value"], goals[OURS_OVER_BEST.key]["worst_config"]) == (0.9, "b")
    assert goals[SIMULATED_WORST_STEP.key]["worst_config"] == "64 ranks/rotate1"
    assert goals[SIMULATED_OURS_OVER_BEST.key]["value"] == pytest.approx(0.8)
    assert all(g["runs_required"] == 2 and g["issue"] == 49 for g in goals.values())
    assert (WORST_STEP.target, OURS_OVER_BEST.target) == (1.25, 1.0)


def test_dropless_alone_is_counted_against_the_balance_goal():
    assert dropless_meets_balance(ROWS) == {"meeting": 1, "configurations": 3, "configs": ["a"]}


def test_table_lists_measured_then_simulated_rows():
    data = {"rows": ROWS, "simulated": {"label": "simulated", "rows": SIMULATED}, "world_size": 4,
            "ours_options": {"dispatch": "dropless", "placement": "auto"}, "baselines": BASELINE_LABELS,
            "dropless_meets_balance": dropless_meets_balance(ROWS)}
    data["rank_cpu"] = {"emulation": "quota", "quota_us": 50_000, "core_share_per_rank": 0.5}
    table = moe_table(data)
    assert [row[:3] for row in table.rows] == [["emulated", "a", "1.100"], ["emulated", "b", "1.400"],
                                               ["emulated", "c", "1.200"], ["simulated", "8 ranks/rotate1", "1.100"],
                                               ["simulated", "64 ranks/rotate1", "1.300"]]
    assert table.rows[3][4] == "1.25× (shadowing)"
    assert any("in 1 of 3" in note for note in table.notes)
    assert any("fixed CPU quota of 0.5 core, ours and baselines alike" in note for note in table.notes)
    data["rank_cpu"].update(lone_over_shared_expert_rate={"a": 3.4}, no_lending_at_call_scale=False)
    assert any("alone ran 3.4× the shared expert rate" in note for note in moe_table(data).notes)
