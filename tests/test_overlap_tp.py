"""Sub-batch overlapped tensor parallelism: equal to plain TP, per-sample exact, no repeated collectives."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.distributed import turns
from lightning_merak.distributed.sub_batches import SubBatchForward, run_sub_batches
from lightning_merak.distributed.turns import meet_in_turn
from lightning_merak.parallel.layout import check_overlap
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
from lightning_merak.testing import assert_traces_match, merge_rank_traces, run_distributed
from tests.test_merak3d import _module, _reference, _train_rank
from tests.test_sequence_parallel import _step

VOCAB, SEQ = 96, 16


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _assert_relative(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = 1e-6, name: str = "") -> None:
    """Relative error of the whole tensor: gradients summed over sub-batches differ in rounding only."""
    error = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Residual() for _ in range(3)])


def test_sub_batches_equal_the_whole_batch_without_communication():
    model = _stack()
    inputs = torch.randn(4, 5, 8, requires_grad=True)
    expected = model(inputs)
    expected.square().sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    expected_input_grad = inputs.grad.clone()
    model.zero_grad()
    inputs.grad = None
    output = SubBatchForward(model, 2)(inputs)
    output.square().sum().backward()
    torch.testing.assert_close(output, expected, rtol=1e-6, atol=0)
    for grad, reference in zip((p.grad for p in model.parameters()), expected_grads):
        _assert_relative(grad, reference)
    _assert_relative(inputs.grad, expected_input_grad)


def test_each_sample_keeps_its_own_residual():
    """A sub-batch that took another's residual would change these rows."""
    model = _stack()
    inputs = torch.cat([torch.zeros(2, 5, 8), 10 * torch.randn(2, 5, 8)])
    output = SubBatchForward(model, 2)(inputs)
    for row in range(4):
        torch.testing.assert_close(output[row: row + 1], model(inputs[row: row + 1]), rtol=1e-6, atol=1e-6)


def test_turns_alternate_between_sub_batches():
    order: list[tuple[int, int]] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        for segment in range(3):
            order.append((turns.sub_batch_index(), segment))
            turns.yield_turn()
        return x

    run_sub_batches(forward, 3, (torch.zeros(6, 2),))
    assert order == [(s, seg) for seg in range(3) for s in range(3)]


def test_sub_batch_errors_reach_the_caller_and_release_every_thread():
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x[0, 0] > 0:
            raise RuntimeError("sub-batch failure")
        turns.yield_turn()
        return x

    run_sub_batches(forward, 2, (torch.zeros(2, 2),))
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="sub-batch failure"):
        run_sub_batches(forward, 2, (torch.cat([torch.zeros(1, 2), torch.ones(1, 2)]),))
    # Both sub-batch threads went back to the pool: the next region reuses them.
    run_sub_batches(forward, 2, (torch.zeros(2, 2),))
    assert threading.active_count() == before


def test_sub_batch_threads_are_reused_between_regions():
    seen: list[set[int]] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        seen[-1].add(threading.get_ident())
        turns.yield_turn()
        return x

    for _ in range(3):
        seen.append(set())
        run_sub_batches(forward, 2, (torch.zeros(2, 2),))
    assert len(seen[0]) == 2 and seen[0] == seen[1] == seen[2]


def test_a_region_inside_a_sub_batch_gets_its_own_threads():
    def inner(x: torch.Tensor) -> torch.Tensor:
        turns.yield_turn()
        return x * 2

    def outer(x: torch.Tensor) -> torch.Tensor:
        turns.yield_turn()
        return run_sub_batches(inner, 2, (x,))

    torch.testing.assert_close(run_sub_batches(outer, 2, (torch.arange(8.0).view(4, 2),)),
                               torch.arange(8.0).view(4, 2) * 2)


def test_each_sub_batch_draws_its_own_random_stream_and_the_callers_is_left_as_it_was():
    def dropped(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, p=0.5)

    same_halves = torch.ones(8, 16).repeat(2, 1)
    torch.manual_seed(3)
    out = run_sub_batches(dropped, 2, (same_halves,))
    after_region = torch.rand(4)
    assert not torch.equal(out[:8], out[8:])  # sub-batches do not share a dropout mask
    torch.manual_seed(3)
    torch.testing.assert_close(run_sub_batches(dropped, 2, (same_halves,)), out)
    torch.manual_seed(3)
    torch.testing.assert_close(torch.rand(4), after_region)


