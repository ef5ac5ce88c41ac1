"""What this CPU does natively that changes which kernels are fast (read by the optimizer's warnings and the
benchmarks' machine records)."""

from __future__ import annotations

import torch

__all__ = ["cpu_multiplies_bfloat16"]


def cpu_multiplies_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX; torch's private feature checks, taken as
    native where this torch does not have them)."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    checks = [check for check in checks if callable(check)]
    return not checks or any(check() for check in checks)
