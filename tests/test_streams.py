"""Side streams (``lightning_merak.distributed.streams``): a no-op on the CPU, and on CUDA the order of waits
and ``record_stream`` calls that keeps overlapped work correct.

The CUDA order is checked on any machine through the module's own seam (:class:`StreamApi`): a stand-in records
every stream call. The ``gpu``-marked tests run the real thing: a matmul on a side stream while the compute
stream copies and reuses memory, under torch's CUDA sanitizer where this torch has it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from typing import Any, Iterator

import pytest
import torch

from lightning_merak.callbacks.delta.swap_tiers import HostTier
from lightning_merak.distributed import streams
from lightning_merak.distributed.streams import SideStreamWork, StreamApi, side_stream

GPU = torch.device("cuda", 0)


def _on_side_stream(device: torch.device, purpose: str, work: Any, inputs: tuple[torch.Tensor, ...]) -> Any:
    """``work()`` on the side stream with its inputs recorded there: that stream's work (which hands the value
    over) and the value."""
    with SideStreamWork(device, purpose) as side:
        side.uses(*inputs)
        value = work()
    return side, value


def test_on_the_cpu_work_runs_inline_and_results_are_the_same_tensors() -> None:
    left, right = torch.randn(8, 4), torch.randn(4, 3)
    side, value = _on_side_stream(torch.device("cpu"), "test", lambda: left @ right, inputs=(left, right))
    assert side.done()
    value = side.hand_over(value)
    assert torch.equal(value, left @ right)
    assert side_stream(torch.device("cpu"), "test") is None
    with SideStreamWork(torch.device("cpu"), "test") as side:
        side.uses(left)
        copied = left.clone()
    assert side.hand_over(copied) is copied and side.done()


class _Recorded:
    """A stream or event of the stand-in: every call is written to the shared log."""

    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self._log = name, log

    def wait_stream(self, other: "_Recorded") -> None:
        self._log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: "_Recorded") -> None:
        self._log.append(("wait_event", self.name, event.name))

    def record(self, stream: "_Recorded") -> None:
        self._log.append(("record_event", self.name, stream.name))

    def query(self) -> bool:
        self._log.append(("query", self.name))
        return False


class RecordingStreamApi(StreamApi):
    """The CUDA stream calls, written to ``log`` instead of made (every tensor counts as a CUDA tensor)."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.streams = 0
        self.current = _Recorded("compute", self.log)

    def new_stream(self, device: torch.device) -> _Recorded:
        self.streams += 1
        self.log.append(("new_stream", str(device)))
        return _Recorded(f"side{self.streams}", self.log)

    def current_stream(self, device: torch.device) -> _Recorded:
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream: _Recorded) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        yield
        self.log.append(("leave", stream.name))

    def new_event(self) -> _Recorded:
        return _Recorded("event", self.log)

    def record_stream(self, tensor: torch.Tensor, stream: _Recorded) -> None:
        self.log.append(("record_stream", tuple(tensor.shape), stream.name))

    def on_streams(self, tensor: torch.Tensor) -> bool:
        return True


@pytest.fixture
def recording() -> Iterator[RecordingStreamApi]:
    with streams.using_stream_api(RecordingStreamApi()) as api:
        yield api


def test_side_stream_waits_then_works_then_records_then_the_consumer_waits(recording: RecordingStreamApi) -> None:
    left, right = torch.randn(2, 5), torch.randn(5, 7)

    def work() -> torch.Tensor:
        recording.log.append(("work",))
        return left @ right

    side, value = _on_side_stream(GPU, "matmul", work, inputs=(left, right))
    value = side.hand_over(value)
    assert torch.equal(value, left @ right)
    assert recording.log == [
        ("new_stream", "cuda:0"),
        ("wait_stream", "side1", "compute"),  # the side stream starts after the compute stream's work so far
        ("enter", "side1"),
        ("record_stream", (2, 5), "side1"),  # inputs the compute stream allocated: not reused under the side
        ("record_stream", (5, 7), "side1"),
        ("work",),
        ("leave", "side1"),
        ("record_event", "event", "side1"),
        ("wait_event", "compute", "event"),  # the consumer reads only after the side stream's event
        ("record_stream", (2, 7), "compute"),  # the result, allocated on the side stream, is used on compute
    ]


