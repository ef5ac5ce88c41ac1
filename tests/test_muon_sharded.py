"""Muon under ZeRO-1/2, pipeline and tensor parallelism: each matrix put together from the ranks' flat slices on
one owner, orthogonalised there and sent back, equal to ``torch.optim.Muon`` on the same gradients bit for bit;
merak3d at dp4 ZeRO-1, pp2×dp2 ZeRO-1 and pp2×tp2 against one process."""

from __future__ import annotations

import dataclasses

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig, Schedule
from lightning_merak.modules.muon import MatrixMuon, MuonWithAdamW
from lightning_merak.parallel.data.owners import plan_rounds
from lightning_merak.parallel.data.sharding_checks import check_shardable_optimizer
from lightning_merak.parallel.data.whole_matrices import MatrixPieces, Piece
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed
from tests import test_merak3d_fully_sharded as sharded

SHAPES = [(64, 32), (32, 64), (16, 16), (48, 48), (8, 128), (24, 40)]


def test_rounds_keep_one_element_size_and_a_byte_cap() -> None:
    assert plan_rounds([10, 10, 10], [4, 4, 4], round_bytes=80) == [[0, 1], [2]]
    assert plan_rounds([10, 10, 10], [4, 2, 2], round_bytes=1000) == [[0], [1, 2]]
    assert plan_rounds([100, 1], [4, 4], round_bytes=40) == [[0], [1]]  # a larger matrix is its own round
    assert plan_rounds([], [], round_bytes=40) == []


def test_pieces_must_cover_each_matrix_once_per_rank() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        matrix = nn.Parameter(torch.zeros(4, 4))
        with pytest.raises(ValueError, match="cover 12"):
            MatrixPieces([matrix], [[Piece(0, 0, 12)]], dist.group.WORLD)
        with pytest.raises(ValueError, match="two pieces of one matrix"):
            MatrixPieces([matrix], [[Piece(0, 0, 8), Piece(0, 8, 16)]], dist.group.WORLD)
        plan = MatrixPieces([matrix], [[Piece(0, 0, 16)]], dist.group.WORLD)
        assert plan.owned() == [0]
        result = plan.map_whole(lambda index, whole: whole * 2, {0: torch.arange(16.0)})
        torch.testing.assert_close(result[0], torch.arange(16.0) * 2)
    finally:
        dist.destroy_process_group()


def test_a_composite_that_assembles_matrices_may_shard_and_plain_muon_may_not() -> None:
    params = [nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))]
    check_shardable_optimizer(MuonWithAdamW([{"params": params}], lr=0.02, momentum=0.95), "optimizer")
    with pytest.raises(ValueError, match="does not update element by element"):
        check_shardable_optimizer(torch.optim.Muon(params[:1]), "optimizer")


def _optimizer() -> tuple[list[nn.Parameter], MuonWithAdamW]:
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]
    params.append(nn.Parameter(torch.randn(32, generator=generator)))  # a bias: AdamW's
    groups = [{"params": params[:4], "weight_decay": 0.01}, {"params": params[4:], "weight_decay": 0.0}]
    return params, MuonWithAdamW(groups, lr=0.02, momentum=0.95)


def _gradients(params: list[nn.Parameter], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(param.shape, generator=generator) for param in params]


