"""merak3d with ``context_parallel``: every sample's sequence split over ranks trains as one process does (losses,
gradient norms before clipping and final weights), with data parallelism and sharding beside it; and what it does
not run yet is refused before launch."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import (
    LayoutTraceRecorder,
    assert_traces_match,
    merge_rank_traces,
    record_reference_trace,
    run_distributed,
)
from lightning_merak.testing.causal_lm import FixedOptimizerModule
from tests import test_merak3d_fully_sharded as sharded
from tests.test_merak3d_fully_sharded import CLIP, VOCAB, _module, _Recorder, _reference

STEPS, BATCH, SEQ = 3, 4, 64  # the sequence splits into 2 x cp chunks


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))


class _Data(pl.LightningDataModule):
    """Each batch replica gets its slice of every global batch; the context-parallel ranks of one replica the same."""

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        shard = BATCH // kwargs["num_replicas"]
        local = _batches()[:, kwargs["rank"] * shard:(kwargs["rank"] + 1) * shard]
        return DataLoader(TensorDataset(local.reshape(-1, SEQ)), batch_size=shard, shuffle=False)


def _train_rank(rank: int, world_size: int, layout: dict) -> dict:
    """One rank's losses, gradient norms before clipping and final weights; its layout and, when planned, what the
    planner ranked."""
    from lightning_merak.strategies.merak3d import planning

    planning.PLANNER_REPEATS = 3  # a tiny model: the figures only need to exist
    layout = dict(layout)
    module = _module(adam=False)  # SGD: Adam would magnify rounding in near-zero gradients
    module.model.set_attn_implementation(layout.pop("attention", "sdpa"))
    recorder = _Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[recorder], gradient_clip_val=CLIP)
    trainer.fit(module, datamodule=_Data())
    weights = {}
    original = getattr(module.model, "original_name", lambda name: name)  # pipeline stages: the unsplit names
    for name, param in module.model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        weights[original(name)] = full.detach().clone()
    plan = trainer.strategy.layout_plan
    logits = None
    if layout.get("pipeline_parallel", 1) > 1:  # predict through the stages: the whole sequence's logits
        module.eval()
        with torch.no_grad():
            logits = module(_batches()[0][:BATCH // trainer.strategy.layout.batch_replicas])
    return {"logits": logits, "losses": recorder.losses, "norms": recorder.norms, "weights": weights,
            "replicas": trainer.strategy.data_parallel, "layout": trainer.strategy.layout,
            "ranked": None if plan is None else [(p.layout.cp, p.layout.context_attention, p.step_time_s,
                                                  p.components["context_exchange"]) for p in plan.ranked]}


LAYOUTS = {
    "cp2-ring": ({"context_parallel": 2}, 2),
    "cp2-all_to_all": ({"context_parallel": 2, "context_attention": "all_to_all"}, 2),
    "dp2-cp2-zero1": ({"data_parallel": 2, "context_parallel": 2, "data_parallel_sharding": "optimizer"}, 4),
    "cp2-fsdp2": ({"context_parallel": 2, "data_parallel_sharding": "full"}, 2),
    "cp2-tp2": ({"context_parallel": 2, "tensor_parallel": 2}, 4),  # heads split over tp, sequence over cp
    # each context rank's tokens split again over tp between the blocks' column and row layers
    "cp2-tp2-sp": ({"context_parallel": 2, "tensor_parallel": 2, "sequence_parallel": True}, 4),
    # each micro-batch's sub-batches take turns at the tensor- and context-parallel collectives
    "cp2-tp2-overlap2": ({"context_parallel": 2, "tensor_parallel": 2, "tp_overlap": 2}, 4),
    # each stage's blocks run on the shard its input holds; the last stage scores its rows of the sequence
    "cp2-pp2": ({"context_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2}, 4),
    # an eager model's own mask is no value between the stages: the split forward builds none
    "cp2-pp2-eager": ({"context_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2, "attention": "eager"}, 4),
    "cp2-pp2-zero-bubble-all_to_all": ({"context_parallel": 2, "context_attention": "all_to_all",
                                        "pipeline_parallel": 2, "schedule": "interleaved_zero_bubble",
                                        "virtual_stages": 2, "micro_batches": 2, "partition": "min_max"}, 4),
}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_training_matches_one_process(name: str) -> None:
    layout, world_size = LAYOUTS[name]
    losses, norms, weights = _reference(CLIP, batches=_batches())
    results = run_distributed(_train_rank, world_size, args=(layout,), timeout_s=300)
    trained: dict[str, torch.Tensor] = {}
    for result in results:
        assert result["replicas"] == world_size // (layout["context_parallel"] * layout.get("tensor_parallel", 1)
                                                    * layout.get("pipeline_parallel", 1))
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        assert result["norms"] == pytest.approx(norms, rel=1e-5)
        trained.update(result["weights"])  # with pipeline stages each rank holds its stage's
    assert set(trained) == set(weights)
    for key, expected in weights.items():
        torch.testing.assert_close(trained[key], expected, atol=1e-5, rtol=1e-4, msg=key)
    if results[0]["logits"] is not None:
        reference = _module(adam=False)
        reference.model.load_state_dict(trained)
        reference.eval()
        with torch.no_grad():
            expected_logits = reference(_batches()[0][:results[0]["logits"].shape[0]])
        for result in results:
            torch.testing.assert_close(result["logits"], expected_logits, atol=1e-5, rtol=1e-4)


@pytest.mark.distributed
def test_the_planner_chooses_the_context_degree_and_attention_and_trains_as_one_process() -> None:
    """Two ranks, one batch replica: the planner must split each sequence over both and chooses ring or
    all-to-all attention by their predicted step (each priced with its exchange); the run it adopts is exact."""
    losses, norms, weights = _reference(CLIP, batches=_batches())
    planned = {"data_parallel": 1, "context_parallel": "auto", "context_attention": "auto"}
    results = run_distributed(_train_rank, 2, args=(planned,), timeout_s=300)
    for result in results:
        split = [entry for entry in result["ranked"] if entry[0] == 2]  # the ranking holds dp=2 layouts too
        assert {method for _, method, *_ in split} == {"ring", "all_to_all"}
        assert all(exchange > 0 for *_, exchange in split)
        assert all(exchange == 0 for cp, *_, exchange in result["ranked"] if cp == 1)
        layout = result["layout"]
        assert (layout.context_parallel, layout.batch_replicas) == (2, 1)
        assert layout.context_attention == split[0][1]  # the fastest predicted of those data_parallel=1 allows
        assert result["losses"] == pytest.approx(losses, rel=1e-5)
        assert result["norms"] == pytest.approx(norms, rel=1e-5)
        for key, expected in weights.items():
            torch.testing.assert_close(result["weights"][key], expected, atol=1e-5, rtol=1e-4, msg=key)


def _lora_window_module() -> FixedOptimizerModule:
    """LoRA on Mistral with an 8-token window: a model that builds its own mask, unless its base model's attention
    is context parallelism's while the stages are traced."""
    from tests.test_merak3d_context_degrees import MISTRAL
    from tests.test_merak3d_context_degrees import _module as degrees_module

    return degrees_module(MISTRAL, lora=True)


