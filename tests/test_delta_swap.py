"""DeltaMemory's torch side on CPU: block discovery, swap hooks (host and disk tiers),
recompute switches, accounting, and cleanup of the disk tier."""

from __future__ import annotations

import copy
import ctypes
import os

import pytest
import torch
from torch import nn

from lightning_merak.callbacks.delta.activation_swap import SwapManager
from lightning_merak.callbacks.delta.blocks import discover_blocks
from lightning_merak.callbacks.delta.budget import parse_budget
from lightning_merak.callbacks.delta.ledger import ResidentLedger
from lightning_merak.callbacks.delta.memory_planner import Action
from lightning_merak.callbacks.delta.profiler import DeviceMemory, SavedTensorTracker
from lightning_merak.callbacks.delta.recompute_switch import user_checkpointing
from lightning_merak.callbacks.delta.runtime import ManagerOptions, MemoryManager
from lightning_merak.callbacks.delta.swap_tiers import DiskTier, HostTier
from lightning_merak.testing.delta_models import BasicBlock, SmallResNet, tiny_gpt2, tiny_llama


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def test_discovery_finds_the_repeated_blocks_of_each_model():
    assert [n for n, _ in discover_blocks(tiny_llama())] == ["model.layers.0", "model.layers.1"]
    assert [n for n, _ in discover_blocks(tiny_gpt2())] == ["transformer.h.0", "transformer.h.1"]
    resnet = [n for n, m in discover_blocks(SmallResNet())]
    assert resnet == [f"stages.{s}.{i}" for s in range(3) for i in range(2)]


def test_discovery_works_on_a_pipeline_stage_slice():
    layers = tiny_llama(layers=4).model.layers
    stage = nn.Sequential(*layers[2:])
    assert [n for n, _ in discover_blocks(stage)] == ["0", "1"]


def test_discovery_selectors_and_errors():
    model = SmallResNet()
    assert len(discover_blocks(model, BasicBlock)) == 6
    assert [n for n, _ in discover_blocks(model, ["stages.1.0"])] == ["stages.1.0"]
    assert len(discover_blocks(model, lambda name, m: name.startswith("stages.2."))) >= 2
    with pytest.raises(ValueError, match="not submodules"):
        discover_blocks(model, ["stages.9"])
    assert discover_blocks(nn.Linear(2, 2)) == []


def test_user_checkpointing_is_recognised():
    model = tiny_llama()
    assert user_checkpointing(model.model.layers[0]) is None
    model.activation_checkpointing_enable()
    assert "transformers gradient checkpointing" in user_checkpointing(model.model.layers[0])


