"""Muon over replicas: each matrix orthogonalised by one owner rank and broadcast, equal to every rank stepping
every matrix (and to one process under merak3d), with the momentum divided and whole again in ``state_dict``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_merak.modules.muon import MuonWithAdamW
from lightning_merak.parallel.data.owners import assign_owners, orthogonalisation_cost
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from lightning_merak.testing.causal_lm import FixedOptimizerModule
from tests import test_merak3d_fully_sharded as sharded

SHAPES = [(64, 32), (32, 64), (16, 16), (48, 48), (8, 128)]


def test_owners_take_the_largest_matrices_first_and_balance_the_work() -> None:
    costs = [orthogonalisation_cost(shape) for shape in SHAPES]
    assert costs[0] == 64 * 32 * 32 and costs[1] == costs[0]
    owners = assign_owners(costs, 2)
    assert owners == assign_owners(costs, 2)  # the same on every rank
    loads = [sum(cost for cost, owner in zip(costs, owners) if owner == rank) for rank in range(2)]
    assert max(loads) - min(loads) <= max(costs)
    assert assign_owners(costs, 1) == [0] * len(costs)
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        assign_owners(costs, 0)


def _optimizer(seed: int = 0) -> tuple[list[torch.nn.Parameter], MuonWithAdamW]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    params.append(torch.nn.Parameter(torch.randn(32, generator=generator)))  # a bias: AdamW's
    return params, MuonWithAdamW([{"params": params, "weight_decay": 0.01}], lr=0.02, momentum=0.95)


def _steps(params: list[torch.nn.Parameter], optimizer: MuonWithAdamW, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()


def _spread_rank(rank: int, world_size: int) -> dict:
    params, optimizer = _optimizer()
    optimizer.spread_over(dist.group.WORLD)
    _steps(params, optimizer, range(3))
    held = [index for index, param in enumerate(params[:-1]) if "momentum_buffer" in optimizer.muon.state[param]]
    state = optimizer.state_dict()
    momenta = {key: value["momentum_buffer"].clone() for key, value in state["parts"][0]["state"].items()}
    after_gather = sum("momentum_buffer" in optimizer.muon.state.get(param, {}) for param in params[:-1])
    optimizer.load_state_dict(state)
    _steps(params, optimizer, range(3, 5))
    return {"params": [param.detach().clone() for param in params], "held": held, "after_gather": after_gather,
            "momenta": momenta}


@pytest.mark.distributed
def test_spread_muon_equals_every_rank_stepping_every_matrix() -> None:
    params, optimizer = _optimizer()
    _steps(params, optimizer, range(3))
    expected_momenta = {key: value["momentum_buffer"].clone()
                        for key, value in optimizer.state_dict()["parts"][0]["state"].items()}
    _steps(params, optimizer, range(3, 5))
    results = run_distributed(_spread_rank, 2, timeout_s=120)
    held = [result["held"] for result in results]
    assert sorted(held[0] + held[1]) == list(range(len(SHAPES))) and held[0] and held[1]  # divided, each once
    for result in results:
        assert result["after_gather"] == len(result["held"])  # state_dict gathered, then dropped again
        assert result["momenta"].keys() == expected_momenta.keys()
        for key, momentum in expected_momenta.items():
            torch.testing.assert_close(result["momenta"][key], momentum, rtol=0, atol=0)
        for got, want in zip(result["params"], params):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class _MuonModule(FixedOptimizerModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return MuonWithAdamW([{"params": list(self.model.parameters())}], lr=0.02, momentum=0.95,
                             adamw_only={id(param) for param in self.model.get_input_embeddings().parameters()})


def _muon_module() -> _MuonModule:
    return _MuonModule(sharded._module(adam=False).model)


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    module = _muon_module()
    optimizer = module.configure_optimizers()
    losses = []
    for batch in sharded._batches():
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses, {name: param.detach().clone() for name, param in module.model.named_parameters()}


def _train_rank(rank: int, world_size: int, spread: bool = True, first_step: int = 0, last_step: int = sharded.STEPS,
                epochs: int = 1, save_to: str | None = None, resume_from: str | None = None) -> dict:
    if not spread:  # every replica steps every matrix, as before spreading
        MuonWithAdamW.spread_over = lambda self, *args: None
    module = _muon_module()
    recorder = sharded._Recorder()
    strategy = Merak3DStrategy(data_parallel=2, timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=epochs, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(module, datamodule=sharded._ShardedData(first_step, last_step), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    optimizer = trainer.optimizers[0]
    owned = sum("momentum_buffer" in optimizer.muon.state.get(param, {}) for param in optimizer.matrices)
    return {"losses": recorder.losses, "owned": owned, "matrices": len(optimizer.matrices),
            "weights": {name: param.detach().clone() for name, param in module.model.named_parameters()}}


@pytest.mark.distributed
def test_merak3d_replicas_divide_muon_and_train_as_every_replica_stepping_every_matrix() -> None:
    """merak3d at dp2 spreads the module's Muon over its replicas by itself (``data_parallel_sharding="none"``):
    the same weights, bit for bit, as each replica stepping every matrix, with each matrix's momentum on one rank.
    Against one process the losses agree to 1e-5 and the weights to Muon's bfloat16 Newton–Schulz (it turns the
    replicas' gradient rounding into ~1e-3 after a few steps, spread or not)."""
    losses, weights = _reference()
    spread = run_distributed(_train_rank, 2, timeout_s=240)
    plain = run_distributed(_train_rank, 2, args=(False,), timeout_s=240)
    assert sum(result["owned"] for result in spread) == spread[0]["matrices"]  # each matrix's momentum once
    assert all(result["owned"] == result["matrices"] for result in plain)
    for result, unspread in zip(spread, plain):
        assert result["losses"] == unspread["losses"] == pytest.approx(losses, rel=1e-5)
        for name, expected in weights.items():
            torch.testing.assert_close(result["weights"][name], unspread["weights"][name], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(result["weights"][name], expected, atol=5e-2, rtol=0, msg=name)


def test_the_parts_state_is_one_mapping_by_parameter() -> None:
    """Checkpointers read and write ``optimizer.state[param]``: it is the part's that steps the parameter."""
    params, optimizer = _optimizer()
    _steps(params, optimizer, range(1))
    matrix, bias = params[0], params[-1]
    assert matrix in optimizer.state and bias in optimizer.state and len(optimizer.state) == len(params)
    assert optimizer.state[matrix] is optimizer.muon.state[matrix]
    assert set(optimizer.state[bias]) >= {"exp_avg", "exp_avg_sq"}
    optimizer.state[matrix] = {"momentum_buffer": torch.zeros_like(matrix)}
    assert optimizer.muon.state[matrix]["momentum_buffer"].abs().sum() == 0


@pytest.mark.distributed
def test_a_merak3d_checkpoint_keeps_every_matrix_momentum(tmp_path) -> None:
    """Saved at dp2 after half the steps and resumed: the same weights as the run straight through (each owner
    writes its matrices' momentum into the sharded checkpoint; every rank reads them and keeps its own)."""
    straight = run_distributed(_train_rank, 2, timeout_s=240)
    checkpoint = str(tmp_path / "muon.ckpt")
    half = sharded.STEPS // 2
    run_distributed(_train_rank, 2, kwargs={"last_step": half, "save_to": checkpoint}, timeout_s=240)
    resumed = run_distributed(_train_rank, 2, kwargs={"first_step": half, "epochs": 2, "resume_from": checkpoint},
                              timeout_s=240)
    for result, reference in zip(resumed, straight):
        assert result["losses"] == pytest.approx(reference["losses"][half:], rel=1e-6)
        for name, expected in reference["weights"].items():
            torch.testing.assert_close(result["weights"][name], expected, rtol=0, atol=1e-6, msg=name)
