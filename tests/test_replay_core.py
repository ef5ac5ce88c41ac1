"""The pure trace-replay core: graphs from hand-made traces, what-ifs, clock offsets, Perfetto export, layouts."""

from __future__ import annotations

import pytest

from lightning_merak.callbacks.profiler import Trace, WhatIf, chrome_trace, replay_trace
from lightning_merak.planning.replay.engine import (
    Task,
    TaskGraph,
    anchored,
    link_payload_bytes_per_s,
    measured_step_time,
    replay,
)
from lightning_merak.planning.replay.summary import summary_numbers
from lightning_merak.planning.replay.synthesize import LayoutSpec, ModelShape, StepCosts, predict_layout
from lightning_merak.planning.replay.trace import CommRecord, RankTrace, Span, offset_from_round_trips

MB = 1_000_000


def _two_ranks(offset: float = 0.0) -> Trace:
    """Rank 0 computes 10 ms, launches a 1 MB all-reduce, computes to 20 ms and waits to 30 ms;
    rank 1 launches it at 15 ms and waits at once. The op's transfer: 15 → 30 ms (last launch to completion)."""
    group = (0, 1)
    rank0 = RankTrace(0, [Span("step 0", "step", 0.0, 0.032, 0), Span("training_step", "FW", 0.0, 0.020, 0, 1)],
                      [CommRecord("all_reduce", "collective", group, 0, MB, 0.010, 0, complete=0.030,
                                  wait_start=0.020, wait_end=0.030)])
    rank1 = RankTrace(1, [Span("step 0", "step", offset, offset + 0.031, 0),
                          Span("training_step", "FW", offset, offset + 0.015, 0, 1)],
                      [CommRecord("all_reduce", "collective", group, 0, MB, offset + 0.015, 0,
                                  complete=offset + 0.030, wait_start=offset + 0.015, wait_end=offset + 0.030)])
    return Trace([rank0, rank1], [0.0, -offset])


def test_unmodified_replay_reproduces_the_measured_step() -> None:
    trace = _two_ranks(offset=5.0)
    result = replay_trace(trace)
    assert measured_step_time(trace) == pytest.approx(0.032)
    assert result.step_time == pytest.approx(0.032)
    assert result.exposed_comm()[0] == pytest.approx(0.010)
    assert result.exposed_comm()[1] == pytest.approx(0.015)
    assert "comm" in result.critical_breakdown()


def test_bandwidth_what_if_scales_only_the_bytes_share() -> None:
    trace = _two_ranks()
    # 1 MB all-reduce on 2 ranks puts 1 MB on the wire: at 100 MB/s that is the whole 10 ms... of a 15 ms transfer.
    half = replay_trace(trace, WhatIf(bandwidth_ratio=0.5, link_bytes_per_s=100 * MB))
    assert half.step_time == pytest.approx(0.032 + 0.010)
    faster = replay_trace(trace, WhatIf(bandwidth_ratio=2.0, link_bytes_per_s=100 * MB))
    assert faster.step_time == pytest.approx(0.032 - 0.005)


def test_bandwidth_what_if_from_the_trace_alone_scales_the_transfer_beyond_fixed_costs() -> None:
    # no op under 4 KiB: no fixed cost, the whole 15 ms transfer is link-bound
    assert replay_trace(_two_ranks(), WhatIf(bandwidth_ratio=0.5)).step_time == pytest.approx(0.032 + 0.015)


def test_overlap_off_waits_right_after_launch() -> None:
    result = replay_trace(_two_ranks(), WhatIf(overlap=False, link_bytes_per_s=100 * MB))
    # rank 0 waits from 10 ms (launch) until the transfer ends at 30 ms, then computes its last 10 ms
    assert result.step_time == pytest.approx(0.040 + 0.002)


def test_compute_ratio_and_recompute() -> None:
    trace = _two_ranks()
    slower = replay_trace(trace, WhatIf(compute_ratio=(("FW", 2.0),)))
    assert slower.step_time > replay_trace(trace).step_time


def test_round_trip_offset() -> None:
    # peer clock = rank 0 clock + 3 s; 1 ms each way; the noisier sample is ignored
    assert offset_from_round_trips([(0.0, 3.001, 3.002, 0.003), (0.0, 3.004, 3.005, 0.010)]) == pytest.approx(-3.0)
    with pytest.raises(ValueError, match="at least one"):
        offset_from_round_trips([])


