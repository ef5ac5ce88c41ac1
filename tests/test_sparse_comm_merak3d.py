"""SparseCommunication under merak3d's data-parallel group (real gloo ranks): the same losses
and gradients as merak3d's own dense averaging, with and without pipeline stages and clipping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.sparse_comm import ShardedEmbedding, SparseCommunication
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks or a subprocess

STEPS, BATCH, SEQ, VOCAB, TABLE_ROWS = 4, 8, 16, 512, 256
CLIP = 0.05
MODELS = {
    "gpt2_tied": ModelConfig(name="gpt2", model_type="gpt2", config={
        "n_embd": 32, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "llama": ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": False}),
}


class _SGDModule(CausalLMModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=0.5)


class _DataParallelSlices(pl.LightningDataModule):
    """Each data-parallel rank reads its slice of the same global batches."""

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        replicas, rank = kwargs["num_replicas"], kwargs["rank"]
        shard = BATCH // replicas
        batches = torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))
        local = batches[:, rank * shard:(rank + 1) * shard]
        return DataLoader(TensorDataset(local.reshape(-1, SEQ)), batch_size=shard, shuffle=False)


class _Recorder(pl.Callback):
    """Per step: the logged loss, this rank's gradients as the optimizer used them, the norm merak3d
    clipped by and the sharded tables' exchange timings."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.norms: list[float | None] = []
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.exchanges: list[object] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.norms.append(trainer.strategy.last_gradient_norm)
        self.gradients.append({
            name: param.grad.detach().clone() for name, param in pl_module.named_parameters() if param.grad is not None
        })
        self.exchanges += [m.last_exchange for m in pl_module.modules() if isinstance(m, ShardedEmbedding)]


def _fit(model_name: str, layout: dict[str, Any], comm: SparseCommunication | None,
         clip: float | None = None) -> dict[str, object]:
    torch.manual_seed(0)
    model = build_causal_lm(MODELS[model_name], vocab_size=VOCAB)
    module = _SGDModule(model)
    recorder = _Recorder()
    # a uniform split: the profiled (AutoPipe) split may differ between the runs compared rank by rank
    trainer = pl.Trainer(
        accelerator="cpu", devices=layout["data_parallel"] * layout["pipeline_parallel"],
        strategy=Merak3DStrategy(**layout, partition="uniform", timeout_s=120), max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, gradient_clip_val=clip,
        callbacks=[recorder, *([comm] if comm else [])],
    )
    trainer.fit(module, datamodule=_DataParallelSlices())
    result: dict[str, object] = {"losses": recorder.losses, "gradients": recorder.gradients, "norms": recorder.norms}
    if comm is not None and comm.excluded_reducer is not None:
        result["decisions"] = list(comm.excluded_reducer.decision_log)
        result["embedding_wire"] = comm.ledger.snapshot().get("embedding", 0.0)
    result["exchanges"] = recorder.exchanges
    return result


def data_parallel_runs(rank: int, world_size: int) -> dict[str, dict[str, object]]:
    layout = {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1}
    return {
        "gpt2_dense": _fit("gpt2_tied", layout, None),
        "gpt2_s2": _fit("gpt2_tied", layout, SparseCommunication("s2", min_table_rows=TABLE_ROWS)),
        "gpt2_embrace": _fit("gpt2_tied", layout, SparseCommunication("embrace", tables=["model.transformer.wte"])),
        "llama_dense": _fit("llama", layout, None),
        "llama_s2": _fit("llama", layout, SparseCommunication("s2", min_table_rows=TABLE_ROWS)),
        "llama_auto": _fit("llama", layout, SparseCommunication("auto", min_table_rows=TABLE_ROWS,
                                                                bandwidth_gbit=1.0)),
        "llama_embrace_priority": _fit("llama", layout, SparseCommunication(
            "embrace", min_table_rows=TABLE_ROWS, priority=True)),
        "llama_dense_clipped": _fit("llama", layout, None, clip=CLIP),
        "llama_embrace_clipped": _fit("llama", layout, SparseCommunication("embrace", min_table_rows=TABLE_ROWS),
                                      clip=CLIP),
        "llama_s2_zero2": _fit("llama", {**layout, "data_parallel_sharding": "gradients"},
                               SparseCommunication("s2", min_table_rows=TABLE_ROWS)),
        "llama_embrace_zero1_clipped": _fit("llama", {**layout, "data_parallel_sharding": "optimizer"},
                                            SparseCommunication("embrace", min_table_rows=TABLE_ROWS), clip=CLIP),
    }


