"""Per-rank CPU quotas: one device per rank emulated on a shared CPU (needs root and a cgroup cpu controller)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lightning_merak.testing.cpu_quota import CpuQuota, QuotaUnavailable, quota_available
from lightning_merak.testing.netem import (
    EmulatedCluster,
    EmulationUnavailable,
    LinkSpec,
    LoopbackCluster,
    check_prerequisites,
)

needs_quota = pytest.mark.skipif(not quota_available(), reason="CPU quotas need root and a cgroup cpu controller")


def test_quota_arguments_are_checked_before_anything_is_created() -> None:
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        CpuQuota(0)
    with pytest.raises(ValueError, match="cores must be > 0"):
        CpuQuota(2, cores=0)
    assert (CpuQuota(4, cores=2).quota_us, CpuQuota(4, cores=2).period_us) == (1000, 2000)
    with pytest.raises(RuntimeError, match="context manager"):
        CpuQuota(2).procs_file(0)
    with pytest.raises(ValueError, match="cpu_quota is for 4 ranks"):
        LoopbackCluster(2, cpu_quota=CpuQuota(4))


@pytest.mark.skipif(quota_available(), reason="here quotas are available")
def test_without_cgroups_the_quota_refuses_with_the_fix() -> None:
    with pytest.raises(QuotaUnavailable, match="root"), CpuQuota(2):
        pass


@needs_quota
@pytest.mark.distributed
def test_a_busy_process_cannot_run_above_its_share_and_groups_are_removed() -> None:
    with CpuQuota(8, cores=2) as quota:  # a quarter of a core each: 1 ms of every 4 ms
        assert (quota.quota_us, quota.period_us) == (1000, 4000)
        group = quota.group_of(3).parent
        measured = quota.check(seconds=0.5)
        # neither over a long spin nor in a short burst after idling may a rank run above its share
        assert measured.long_share <= 0.25 * 1.15 + 0.02 and measured.burst_share <= 0.25 * 1.15 + 0.02, measured
    assert not group.exists()


def _emulation_unavailable() -> bool:
    try:
        check_prerequisites()
    except EmulationUnavailable:
        return True
    return False


@needs_quota
@pytest.mark.distributed
@pytest.mark.parametrize("emulated", [False, True], ids=["loopback", "namespaces"])
def test_cluster_ranks_start_inside_their_rank_groups(emulated: bool) -> None:
    if emulated and _emulation_unavailable():
        pytest.skip("no network namespaces here")
    code = "print(open('/proc/self/cgroup').read())"
    quota = CpuQuota(2)  # the cluster creates its groups and removes them
    cluster = (EmulatedCluster(2, LinkSpec(rate_mbit=100), cpu_quota=quota) if emulated
               else LoopbackCluster(2, cpu_quota=quota))
    with cluster:
        results = cluster.run([sys.executable, "-c", code], timeout_s=60)
        for result in results:
            assert f"{quota.group_of(result.rank).parent.name}/rank{result.rank}" in result.stdout
        group = quota.group_of(0).parent
    assert not Path(group).exists()


def _own_cpu_group(rank: int, world_size: int) -> str:
    return open("/proc/self/cgroup").read()


@needs_quota
@pytest.mark.distributed
def test_forked_ranks_run_their_function_inside_their_rank_groups() -> None:
    from lightning_merak.testing.distributed import run_distributed

    quota = CpuQuota(2)
    groups = run_distributed(_own_cpu_group, world_size=2, cpu_quota=quota, timeout_s=60)
    for rank, cgroups in enumerate(groups):
        assert f"-{os.getpid()}-" in cgroups and f"/rank{rank}" in cgroups, cgroups


def test_only_more_ranks_than_cores_get_a_quota_and_the_record_says_which() -> None:
    import os

    from lightning_merak.testing.cpu_quota import device_per_rank_quota, emulation_record

    cores = len(os.sched_getaffinity(0))
    assert device_per_rank_quota(cores) is None
    assert "no quota needed" in str(emulation_record(None, cores)["emulation"])
    assert str(emulation_record(None, cores + 1)["emulation"]).startswith("NONE")
    quota = device_per_rank_quota(cores * 2)
    assert (quota is not None) == quota_available()
    if quota is not None:
        assert emulation_record(quota, cores * 2)["core_share_per_rank"] == 0.5