def test_chrome_trace_links_the_collective_across_ranks(tmp_path) -> None:
    trace = _two_ranks(offset=5.0)
    events = chrome_trace(trace)["traceEvents"]
    flows = [e for e in events if e["ph"] in ("s", "f")]
    assert sorted((e["ph"], e["pid"]) for e in flows) == [("f", 1), ("s", 0)]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
    # clocks aligned: rank 1's step starts where rank 0's does
    steps = [e for e in events if e.get("cat") == "step"]
    assert steps[0]["ts"] == pytest.approx(steps[1]["ts"])
    loaded = Trace.load(trace.save(tmp_path / "t.json"))
    assert loaded.to_dict() == trace.to_dict()


def test_summary_numbers() -> None:
    numbers = summary_numbers(_two_ranks())
    assert numbers["replay_error"] == pytest.approx(0.0, abs=1e-9)
    assert numbers["exposed_comm_s"] == pytest.approx({0: 0.010, 1: 0.015})
    assert numbers["bytes_per_step"] == {"all_reduce": 2 * MB}


def test_replay_engine_orders_by_device_and_finds_the_critical_path() -> None:
    graph = TaskGraph()
    a = graph.add(Task("a", "d0", 1.0, 0, "FW"))
    b = graph.add(Task("b", "d0", 2.0, 0, "FW"))
    c = graph.add(Task("c", "link", 4.0, 0, "comm", deps=[a]))
    d = graph.add(Task("d", "d0", 1.0, 0, "BW", deps=[b, c]))
    result = replay(graph)
    assert result.makespan == pytest.approx(6.0)
    assert result.critical_path == [a, c, d]
    with pytest.raises(ValueError, match="not added yet"):
        graph.add(Task("e", "d0", 1.0, 0, "FW", deps=[99]))


COSTS = StepCosts(block_forward_per_sample=0.001, rest_forward_per_sample=0.0, backward_ratio=2.0,
                  update_per_param=0.0, host_per_step=0.0, op_fixed_s=0.0, link_bytes_per_s=1e15)
SHAPE = ModelShape(blocks=2, block_params=1000, other_params=0, hidden=8, seq=4)


def test_layout_pipeline_matches_the_1f1b_formula() -> None:
    # 2 stages, 2 micro-batches of 1 sample: (M + S - 1) * (f + b) with free links
    result = predict_layout(COSTS, SHAPE, LayoutSpec(dp=1, pp=2, tp=1, micro_batches=2, samples=2))
    assert result.step_time == pytest.approx(3 * 0.003)


def test_layout_tensor_and_data_parallel_costs() -> None:
    single = predict_layout(COSTS, SHAPE, LayoutSpec(1, 1, 1, 1, 2)).step_time
    assert single == pytest.approx(2 * 0.002 * 3)
    tp = predict_layout(COSTS, SHAPE, LayoutSpec(1, 1, 2, 1, 2)).step_time
    assert tp == pytest.approx(single / 2)
    slow_link = StepCosts(**{**COSTS.__dict__, "link_bytes_per_s": 8000.0})
    dp = predict_layout(slow_link, SHAPE, LayoutSpec(2, 1, 1, 1, 2)).step_time
    # 2000 parameters of 4 bytes all-reduced over 2 ranks: 8000 bytes on the wire, 1 s; each block's gradients
    # leave as its backward ends, so the first block's transfer hides the second's backward (0.004 s)
    assert dp == pytest.approx(single - 0.004 + 1.0)


def test_simulated_rank_counts_replay() -> None:
    result = predict_layout(COSTS, SHAPE, LayoutSpec(dp=16, pp=2, tp=2, micro_batches=4, samples=8))
    assert {task.rank for task in result.graph.tasks} == set(range(64))
    assert result.step_time > 0


def test_a_link_faster_than_the_trace_resolves_still_gets_a_rate() -> None:
    """Large ops no slower than the fixed cost (a fast loopback) leave nothing beyond it: their whole time bounds the
    rate from below, so calibration never fails for a link that is too fast."""
    from lightning_merak.planning.replay.engine import CommOp, transfer_seconds

    def op(wire: float, duration: float) -> CommOp:
        return CommOp(key=("ar", wire), op="all_reduce", channel="dp", wire=wire, duration=duration, done=0.0,
                      participants={})

    assert transfer_seconds([op(65536, 3e-4), op(131072, 5e-4)], fixed=1e-4) == pytest.approx(6e-4)
    assert transfer_seconds([op(65536, 1e-4), op(131072, 0.9e-4)], fixed=1e-4) == pytest.approx(1.9e-4)


