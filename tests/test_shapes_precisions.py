"""Shapes at the edges of merak3d's layouts: labels masked with ``-100`` unevenly over the micro-batches and the
batch replicas (a whole micro-batch of them included) train as one process does on the whole batch; a last batch
the layout cannot split, one-token sequences and a vocabulary too small for ``vocab_stages`` are refused before any
step."""

from __future__ import annotations

import re

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.data.token_mean import TokenWeightedLoss
from lightning_merak.parallel.layout import Layout
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.arguments import check_last_batch
from lightning_merak.testing import (
    DistributedRunError,
    LayoutTraceRecorder,
    TrainingTrace,
    assert_traces_match,
    merge_rank_traces,
    record_reference_trace,
    run_distributed,
)
from lightning_merak.testing.causal_lm import FixedOptimizerModule

STEPS, BATCH, SEQ, VOCAB = 2, 4, 16, 128
LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})


def _module() -> FixedOptimizerModule:
    torch.manual_seed(0)
    model = build_causal_lm(LLAMA, vocab_size=VOCAB)
    model.config.use_cache = False
    return FixedOptimizerModule(model)


def _masked_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels ``[steps, batch, tokens]``: each sample's padding (a tail of its own length) is ``-100``,
    and the first sample is padding throughout, so the first of two micro-batches scores a quarter of the tokens."""
    ids = torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    for step in range(STEPS):
        for sample in range(BATCH):
            labels[step, sample, SEQ - (5 * sample + 3 * step) % SEQ:] = -100
    labels[:, 0] = -100
    return ids, labels


def _reference() -> TrainingTrace:
    module = _module()
    return record_reference_trace(module.model, zip(*_masked_batches()), lambda _, batch: module.compute_loss(batch),
                                  module.configure_optimizers())


class _Data(pl.LightningDataModule):
    """The masked batches; with several batch replicas each gets a contiguous part of every batch."""

    def __init__(self, samples: int = STEPS * BATCH, replicas: int = 1) -> None:
        super().__init__()
        self.samples, self.replicas = samples, replicas

    def train_dataloader(self) -> DataLoader:
        share = BATCH // self.replicas
        first = self.trainer.strategy.distributed_sampler_kwargs["rank"] * share
        ids, labels = (tensor[:, first:first + share].reshape(-1, SEQ)[:self.samples] for tensor in _masked_batches())
        return DataLoader(TensorDataset(ids, labels), batch_size=share)


def _train_rank(rank: int, world_size: int, layout: dict,
                samples: int = STEPS * BATCH) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    recorder = LayoutTraceRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=60), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(_module(), datamodule=_Data(samples, layout.get("data_parallel", 1)))
    return recorder.losses, recorder.gradients


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [
    {"pipeline_parallel": 2, "micro_batches": 2},
    {"pipeline_parallel": 2, "micro_batches": 2, "vocab_stages": "on"},
], ids=["pp2", "pp2-vocab-stages"])
def test_pipeline_weighs_micro_batches_by_their_scored_tokens(layout):
    """The batch's loss is the mean over its scored tokens, not the mean of the micro-batches' means (nor NaN for a
    micro-batch that scores none)."""
    results = run_distributed(_train_rank, 2, args=(layout,), timeout_s=120)
    assert_traces_match(_reference(), merge_rank_traces(results), loss_rtol=1e-5, grad_rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("layout, world_size", [
    ({"data_parallel": 2}, 2),
    ({"data_parallel": 2, "data_parallel_sharding": "optimizer"}, 2),
    ({"data_parallel": 2, "data_parallel_sharding": "full"}, 2),
    ({"data_parallel": 2, "tensor_parallel": 2}, 4),
    ({"data_parallel": 2, "context_parallel": 2}, 4),
    ({"data_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2}, 4),
    ({"data_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2, "vocab_stages": "on"}, 4),
], ids=["dp2", "dp2-zero1", "dp2-full", "dp2-tp2", "dp2-cp2", "dp2-pp2", "dp2-pp2-vocab-stages"])
def test_batch_replicas_average_to_the_global_token_mean(layout, world_size):
    """Two replicas scoring 5 and 10 tokens (one of them a sample with none): the step is the global batch's mean
    over its scored tokens, as one process computes it, not the mean of the replicas' means (ZeRO-1 frees its
    gradients: its second step's loss carries the first step's update)."""
    results = run_distributed(_train_rank, world_size, args=(layout,), timeout_s=120)
    reference, candidate = _reference(), merge_rank_traces(results)
    if layout.get("data_parallel_sharding") == "optimizer":
        reference.gradients, candidate.gradients = [{} for _ in reference.losses], [{} for _ in candidate.losses]
    assert_traces_match(reference, candidate, loss_rtol=1e-5, grad_rtol=1e-4)


def test_token_weighted_loss_is_the_batch_mean_and_zero_for_a_micro_batch_without_scored_tokens():
    ids, labels = (tensor[0] for tensor in _masked_batches())
    logits = torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(1), requires_grad=True)
    module = _module()
    weighted = TokenWeightedLoss(module.loss_from_logits, micro_batches=2)
    weighted.begin(labels)
    losses = [weighted(logits[:2], labels[:2]), weighted(logits[2:], labels[2:])]
    whole = module.loss_from_logits(logits, labels)
    assert torch.stack(losses).mean().item() == pytest.approx(whole.item(), rel=1e-6)
    alone = weighted(logits[:1], labels[:1])  # the padding-only sample
    alone.backward()
    assert alone.item() == 0.0 and torch.isfinite(logits.grad).all() and not logits.grad.any()


@pytest.mark.distributed
@pytest.mark.parametrize("samples", [7, 6])
def test_a_last_batch_the_pipeline_cannot_take_is_refused_before_the_first_step(samples):
    """7 or 6 samples in batches of 4 end each epoch with 3 or 2, which the stages (shaped by the first batch of 4)
    cannot take, even where 2 micro-batches divide it: refused at the start of training, not after the epoch's other
    steps."""
    with pytest.raises(DistributedRunError, match=re.escape(
            f"the training dataloader ends each epoch with a batch of {samples - 4} samples ({samples} in batches of "
            "4), which merak3d's pipeline stages cannot take: they take every batch in the shape of the first")
    ) as refused:
        run_distributed(_train_rank, 2, args=({"pipeline_parallel": 2, "micro_batches": 2}, samples), timeout_s=120)
    assert "training_step" not in str(refused.value), "refused before any step ran"


def _layout(pipeline_parallel: int, micro_batches: int, tp_overlap: int = 1) -> Layout:
    return Layout(data_parallel=1, pipeline_parallel=pipeline_parallel, tensor_parallel=tp_overlap, virtual_stages=1,
                  schedule="1f1b", micro_batches=micro_batches, micro_batches_by_default=False, tp_overlap=tp_overlap,
                  recompute="none", recompute_ratio=0.5)


def test_last_batch_check_names_the_fix_and_passes_loaders_that_split_or_never_reach_it():
    dataset = TensorDataset(torch.zeros(10, SEQ, dtype=torch.long))
    check_last_batch(DataLoader(dataset, batch_size=4), _layout(2, 2), batches_run=2)  # limit_train_batches=2
    check_last_batch(DataLoader(dataset, batch_size=4), _layout(2, 2), max_steps=1)
    with pytest.raises(ValueError, match="ends each epoch with a batch of 2 samples"):
        check_last_batch(DataLoader(dataset, batch_size=4), _layout(2, 2), batches_run=3, max_steps=3)
    message = "ends each epoch with a batch of 1 samples (10 in batches of 3), which merak3d cannot split: micro-batch"
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        check_last_batch(DataLoader(dataset, batch_size=3), _layout(1, 1, tp_overlap=2))
    assert str(refused.value).endswith("or pass drop_last=True to the DataLoader")
    check_last_batch(DataLoader(dataset, batch_size=4, drop_last=True), _layout(2, 2))
    check_last_batch(DataLoader(dataset, batch_size=5), _layout(2, 5))  # no partial batch
    check_last_batch(DataLoader(dataset, batch_size=4), _layout(1, 1))  # without stages any batch runs


def test_one_token_sequences_are_refused_before_launch_for_a_next_token_loss():
    """One token has no next token: the loss is NaN in one process, and at tensor_parallel=2 the split found on such
    a batch is wrong; refused before launch, naming the value and the fix."""
    for layout in ({"tensor_parallel": 2}, {"pipeline_parallel": 2}, {"data_parallel": 2}):
        with pytest.raises(ValueError, match=re.escape("sequence length 1 leaves FixedOptimizerModule's next-token "
                                                       "loss no token to score (its loss would be NaN); use "
                                                       "sequences of")):
            Merak3DStrategy(**layout).validate_before_launch(_module(), 2, batch_size=4, sequence_length=1)
    Merak3DStrategy(tensor_parallel=2).validate_before_launch(_module(), 2, batch_size=4, sequence_length=2)


def _train_one_token_rank(rank: int, world_size: int) -> None:
    strategy = Merak3DStrategy(tensor_parallel=2, timeout_s=60)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_module(), DataLoader(TensorDataset(torch.randint(VOCAB, (8, 1))), batch_size=4))


@pytest.mark.distributed
def test_one_token_sequences_from_python_are_refused_on_the_first_batch_before_the_split():
    """Without the data known before launch, the first batch refuses them (the tensor-parallel split traced on one
    token would be refused with a misleading cause)."""
    with pytest.raises(DistributedRunError, match=re.escape("sequence length 1 leaves FixedOptimizerModule's "
                                                            "next-token loss no token to score")):
        run_distributed(_train_one_token_rank, 2, timeout_s=120)


def test_vocab_stages_refuse_before_launch_a_vocabulary_too_small_for_every_rank():
    """3 rows over 2 × 2 ranks leave the last one without rows (first batch before; now before launch)."""
    torch.manual_seed(0)
    module = FixedOptimizerModule(build_causal_lm(LLAMA, vocab_size=3))
    with pytest.raises(ValueError, match=re.escape("a vocabulary of 3 rows split over 4 pipeline × tensor-parallel "
                                                   "ranks leaves the last rank without rows; set vocab_stages='off'")):
        Merak3DStrategy(pipeline_parallel=2, tensor_parallel=2, vocab_stages="on").validate_before_launch(module, 4)
    Merak3DStrategy(pipeline_parallel=2, vocab_stages="on").validate_before_launch(module, 2)


def _train_one_row_rank(rank: int, world_size: int) -> list[float]:
    torch.manual_seed(0)
    module = FixedOptimizerModule(build_causal_lm(LLAMA, vocab_size=1))
    recorder = LayoutTraceRecorder()
    strategy = Merak3DStrategy(pipeline_parallel=2, micro_batches=2, vocab_stages="auto", timeout_s=60)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[recorder])
    trainer.fit(module, DataLoader(TensorDataset(torch.zeros(4, SEQ, dtype=torch.long)), batch_size=4))
    return recorder.losses


@pytest.mark.distributed
def test_vocab_stages_auto_keeps_a_vocabulary_too_small_to_split_on_the_last_stage():
    """'auto' chooses: a vocabulary of one row cannot give both stages rows, so the head stays whole (one token:
    the loss is 0), where 'on' is refused."""
    losses = run_distributed(_train_one_row_rank, 2, timeout_s=120)
    assert losses[0] == losses[1] == [0.0]