def test_evaluation_runs_the_whole_batch_whatever_its_size():
    """No backward to overlap in eval mode: a batch that does not split into the sub-batches still runs."""
    model = _stack().eval()
    inputs = torch.randn(5, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(SubBatchForward(model, 2)(inputs), model(inputs), rtol=0, atol=0)


def test_a_checkpointed_region_recomputes_the_dropout_masks_of_its_forward():
    """Reentrant checkpointing runs the region without gradients, then again with them: both runs split alike."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    region = SubBatchForward(model, 2)
    inputs = torch.randn(4, 8, requires_grad=True)  # a reentrant checkpoint's output needs one

    def gradients(checkpointed: bool) -> list[torch.Tensor]:
        model.zero_grad()
        torch.manual_seed(5)
        output = (checkpoint(region, inputs, use_reentrant=True) if checkpointed
                  else region(inputs))
        output.square().sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    for checkpointed, stored in zip(gradients(True), gradients(False)):
        torch.testing.assert_close(checkpointed, stored, rtol=1e-6, atol=1e-7)


def test_whole_batch_work_at_a_meeting_draws_from_the_callers_stream():
    def noise_of_the_whole_batch(x: torch.Tensor) -> torch.Tensor:
        noise = meet_in_turn("noise", x, lambda parts: torch.rand(sum(len(p) for p in parts)).split(
            [len(p) for p in parts]))
        return torch.nn.functional.dropout(x, p=0.5) + noise[:, None]

    torch.manual_seed(4)
    out = run_sub_batches(noise_of_the_whole_batch, 2, (torch.zeros(8, 3),))
    after_region = torch.rand(2)
    torch.manual_seed(4)
    noise = torch.rand(8)  # what the unsplit batch draws
    torch.testing.assert_close(out[:, 0], noise)
    torch.testing.assert_close(torch.rand(2), after_region)


def test_bad_splits_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="tp_overlap=3 sub-batches"):
        run_sub_batches(lambda x: x, 3, (torch.zeros(4, 2),))
    with pytest.raises(ValueError, match="batch-first"):
        run_sub_batches(lambda x: x.sum(0, keepdim=True), 2, (torch.randn(4, 2),))
    with pytest.raises(ValueError, match="tensor_parallel=1"):
        check_overlap(2, 1)
    with pytest.raises(ValueError, match="interleaved_zero_bubble"):
        Merak3DStrategy(tensor_parallel=2, tp_overlap=2, schedule="interleaved_zero_bubble")
    with pytest.raises(ValueError, match="tp_weight_grad_overlap=True .* interleaved_zero_bubble"):
        Merak3DStrategy(tensor_parallel=2, tp_weight_grad_overlap=True, schedule="interleaved_zero_bubble")
    assert not Merak3DStrategy(tensor_parallel=2, schedule="interleaved_zero_bubble").tp_weight_grad_overlap
    assert Merak3DStrategy(tensor_parallel=2).tp_weight_grad_overlap


@pytest.mark.distributed
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_overlapped_tensor_parallel_equals_plain_tensor_parallel(recompute):
    plain = run_distributed(_step, 2, args=("llama", False, 1, False), timeout_s=300)
    overlapped = run_distributed(_step, 2, args=("llama", False, 2, recompute), timeout_s=300)
    for reference, result in zip(plain, overlapped):
        _assert_relative(result["logits"], reference["logits"])
        for name, grad in reference["grads"].items():
            _assert_relative(result["grads"][name], grad, name=name)
    blocks = 3
    # Two all-reduces per block in forward and two in backward, once per sub-batch: a recomputed
    # block must not add any.
    assert plain[0]["collectives"] == 4 * blocks
    assert overlapped[0]["collectives"] == 2 * 4 * blocks
    assert overlapped[0]["sub_batches"] == [0, 1]


OVERLAP_LAYOUTS = [
    {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2, "tp_overlap": 2},
    {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2, "tp_overlap": 4, "recompute": "full"},
    {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2, "tp_overlap": 2},
]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", OVERLAP_LAYOUTS,
                         ids=lambda l: "pp{pipeline_parallel}-tp{tensor_parallel}-k{tp_overlap}".format(**l)
                         + ("-recompute" if "recompute" in l else ""))
def test_merak3d_with_overlap_matches_single_process(layout):
    model_name = "gpt2" if "recompute" in layout else "llama"
    world_size = layout["data_parallel"] * layout["pipeline_parallel"] * layout["tensor_parallel"]
    results = run_distributed(_train_rank, world_size, args=(model_name, layout), timeout_s=600)
    assert_traces_match(_reference(model_name), merge_rank_traces(results), loss_rtol=1e-5, grad_rtol=1e-4)


def _evaluating_rank(rank: int, world_size: int, samples: torch.Tensor) -> dict:
    import lightning.pytorch as pl

    strategy = Merak3DStrategy(tensor_parallel=2, tp_overlap=2, timeout_s=120)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    module = _module("llama")
    loader = DataLoader(TensorDataset(samples), batch_size=4)
    val_loss = trainer.validate(module, dataloaders=loader, verbose=False)[0]["val/loss"]
    return {"val_loss": val_loss, "logits": torch.cat(trainer.predict(module, dataloaders=loader))}


@pytest.mark.distributed
def test_overlapped_evaluation_of_a_batch_that_does_not_split_equals_a_single_process():
    """Validation and prediction run unsplit: a last batch of 3 samples is no error at tp_overlap=2."""
    samples = torch.randint(VOCAB, (7, SEQ), generator=torch.Generator().manual_seed(5))
    module = _module("llama").eval()
    with torch.no_grad():
        batches = samples.split(4)
        expected_loss = sum(module.compute_loss((batch,)).item() * len(batch) for batch in batches) / len(samples)
        expected_logits = torch.cat([module(batch) for batch in batches])
    for result in run_distributed(_evaluating_rank, 2, args=(samples,), timeout_s=300):
        assert result["val_loss"] == pytest.approx(expected_loss, rel=1e-5)
        _assert_relative(result["logits"], expected_logits, tolerance=1e-5, name="logits")


def _planned_rank(rank: int, world_size: int, log_dir: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_merak.parallel.pipeline.stage import tied_parameter_names
    from lightning_merak.strategies.merak3d import planning
    from tests.test_merak3d import STEPS, _module, _Recorder, _ShardedData

    planning.STEP_CHECK_WARMUP, planning.STEP_CHECK_BATCHES = 1, STEPS - 2
    module = _module("llama")
    recorder = _Recorder(tied_parameter_names(module.model))
    strategy = Merak3DStrategy(pipeline_parallel="auto", tensor_parallel="auto", tp_overlap="auto", timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1,
        logger=CSVLogger(log_dir, name="", version=""), enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[recorder],
    )
    trainer.fit(module, datamodule=_ShardedData(0, STEPS))
    chosen = next(p for p in strategy.layout_plan.ranked if p.layout.dp == strategy.data_parallel
                  and p.layout.pp == strategy.pipeline_parallel and p.layout.tp == strategy.tensor_parallel)
    return {"losses": recorder.losses, "gradients": recorder.gradients, "check": strategy.step_time_check,
            "best_predicted_s": strategy.layout_plan.ranked[0].step_time_s, "chosen_predicted_s": chosen.step_time_s}


@pytest.mark.distributed
def test_planned_layout_trains_like_a_single_process_and_reports_its_real_step(tmp_path):
    """Whatever layout the planner picks from its profile, training must equal the reference; after its
    first batches the run puts the slowest rank's median step next to the prediction, in the log and the logger."""
    import csv

    results = run_distributed(_planned_rank, 2, args=(str(tmp_path),), timeout_s=600)
    merged = merge_rank_traces([(r["losses"], r["gradients"]) for r in results])
    assert_traces_match(_reference("llama"), merged, loss_rtol=1e-5, grad_rtol=1e-4)
    checks = [r["check"] for r in results]
    assert checks[0] is not None and checks[0] == checks[1], "every rank holds the same check"
    assert checks[0].predicted_s == results[0]["best_predicted_s"] == results[0]["chosen_predicted_s"]
    assert checks[0].batches == 3 and checks[0].measured_s > 0
    with open(tmp_path / "metrics.csv") as metrics:
        rows = [row for row in csv.DictReader(metrics) if row.get("planner/measured_step_s")]
    assert len(rows) == 1
    assert float(rows[0]["planner/measured_step_s"]) == pytest.approx(checks[0].measured_s)
    assert float(rows[0]["planner/predicted_step_s"]) == pytest.approx(checks[0].predicted_s)


def _plan_only_rank(rank: int, world_size: int, sequence_parallel: bool = False, sequence: int = SEQ,
                    model_name: str = "llama") -> dict:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_merak3d import BATCH, _batches, _module

    class FirstTokens(pl.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(_batches()[0, :, :sequence]), batch_size=BATCH)

    strategy = Merak3DStrategy(pipeline_parallel="auto", tensor_parallel="auto", plan_only=True,
                               sequence_parallel=sequence_parallel, timeout_s=120)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.fit(_module(model_name), datamodule=FirstTokens())
    best = strategy.layout_plan.best
    return {"layout": best.layout, "steps": trainer.global_step, "built": strategy.layout_built,
            "layouts": [p.layout for p in strategy.layout_plan.ranked]}


@pytest.mark.distributed
def test_plan_only_plans_the_same_layout_everywhere_and_trains_nothing():
    results = run_distributed(_plan_only_rank, 2, timeout_s=300)
    assert results[0]["layout"] == results[1]["layout"]
    assert all(r["steps"] == 0 and not r["built"] for r in results)
    degrees = {(layout.dp, layout.pp, layout.tp) for layout in results[0]["layouts"]}
    assert degrees == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}