def _train_lora_rank(rank: int, world_size: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    recorder = LayoutTraceRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_epochs=1, logger=False, enable_checkpointing=False,
        strategy=Merak3DStrategy(context_parallel=2, pipeline_parallel=2, micro_batches=2, timeout_s=120),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        callbacks=[recorder])
    trainer.fit(_lora_window_module(), datamodule=_Data())
    return recorder.losses, recorder.gradients


@pytest.mark.distributed
def test_lora_on_a_model_building_its_own_mask_trains_over_context_and_pipeline_as_one_process() -> None:
    """cp2 x pp2 with a PEFT model: the stages are traced with its base model's attention swapped, so no mask of
    the model's own travels between them (the split forward builds none)."""
    module = _lora_window_module()
    reference = record_reference_trace(module.model, _batches(), lambda _, batch: module.compute_loss((batch,)),
                                       module.configure_optimizers())
    assert_traces_match(reference, merge_rank_traces(run_distributed(_train_lora_rank, 4, timeout_s=300)))


def test_the_degrees_planned_follow_the_options_and_the_model() -> None:
    from lightning_merak.strategies.merak3d.planning import context_attention_of, context_parallel_degrees

    auto = Merak3DStrategy(context_parallel="auto", tensor_parallel="auto")._arguments
    assert auto.needs_planning and auto.context_parallel_degrees(4) == (1, 2, 4)
    assert auto.context_attention_methods == ("ring", "all_to_all")  # the default, 'auto', plans the method too
    assert Merak3DStrategy(context_parallel="auto", context_attention="ring")._arguments.context_attention_methods == (
        "ring",)
    fixed = Merak3DStrategy(context_parallel=2)._arguments  # nothing planned: 'auto' attention runs the ring
    assert not fixed.needs_planning and fixed.layout(2).context_attention == "ring"
    packed = Merak3DStrategy(context_parallel="auto", pipeline_parallel=2, micro_batching="pack")._arguments
    assert packed.context_parallel_degrees(8) == (1, 2, 4, 8)
    model = _module(adam=False).model
    assert context_parallel_degrees(auto, model, 4) == (1, 2, 4)
    assert context_parallel_degrees(auto, torch.nn.Sequential(torch.nn.Linear(2, 2)), 4) == (1,)
    shape = context_attention_of(model, torch.zeros(2, SEQ, dtype=torch.long), None)
    assert (shape.sequence_length, shape.key_value_heads, shape.element_bytes) == (
        SEQ, model.config.num_key_value_heads, 4)


