"""The NCCL path made explicit: which backend serves a collective, what a group binds to, the flight recorder
and watchdog settings merak gives torch, and how its own watchdog defers to torch's on NCCL.

All of it is decided from strings and numbers, checked here on the CPU; one gloo run checks the helpers that
create groups and place collective tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_merak.distributed import nccl_environment
from lightning_merak.distributed.nccl_environment import (
    apply_nccl_defaults,
    flight_recorder_dump_prefix,
    missing_nccl_defaults,
)
from lightning_merak.distributed.process_groups import (
    backend_serving,
    group_device_id,
    process_group_options,
    process_group_setup,
    reduce_scatter_by_exchange,
)
from lightning_merak.distributed.watchdog import defers_stalls_to_torch, flight_recorder_reader
from lightning_merak.testing.distributed import run_distributed


@pytest.mark.parametrize(("backend", "device_type", "serving"), [
    ("gloo", "cpu", "gloo"), ("nccl", "cuda", "nccl"), ("cpu:gloo,cuda:nccl", "cuda", "nccl"),
    ("cpu:gloo,cuda:nccl", "cpu", "gloo"), ("NCCL", "cuda", "nccl"),
])
def test_the_backend_serving_a_device(backend: str, device_type: str, serving: str) -> None:
    assert backend_serving(backend, device_type) == serving


def test_a_per_device_backend_without_the_device_is_refused() -> None:
    with pytest.raises(ValueError, match="serves no cpu tensors"):
        backend_serving("cuda:nccl", "cpu")


@pytest.mark.parametrize(("backend", "device_type", "exchange"), [
    ("gloo", "cpu", True),  # gloo's reduce-scatter all-reduces everything: an all-to-all and a local sum instead
    ("nccl", "cuda", False),  # NCCL's is native
    ("cpu:gloo,cuda:nccl", "cpu", True), ("cpu:gloo,cuda:nccl", "cuda", False),
])
def test_reduce_scatter_runs_natively_on_nccl_and_as_an_exchange_on_gloo(backend: str, device_type: str,
                                                                       exchange: bool) -> None:
    assert reduce_scatter_by_exchange(backend, device_type) is exchange


def test_only_nccl_groups_bind_a_device() -> None:
    assert group_device_id("gloo") is None
    assert process_group_options("gloo", torch.device("cpu")) == {}
    assert process_group_setup(None, torch.device("cpu")) == ("gloo", {})  # NCCL is the default on CUDA only
    assert process_group_setup("gloo", torch.device("cpu")) == ("gloo", {})
    assert group_device_id("nccl", torch.device("cuda", 3)) == torch.device("cuda", 3)


def test_nccl_defaults_fill_only_what_the_user_left_unset() -> None:
    everything = missing_nccl_defaults({}, dump_prefix="/runs/trace_")
    assert everything == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                          "TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
                          "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/trace_"}
    assert "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" not in everything  # torch's 480 s stays
    users = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_BUFFER_SIZE": "100", "NCCL_ASYNC_ERROR_HANDLING": "1",
             "TORCH_FR_DUMP_TEMP_FILE": "/mine/fr_"}
    assert missing_nccl_defaults(users) == {"TORCH_NCCL_ENABLE_MONITORING": "1"}  # aliases count as set


def test_applying_the_defaults_sets_them_once_and_names_the_dump_file() -> None:
    environ: dict[str, str] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    added = apply_nccl_defaults(environ)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in added and environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert apply_nccl_defaults(environ) == {}
    assert flight_recorder_dump_prefix(environ).endswith("lightning_merak_nccl_trace_rank_")
    assert flight_recorder_dump_prefix({"TORCH_FR_DUMP_TEMP_FILE": "/x/fr_"}) == "/x/fr_"
    assert set(added) <= {names[0] for names in nccl_environment.NCCL_DEFAULTS} | {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}


def test_the_watchdog_reads_nccls_own_flight_recorder_where_the_build_has_it() -> None:
    both = {"_dump_fr_trace_json", "_dump_nccl_trace_json"}
    assert flight_recorder_reader("nccl", both) == "_dump_nccl_trace_json"
    assert flight_recorder_reader("gloo", both) == "_dump_fr_trace_json"
    assert flight_recorder_reader("nccl", {"_dump_fr_trace_json"}) == "_dump_fr_trace_json"


@pytest.mark.parametrize(("backend", "group_timeout_s", "defers"), [
    ("nccl", 60.0, True),  # torch's NCCL watchdog aborts first and dumps its flight recorder
    ("nccl", 120.0, True),
    ("nccl", 1800.0, False),  # ours names the absent ranks long before torch's timeout
    ("nccl", None, False),
    ("gloo", 60.0, False),  # gloo cannot abort a blocked collective: ours always ends it
])
def test_the_watchdog_leaves_hangs_to_torch_only_where_torch_ends_them_first(
        backend: str, group_timeout_s: float | None, defers: bool) -> None:
    assert defers_stalls_to_torch(backend, 120.0, group_timeout_s) is defers


def _groups_on_gloo(rank: int, world_size: int) -> tuple[str, float, bool]:
    from lightning_merak.distributed.process_groups import collective_device, new_group

    group = new_group(list(range(world_size)))
    vote = torch.ones(1, device=collective_device(group))
    dist.all_reduce(vote, group=group)
    return str(vote.device), float(vote.item()), getattr(group, "bound_device_id", None) is None


@pytest.mark.distributed
def test_groups_made_by_the_helper_on_gloo_stay_unbound_and_collect_on_the_cpu() -> None:
    assert run_distributed(_groups_on_gloo, world_size=2) == [("cpu", 2.0, True)] * 2