def test_fixed_costs_per_call_are_not_divided_away_by_smaller_micro_batches() -> None:
    # per sample only: 4 samples in 2 or 4 micro-batches of 2 or 1 sample, (M + 1) * (f + b) with f = b / 2
    assert predict_layout(COSTS, SHAPE, LayoutSpec(1, 2, 1, 2, 4)).step_time == pytest.approx(3 * 0.006)
    assert predict_layout(COSTS, SHAPE, LayoutSpec(1, 2, 1, 4, 4)).step_time == pytest.approx(5 * 0.003)
    # 1 ms fixed per block call or per chunk, no per-sample cost: every micro-batch costs its 1 + 2 ms
    for fixed in ({"block_call_s": 0.001}, {"chunk_forward_s": 0.001}):
        costs = StepCosts(**{**COSTS.__dict__, "block_forward_per_sample": 0.0, **fixed})
        for m in (2, 4):
            assert predict_layout(costs, SHAPE, LayoutSpec(1, 2, 1, m, 4)).step_time == pytest.approx((m + 1) * 0.003)


def test_the_loops_work_between_chunks_follows_every_chunk_but_the_last() -> None:
    gaps = StepCosts(**{**COSTS.__dict__, "block_forward_per_sample": 0.0, "chunk_host_s": (0.001, 0.001)})
    # stage 1 runs F0 B0 F1 B1, each gap holding up stage 0's next chunk: three gaps in a row
    assert predict_layout(gaps, SHAPE, LayoutSpec(1, 2, 1, 2, 4)).step_time == pytest.approx(0.003)
    assert predict_layout(gaps, SHAPE, LayoutSpec(1, 1, 1, 2, 4)).step_time == pytest.approx(0.0)  # no pipeline


def test_anchored_scales_compute_to_the_untraced_step_and_leaves_the_transfers() -> None:
    trace = _two_ranks()
    # the run's untraced steps took 40 ms where the traced one took 32: the replay of the anchored trace agrees
    anchor = anchored(trace, 0.040)
    factor = dict(anchor.compute_ratio)["FW"]
    assert dict(anchor.compute_ratio) == {category: factor for category in ("FW", "BW", "UPDATE", "host")}
    assert replay_trace(trace, anchor).step_time == pytest.approx(0.040, rel=1e-3)
    # rank 1's 15 ms of compute sets the transfer's start: 15 * f + 15 ms transfer + rank 0's 2 ms tail * f = 40 ms
    assert factor == pytest.approx(25 / 17, rel=1e-3)
    # a slower link stretches the transfer alone: 15 ms more at half the rate, however compute was anchored
    slower = anchored(trace, 0.040, WhatIf(bandwidth_ratio=0.5, compute_ratio=(("BW", 3.0),)))
    assert dict(slower.compute_ratio)["BW"] == pytest.approx(3.0 * factor)
    assert replay_trace(trace, slower).step_time == pytest.approx(0.040 + 0.015, rel=1e-3)


def test_anchored_refuses_a_step_shorter_than_the_traced_communication() -> None:
    with pytest.raises(ValueError, match="communication alone replays to 15.00 ms"):
        anchored(_two_ranks(), 0.010)
    with pytest.raises(ValueError, match="step_s must be positive"):
        anchored(_two_ranks(), 0.0)


def test_a_known_link_rate_scales_the_bytes_and_keeps_what_the_transfer_took_short_of_them() -> None:
    # the 1 MB transfer took 15 ms where its bytes need 20 ms at 50 MB/s (a shaper's burst): the 5 ms it saved stay
    # saved at half the rate, 40 ms of bytes less 5 ms
    result = replay_trace(_two_ranks(), WhatIf(bandwidth_ratio=0.5, link_bytes_per_s=50 * MB))
    assert result.step_time == pytest.approx(0.032 + 0.020)
    with pytest.raises(ValueError, match="link_bytes_per_s must be positive"):
        WhatIf(link_bytes_per_s=0.0)


def test_link_payload_rate_counts_tcp_and_frame_headers() -> None:
    assert link_payload_bytes_per_s(1e9) == pytest.approx(125e6 * 1448 / 1514)
    assert link_payload_bytes_per_s(8e6, mtu=9000, frame_overhead=38) == pytest.approx(1e6 * 8948 / 9038)
    with pytest.raises(ValueError, match="mtu must exceed"):
        link_payload_bytes_per_s(1e9, mtu=40)
