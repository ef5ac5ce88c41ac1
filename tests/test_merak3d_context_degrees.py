"""A context-parallel degree per sample (``context_parallel_degree='per_micro_batch'``): the pure planner, the
refusals before launch, and a 2-rank run (one long sample split, short ones whole on one rank each) against one
process on the same global batches."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.context.variable import DegreeCost, plan_context_degrees, split_length
from lightning_merak.parallel.micro_batching import GlobalBatches, VariableBatch
from lightning_merak.parallel.micro_batching.plan import CostModel
from lightning_merak.parallel.micro_batching.samples import global_batch_loader, summed_token_loss, target_count
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import TrainingTrace, assert_traces_match, merge_rank_traces, run_distributed
from lightning_merak.testing.causal_lm import FixedOptimizerModule
from lightning_merak.testing.compare import record_reference_trace
from tests.test_micro_batching_distributed import _Recorder as _TraceRecorder

COST = DegreeCost(CostModel(1.0, 0.01, 50.0), exchange_per_step=20.0)


def _all_samples(plan, count: int) -> list[int]:
    seen = [i for rounds in plan.replicas for round_ in rounds for slot in round_.slots for i in slot]
    assert sorted(seen) == list(range(count))  # every sample exactly once
    return seen


def test_long_samples_split_and_short_ones_balance_over_the_group() -> None:
    lengths = [2000, 100, 120, 90, 300, 80, 110, 2100, 60, 70]
    plan = plan_context_degrees(lengths, replicas=1, group_size=4, cost=COST, token_cap=1200)
    _all_samples(plan, len(lengths))
    assert plan.degrees[0] > 1 and plan.degrees[7] > 1  # over the cap at degree 1
    assert all(plan.degrees[i] == 1 for i in (1, 2, 3, 5, 8, 9))  # short: no exchange, no extra launches
    for round_ in plan.replicas[0]:
        assert len(round_.slots) == 4 // round_.degree
        if round_.degree > 1:
            assert all(len(slot) <= 1 for slot in round_.slots)
        else:
            assert all(sum(lengths[i] for i in slot) <= 1200 for slot in round_.slots)
    per_sample = plan.group_times(lengths, COST)[0]
    fixed = {k: plan_context_degrees(lengths, 1, 4, COST, 1200, degree=k).group_times(lengths, COST)[0]
             for k in (2, 4)}
    assert per_sample < min(fixed.values())
    assert plan == plan_context_degrees(lengths, 1, 4, COST, 1200)  # deterministic


def test_fixed_degrees_replicas_and_refusals() -> None:
    lengths = [40, 50, 300, 20, 25, 33]
    for degree in (1, 2):
        plan = plan_context_degrees(lengths, replicas=2, group_size=2, cost=COST, token_cap=400, degree=degree)
        _all_samples(plan, len(lengths))
        assert set(plan.degrees) == {degree}
        assert len(plan.replicas[0]) == len(plan.replicas[1])  # every rank runs as many backward passes
    assert split_length(301, 2) == 304 and split_length(301, 1) == 301
    with pytest.raises(ValueError, match="over the cap of 100; raise strategy.micro_batch_tokens"):
        plan_context_degrees(lengths, 1, 2, COST, token_cap=100)
    with pytest.raises(ValueError, match="divisor of the group size 4"):
        plan_context_degrees(lengths, 1, 4, COST, 400, degree=3)


def test_per_micro_batch_refuses_what_its_rounds_cannot_run() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel=1 for now"):
        Merak3DStrategy(context_parallel=2, pipeline_parallel=2, context_parallel_degree="per_micro_batch")
    with pytest.raises(ValueError, match="context_parallel to a fixed degree of at least 2"):
        Merak3DStrategy(context_parallel="auto", context_parallel_degree="per_micro_batch")
    with pytest.raises(ValueError, match="past FSDP2's hooks on the whole model"):
        Merak3DStrategy(context_parallel=2, data_parallel_sharding="full", context_parallel_degree="per_micro_batch")
    with pytest.raises(ValueError, match="choose one of fixed, per_micro_batch"):
        Merak3DStrategy(context_parallel=2, context_parallel_degree="sometimes")


BATCH, VOCAB = 6, 96
LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})
MISTRAL = ModelConfig(name="mistral", model_type="mistral", config={  # a window shorter than most samples
    **LLAMA.config, "sliding_window": 8})


def _samples() -> list[torch.Tensor]:
    """Two global batches, each one long sample (over the 64-token cap: split over both ranks) and five short."""
    generator = torch.Generator().manual_seed(7)
    lengths = [100, 9, 23, 31, 14, 40, 17, 120, 35, 11, 26, 19]
    return [torch.randint(VOCAB, (length,), generator=generator) for length in lengths]


def _module(config: ModelConfig = LLAMA, lora: bool = False) -> FixedOptimizerModule:
    torch.manual_seed(0)
    model = build_causal_lm(config, vocab_size=VOCAB)
    if lora:  # a PEFT model: context parallelism swaps its base model's attention, which its adapters wrap around
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return FixedOptimizerModule(model)


def test_per_micro_batch_refuses_a_loss_its_rounds_cannot_compute_before_launch() -> None:
    """A MoE router aux loss and a module's loss of its own: refused before launch (merak-train validates the
    module so), not by the rounds after launch."""
    from lightning_merak.plugins.moe.experts import tiny_moe_model
    from tests.test_merak3d_context_parallel import _OwnLoss

    strategy = Merak3DStrategy(context_parallel=2, context_parallel_degree="per_micro_batch")
    routed = tiny_moe_model("mixtral", hidden=32, vocab=VOCAB, output_router_logits=True)
    with pytest.raises(ValueError, match="no router aux loss over the whole batch yet; set output_router_logits=False"):
        strategy.validate_before_launch(FixedOptimizerModule(routed), 2)
    with pytest.raises(ValueError, match="_OwnLoss brings its own loss; keep CausalLMModule's loss_from_logits"):
        strategy.validate_before_launch(_OwnLoss(_module().model), 2)
    strategy.validate_before_launch(_module(MISTRAL, lora=True), 2)


def _token_mean(model: torch.nn.Module, batch: VariableBatch) -> torch.Tensor:
    """Each sample whole through the model; the summed token loss over the global batch's targets."""
    total = sum(summed_token_loss(model(batch.sample(i)[None]).logits[:, :-1], batch.sample(i)[None, 1:])
                for i in range(len(batch.lengths)))
    return total / target_count(batch.lengths)