class Chain(nn.Module):
    """Saves views (transposes, slices) and a parameter, exercising storage deduplication."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(32, 64)
        self.second = nn.Linear(64, 32)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = self.drop(h) * h.t().t()
        return self.second(h[:, :64].contiguous()).sin()


@pytest.mark.parametrize("tier_name", ["host", "disk"])
def test_swap_hooks_give_identical_gradients_and_settle_the_ledger(tier_name, tmp_path):
    torch.manual_seed(0)
    model = Chain()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    ledger = ResidentLedger()
    tracker = SavedTensorTracker(ledger)
    tracker.exclude_module_state(model)
    tier = HostTier(torch.device("cpu"), 2**30) if tier_name == "host" else DiskTier(torch.device("cpu"), str(tmp_path))
    swap = SwapManager(tier, tracker, min_offload_bytes=0, stash_depth=2)
    torch.manual_seed(1)
    with swap.hooks("chain"):
        out = model(x)
    swap.flush()
    assert tracker.saved_bytes("chain") > 0
    if tier_name == "disk":
        assert tier.files(), "copy-outs should have written files"
    out.square().sum().backward()
    swap.end_step()
    torch.manual_seed(1)
    reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert relative_error(p.grad, q.grad) <= 1e-6
    assert ledger.resident_bytes == 0
    if tier_name == "disk":
        del out
        tier.close()
        assert not os.path.exists(tier.directory)


def test_disk_tier_removes_its_files_after_an_exception(tmp_path):
    model = tiny_gpt2()
    model.train()
    options = ManagerOptions(
        budget=parse_budget("1KiB"), swap_tier="disk", swap_dir=str(tmp_path), warmup_steps=1,
        overrides={"transformer.h.0": Action.SWAP, "transformer.h.1": Action.SWAP},
    )
    manager = MemoryManager(discover_blocks(model), options, log=lambda message: None)
    manager.start(model, torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 16))
    directory = manager.swap.tier.directory
    with pytest.raises(RuntimeError, match="boom"):
        for step in range(3):
            manager.begin_step("ids", ids.numel())
            loss = model(input_ids=ids, labels=ids).loss
            manager.end_forward()
            if step == 2:
                assert manager.swap.tier.files()
                raise RuntimeError("boom")
            loss.backward()
            manager.end_backward()
    manager.close()
    assert not os.path.exists(directory)
    assert "forward" not in model.transformer.h[0].__dict__, "the forward switch must be removed"


def test_manager_recompute_and_swap_match_plain_training_with_dropout():
    torch.manual_seed(0)
    model = tiny_gpt2(layers=3)
    reference = copy.deepcopy(model)
    model.train(), reference.train()
    options = ManagerOptions(
        budget=parse_budget(10**9), swap_tier="host", warmup_steps=1,
        overrides={"transformer.h.0": Action.RECOMPUTE, "transformer.h.1": Action.SWAP},
    )
    manager = MemoryManager(discover_blocks(model), options, log=lambda message: None)
    manager.start(model, torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 16))
    for step in range(3):
        manager.begin_step("ids", ids.numel())
        torch.manual_seed(step)
        loss = model(input_ids=ids, labels=ids).loss
        manager.end_forward()
        loss.backward()
        manager.end_backward()
        torch.manual_seed(step)
        reference(input_ids=ids, labels=ids).loss.backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert relative_error(p.grad, q.grad) <= 1e-6
            p.grad = q.grad = None
        assert manager.ledger.resident_bytes == 0
    assert manager.plan.actions == {
        "transformer.h.0": Action.RECOMPUTE, "transformer.h.1": Action.SWAP, "transformer.h.2": Action.KEEP,
    }
    assert manager.blocks[0].switch.recompute
    manager.close()


def test_disk_tier_batches_round_trip_and_reuse_the_file_every_step(tmp_path):
    tier = DiskTier(torch.device("cpu"), str(tmp_path), batch_bytes=10_000)
    generator = torch.Generator().manual_seed(0)
    try:
        for step in range(3):
            sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
                       for n in (3000, 0, 5000, 4097, 7)]
            outgoing = [tier.copy_out(source) for source in sources]
            # waiting on a member of a batch nobody sent yet must send it, not hang
            stored = [outgoing[-1].finish()] + [t.finish() for t in outgoing[:-1]]
            stored = stored[1:] + stored[:1]
            incoming = [tier.copy_in(s, torch.device("cpu")) for s in stored]
            tier.submit()
            for source, transfer in zip(reversed(sources), reversed(incoming)):
                assert torch.equal(transfer.finish(), source)
            assert os.path.getsize(tier.path) == sum(s.numel() for s in sources), f"step {step} grew the file"
            for s in stored:
                tier.discard(s)
        assert tier.files() == ["arena.bin"]
    finally:
        tier.close()
    assert not os.path.exists(tier.directory)


class Wide(nn.Module):
    """Saves large tensors inside a swapped part and keeps others in a kept part."""

    def __init__(self) -> None:
        super().__init__()
        self.swapped = nn.Sequential(*(m for i in range(4) for m in (nn.Linear(64 if i == 0 else 256, 256), nn.Tanh())))
        self.kept = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64), nn.Tanh())


def test_stash_makes_room_before_a_tensor_counts_so_the_budget_is_never_crossed(tmp_path):
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(128, 64)
    ledger = ResidentLedger()
    tracker = SavedTensorTracker(ledger)
    tracker.exclude_module_state(model)
    tier = DiskTier(torch.device("cpu"), str(tmp_path))
    swap = SwapManager(tier, tracker, min_offload_bytes=0, stash_depth=64)
    swap.budget_bytes = 3 * 128 * 256 * 4  # three saved activations of the wide layers
    ledger.start_step()
    with swap.hooks("swapped"):
        hidden = model.swapped(x)
    with tracker.hooks("kept"):
        out = model.kept(hidden)
    swap.flush()
    assert tracker.saved_bytes("swapped") > swap.budget_bytes, "the test needs more swapped bytes than the budget"
    assert ledger.peak_bytes <= swap.budget_bytes
    out.sum().backward()
    swap.end_step()
    assert ledger.resident_bytes == 0
    tier.close()


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(
    not hasattr(ctypes.CDLL(None), "malloc_trim") or not os.path.exists("/proc/self/statm"),
    reason="needs glibc on Linux",
)
def test_release_free_gives_freed_heap_holes_back_to_the_os():
    # small blocks live on the heap, not in their own mappings; freeing every other one
    # leaves holes inside the heap that free() alone never returns
    blocks = [torch.ones(48 * 1024, dtype=torch.uint8) for _ in range(1200)]
    del blocks[::2]
    before = _rss_bytes()
    DeviceMemory(torch.device("cpu")).release_free()
    assert before - _rss_bytes() >= 10 * 2**20, "malloc_trim should return most of the ~28 MiB of holes"
    del blocks


def test_block_times_wait_for_the_gpu_in_warm_up_steps_only(monkeypatch):
    """On a GPU a block's time must be its kernels' run, not their launch: every block event of a profiled
    (warm-up) step synchronises the device first; managed steps never do."""
    model = tiny_gpt2(layers=2)
    model.train()
    options = ManagerOptions(budget=parse_budget(10**9), swap_tier="host", warmup_steps=1)
    manager = MemoryManager(discover_blocks(model), options, log=lambda message: None)
    manager.start(model, torch.device("cpu"))
    manager.device_memory.is_cuda = True  # the events' path as on a GPU; the synchronisations are counted
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    monkeypatch.setattr(manager.device_memory, "peak", lambda: 0)
    monkeypatch.setattr(manager.device_memory, "reset_peak", lambda: None)
    monkeypatch.setattr(manager.device_memory, "release_free", lambda: None)
    monkeypatch.setattr(manager.device_memory, "total", lambda: 2**34)
    ids = torch.randint(0, 128, (2, 16))
    per_step = []
    for _ in range(2):
        before = len(synchronized)
        manager.begin_step("ids", ids.numel())
        loss = model(input_ids=ids, labels=ids).loss
        manager.end_forward()
        loss.backward()
        manager.end_backward()
        per_step.append(len(synchronized) - before)
    manager.close()
    assert per_step[0] >= 4 * 2, "a warm-up step synchronises at each block's four events"
    assert per_step[1] == 0, "a managed step must not synchronise"
