"""Pure-torch cores of the quantized adapters: pooling math, INT4 quantizer, exact zero-point merge."""

from __future__ import annotations

import pytest
import torch

from lightning_merak.adapters import (
    QuantLinearInt4,
    dequantize_int4,
    expand_outputs,
    per_group_delta,
    pool_inputs,
    qbara_rank,
    quantize_int4,
    tiled_delta_weight,
)
from lightning_merak.adapters.int4 import pack_int4, unpack_int4


def test_pool_and_expand_work_on_any_rank() -> None:
    x = torch.arange(24.0).reshape(2, 3, 4)
    pooled = pool_inputs(x, 2)
    assert pooled.shape == (2, 3, 2)
    assert torch.equal(pooled[1, 2], torch.tensor([20.5, 22.5]))
    assert torch.equal(pool_inputs(x[0, 0], 4), torch.tensor([1.5]))
    y = torch.tensor([[1.0, 2.0]])
    assert torch.equal(expand_outputs(y, 3), torch.tensor([[1.0, 1.0, 1.0, 2.0, 2.0, 2.0]]))


@pytest.mark.parametrize("lambda_in,lambda_out", [(1, 1), (2, 2), (4, 8), (8, 1)])
def test_tiled_delta_equals_pooled_forward(lambda_in: int, lambda_out: int) -> None:
    torch.manual_seed(0)
    d_in, d_out, scaling = 32, 48, 0.7
    matrix = torch.randn(d_out // lambda_out, d_in // lambda_in, dtype=torch.float64)
    x = torch.randn(5, 7, d_in, dtype=torch.float64)
    forward = scaling * expand_outputs(pool_inputs(x, lambda_in) @ matrix.T, lambda_out)
    dense = x @ tiled_delta_weight(matrix, lambda_in, lambda_out, scaling).T
    torch.testing.assert_close(forward, dense, rtol=0, atol=1e-12)


def test_qbara_rank_gives_lora_parameter_count() -> None:
    for d_in, d_out, lam, r in [(64, 64, 2, 8), (4096, 11008, 2, 64), (64, 32, 4, 4), (128, 64, 8, 1)]:
        rank = qbara_rank(r, d_in, d_out, lam, lam)
        assert rank == lam * r
        assert rank * (d_in // lam + d_out // lam) == r * (d_in + d_out)


def test_pack_unpack_round_trip() -> None:
    codes = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 6) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("group_size", [8, 32, 64])
def test_int4_quantizer_error_and_layout(group_size: int) -> None:
    torch.manual_seed(1)
    weight = torch.randn(24, 128) * 0.02
    packed, scales, zeros = quantize_int4(weight, group_size)
    assert packed.shape == (24, 64) and scales.shape == zeros.shape == (24, 128 // group_size)
    assert torch.equal(zeros, zeros.round()) and zeros.min() >= 0 and zeros.max() <= 15
    error = (dequantize_int4(packed, scales, zeros) - weight).abs()
    half_step = scales.repeat_interleave(group_size, dim=1) / 2
    assert (error <= half_step + 1e-7).all()


def test_int4_rejects_bad_group_size() -> None:
    with pytest.raises(ValueError, match="not divisible by the INT4 group_size=48"):
        QuantLinearInt4(64, 8, group_size=48)


@pytest.mark.parametrize("seed", range(6))
def test_zero_shift_merge_is_exact_on_random_shapes(seed: int) -> None:
    """The exact-merge property: shifting zeros reproduces base + tiled delta, for any aligned lambda_in."""
    generator = torch.Generator().manual_seed(seed)
    group_size = [4, 8, 16, 32][seed % 4]
    lambda_in = group_size * [1, 2][seed % 2]
    lambda_out = [1, 2, 4][seed % 3]
    d_in = lambda_in * int(torch.randint(1, 5, (1,), generator=generator))
    d_out = lambda_out * int(torch.randint(1, 9, (1,), generator=generator))
    linear = torch.nn.Linear(d_in, d_out)
    layer = QuantLinearInt4.from_linear(linear, group_size)
    matrix = torch.randn(d_out // lambda_out, d_in // lambda_in, generator=generator) * 0.05
    scaling = float(torch.rand(1, generator=generator)) * 4
    expected = layer.dequantize() + tiled_delta_weight(matrix, lambda_in, lambda_out, scaling)
    codes_before, scales_before = layer.qweight.clone(), layer.scales.clone()
    layer.shift_zeros(per_group_delta(matrix, lambda_in, lambda_out, scaling, group_size))
    assert torch.equal(layer.qweight, codes_before) and torch.equal(layer.scales, scales_before)
    torch.testing.assert_close(layer.dequantize(), expected, rtol=0, atol=1e-6 * expected.abs().max().item())


def test_per_group_delta_rejects_misaligned_groups() -> None:
    with pytest.raises(ValueError, match="not a multiple of the quantization group size 8"):
        per_group_delta(torch.zeros(4, 4), lambda_in=4, lambda_out=1, scaling=1.0, group_size=8)


def test_quant_linear_matches_its_dequantized_linear() -> None:
    torch.manual_seed(2)
    layer = QuantLinearInt4.from_linear(torch.nn.Linear(64, 16), group_size=16)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), layer.to_linear()(x))