def _reference(config: ModelConfig, lora: bool = False) -> tuple[TrainingTrace, float]:
    """The training trace of one process, and the validation loss of its trained model on the first batch."""
    module = _module(config, lora)
    batches = list(GlobalBatches(_samples(), BATCH, seed=0, shuffle=False))
    trace = record_reference_trace(module.model, batches, _token_mean, module.configure_optimizers())
    with torch.no_grad():
        return trace, float(_token_mean(module.model, batches[0]))


class _Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return global_batch_loader(_samples(), BATCH, seed=0, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return global_batch_loader(_samples()[:BATCH], BATCH, seed=0, shuffle=False)


class _Recorder(_TraceRecorder):
    """Losses and gradients of each step, and each sample's degree in its plan."""

    def __init__(self) -> None:
        super().__init__()
        self.degrees: list[tuple[int, ...]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.degrees.append(trainer.strategy._pipeline.last_plan.degrees)


def _train_rank(rank: int, world_size: int, layout: dict, config: ModelConfig,
                lora: bool = False) -> tuple[list[float], list[dict], list[tuple[int, ...]], float]:
    recorder = _Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(_module(config, lora), datamodule=_Data())  # validates the first batch after training
    return recorder.losses, recorder.gradients, recorder.degrees, float(trainer.callback_metrics["val/loss"])


@pytest.mark.distributed
@pytest.mark.parametrize("config, recompute, tp, lora", [(LLAMA, "none", 1, False), (MISTRAL, "none", 1, False),
                                                         (LLAMA, "full", 1, False), (LLAMA, "none", 2, False),
                                                         (MISTRAL, "none", 1, True)],
                         ids=["llama", "sliding_window", "llama-recompute", "llama-tp2", "sliding_window-lora"])
def test_per_micro_batch_degrees_train_and_validate_as_one_process(config: ModelConfig, recompute: str, tp: int,
                                                                    lora: bool) -> None:
    """Llama, and Mistral with an 8-token window: the split sample's ring and the short samples' one-rank attention
    both apply the window as transformers' mask does; recomputed, each block attends as its forward did; with
    tensor parallelism each rank's heads attend over the round's group; with LoRA, the rounds run the PEFT model's
    base model, whose attention is the one swapped."""
    layout = {"context_parallel": 2, "context_parallel_degree": "per_micro_batch", "micro_batch_tokens": 64,
              "recompute": recompute, "tensor_parallel": tp}
    results = run_distributed(_train_rank, 2 * tp, args=(layout, config, lora), timeout_s=300)
    trace, validation = _reference(config, lora)
    for _, _, degrees, validated in results:
        assert degrees == [(2, 1, 1, 1, 1, 1), (1, 2, 1, 1, 1, 1)]  # the long sample split, the short ones whole
        assert validated == pytest.approx(validation, rel=1e-5)
    assert_traces_match(trace, merge_rank_traces([(losses, grads) for losses, grads, *_ in results]))
