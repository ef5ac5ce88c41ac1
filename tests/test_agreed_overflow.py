"""A loss scaler's overflow verdict agreed over the ranks (:mod:`lightning_merak.parallel.data.agreed_overflow`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_merak.parallel.data import agreed_overflow
from lightning_merak.parallel.data.agreed_overflow import agree_on_overflow


def _peer_found_inf(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Stand in for a world where another rank found an inf: the MAX all-reduce returns 1."""
    calls: list[Any] = []

    def all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        calls.append(op)
        tensor.fill_(1.0)

    monkeypatch.setattr(agreed_overflow.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(agreed_overflow.dist, "all_reduce", all_reduce)
    return calls


def _scaled_step(scaler: torch.amp.GradScaler, weight: torch.nn.Parameter, optimizer: torch.optim.Optimizer) -> None:
    scaler.scale((weight * 2.0).sum()).backward()
    scaler.unscale_(optimizer)  # as Lightning's MixedPrecision before on_before_optimizer_step
    scaler.step(optimizer)
    scaler.update()


def test_a_peer_overflow_skips_this_ranks_finite_step_and_backs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _peer_found_inf(monkeypatch)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    agree_on_overflow(scaler)
    agree_on_overflow(scaler)  # installed twice (setup, then the build): still one collective per unscale
    _scaled_step(scaler, weight, optimizer)
    assert calls == [dist.ReduceOp.MAX]
    torch.testing.assert_close(weight.detach(), torch.ones(3))  # skipped, as the peer skips
    assert scaler.get_scale() == 512.0


def test_without_an_overflow_anywhere_the_step_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agreed_overflow.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(agreed_overflow.dist, "all_reduce", lambda tensor, op=None, group=None: None)
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    agree_on_overflow(scaler)
    _scaled_step(scaler, weight, optimizer)
    torch.testing.assert_close(weight.detach(), torch.full((3,), 0.8))
    assert scaler.get_scale() == 1024.0


def test_a_scaler_without_the_state_it_reads_is_refused() -> None:
    class Other:
        pass

    with pytest.raises(RuntimeError, match="_per_optimizer_states.*bf16-mixed"):
        agree_on_overflow(Other())  # type: ignore[arg-type]


def _train_experts_under_ddp(rank: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.modules.config import OptimConfig
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    module = CausalLMModule(tiny_moe_model("qwen3_moe"), OptimConfig(learning_rate=3e-3, warmup_steps=1,
                                                                     total_steps=3))

    class ExpertOverflow(pl.Callback):
        """Rank 1's expert gradient overflows on the second step: rank 0 holds other experts."""

        def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if trainer.global_step == 1 and trainer.global_rank == 1:
                pl_module.model.model.layers[0].mlp.experts.gate_up_proj.grad.view(-1)[0] = float("inf")

    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, plugins=[MixedPrecision("16-mixed", "cpu",
                                                                                scaler=torch.amp.GradScaler("cpu"))],
                         callbacks=[ExpertParallelCallback(ep_size=2), ExpertOverflow()])
    batches = torch.randint(0, 128, (6, 8), generator=torch.Generator().manual_seed(20 + rank))
    trainer.fit(module, DataLoader(TensorDataset(batches), batch_size=2))
    replicated = module.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    return {"scale": trainer.precision_plugin.scaler.get_scale(), "replicated": replicated}


@pytest.mark.distributed
def test_merak_ep_under_ddp_skips_one_ranks_expert_overflow_on_every_rank() -> None:
    from lightning_merak.testing import run_distributed

    results = run_distributed(_train_experts_under_ddp, 2, timeout_s=180)
    initial = torch.amp.GradScaler("cpu").get_scale()
    assert [result["scale"] for result in results] == [initial / 2] * 2  # one skipped step, on both ranks
    torch.testing.assert_close(results[0]["replicated"], results[1]["replicated"], rtol=0, atol=0)
