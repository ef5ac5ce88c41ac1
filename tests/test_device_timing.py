"""Device time (``lightning_merak.util.timing``): every measurement that feeds a decision waits for the device.

On the CPU the helper is the wall clock; on CUDA a figure must be the kernels' run, not their launch. Here a fake
CUDA stands in for the GPU: the helper believes every device is CUDA, events and synchronisations are recorded,
and each measurement path that feeds a planner, partitioner, cost model or scheduler is driven through its public
function on CPU tensors, proving that it times through the helper (its figures are the fake device's clock, whose
ticks are far longer than any real call here) and that every time it reads waited for the device first. One test
marked ``gpu`` checks on a real CUDA device that the helper reads device time, not launch time.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.util import timing
from lightning_merak.util.timing import (
    DeviceSeconds,
    DeviceStamp,
    DeviceTimer,
    device_now,
    mean_call_time,
    median_call_time,
    synchronize,
)

TICK_S = 1000.0
"""How far the fake device's clock moves at each event or clock read: no real call in these tests takes that long,
so a figure of this size came from the fake device."""


# On the CPU ------------------------------------------------------------------------------------


# A loaded machine oversleeps: each figure is checked against a wall clock read around its region.


def test_a_timer_measures_its_region_and_not_the_wait_before_its_read() -> None:
    before = time.perf_counter()
    with DeviceTimer("cpu") as timer:
        time.sleep(0.05)
    around = time.perf_counter() - before
    time.sleep(0.05)  # after the region: a late read must not count it
    first = timer.seconds
    assert 0.049 <= first <= around
    assert timer.seconds == first, "a finished region reads the same however late"


def test_stamps_measure_the_time_between_them() -> None:
    before = time.perf_counter()
    start = DeviceStamp(torch.device("cpu"))
    time.sleep(0.03)
    end = DeviceStamp(torch.device("cpu"))
    around = time.perf_counter() - before
    assert 0.029 <= end.seconds_since(start) <= around
    assert start.seconds_since(end) == -end.seconds_since(start)


def test_a_node_is_timed_after_a_forward_and_backward_of_it() -> None:
    """AutoPipe's node profile (``recording.measure``): a process's first node paid one-off costs in its first
    timed forwards (10-15 ms calls of a 0.3 ms lookup), so the node runs forward and backward before any timing."""
    from lightning_merak.parallel.pipeline.recording import measure

    weight = nn.Parameter(torch.ones(3))
    grad_modes: list[bool] = []

    def run() -> torch.Tensor:
        grad_modes.append(torch.is_grad_enabled())
        return weight * 2

    measure(run, [weight], 2, torch.device("cpu"))
    assert grad_modes[:4] == [True, False, False, False], "forward and backward, then the forward's warm-up and timing"
    assert weight.grad is None


def test_call_times_leave_out_the_warm_up_call() -> None:
    calls = []

    def slow_first() -> None:
        calls.append(None)
        time.sleep(0.2 if len(calls) == 1 else 0.01)

    before = time.perf_counter()
    median = median_call_time(slow_first, 3, "cpu")
    around = time.perf_counter() - before
    assert 0.0099 <= median <= (around - 0.2) / 2, "the median of three calls, none of them the first"
    assert mean_call_time(slow_first, 3, torch.device("cpu")) >= 0.0099
    assert len(calls) == 8


def test_the_cpu_never_synchronises_a_gpu(monkeypatch) -> None:
    def refuse(device: Any = None) -> None:
        raise AssertionError("used CUDA for a CPU timing")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda, "Event", refuse)
    synchronize("cpu")
    before = time.perf_counter()
    assert before <= device_now(torch.device("cpu")) <= time.perf_counter()
    with DeviceTimer("cpu") as timer:
        pass
    assert timer.seconds >= 0


def test_a_series_of_regions_reads_each_once_when_looked_at() -> None:
    seconds = DeviceSeconds()
    assert len(seconds) == 0 and not seconds and list(seconds) == []
    around = []
    for pause in (0.01, 0.03):
        before = time.perf_counter()
        start = DeviceStamp("cpu")
        time.sleep(pause)
        seconds.append(start, DeviceStamp("cpu"))
        around.append(time.perf_counter() - before)
    assert len(seconds) == 2
    assert 0.0099 <= seconds[0] <= around[0] and 0.0299 <= seconds[-1] <= around[1]
    assert seconds[1:] == [seconds[1]] and list(seconds) == seconds[:]


def test_a_timer_read_inside_its_region_is_refused() -> None:
    timer = DeviceTimer("cpu")
    with pytest.raises(RuntimeError, match="after its with block"):
        _ = timer.seconds
    with timer:
        with pytest.raises(RuntimeError, match="after its with block"):
            _ = timer.seconds


# The fake CUDA ---------------------------------------------------------------------------------


class FakeCuda:
    """Stands in for a GPU: ``log`` records, in order, ``record``, ``wait`` (an event's synchronize), ``read``
    (an elapsed time), ``synchronize`` (the device's) and ``clock`` (the helper's wall clock)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.ticks = 0
        self.unwaited_reads = 0

    def now(self) -> float:
        """The device's clock: a tick further at every reading, and the real time (so that the figures a
        measurement subtracts from each other keep their real order)."""
        self.ticks += 1
        return self.ticks * TICK_S + time.perf_counter()

    def assert_every_read_waited(self, reads: int = 1) -> None:
        """At least ``reads`` times were read, each after the device was waited for."""
        assert self.log.count("read") + self.log.count("clock") >= reads, self.log
        assert self.unwaited_reads == 0, "an event's time was read before waiting for it"
        for index, entry in enumerate(self.log):
            if entry == "clock":
                assert index > 0 and self.log[index - 1] == "synchronize", "the wall clock read without a wait"


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing, "a timing event needs enable_timing=True"
            self.at_s: float | None = None
            self.waited = False

        def record(self, stream: Any = None) -> None:
            self.at_s, self.waited = fake.now(), False
            fake.log.append("record")

        def synchronize(self) -> None:
            self.waited = True
            fake.log.append("wait")

        def elapsed_time(self, end: "Event") -> float:
            if not (self.waited and end.waited):
                fake.unwaited_reads += 1
            fake.log.append("read")
            return (end.at_s - self.at_s) * 1000.0

    def synchronize_device(device: Any = None) -> None:
        fake.log.append("synchronize")

    def perf_counter() -> float:
        fake.log.append("clock")
        return fake.now()

    monkeypatch.setattr(timing, "_on_cuda", lambda device: True)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize_device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return fake



def test_a_timer_reads_its_events_only_when_asked_and_waits_first(fake_cuda) -> None:
    with DeviceTimer("cpu") as timer:
        torch.ones(4).sum()
    assert fake_cuda.log == ["record", "record"], "nothing waits before the figure is asked for"
    assert TICK_S <= timer.seconds < TICK_S + 1
    assert fake_cuda.log[2:] == ["wait", "wait", "read"]
    fake_cuda.assert_every_read_waited()


def test_device_now_synchronises_before_reading_the_clock(fake_cuda) -> None:
    first, second = device_now("cpu"), device_now("cpu")
    assert TICK_S <= second - first < TICK_S + 1
    assert fake_cuda.log == ["synchronize", "clock"] * 2


def test_stamps_of_two_kinds_are_refused(fake_cuda, monkeypatch) -> None:
    on_device = DeviceStamp("cpu")
    monkeypatch.setattr(timing, "_on_cuda", lambda device: False)
    monkeypatch.setattr(timing, "time", time)
    with pytest.raises(ValueError, match="one device"):
        DeviceStamp("cpu").seconds_since(on_device)


def test_call_times_wait_for_every_timed_call(fake_cuda) -> None:
    assert TICK_S <= median_call_time(lambda: None, 3, "cpu") < TICK_S + 1
    assert fake_cuda.log.count("record") == 6, "the warm-up call is not timed"
    assert TICK_S <= mean_call_time(lambda: None, 2, "cpu") < TICK_S + 1
    fake_cuda.assert_every_read_waited(reads=5)


# Each measurement path, under the fake CUDA ------------------------------------------------------


VOCAB, SEQ = 96, 8


def _llama(meta: bool = False) -> nn.Module:
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2})
    if meta:
        with torch.device("meta"):
            model = build_causal_lm(config, vocab_size=VOCAB)
    else:
        model = build_causal_lm(config, vocab_size=VOCAB)
    model.config.use_cache = False
    return model