def test_each_purpose_has_one_cached_stream_per_device(recording: RecordingStreamApi) -> None:
    first = side_stream(GPU, "gather")
    assert side_stream(GPU, "gather") is first
    assert side_stream(GPU, "swap") is not first
    assert side_stream(torch.device("cuda", 1), "gather") is not first
    assert recording.streams == 3


def test_the_swap_tier_copies_through_its_side_stream(recording: RecordingStreamApi) -> None:
    """DELTA's host tier: the copy-in waits for compute, runs on the swap stream, and is handed to compute."""
    tier = HostTier.__new__(HostTier)
    tier.device, tier.is_cuda = GPU, True
    tier.copy_stream = side_stream(GPU, "delta-swap")
    stored = torch.arange(6, dtype=torch.uint8)
    recording.log.clear()
    original_empty = torch.empty
    with pytest.MonkeyPatch.context() as patch:  # the stand-in has no GPU to allocate on: the CPU stands in
        patch.setattr(torch, "empty", lambda *shape, **kwargs: original_empty(*shape, dtype=kwargs["dtype"]))
        transfer = tier.copy_in(stored, GPU)
    assert not transfer.done()
    restored = transfer.finish()
    assert torch.equal(restored, stored)
    assert [entry[0] for entry in recording.log] == ["wait_stream", "enter", "leave", "record_event", "query",
                                                     "wait_event", "record_stream"]
    assert recording.log[0] == ("wait_stream", "side1", "compute")


# ------------------------------------------------------------------------------------------------- real CUDA

def _side_matmul_beside_reuse(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A matmul on a side stream whose inputs the compute stream frees at once and overwrites with new tensors of
    the same size while it runs: its result must equal the one computed on the compute stream alone."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    left = torch.randn(size, size, device="cuda", generator=generator)
    right = torch.randn(size, size, device="cuda", generator=generator)
    expected = left @ right
    source = torch.randn(size * size, device="cuda", generator=generator)
    target = torch.empty_like(source)
    operands = [left, right]
    del left, right
    side, pending = _on_side_stream(operands[0].device, "test-matmul", lambda: operands[0] @ operands[1],
                                    inputs=tuple(operands))
    target.copy_(source)  # compute-stream work beside the side stream's
    operands.clear()  # the inputs' last references: freed while the side stream may still read them
    reuse = [torch.full((size, size), float("nan"), device="cuda") for _ in range(4)]
    result = side.hand_over(pending)
    torch.cuda.synchronize()
    assert torch.equal(target, source) and all(bool(torch.isnan(block).all()) for block in reuse)
    return result, expected


@pytest.mark.gpu
def test_a_side_stream_matmul_overlaps_a_copy_and_its_freed_inputs_are_not_reused_early() -> None:
    result, expected = _side_matmul_beside_reuse(4096)
    torch.testing.assert_close(result, expected)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("torch.cuda._sanitizer") is None,
                    reason="this torch has no CUDA sanitizer")
def test_the_side_stream_order_passes_the_cuda_sanitizer() -> None:
    """torch's CUDA sanitizer (``TORCH_CUDA_SANITIZER=1``) reports any unsynchronized access across streams."""
    script = textwrap.dedent("""
        import torch
        from tests.test_streams import _side_matmul_beside_reuse
        result, expected = _side_matmul_beside_reuse(512)
        torch.testing.assert_close(result, expected)
        print("sanitized ok")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1", "PYTHONPATH": os.pathsep.join([root, os.environ.get(
        "PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "sanitized ok" in run.stdout, run.stdout + run.stderr