class _AdamModule(CausalLMModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=0.01)


def _resumed(method: str | None, root: Path) -> dict[str, object]:
    """Adam for half the steps, merak3d's sharded checkpoint, a new run resuming it for the rest (the epoch starts
    over: the loader is not resumable): the resumed run's losses and gradients."""
    checkpoint = root / f"{method}.ckpt"
    recorder = _Recorder()
    for steps, callbacks, ckpt_path in ((STEPS // 2, [], None), (STEPS, [recorder], checkpoint)):
        torch.manual_seed(0)
        comm = [SparseCommunication(method, min_table_rows=TABLE_ROWS)] if method else []
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy=Merak3DStrategy(data_parallel=2, timeout_s=120), max_steps=steps,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, default_root_dir=root,
            callbacks=[*callbacks, *comm])
        trainer.fit(_AdamModule(build_causal_lm(MODELS["llama"], vocab_size=VOCAB)), datamodule=_DataParallelSlices(),
                    ckpt_path=ckpt_path)
        if ckpt_path is None:
            trainer.save_checkpoint(checkpoint)
    return {"losses": recorder.losses, "gradients": recorder.gradients}


def resumed_runs(rank: int, world_size: int, root: str) -> dict[str, dict[str, object]]:
    return {"dense": _resumed(None, Path(root)), "embrace": _resumed("embrace", Path(root))}


def _refusal(layout: dict[str, int]) -> str:
    """The error of an EmbRace run merak3d cannot host (raised in setup, before any collective)."""
    module = _SGDModule(build_causal_lm(MODELS["llama"], vocab_size=VOCAB))
    trainer = pl.Trainer(
        accelerator="cpu", devices=layout["data_parallel"] * layout["pipeline_parallel"],
        strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        callbacks=[SparseCommunication("embrace", min_table_rows=TABLE_ROWS)],
    )
    try:
        trainer.fit(module, datamodule=_DataParallelSlices())
    except ValueError as error:
        return str(error)
    return "no error"


def pipeline_runs(rank: int, world_size: int) -> dict[str, object]:
    layout = {"data_parallel": 2, "pipeline_parallel": 2, "tensor_parallel": 1}
    return {
        "gpt2_dense": _fit("gpt2_tied", layout, None),
        "gpt2_s2": _fit("gpt2_tied", layout, SparseCommunication("s2", min_table_rows=TABLE_ROWS)),
        "embrace_pipeline_refusal": _refusal(layout),
    }


@pytest.fixture(scope="module")
def dp2() -> list[dict[str, dict[str, object]]]:
    return run_distributed(data_parallel_runs, 2, timeout_s=300)


@pytest.fixture(scope="module")
def dp2_pp2() -> list[dict[str, dict[str, object]]]:
    return run_distributed(pipeline_runs, 4, timeout_s=300)


def _assert_same_training(runs: dict[str, dict[str, object]], candidate: str, reference: str,
                          rtol: float, skip: tuple[str, ...] = ()) -> None:
    torch.testing.assert_close(runs[candidate]["losses"], runs[reference]["losses"], rtol=rtol, atol=0)
    for step, (actual, expected) in enumerate(zip(runs[candidate]["gradients"], runs[reference]["gradients"])):
        compared = {name for name in expected if not any(part in name for part in skip)}
        assert compared <= set(actual), f"step {step}: missing gradients {sorted(compared - set(actual))}"
        for name in compared:
            torch.testing.assert_close(actual[name], expected[name], rtol=rtol, atol=1e-7, msg=f"{step} {name}")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_s2_exact_equals_merak3d_dense_over_data_parallel(dp2, model: str) -> None:
    for runs in dp2:
        _assert_same_training(runs, f"{model}_s2", f"{model}_dense", rtol=1e-5)
        assert runs[f"{model}_s2"]["embedding_wire"] > 0


def test_auto_under_merak3d_equals_dense_and_says_why(dp2) -> None:
    for runs in dp2:
        _assert_same_training(runs, "llama_auto", "llama_dense", rtol=1e-5)
        assert runs["llama_auto"]["decisions"], "auto logged no reason for its choice"


@pytest.mark.parametrize(("candidate", "reference"), [
    ("gpt2_embrace", "gpt2_dense"), ("llama_embrace_priority", "llama_dense"),
])
def test_embrace_under_merak3d_trains_like_dense(dp2, candidate: str, reference: str) -> None:
    """Replicated weights' gradients and losses match; the tables' columns are rank-local."""
    for runs in dp2:
        _assert_same_training(runs, candidate, reference, rtol=1e-4, skip=("wte", "lm_head", "embed_tokens"))


def test_sparse_tables_compose_with_data_parallel_sharding(dp2) -> None:
    """The tables S2 and EmbRace reduce themselves stay whole in the optimizer; ZeRO shards the rest, and the
    clipping norm counts both kinds of shard once (the parameters' own gradients are the shards' then)."""
    for runs in dp2:
        torch.testing.assert_close(runs["llama_s2_zero2"]["losses"], runs["llama_dense"]["losses"], rtol=1e-5, atol=0)
        dense, sharded = runs["llama_dense_clipped"], runs["llama_embrace_zero1_clipped"]
        torch.testing.assert_close(sharded["norms"], dense["norms"], rtol=1e-5, atol=0)
        torch.testing.assert_close(sharded["losses"], dense["losses"], rtol=1e-4, atol=0)


def test_embrace_priority_sends_next_batch_rows_first(dp2) -> None:
    """Every step but the epoch's last (no next batch) sends a priority chunk first."""
    for runs in dp2:
        exchanges = runs["llama_embrace_priority"]["exchanges"]
        assert len(exchanges) == STEPS
        for timing in exchanges[:-1]:
            assert 0 < timing.priority_tokens < timing.tokens
            assert timing.priority_rows_s <= timing.all_rows_s
        assert exchanges[-1].priority_tokens == 0 and exchanges[-1].priority_rows_s is None
        assert all(timing.priority_tokens == 0 for timing in runs["gpt2_embrace"]["exchanges"])


def test_s2_under_merak3d_pipeline_with_tied_head_equals_dense(dp2_pp2) -> None:
    """dp=2 × pp=2: the table on the first stage and its tied LM-head copy on the last are both
    reduced by S2 before merak3d sums the tied pair."""
    for runs in dp2_pp2:
        _assert_same_training(runs, "gpt2_s2", "gpt2_dense", rtol=1e-5)


def test_embrace_refuses_what_merak3d_cannot_host(dp2_pp2) -> None:
    for runs in dp2_pp2:
        assert "pipeline_parallel=1" in runs["embrace_pipeline_refusal"]


def test_clipped_embrace_under_merak3d_trains_like_clipped_dense(dp2) -> None:
    """merak3d's clipping sums the squares of EmbRace's column shards over the data-parallel group:
    the same norm as the dense table's, so the same clipped steps."""
    for runs in dp2:
        dense, embrace = runs["llama_dense_clipped"], runs["llama_embrace_clipped"]
        assert all(norm is not None and norm > CLIP for norm in dense["norms"]), dense["norms"]
        torch.testing.assert_close(embrace["norms"], dense["norms"], rtol=1e-5, atol=0)
        _assert_same_training(runs, "llama_embrace_clipped", "llama_dense_clipped", rtol=1e-4,
                              skip=("embed_tokens",))


def test_embrace_under_merak3d_resumes_every_ranks_columns_of_the_adam_moments(tmp_path: Path) -> None:
    """merak3d's sharded checkpoint once kept one rank's columns of Adam's moments (a plain tensor is replicated to
    it): the other rank resumed with them."""
    for runs in run_distributed(resumed_runs, 2, args=(str(tmp_path),), timeout_s=300):
        assert len(runs["embrace"]["losses"]) == STEPS // 2
        _assert_same_training(runs, "embrace", "dense", rtol=1e-5, skip=("embed_tokens",))


@pytest.mark.timeout(420)
def test_merak_train_comm_s2_on_the_default_model_reduces_the_table_with_s2(tmp_path) -> None:
    """`merak-train comm=s2 comm.min_table_rows=256` (default Llama, merak3d, 2 processes) really runs S2."""
    import csv
    import subprocess
    import sys
    from itertools import pairwise

    result = subprocess.run(
        [sys.executable, "-m", "lightning_merak.cli.train", "comm=s2", "comm.min_table_rows=256", "trainer.max_steps=4",
         "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
         "data.num_sequences=128", "trainer.enable_progress_bar=false", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "replaces nothing" not in result.stdout + result.stderr
    with (tmp_path / "csv" / "metrics.csv").open() as metrics:
        # running total of the table's wire bytes; with method s2 only S2's reducer records them
        # (its bitmap all-gather and union-row all-reduce), so a rise every step means S2 reduced it
        wire = [float(row["sparse_comm/embedding_wire_mb"]) for row in csv.DictReader(metrics)
                if row.get("sparse_comm/embedding_wire_mb")]
    assert len(wire) == 4 and all(later > earlier > 0 for earlier, later in pairwise(wire)), wire