def _tokens(rows: int = 4) -> torch.Tensor:
    return torch.randint(VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(1))


def test_layout_profiler_and_autopipe_block_profile_wait_for_the_device(fake_cuda) -> None:
    """``profile_model`` in one process: the trace's block costs (AutoPipe's profile, ``recording.measure``), the
    blocks cut at their collectives, the loss's forward and backward, and the optimizer and clipping passes.

    ``profile_network`` (all-reduce, gradient sync, p2p, the pipeline runtime) and ``measure_all_to_all`` need two
    ranks or more (one returns before timing); they time through :func:`median_call_time` /
    :func:`mean_call_time` with their device, which ``test_call_times_wait_for_every_timed_call`` covers.
    """
    from lightning_merak.planning.measure.layout import profile_model
    from lightning_merak.planning.planner import SearchSpace, required_profile_keys
    from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
    from lightning_merak.strategies.merak3d.build import call_model

    model, tokens = _llama(), _tokens()
    space = SearchSpace(world_size=1, global_batch_size=None, replica_batch_size=4, tp_degrees_allowed=(1,),
                        max_pipeline_stages=2, overlap_choices=(1,))

    def loss_of(logits: torch.Tensor, samples: int) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:samples].flatten())

    profile = profile_model(model, tokens, call_model, tensor_parallel_plan, required_profile_keys(space, 2),
                            lambda params: torch.optim.AdamW(params), repeats=2, loss_of=loss_of)
    fake_cuda.assert_every_read_waited(reads=20)
    assert profile.block_times
    for times in profile.block_times.values():
        assert min(*times.forward_segments_s, *times.backward_segments_s) >= TICK_S, times
    assert profile.loss_times and all(min(times) >= TICK_S for times in profile.loss_times.values())
    assert min(profile.block_optimizer_s.values()) >= TICK_S and min(profile.block_clip_s.values()) >= TICK_S
    assert min(profile.prefix_update_s) >= TICK_S and min(profile.suffix_update_s) >= TICK_S
    # the prefix's and suffix's forward come from the trace's node costs: AutoPipe's block profile
    assert all(times[0] >= TICK_S for times in (*profile.prefix_times.values(), *profile.suffix_times.values()))