@pytest.mark.distributed
@pytest.mark.parametrize("sequence", [SEQ, SEQ - 1], ids=["even", "odd"])
def test_sequence_parallel_planning_keeps_only_degrees_that_split_the_sequence(sequence):
    results = run_distributed(_plan_only_rank, 2, args=(True, sequence), timeout_s=300)
    assert results[0]["layout"] == results[1]["layout"]
    degrees = {(layout.dp, layout.pp, layout.tp) for layout in results[0]["layouts"]}
    expected = {(2, 1, 1), (1, 2, 1)} | ({(1, 1, 2)} if sequence % 2 == 0 else set())
    assert degrees == expected


def test_local_shard_of_a_block_holds_one_rank_of_every_split_layer():
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.planning.measure.layout import local_shard_of_block
    from lightning_merak.strategies.merak3d.build import call_model

    model = build_causal_lm(ModelConfig(name="gpt2", model_type="gpt2", config={"n_embd": 32, "n_layer": 2,
                                                                                "n_head": 4}), vocab_size=VOCAB)
    model.config.use_cache = False
    trace = trace_model(model, torch.randint(VOCAB, (2, SEQ)), call_model, profile=False)
    block = model.get_submodule(trace.trunk_path)[0]
    plan = tensor_parallel_plan(block, trace)
    shard = local_shard_of_block(block, plan, 2)
    assert shard.attn.c_attn.out_features == 48 and shard.mlp.c_proj.in_features == 64
    args, kwargs = trace.block_arguments(trace.sample_side_tensors)
    output = trace.hidden_of(shard(trace.sample_hidden, *args, **kwargs))
    assert output.shape == trace.sample_hidden.shape


def test_local_shard_of_a_block_keeps_whole_shared_key_value_heads():
    """Four query heads over two key/value heads at tensor_parallel=4: each rank's shard holds one whole key/value
    head (shared by two ranks), as the split does, and runs; the planner times it so."""
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.planning.measure.layout import local_shard_of_block
    from lightning_merak.strategies.merak3d.build import call_model

    model = build_causal_lm(ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2}), vocab_size=VOCAB)
    model.config.use_cache = False
    trace = trace_model(model, torch.randint(VOCAB, (2, SEQ)), call_model, profile=False)
    block = model.get_submodule(trace.trunk_path)[0]
    shard = local_shard_of_block(block, tensor_parallel_plan(block, trace), 4)
    assert (shard.self_attn.q_proj.out_features, shard.self_attn.k_proj.out_features) == (16, 16)
    args, kwargs = trace.block_arguments(trace.sample_side_tensors)
    assert trace.hidden_of(shard(trace.sample_hidden, *args, **kwargs)).shape == trace.sample_hidden.shape
