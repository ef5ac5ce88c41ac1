"""MuonWithAdamW's groups: a learning-rate schedule still reaches both parts after a resume, a group added later
(Lightning's ``BaseFinetuning``) trains, and the embeddings and task heads of transformers models go to AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from lightning_merak.modules.causal_lm import _embedding_parameters
from lightning_merak.modules.muon import MuonWithAdamW
from lightning_merak.parallel.data.whole_matrices import MatrixPieces, Piece

SHAPES = [(16, 8), (8, 16), (8,)]


def _params(seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _optimizer(params: list[nn.Parameter]) -> MuonWithAdamW:
    return MuonWithAdamW([{"params": params[:2], "weight_decay": 0.1, "name": "matrices"},
                          {"params": params[2:], "weight_decay": 0.0, "name": "biases"}],
                         lr=0.02, momentum=0.95, newton_schulz_dtype="float32")


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def _train(params: list[nn.Parameter], optimizer: torch.optim.Optimizer,
           scheduler: torch.optim.lr_scheduler.LRScheduler, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
        scheduler.step()


def test_a_resumed_run_follows_the_schedule_as_an_uninterrupted_one() -> None:
    params = _params()
    optimizer = _optimizer(params)
    scheduler = _schedule(optimizer)
    _train(params, optimizer, scheduler, range(6))

    first = _params()
    first_optimizer = _optimizer(first)
    first_scheduler = _schedule(first_optimizer)
    _train(first, first_optimizer, first_scheduler, range(3))
    resumed = [nn.Parameter(param.detach().clone()) for param in first]
    resumed_optimizer = _optimizer(resumed)
    resumed_scheduler = _schedule(resumed_optimizer)
    resumed_optimizer.load_state_dict(first_optimizer.state_dict())
    resumed_scheduler.load_state_dict(first_scheduler.state_dict())
    assert all(outer is inner for outer, inner in zip(
        resumed_optimizer.param_groups, [group for part in resumed_optimizer.parts for group in part.param_groups]))
    assert "momentum_buffer" in resumed_optimizer.muon.state[resumed[0]]
    _train(resumed, resumed_optimizer, resumed_scheduler, range(3, 6))

    for whole, again in zip(params, resumed):
        torch.testing.assert_close(again, whole, rtol=0, atol=0)


def test_loading_finds_the_assembled_matrices_groups_again() -> None:
    """ZeRO's Muon orthogonalises each assembled matrix with its group's settings: the loaded group, not the old."""
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        params = _params()
        optimizer = _optimizer(params)
        optimizer.assemble_pieces(lambda matrices: MatrixPieces(
            matrices, [[Piece(0, 0, matrix.numel())] for matrix in matrices], dist.group.WORLD))
        optimizer.load_state_dict(optimizer.state_dict())
        assert all(group is optimizer.muon.param_groups[0] for group in optimizer.muon._group_of.values())
        assert len(optimizer.muon._group_of) == 2
    finally:
        dist.destroy_process_group()


def test_an_added_group_trains_as_if_given_to_the_constructor() -> None:
    params, together = _params(), _params()

    def groups(params: list[nn.Parameter]) -> list[dict]:
        return [{"params": params[:1], "weight_decay": 0.1, "name": "matrices"},
                {"params": params[2:], "weight_decay": 0.0, "name": "biases"},
                {"params": params[1:2], "weight_decay": 0.1, "name": "unfrozen"}]

    later = MuonWithAdamW(groups(params)[:2], lr=0.02, momentum=0.95, newton_schulz_dtype="float32")
    later.add_param_group(groups(params)[2])  # a matrix added later, as an unfrozen layer's is
    expected = MuonWithAdamW(groups(together), lr=0.02, momentum=0.95, newton_schulz_dtype="float32")
    assert [group["name"] for group in later.param_groups] == [group["name"] for group in expected.param_groups]
    assert any(param is params[1] for param in later.matrices)
    with pytest.raises(ValueError, match="already in this optimizer's groups"):
        later.add_param_group({"params": params[1:2]})
    for run_params, optimizer in ((params, later), (together, expected)):
        _train(run_params, optimizer, _schedule(optimizer), range(3))
    for param, reference in zip(params, together):
        torch.testing.assert_close(param, reference, rtol=0, atol=0)


def test_every_embedding_and_the_task_head_go_to_adamw() -> None:
    model = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16, num_labels=2, pad_token_id=0))
    to_adamw = _embedding_parameters(model)
    names = {name for name, param in model.named_parameters() if id(param) in to_adamw}
    assert names == {"transformer.wte.weight", "transformer.wpe.weight", "score.weight"}


class _LearnedPositions(torch.nn.Module):
    """A model holding its tables as bare parameters (as ViT-style and hand-written models do), beside a fused
    stack of expert matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, 8, 4))
        self.position_table = torch.nn.Parameter(torch.zeros(8, 4))
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))
        self.proj = torch.nn.Linear(4, 4)


def test_a_bare_position_table_goes_to_adamw_and_an_expert_stack_to_muon() -> None:
    model = _LearnedPositions()
    to_adamw = _embedding_parameters(model)
    names = {name for name, param in model.named_parameters() if id(param) in to_adamw}
    assert names == {"pos_embed", "position_table"}