def test_the_replay_probe_waits_for_the_device(fake_cuda) -> None:
    from lightning_merak.planning.measure.probe import probe_call_curves

    block, head, prefix, loss = probe_call_curves(_llama(), _tokens(), (1, 2), rounds=1, warmup=0)
    fake_cuda.assert_every_read_waited(reads=16)
    assert min(block.forward_s + block.backward_s) >= TICK_S / 2, "the two blocks' time, per block"
    assert min(head.forward_s + head.backward_s + prefix.forward_s + prefix.backward_s) >= TICK_S
    assert min(loss.forward_s + loss.backward_s) >= TICK_S


def test_autopipe_block_profile_of_a_meta_model_waits_for_the_device(fake_cuda) -> None:
    """A meta model's trace materialises and times one node at a time (``meta_trace``), and the dense gradient of
    the embedding rows its stand-in leaves out is timed apart."""
    from lightning_merak.parallel.pipeline.trace import trace_model

    costs = trace_model(_llama(meta=True), _tokens(2), profile=True, profile_repeats=1).costs
    fake_cuda.assert_every_read_waited(reads=7)  # forward, then with backward: prefix, one block of a kind, head;
    # and the dense gradient
    assert all(cost.forward_s >= TICK_S for cost in costs)
    assert costs[0].is_embedding and costs[0].backward_s >= TICK_S, "the table's dense gradient, timed on the device"


