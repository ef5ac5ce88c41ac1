"""Which buffers data-parallel replicas share (:func:`replicated_buffers`): what a setup may broadcast from rank 0.

INT4 experts cut to a rank's experts keep scales and zero-points of those experts only; broadcast from rank 0 they
would dequantize rank 1's codes with rank 0's experts' scales (a wrong loss, no error)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_merak.parallel.data.gradients import replicated_buffers
from lightning_merak.util.buffers import buffer_snapshot


def _ids(tensors: list[torch.Tensor]) -> set[int]:
    return {id(tensor) for tensor in tensors}


def test_replicated_buffers_leave_out_ignored_expert_and_marked_buffers() -> None:
    model = nn.Module()
    model.shared, model.ignored, model.expert, model.marked = nn.BatchNorm1d(2), nn.BatchNorm1d(2), nn.Linear(2, 2), \
        nn.Module()
    model.expert.weight.allreduce = False  # an expert-parallel module: its buffers are this rank's experts
    model.expert.register_buffer("counts", torch.zeros(2))
    model.marked.register_buffer("local", torch.zeros(2))
    model.marked.holds_local_experts = True  # a module that says its buffers are this rank's experts
    model.kept = nn.Module()
    model.kept.register_buffer("kept", torch.zeros(2))
    model.kept.holds_local_experts = False
    model._ddp_params_and_buffers_to_ignore = ["ignored.running_mean", "ignored.running_var",
                                               "ignored.num_batches_tracked"]
    shared = [*model.shared.buffers(), model.kept.kept]
    assert _ids(replicated_buffers(model)) == _ids(shared)
    assert {id(tensor) for tensor, _, _ in buffer_snapshot(model).values()} == _ids(shared)  # one rule for both


def _int4_moe() -> nn.Module:
    from lightning_merak.adapters import quantize_model
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    model = tiny_moe_model("qwen3_moe", hidden=32, layers=1, vocab=64, seed=0)
    return quantize_model(model, "int4", 16, experts=True)


def test_int4_expert_scales_cut_to_local_experts_are_not_replicated() -> None:
    """After ``enable_expert_parallel`` the scales and zero-points are this rank's (also after a conversion or an
    assignment replaces them), and the report names them and the codes as the model does."""
    from lightning_merak.adapters.int4_experts import int4_expert_tensor
    from lightning_merak.plugins.moe.experts import enable_expert_parallel, experts_modules

    model = _int4_moe()
    (_, experts), = experts_modules(model)
    steps = [int4_expert_tensor(experts, tensor) for tensor in ("gate_up_proj", "down_proj")]
    local = [buffer for step in steps for buffer in (step.scales, step.zeros)]
    assert _ids(local) <= _ids(replicated_buffers(model))  # whole, every replica holds them all
    report = enable_expert_parallel(model)
    named_buffers, named_parameters = dict(model.named_buffers()), dict(model.named_parameters())
    assert set(report.expert_parameters) <= set(named_parameters)
    assert {id(named_buffers[name]) for name in report.expert_buffers} == _ids(
        [buffer for step in steps for buffer in (step.scales, step.zeros)])
    model.to(torch.float64)  # new scales and zero-points tensors
    steps[0].scales = steps[0].scales.clone()
    cut = _ids([buffer for step in steps for buffer in (step.scales, step.zeros)])
    assert len(cut) == 4 and not cut & _ids(replicated_buffers(model))
    assert not cut & {id(tensor) for tensor, _, _ in buffer_snapshot(model).values()}
