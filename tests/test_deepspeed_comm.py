"""DeepSpeed's comm wrapper starts without compiling its CPU shared-memory kernel."""

from __future__ import annotations

import pytest

from lightning_merak.distributed.deepspeed_comm import SHARED_MEMORY_OP, skip_shared_memory_kernel


def test_deepspeed_builds_no_shared_memory_kernel_once_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    deepspeed_ops = pytest.importorskip("deepspeed.ops")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None:
        pytest.skip("this accelerator has no shared-memory comm kernel")
    assert builder.NAME == SHARED_MEMORY_OP
    monkeypatch.setitem(deepspeed_ops.__compatible_ops__, SHARED_MEMORY_OP, True)
    skip_shared_memory_kernel()
    assert build_shm_op() is None  # it would compile (or wait on the build lock) otherwise