def _moe(hidden: int = 8, num_experts: int = 2) -> nn.Module:
    from lightning_merak.plugins.moe import CommCurve, CostModel, MoE

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(hidden, 16), nn.GELU(), nn.Linear(16, hidden))
    cost = CostModel(CommCurve.from_bandwidth(1e5), CommCurve.from_bandwidth(1e12), 1e6, hidden * 4,
                     sum(p.numel() for p in expert.parameters()) * 4, num_experts)
    return MoE(hidden, expert, num_experts=num_experts, ep_size=1, k=1, min_capacity=2, cost_model=cost,
               online_check=False)


def test_moe_exchange_times_for_the_plan_check_wait_for_the_device(fake_cuda) -> None:
    """The exchange's forward and backward seconds, which the online plan check learns from."""
    moe = _moe()
    out, l_aux, _ = moe(torch.randn(2, 4, 8, requires_grad=True))
    (out.sum() + l_aux).backward()
    stats = moe.deepspeed_moe.stats
    fake_cuda.assert_every_read_waited(reads=2)
    assert stats["exchange_forward_s"] >= TICK_S and stats["exchange_backward_s"] >= TICK_S


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense, self.moe = nn.Linear(8, 8), _moe()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, l_aux, _ = self.moe(self.dense(x))
        return x + out, l_aux


def test_block_scope_lancet_measurements_wait_for_the_device(fake_cuda) -> None:
    """``chunks="auto"``: the unsplit block and its MoE layers (dense time), then the block as two sub-batches.

    With one rank the choice follows the first call; the split measurement runs where the batch and several
    ranks allow it, so it is driven here by asking for it again (``chunks`` unset) on the same public call.
    """
    from lightning_merak.plugins.moe.lancet_block import lancet_overlap

    stack = nn.ModuleList([_MoEBlock()])
    (block,) = lancet_overlap(stack, "auto")
    x = torch.randn(4, 3, 8)
    block(x)
    assert block.forward.dense_s >= TICK_S, "the block's time less its MoE layer's, both on the device"
    block.forward.chunks = None
    block(x)
    fake_cuda.assert_every_read_waited(reads=4)
    assert block.forward.sub_batch_overhead_s is not None


def test_expert_parallel_lancet_trials_wait_for_the_device(fake_cuda, single_rank_group) -> None:
    """The ``auto`` trials run only with experts over several ranks; their timing unit, :meth:`_trial`, is driven
    directly on one rank's group."""
    from lightning_merak.plugins.moe.experts.lancet import TRIAL_ROUNDS, ExpertParallelLancet

    block = nn.Linear(8, 8)
    lancet = ExpertParallelLancet(block, nn.Identity(), "auto")
    x = torch.randn(4, 8)
    candidates = 3  # 1, 2 and 4 sub-batches divide the batch of 4
    for _ in range(1 + TRIAL_ROUNDS * candidates):
        lancet._trial(4, single_rank_group, (x,), {})
    fake_cuda.assert_every_read_waited(reads=TRIAL_ROUNDS * candidates)
    assert lancet.chunks in (1, 2, 4)
    assert all(min(times) >= TICK_S for times in lancet.trials.values())


def test_moe_cost_model_measurement_waits_for_the_device(fake_cuda) -> None:
    from lightning_merak.plugins.moe.cost_measurement import profile_cost_model

    expert = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    cost = profile_cost_model(expert, 8, 1, None, [0], repeats=2)
    fake_cuda.assert_every_read_waited(reads=2)
    assert cost.measured["expert_forward_1024_tokens_s"] >= TICK_S


def test_sparse_communication_wire_model_waits_for_the_device(fake_cuda, single_rank_group, monkeypatch) -> None:
    """The network and scan-speed probes ``on_fit_start`` runs, called directly (the callback needs a trainer and
    several ranks; on one rank the all-reduce is timed the same, priced as two ranks' wire bytes)."""
    from lightning_merak.callbacks.sparse_comm import strategy_wiring

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    network = strategy_wiring.measure_bandwidth(single_rank_group)
    scan_speed = strategy_wiring.measure_scan_speed(torch.device("cpu"))
    fake_cuda.assert_every_read_waited(reads=2)
    probe_bytes = strategy_wiring.BANDWIDTH_PROBE_BYTES
    assert network.bandwidth_bytes_per_s <= probe_bytes * 3 / TICK_S and scan_speed <= probe_bytes * 3 / TICK_S


