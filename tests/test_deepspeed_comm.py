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


def test_deepspeed_comm_is_started_only_through_init_deepspeed_comm() -> None:
    """A direct ``deepspeed.init_distributed()`` compiles the kernel at its first run on a machine (60-90 s of g++
    on two cores, paid by whichever test gets there first); the package, its tests and benchmarks start DeepSpeed's
    comm through ``init_deepspeed_comm``, which skips it."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    starter = root / "lightning_merak" / "distributed" / "deepspeed_comm.py"
    calls = []
    for folder in ("lightning_merak", "tests", "benchmarks", "examples"):
        for path in sorted((root / folder).rglob("*.py")):
            text = path.read_text()
            if path == starter or "init_distributed" not in text:
                continue
            for node in ast.walk(ast.parse(text, str(path))):
                function = node.func if isinstance(node, ast.Call) else None
                name = getattr(function, "attr", None) or getattr(function, "id", None)
                if name == "init_distributed":
                    calls.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not calls, f"call init_deepspeed_comm() instead of deepspeed.init_distributed() at {calls}"
