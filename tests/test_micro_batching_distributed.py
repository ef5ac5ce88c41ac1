"""merak3d with variable-length micro-batches (pad, pack, dynamic) against a single-process reference, gloo ranks."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.micro_batching import GlobalBatches, VariableBatch
from lightning_merak.parallel.micro_batching.plan import MicroBatch
from lightning_merak.parallel.micro_batching.samples import micro_batch_tensors, summed_token_loss, target_count
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import (
    DistributedRunError,
    TrainingTrace,
    assert_traces_match,
    layout_gradients,
    merge_rank_traces,
    run_distributed,
    snapshot_gradients,
)
from lightning_merak.testing.causal_lm import FixedOptimizerModule

pytestmark = pytest.mark.distributed

STEPS, BATCH, VOCAB = 2, 12, 96
LLAMA = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False, "attn_implementation": "eager"})


def _samples() -> list[torch.Tensor]:
    """Longer samples in the second global batch: dynamic plans more micro-batches than in the first."""
    generator = torch.Generator().manual_seed(5)
    lengths = torch.cat([torch.randint(3, 41, (BATCH,), generator=generator),
                         torch.randint(20, 81, ((STEPS - 1) * BATCH,), generator=generator)])
    return [torch.randint(VOCAB, (int(length),), generator=generator) for length in lengths]


def _global_batches() -> list[VariableBatch]:
    return list(GlobalBatches(_samples(), BATCH, seed=0, shuffle=False))



def _module(config: ModelConfig = LLAMA) -> FixedOptimizerModule:
    torch.manual_seed(0)
    model = build_causal_lm(config, vocab_size=VOCAB)
    model.config.use_cache = False
    return FixedOptimizerModule(model)


def _reference(config: ModelConfig = LLAMA) -> TrainingTrace:
    """Each sample on its own through the whole model; loss = summed token loss / real targets of the batch."""
    module = _module(config)
    optimizer = torch.optim.SGD(module.model.parameters(), lr=0.5)
    trace = TrainingTrace()
    for batch in _global_batches():
        optimizer.zero_grad()
        total = sum(
            summed_token_loss(module(tensors.input_ids), tensors.labels)
            for tensors in (micro_batch_tensors(batch, MicroBatch(((index,),), len(batch.sample(index))))
                            for index in range(len(batch.lengths))))
        loss = total / target_count(batch.lengths)
        loss.backward()
        trace.append(loss.item(), snapshot_gradients(module.model))
        optimizer.step()
    return trace


def _keep(batch: VariableBatch) -> VariableBatch:
    return batch


class _Data(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(GlobalBatches(_samples(), BATCH, seed=0, shuffle=False), batch_size=None, collate_fn=_keep)


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.gradients: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        self.gradients.append(layout_gradients(trainer.strategy, pl_module.model))


def _train_rank(rank: int, world_size: int, layout: dict) -> tuple[list[float], list[dict]]:
    recorder = _Recorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder])
    trainer.fit(_module(), datamodule=_Data())
    return recorder.losses, recorder.gradients


LAYOUTS = [
    ("pad", {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1}),
    ("pack", {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1}),
    ("dynamic", {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1}),
    # 48 tokens: replicas plan 4 and 3 micro-batches, topped up to the same count (both steps)
    ("dynamic", {"data_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1, "micro_batch_tokens": 48}),
    ("dynamic", {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2, "recompute": "full"}),
    ("dynamic", {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1,
                 "schedule": "shifted_critical_path"}),
    # the LM head and embedding split over the stages: each micro-batch's labels scored by the exchange
    ("dynamic", {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1, "vocab_stages": "on"}),
    ("pack", {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1, "vocab_stages": "on"}),
    ("dynamic", {"data_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1, "micro_batch_tokens": 48,
                 "vocab_stages": "on"}),
    # each micro-batch's sequence split over 2 context ranks, every stage on its shard, the loss summed over them
    ("pad", {"data_parallel": 1, "context_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1}),
    ("dynamic", {"data_parallel": 1, "context_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1,
                 "micro_batch_tokens": 48}),
    ("dynamic", {"data_parallel": 1, "context_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1,
                 "vocab_stages": "on"}),
    # packed rows: each rank's document ids travel with the hidden state from the first stage
    ("pack", {"data_parallel": 1, "context_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1}),
    ("dynamic", {"data_parallel": 1, "context_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1,
                 "recompute": "full"}),
]


@pytest.mark.parametrize("mode, layout", LAYOUTS, ids=lambda item: item if isinstance(item, str) else
                         "dp{data_parallel}-pp{pipeline_parallel}-tp{tensor_parallel}".format(**item)
                         + (f"-cp{item['context_parallel']}" if "context_parallel" in item else "")
                         + ("-" + item["schedule"] if "schedule" in item else "")
                         + ("-vocab_stages" if "vocab_stages" in item else "")
                         + ("-recompute" if "recompute" in item else ""))
def test_micro_batching_matches_single_process(mode, layout):
    """Same loss and gradients as one process over the same samples, whatever the micro-batches."""
    world_size = (layout["data_parallel"] * layout.get("context_parallel", 1) * layout["pipeline_parallel"]
                  * layout["tensor_parallel"])
    options = {"micro_batch_tokens": 96, **layout, "micro_batching": mode, "micro_batches": 4}
    results = run_distributed(_train_rank, world_size, args=(options,), timeout_s=300)
    assert_traces_match(_reference(), merge_rank_traces(results))


class _WithTemperature(FixedOptimizerModule):
    """A trainable parameter outside the network, which micro_batching's token loss would leave untrained."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.temperature = torch.nn.Parameter(torch.ones(()))


def _train_with_temperature(rank: int, world_size: int) -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_epochs=1, logger=False, enable_checkpointing=False,
        strategy=Merak3DStrategy(data_parallel=1, pipeline_parallel=2, tensor_parallel=1, micro_batching="pad",
                                 micro_batches=4, micro_batch_tokens=96, timeout_s=120),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False)
    torch.manual_seed(0)
    trainer.fit(_WithTemperature(build_causal_lm(LLAMA, vocab_size=VOCAB)), datamodule=_Data())


def test_parameters_outside_the_network_are_refused_under_micro_batching():
    with pytest.raises(DistributedRunError, match=r"temperature of _WithTemperature \(outside the pipelined network\)"):
        run_distributed(_train_with_temperature, 2, timeout_s=300)