def test_embrace_exchange_timing_waits_for_the_device(fake_cuda, single_rank_group) -> None:
    from lightning_merak.callbacks.sparse_comm import ShardedEmbedding

    torch.manual_seed(0)
    table = ShardedEmbedding.from_embedding(nn.Embedding(16, 4), single_rank_group)
    table(torch.tensor([[1, 2, 3], [3, 4, 5]])).sum().backward()
    fake_cuda.assert_every_read_waited()
    assert table.last_exchange is not None and table.last_exchange.all_rows_s >= TICK_S


def test_data_parallel_exposed_communication_is_read_lazily_from_the_device(fake_cuda, single_rank_group) -> None:
    from lightning_merak.parallel.data.buckets import DataParallelGradients

    layer = nn.Linear(8, 8)
    groups = SimpleNamespace(layout=SimpleNamespace(data_parallel=1, data_parallel_sharding="none"),
                             data_parallel_group=single_rank_group)
    reduction = DataParallelGradients(list(layer.parameters()), [], groups=groups, mode="none", shards=1,
                                      overlap=True, bucket_bytes=1 << 10)
    for _ in range(2):
        reduction.arm(1)
        layer(torch.randn(4, 8)).sum().backward()
        reduction.finish()
    assert len(reduction.exposed_s) == 2 and "read" not in fake_cuda.log, "a step, or counting them, does not wait"
    assert reduction.exposed_s[-1] >= TICK_S and min(reduction.exposed_s) >= TICK_S
    fake_cuda.assert_every_read_waited(reads=2)
    assert reduction.stats()["steps"] == 2 and fake_cuda.log.count("read") == 2, "each step is read once"


def test_the_pipeline_bubble_is_read_from_the_device_after_the_step(fake_cuda) -> None:
    """merak3d's measured bubble (``StageBusyClock``): chunks and the step are events, read only when asked."""
    from lightning_merak.parallel.pipeline.busy import StageBusyClock

    class Stage:
        def forward_one_chunk(self, chunk_id: int) -> int:
            return chunk_id

    stage = Stage()
    clock = StageBusyClock([stage], torch.device("cpu"))
    with clock.step():
        stage.forward_one_chunk(0)
        stage.forward_one_chunk(1)
    assert set(fake_cuda.log) == {"record"}, "nothing waits during the step"
    busy, step = clock.last
    assert 2 * TICK_S <= busy < 2 * TICK_S + 1 and step > busy
    fake_cuda.assert_every_read_waited(reads=3)


def test_delta_swap_bandwidth_waits_for_the_device(fake_cuda) -> None:
    from lightning_merak.callbacks.delta.swap_tiers import HostTier

    copy_out, copy_in = HostTier(torch.device("cpu"), 1 << 20).measure_bandwidth(torch.device("cpu"), 1024, 2)
    fake_cuda.assert_every_read_waited(reads=6)
    assert max(copy_out, copy_in) <= 1024 / TICK_S


# On a real GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_matmul_is_timed_on_the_device_not_at_its_launch() -> None:
    """The helper's figure is at least what a synchronised wall clock measures for the same work, and far more
    than the launch alone."""
    device = torch.device("cuda")
    a = torch.randn(8192, 8192, device=device)
    a @ a  # cuBLAS's first call sets up
    torch.cuda.synchronize(device)

    def matmuls() -> None:
        for _ in range(4):
            a @ a

    launched = time.perf_counter()
    with DeviceTimer(device) as timer:
        matmuls()
    launch_s = time.perf_counter() - launched
    device_s = timer.seconds
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    matmuls()
    torch.cuda.synchronize(device)
    synchronised_s = time.perf_counter() - start
    assert device_s >= 0.9 * synchronised_s - 1e-3, (device_s, synchronised_s)
    assert launch_s < 0.5 * device_s, "the launch returned before the kernels ran"
    per_call = median_call_time(lambda: a @ a, 3, device)
    assert per_call >= 0.9 * synchronised_s / 4 - 1e-3, (per_call, synchronised_s)
    assert device_now(device) - start >= synchronised_s