@pytest.mark.parametrize("arguments, message", [
    ({"context_parallel": 0}, "context_parallel=0 must be a positive integer"),
    ({"context_parallel": 2, "context_attention": "ulysses"}, "choose one of ring, all_to_all"),
    ({"context_parallel": "auto", "planner_calibration": __file__}, "planner_calibration='analytic'"),
    ({"context_parallel": 2, "tensor_parallel": "auto", "planner_calibration": __file__}, "cannot rank"),
])
def test_what_context_parallelism_does_not_run_is_refused_when_made(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Merak3DStrategy(**arguments)


def test_degrees_and_sequence_are_checked_before_launch() -> None:
    strategy = Merak3DStrategy(context_parallel=2)
    with pytest.raises(ValueError, match="context_parallel=2"):
        strategy.validate_arguments(3)
    with pytest.raises(ValueError, match="pad to a multiple of 4"):
        strategy.validate_arguments(4, batch_size=2, sequence_length=30)
    split_again = Merak3DStrategy(context_parallel=2, tensor_parallel=4, sequence_parallel=True)
    split_again.validate_arguments(8, batch_size=2, sequence_length=16)
    with pytest.raises(ValueError, match="sequence length 6 is not divisible"):  # 12 tokens: 6 per context rank
        split_again.validate_arguments(8, batch_size=2, sequence_length=12)
    assert Merak3DStrategy(data_parallel=2, context_parallel=2)._arguments.layout(4).batch_replicas == 2
    with pytest.raises(ValueError, match="attention interface"):
        Merak3DStrategy(context_parallel=2)._arguments.check_model(torch.nn.Linear(2, 2), 1, 1)
    two_heads_per_tp_rank = _module(adam=False).model  # 2 key/value heads, split over tp=2: 1 per rank
    ulysses = Merak3DStrategy(context_parallel=2, tensor_parallel=2, context_attention="all_to_all")
    with pytest.raises(ValueError, match="1 key/value heads"):
        ulysses._arguments.check_model(two_heads_per_tp_rank, 1, 2)


@pytest.mark.distributed
def test_a_checkpoint_resumes_across_a_change_of_context_parallel_degree(tmp_path) -> None:
    """Saved at cp=2 with ZeRO-1 and resumed at dp=2 (no cp), and saved at dp=2 and resumed at cp=2 × dp=2: both
    continue the single-process trajectory, Adam state included (Adam magnifies rounding to ~1e-4, as in
    ``test_checkpoints_resume_across_sharding_modes_and_layouts``)."""
    reference = sharded._reference(None, adam=True)
    half = sharded.STEPS // 2
    for index, (saved, saved_world, resumed, resumed_world) in enumerate([
        ({"context_parallel": 2, "data_parallel_sharding": "optimizer"}, 2, {"data_parallel": 2}, 2),
        ({"data_parallel": 2}, 2, {"data_parallel": 2, "context_parallel": 2}, 4),
    ]):
        checkpoint = str(tmp_path / f"saved{index}.ckpt")
        first = sharded._run(saved, saved_world, last_step=half, save_to=checkpoint, adam=True)
        assert first[0]["losses"] == pytest.approx(reference[0][:half], abs=1e-5)
        second = sharded._run(resumed, resumed_world, first_step=half, epochs=2, resume_from=checkpoint, adam=True)
        sharded._assert_matches(second, reference, slice(half, None), atol=1e-4)


class _OwnLoss(FixedOptimizerModule):
    """A module scoring logits with a loss of its own, which the last stage cannot apply to its rows."""

    def loss_from_logits(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return super().loss_from_logits(logits, targets) * 1.0


def _train_own_loss(rank: int, world_size: int) -> None:
    module = _OwnLoss(sharded._module(adam=False).model)
    module.adam = False
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_steps=1, logger=False, enable_checkpointing=False,
        strategy=Merak3DStrategy(context_parallel=2, pipeline_parallel=2, micro_batches=2, timeout_s=120),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    trainer.fit(module, datamodule=_Data())


@pytest.mark.distributed
def test_a_loss_of_its_own_is_refused_inside_pipeline_stages_on_every_rank():
    """cp2 x pp2 with a module overriding loss_from_logits: every rank stops at the build, naming the fix."""
    from lightning_merak.testing import DistributedRunError

    with pytest.raises(DistributedRunError, match="keep CausalLMModule's loss_from_logits"):
        run_distributed(_train_own_loss, 4, timeout_s=180)
