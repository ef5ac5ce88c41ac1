"""A recomputed block (merak3d's ``recompute="full"``) whose region torch recomputes more than once, or that runs a
backward of its own: one process, against the same block without recomputation."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_merak.distributed.collectives import _communicate_once
from lightning_merak.plugins.moe.experts import grouped
from lightning_merak.protocols.layout_aware import RecomputedForward


def test_every_recomputation_replays_the_recorded_collectives() -> None:
    """Two backward passes over one region recompute it twice: each gets the forward's collective results."""
    weight = nn.Parameter(torch.linspace(0.5, 1.5, 4))
    issued: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        total = _communicate_once(lambda: issued.append(1) or torch.tensor(3.0))
        return (x * weight).sin() * total

    out = RecomputedForward(forward)(torch.ones(4))
    grads = [torch.autograd.grad(out.sum(), [weight], retain_graph=True)[0] for _ in range(2)]
    for grad in grads:
        torch.testing.assert_close(grad, 3.0 * weight.detach().cos())
    assert issued == [1], "a recomputation communicated again"


class _MoEBlock(nn.Module):
    """A linear layer and the DeepSpeed-MoE drop-in (one process: every expert local); counts its forwards."""

    def __init__(self) -> None:
        from lightning_merak.plugins.moe.layer import MoE

        super().__init__()
        expert = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.linear = nn.Linear(8, 8)
        self.moe = MoE(8, expert, num_experts=4, ep_size=1, k=2, drop_tokens=False, dispatch="dropless",
                       placement="none", lancet_backward=True)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        out, _, _ = self.moe(self.linear(x))
        return (out * x).tanh()


def test_the_expert_exchange_of_a_recomputed_block_gives_the_plain_gradients_with_one_recomputation() -> None:
    """The exchange's backward runs ``torch.autograd.grad`` over its experts' graphs; in a recomputed block
    those backward passes must neither fail nor recompute the block again."""
    torch.manual_seed(0)
    plain = _MoEBlock()
    recomputed = copy.deepcopy(plain)
    recomputed.forward = RecomputedForward(recomputed.forward)
    inputs = torch.randn(2, 6, 8)
    for block in (plain, recomputed):
        torch.manual_seed(3)  # the same second-expert sampling in both
        block(inputs).square().sum().backward()
    for (name, want), got in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert recomputed.forwards == 2, f"{recomputed.forwards - 1} recomputations for one backward"


@pytest.mark.skipif(grouped._grouped_mm_fn() is None, reason="this torch has no grouped matmul to probe")
def test_the_grouped_mm_probe_runs_apart_from_its_callers_autograd_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """First probed inside a recomputed block's forward: no recomputation mid-forward; under ``no_grad``: the
    same answer as anywhere else."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(grouped, "_PROBES", {})
    expected = grouped._probe(cpu, torch.float32)
    monkeypatch.setattr(grouped, "_PROBES", {})
    weight = nn.Parameter(torch.linspace(0.5, 1.5, 4))
    forwards: list[int] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        forwards.append(1)
        saved = (x * weight).sin()
        return saved * (2.0 if grouped._probe(cpu, torch.float32) else 1.0)

    RecomputedForward(forward)(torch.ones(4)).sum().backward()
    torch.testing.assert_close(weight.grad, (2.0 if expected else 1.0) * weight.detach().cos())
    assert len(forwards) == 2, f"{len(forwards) - 1} recomputations for one backward"
    monkeypatch.setattr(grouped, "_PROBES", {})
    with torch.no_grad():
        assert grouped._probe(cpu, torch.float32) == expected