def _slices(numels: list[int], ranks: int) -> list[list[Piece]]:
    """ZeRO's cut: the matrices laid end to end in one flat bucket padded to ``ranks`` equal parts."""
    total = sum(numels)
    part = -(-total // ranks)
    pieces, offset = [], 0
    for numel in numels:
        held = []
        for rank in range(ranks):
            start, stop = max(offset, rank * part), min(offset + numel, (rank + 1) * part)
            if start < stop:
                held.append(Piece(rank, start - offset, stop - offset))
        pieces.append(held)
        offset += numel
    return pieces


def _sliced(optimizer: MuonWithAdamW, matrices: list[nn.Parameter], rank: int, world_size: int,
            round_bytes: int = 16 * 2**20) -> list[tuple[int, nn.Parameter]]:
    """``rank``'s slices of ``matrices`` in ``optimizer``'s groups, as data-parallel sharding leaves them: (matrix
    index, slice)."""
    pieces = _slices([matrix.numel() for matrix in matrices], world_size)
    optimizer.assemble_pieces(lambda held: MatrixPieces(held, pieces, dist.group.WORLD, round_bytes=round_bytes))
    mine: list[tuple[int, nn.Parameter]] = []
    for group in optimizer.muon.param_groups:  # what data-parallel sharding does to the groups
        sliced = []
        for matrix in group["params"]:
            index = next(i for i, param in enumerate(matrices) if param is matrix)
            for piece in pieces[index]:
                if piece.rank == rank:
                    shard = nn.Parameter(matrix.detach().view(-1)[piece.start:piece.stop])
                    shard.sharded_from, shard.shard_start = matrix, piece.start
                    sliced.append(shard)
                    mine.append((index, shard))
        group["params"] = sliced
    return mine


def _give_gradients(params: list[nn.Parameter], mine: list[tuple[int, nn.Parameter]], step: int) -> None:
    """Step ``step``'s gradients on the bias and on this rank's slices of the matrices."""
    gradients = _gradients(params, step)
    for index, shard in mine:
        shard.grad = gradients[index].view(-1)[shard.shard_start:shard.shard_start + shard.numel()].clone()
    params[-1].grad = gradients[-1]


def _sliced_rank(rank: int, world_size: int, round_bytes: int) -> dict:
    params, optimizer = _optimizer()
    mine = _sliced(optimizer, params[:len(SHAPES)], rank, world_size, round_bytes)
    for step in range(3):
        _give_gradients(params, mine, step)
        optimizer.step()
    return {"slices": {(index, shard.shard_start): shard.detach().clone() for index, shard in mine},
            "momenta": {(index, shard.shard_start): optimizer.muon.state[shard]["momentum_buffer"].clone()
                        for index, shard in mine},
            "owned": optimizer.muon.pieces.owned(), "bias": params[-1].detach().clone()}


@pytest.mark.distributed
@pytest.mark.parametrize(("ranks", "round_bytes"), [(2, 16 * 2**20), (4, 4096)])
def test_muon_on_zero_slices_equals_torch_muon_on_whole_matrices(ranks: int, round_bytes: int) -> None:
    """At 4 ranks with 4 KiB rounds each matrix travels in a round of its own (overlapped with the others'
    Newton–Schulz); at 2, all in one. Same bits as one process stepping the whole matrices."""
    params, optimizer = _optimizer()
    for step in range(3):
        for param, gradient in zip(params, _gradients(params, step)):
            param.grad = gradient
        optimizer.step()
    results = run_distributed(_sliced_rank, ranks, args=(round_bytes,), timeout_s=120)
    owned = sorted(index for result in results for index in result["owned"])
    assert owned == list(range(len(SHAPES)))  # each matrix orthogonalised once
    assert all(result["owned"] for result in results)  # the work divides
    for result in results:
        torch.testing.assert_close(result["bias"], params[-1], rtol=0, atol=0)
        for (index, start), value in result["slices"].items():
            whole = params[index].detach().view(-1)
            torch.testing.assert_close(value, whole[start:start + value.numel()], rtol=0, atol=0)
            momentum = optimizer.muon.state[params[index]]["momentum_buffer"].view(-1)
            torch.testing.assert_close(result["momenta"][(index, start)], momentum[start:start + value.numel()],
                                       rtol=0, atol=0)


def test_a_step_without_gradients_leaves_the_slices_and_their_momentum_as_they_are() -> None:
    """A step after the gradients were dropped (``NonFiniteGuard``'s skip, on every rank alike) changes no slice and
    no momentum, as torch leaves a parameter without a gradient; the slices still travel (as zeros), so ranks that
    hold none wait for no one (the merak3d run: ``tests/test_faults_nonfinite.py``)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        params, optimizer = _optimizer()
        mine = _sliced(optimizer, params[:len(SHAPES)], rank=0, world_size=1)
        _give_gradients(params, mine, step=0)
        optimizer.step()
        before = [(shard.detach().clone(), optimizer.muon.state[shard]["momentum_buffer"].clone()) for _, shard in mine]
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
        for (_, shard), (value, momentum) in zip(mine, before):
            assert torch.equal(shard, value) and torch.equal(optimizer.muon.state[shard]["momentum_buffer"], momentum)
    finally:
        dist.destroy_process_group()


OPTIM = OptimConfig(name="muon", learning_rate=0.02, momentum=0.95, lr_schedule=Schedule.constant, warmup_steps=0,
                    total_steps=sharded.STEPS)


def _module(schedule: Schedule = Schedule.constant) -> CausalLMModule:
    return CausalLMModule(sharded._module(adam=False).model, optim=dataclasses.replace(OPTIM, lr_schedule=schedule))


def _reference(module: CausalLMModule | None = None) -> list[float]:
    """The losses of one process training ``module`` (default :func:`_module`) on the ranks' batches."""
    module = module or _module()
    optimizer = module.configure_optimizers()["optimizer"]
    losses = []
    for batch in sharded._batches():
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses


def _train_rank(rank: int, world_size: int, layout: dict | str, first_step: int = 0, last_step: int = sharded.STEPS,
                epochs: int = 1, save_to: str | None = None, resume_from: str | None = None,
                schedule: Schedule = Schedule.constant) -> dict:
    module = _module(schedule)
    recorder = sharded._Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_epochs=epochs,
        strategy=layout if isinstance(layout, str) else Merak3DStrategy(**layout, timeout_s=120),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(module, datamodule=sharded._ShardedData(first_step, last_step), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    optimizer, partition = trainer.optimizers[0], getattr(trainer.strategy, "partition", None)
    return {"losses": recorder.losses, "stage_optimizer_s": None if partition is None else partition.stage_optimizer_s,
            "weights": {name: param.detach().clone() for name, param in module.model.named_parameters()},
            "embeddings_on_muon": [
        name for name, param in module.model.named_parameters()
        if "embed" in name or "lm_head" in name if any(param is held for held in optimizer.matrices)]}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [
    {"data_parallel": 4, "data_parallel_sharding": "optimizer"},
    {"pipeline_parallel": 2, "data_parallel": 2, "data_parallel_sharding": "gradients"},
    {"pipeline_parallel": 2, "tensor_parallel": 2},
], ids=["dp4-zero1", "pp2-dp2-zero2", "pp2-tp2"])
def test_merak3d_muon_trains_as_one_process(layout: dict) -> None:
    """Losses against one process: the first (before any update) to 1e-6; after it, Muon's bfloat16 Newton–Schulz
    turns the layouts' gradient rounding (~1e-7) into 1e-5 of the loss from the second step on (spread or not,
    sharded or not: the sharded step itself is bit-exact above), so the bound is 5e-5. The embeddings and head
    stay with AdamW inside pipeline stages too, and AutoPipe cut the pipeline pricing the Newton–Schulz work."""
    expected = _reference()
    for result in run_distributed(_train_rank, 4, args=(layout,), timeout_s=300):
        assert result["losses"][0] == pytest.approx(expected[0], rel=1e-6)
        assert result["losses"] == pytest.approx(expected, rel=5e-5)
        assert result["embeddings_on_muon"] == []
        if layout.get("pipeline_parallel", 1) > 1:
            assert result["stage_optimizer_s"] is not None and sum(result["stage_optimizer_s"]) > 0


@pytest.mark.distributed
def test_a_zero1_muon_checkpoint_resumes_in_another_layout(tmp_path) -> None:
    """Saved at dp2 ZeRO-1 after half the steps (the momentum of every matrix whole, under its own name), resumed
    at pp2 without sharding: the losses of the run straight through at dp2 ZeRO-1 (to the bound above; a lost or
    misplaced momentum moves the second resumed loss by ~4e-4)."""
    zero1 = {"data_parallel": 2, "data_parallel_sharding": "optimizer"}
    straight = run_distributed(_train_rank, 2, args=(zero1,), timeout_s=300)[0]["losses"]
    checkpoint = str(tmp_path / "muon.ckpt")
    half = sharded.STEPS // 2
    run_distributed(_train_rank, 2, args=(zero1,), kwargs={"last_step": half, "save_to": checkpoint}, timeout_s=300)
    resumed = run_distributed(_train_rank, 2, args=({"pipeline_parallel": 2},),
                              kwargs={"first_step": half, "epochs": 2, "resume_from": checkpoint}, timeout_s=300)
    assert resumed[-1]["losses"] == pytest.approx(straight[half:], rel=5e-5)


@pytest.mark.distributed
def test_a_ddp_muon_file_resumes_at_pp2(tmp_path) -> None:
    """A DDP run's ``.ckpt`` (``MuonWithAdamW``'s own state format: one state per part) resumed at pp2: the losses of
    one process straight through, to the bound above (the file's optimizer state was unreadable under merak3d)."""
    expected = _reference()
    checkpoint = str(tmp_path / "muon.ckpt")
    half = sharded.STEPS // 2
    run_distributed(_train_rank, 2, args=("ddp",), kwargs={"last_step": half, "save_to": checkpoint}, timeout_s=300)
    resumed = run_distributed(_train_rank, 2, args=({"pipeline_parallel": 2},),
                              kwargs={"first_step": half, "epochs": 2, "resume_from": checkpoint}, timeout_s=300)
    assert resumed[-1]["losses"] == pytest.approx(expected[half:], rel=5e-5)


@pytest.mark.distributed
def test_a_zero1_muon_resume_follows_the_learning_rate_schedule(tmp_path) -> None:
    """Saved and resumed at dp2 ZeRO-1 under a linear decay: the weights of the run straight through (loading the
    state replaced the inner optimizers' groups, and the schedule, setting the old ones, no longer reached them)."""
    zero1 = {"data_parallel": 2, "data_parallel_sharding": "optimizer"}
    straight = run_distributed(_train_rank, 2, args=(zero1,), kwargs={"schedule": Schedule.linear}, timeout_s=300)
    checkpoint = str(tmp_path / "muon.ckpt")
    half = sharded.STEPS // 2
    run_distributed(_train_rank, 2, args=(zero1,),
                    kwargs={"last_step": half, "save_to": checkpoint, "schedule": Schedule.linear}, timeout_s=300)
    resumed = run_distributed(_train_rank, 2, args=(zero1,), timeout_s=300, kwargs={
        "first_step": half, "epochs": 2, "resume_from": checkpoint, "schedule": Schedule.linear})
    for result, reference in zip(resumed, straight):
        assert result["losses"] == pytest.approx(reference["losses"][half:], rel=1e-6)
        for name, expected in reference["weights"].items():
            torch.testing.assert_close(result["weights"][name], expected, rtol=0, atol=1e-6, msg=name)


def test_matrix_muon_is_torch_muon_on_matrices_and_on_each_matrix_of_a_stack() -> None:
    """Bit for bit: on a matrix, ``torch.optim.Muon`` (its defaults, weight decay, Nesterov); on a fused expert
    tensor ``[experts, rows, cols]``, ``torch.optim.Muon`` on each expert's matrix as its own parameter."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(24, 40, generator=generator)
    stack = torch.randn(3, 16, 8, generator=generator)
    ours = [nn.Parameter(matrix.clone()), nn.Parameter(stack.clone())]
    theirs = [nn.Parameter(matrix.clone()), *(nn.Parameter(expert.clone()) for expert in stack)]
    mine = MatrixMuon(ours, lr=0.02, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    torch_muon = torch.optim.Muon(theirs, lr=0.02, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        gradients = [torch.randn(24, 40, generator=generator), torch.randn(3, 16, 8, generator=generator)]
        ours[0].grad, ours[1].grad = gradients
        theirs[0].grad = gradients[0].clone()
        for expert, gradient in zip(theirs[1:], gradients[1]):
            expert.grad = gradient.clone()
        mine.step()
        torch_muon.step()
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[1], torch.stack(theirs[1:]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="belongs with AdamW"):
        MatrixMuon([nn.Parameter(torch.zeros(4))], lr=0.02, momentum=0.9)


EXACT_OPTIM = dataclasses.replace(OPTIM, newton_schulz_dtype="float32")
"""Muon with its Newton–Schulz iteration in float32: bfloat16's amplifies the layouts' gradient rounding (a sum over
dp2 in another order) to 2e-4 after one update on CPUs without bfloat16 instructions, past what tells a wrong expert
step from a right one."""


def _moe_module() -> CausalLMModule:
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = tiny_moe_model("mixtral", hidden=32, layers=2, vocab=sharded.VOCAB, seed=0)
    model.config.use_cache = False
    return CausalLMModule(model, optim=EXACT_OPTIM)


def _moe_rank(rank: int, world_size: int) -> dict:
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback

    module = _moe_module()
    recorder = sharded._Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(data_parallel=2, timeout_s=120),
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        callbacks=[ExpertParallelCallback(ep_size=2), recorder])
    trainer.fit(module, datamodule=sharded._ShardedData(0, sharded.STEPS))
    stacks = [param for param in trainer.optimizers[0].matrices if param.ndim == 3]
    return {"losses": recorder.losses, "stacks": len(stacks), "experts_held": stacks[0].shape[0]}


@pytest.mark.distributed
def test_merak3d_muon_steps_each_expert_matrix_under_expert_parallelism() -> None:
    """Mixtral's fused expert tensors under ``merak_ep`` (experts spread over dp2): each rank steps the experts it
    holds with Muon, one matrix per expert (Newton–Schulz in float32: :data:`EXACT_OPTIM`). Losses against the
    unswapped single-process model with the same optimizer, every step to 1e-5: a wrong expert step moves the
    second by more."""
    module = _moe_module()
    optimizer = module.configure_optimizers()["optimizer"]
    assert any(param.ndim == 3 for param in optimizer.matrices)  # the fused experts are Muon's
    expected = []
    for batch in sharded._batches():
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        expected.append(loss.item())
        optimizer.step()
    for result in run_distributed(_moe_rank, 2, timeout_s=300):
        assert result["stacks"] > 0 and result["experts_held"] == module.model.config.num_local_experts // 2
        assert result["losses"] == pytest.approx(expected, rel=1e-5)


def _step_sharded_stack(experts: int, placement: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two Muon steps of one expert stack, plain and as a DTensor sharded along dim ``placement`` over the world:
    (the plain result, the sharded one gathered)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    generator = torch.Generator().manual_seed(0)
    stack = torch.randn(experts, 16, 8, generator=generator)
    plain = nn.Parameter(stack.clone())
    sharded = nn.Parameter(distribute_tensor(stack.clone(), mesh, [Shard(placement)]))
    optimizers = [MatrixMuon([param], lr=0.02, momentum=0.9, newton_schulz_dtype="float32")
                  for param in (plain, sharded)]
    for _ in range(2):
        gradient = torch.randn(experts, 16, 8, generator=generator)
        plain.grad = gradient.clone()
        sharded.grad = distribute_tensor(gradient.clone(), mesh, [Shard(placement)])
        for optimizer in optimizers:
            optimizer.step()
    assert isinstance(sharded.data, DTensor) and sharded.placements == (Shard(placement),)
    return plain.detach(), sharded.full_tensor()


@pytest.mark.parametrize("placement", [0, 1, 2], ids=["experts", "rows", "cols"])
def test_matrix_muon_steps_each_matrix_of_a_sharded_stack(single_rank_group, placement: int) -> None:
    """A fused expert stack as a DTensor (FSDP2 shards dim 0: whole experts per rank; a shard of rows or columns is
    gathered first): the step of the plain stack (DTensor refused to unbind the sharded experts)."""
    plain, sharded_result = _step_sharded_stack(4, placement)
    torch.testing.assert_close(sharded_result, plain, rtol=0, atol=0)


def _sharded_stacks_rank(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # three experts: an uneven split; rows: each rank holds half of every matrix
    return [_step_sharded_stack(3, 0), _step_sharded_stack(4, 1)]


def _fully_sharded_moe_rank(rank: int, world_size: int) -> dict:
    module = _moe_module()
    recorder = sharded._Recorder()
    strategy = Merak3DStrategy(data_parallel=world_size, data_parallel_sharding="full", timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(module, datamodule=sharded._ShardedData(0, sharded.STEPS))
    stacks = [param for param in trainer.optimizers[0].matrices if param.ndim == 3]
    return {"losses": recorder.losses, "stack_placements": {str(param.placements) for param in stacks},
            "weights": sharded._full_weights(strategy, module.model)}


@pytest.mark.distributed
def test_merak3d_muon_steps_each_expert_matrix_under_full_sharding() -> None:
    """Mixtral's fused expert tensors at dp2 ``data_parallel_sharding="full"`` (FSDP2 shards them along the experts):
    each rank orthogonalises the experts its shard holds; losses and final weights equal one process's (float32
    Newton–Schulz, 1e-5). The first optimizer step crashed (DTensor refuses to unbind a sharded dimension). Before
    it, ``MatrixMuon`` alone on a stack split unevenly over the experts and on one split along rows (gathered for
    the step): the plain stack's step."""
    module = _moe_module()
    expected = _reference(module)
    for pairs in run_distributed(_sharded_stacks_rank, 2, timeout_s=120):
        for plain, sharded_result in pairs:
            torch.testing.assert_close(sharded_result, plain, rtol=0, atol=0)
    for result in run_distributed(_fully_sharded_moe_rank, 2, timeout_s=300):
        assert result["stack_placements"] == {"(Shard(dim=0),)"}
        assert result["losses"] == pytest.approx(expected, rel=1e-5)
        for name, param in module.model.named_parameters():
            torch.testing.assert_close(result["weights"][name], param.detach(), rtol=0, atol=1e-5, msg=name)
