"""Muon's Newton–Schulz dtype: bfloat16 is torch's own kernel, float32 the same iteration in float32 (for CPUs that
multiply bfloat16 without native support), and a bfloat16 run on such a CPU says so once, naming the option."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

from lightning_merak.modules import muon
from lightning_merak.modules.config import OptimConfig
from lightning_merak.modules.muon import MatrixMuon, MuonWithAdamW, newton_schulz

COEFFICIENTS = (3.4445, -4.775, 2.0315)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16)])
def test_bfloat16_iteration_is_torchs_kernel_bit_for_bit(shape) -> None:
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz(matrix, COEFFICIENTS, 5, 1e-7, torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, _zeropower_via_newtonschulz(matrix, COEFFICIENTS, 5, 1e-7), rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_float32_iteration_is_the_float64_one_to_float32_rounding(shape) -> None:
    """float32 follows the exact (float64) iteration to its own rounding; bfloat16 only to bfloat16's."""
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    exact = newton_schulz(matrix.double(), COEFFICIENTS, 5, 1e-7, torch.float64)
    single = newton_schulz(matrix, COEFFICIENTS, 5, 1e-7)
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), exact, rtol=0, atol=1e-5)
    assert (newton_schulz(matrix, COEFFICIENTS, 5, 1e-7, torch.bfloat16).double() - exact).abs().max() > 1e-3


def test_float32_muon_steps_each_matrix_of_a_stack_as_a_matrix() -> None:
    """``newton_schulz_dtype="float32"``: a matrix and each expert of a fused tensor get the float32 iteration, with
    torch's momentum, Nesterov and learning-rate adjustment around it (a hand-written step)."""
    generator = torch.Generator().manual_seed(2)
    matrix, stack = torch.randn(24, 40, generator=generator), torch.randn(3, 16, 8, generator=generator)
    params = [nn.Parameter(matrix.clone()), nn.Parameter(stack.clone())]
    optimizer = MatrixMuon(params, lr=0.02, momentum=0.9, newton_schulz_dtype="float32",
                           adjust_lr_fn="match_rms_adamw")
    gradients = [torch.randn(24, 40, generator=generator), torch.randn(3, 16, 8, generator=generator)]
    params[0].grad, params[1].grad = gradients
    optimizer.step()
    group = optimizer.param_groups[0]

    def expected(weight: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        update = gradient.lerp(gradient * (1 - 0.9), 0.9)  # Nesterov on a fresh momentum buffer
        orthogonal = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
        lr = 0.02 * 0.2 * max(weight.shape) ** 0.5
        return weight * (1 - 0.02 * group["weight_decay"]) - lr * orthogonal

    torch.testing.assert_close(params[0].detach(), expected(matrix, gradients[0]), rtol=0, atol=1e-6)
    for expert in range(3):
        torch.testing.assert_close(params[1].detach()[expert], expected(stack[expert], gradients[1][expert]),
                                   rtol=0, atol=1e-6)


def test_bfloat16_on_a_cpu_without_native_products_warns_naming_the_option(monkeypatch) -> None:
    monkeypatch.setattr(muon, "cpu_multiplies_bfloat16", lambda: False)
    matrix = nn.Parameter(torch.zeros(8, 8))
    with pytest.warns(UserWarning, match="optim.newton_schulz_dtype=float32"):
        MuonWithAdamW([{"params": [matrix]}], lr=0.01, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MuonWithAdamW([{"params": [matrix]}], lr=0.01, momentum=0.9, newton_schulz_dtype="float32")
        monkeypatch.setattr(muon, "cpu_multiplies_bfloat16", lambda: True)
        MuonWithAdamW([{"params": [matrix]}], lr=0.01, momentum=0.9)


def test_an_unknown_newton_schulz_dtype_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of bfloat16, float32"):
        OptimConfig(name="muon", newton_schulz_dtype="float16")
    with pytest.raises(ValueError, match="choose one of bfloat16, float32"):
        MatrixMuon([nn.Parameter(torch.zeros(4, 4))], lr=0.01, momentum=0.9, newton_schulz_dtype="fp32")
