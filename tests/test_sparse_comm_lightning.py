"""SparseCommunication inside real Lightning DDP runs (2 gloo ranks): training matches dense DDP."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.callbacks.sparse_comm import ShardedEmbedding, SparseCommunication
from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks or a subprocess

VOCAB, DIM, SEQ, STEPS = 4096, 16, 16, 8


class TokenModel(pl.LightningModule):
    """Next-token model with a large table: what the callback is for."""

    def __init__(self, tied: bool, zero_in_place: bool = False) -> None:
        super().__init__()
        self.zero_in_place = zero_in_place
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.head(torch.tanh(self.mix(self.embed(tokens[:, :-1]))))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=not self.zero_in_place)


class _BucketView(pl.Callback):
    """Whether DDP, as training starts, keeps gradients as views of its buckets, and whether the table's lookups
    are sparse then and its gradient dense at each optimizer step."""

    seen: bool | None = None
    sparse_lookups: bool | None = None
    dense_at_steps: bool = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = trainer.strategy.model.gradient_as_bucket_view
        self.sparse_lookups = getattr(pl_module.embed, "sparse", None)

    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        gradient = getattr(pl_module.embed, "weight", None)
        if gradient is not None and gradient.grad is not None:
            self.dense_at_steps &= not gradient.grad.is_sparse


def _fit(tied: bool, callback: SparseCommunication | None, checkpoint: Path | None = None,
         accumulate: int = 1, zero_in_place: bool = False) -> dict[str, object]:
    pl.seed_everything(0, verbose=False)
    views = _BucketView()
    model = TokenModel(tied, zero_in_place)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randint(0, VOCAB, (STEPS * 2 * 8, SEQ + 1), generator=generator))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS, gradient_clip_val=1.0,
        accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[views, *([callback] if callback else [])],
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    result: dict[str, object] = {"losses": model.losses, "mix": model.mix.weight.detach().clone(),
                                 "bucket_view": views.seen, "sparse_lookups": views.sparse_lookups,
                                 "dense_at_steps": views.dense_at_steps,
                                 "sparse_after": getattr(model.embed, "sparse", None)}
    if callback is not None and callback.ledger is not None:
        result["wire"] = callback.ledger.snapshot()
        result["decisions"] = list(callback.hook_reducer.decision_log) if callback.hook_reducer else []
    if checkpoint is not None:
        trainer.save_checkpoint(checkpoint)
        trainer.save_checkpoint(checkpoint.with_suffix(".weights.ckpt"), weights_only=True)
        assert isinstance(model.embed, ShardedEmbedding)
        result["full_table"] = model.embed.full_weight()
    return result


def lightning_runs(rank: int, world_size: int, checkpoint: str) -> dict[str, dict[str, object]]:
    torch.use_deterministic_algorithms(True)
    return {
        "dense": _fit(False, None),
        "s2": _fit(False, SparseCommunication("s2", min_table_rows=1000)),
        "auto": _fit(False, SparseCommunication("auto", min_table_rows=1000, bandwidth_gbit=1.0)),
        "sketch": _fit(False, SparseCommunication("s2", mode="sketch", column_factor=1.0, min_table_rows=1000)),
        "embrace": _fit(False, SparseCommunication("embrace", min_table_rows=1000), Path(checkpoint)),
        "embrace_priority": _fit(False, SparseCommunication(
            "embrace", min_table_rows=1000, priority=True, priority_ids=lambda batch: batch[0][:, :-1])),
        "dense_tied": _fit(True, None),
        "embrace_tied": _fit(True, SparseCommunication("embrace", min_table_rows=1000)),
        "s2_tied": _fit(True, SparseCommunication("s2", min_table_rows=1000)),
        "dense_accumulated": _fit(False, None, accumulate=2, zero_in_place=True),
        "s2_accumulated": _fit(False, SparseCommunication("s2", min_table_rows=1000), accumulate=2, zero_in_place=True),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, dict[str, object]]], Path]:
    checkpoint = tmp_path_factory.mktemp("sparse_comm") / "embrace.ckpt"
    return run_distributed(lightning_runs, 2, args=(str(checkpoint),), timeout_s=240), checkpoint


@pytest.mark.parametrize(("candidate", "reference", "rtol"), [
    ("s2", "dense", 1e-6), ("auto", "dense", 1e-6), ("embrace", "dense", 1e-4), ("embrace_tied", "dense_tied", 1e-4),
    ("embrace_priority", "embrace", 0.0), ("s2_tied", "dense_tied", 1e-6),
    ("s2_accumulated", "dense_accumulated", 1e-6),
])
def test_training_curves_match_dense_ddp(runs, candidate: str, reference: str, rtol: float) -> None:
    for rank_runs in runs[0]:
        torch.testing.assert_close(rank_runs[candidate]["losses"], rank_runs[reference]["losses"], rtol=rtol, atol=0)


def test_sketch_mode_trains_close_to_dense(runs) -> None:
    for rank_runs in runs[0]:
        final, dense_final = rank_runs["sketch"]["losses"][-1], rank_runs["dense"]["losses"][-1]
        assert abs(final - dense_final) / dense_final < 0.02


def test_replicated_weights_stay_identical_across_ranks(runs) -> None:
    rank0, rank1 = runs[0]
    for name in ("s2", "auto", "sketch", "embrace", "embrace_tied", "embrace_priority"):
        assert torch.equal(rank0[name]["mix"], rank1[name]["mix"]), name


def test_the_hooked_methods_keep_gradients_in_ddp_buckets_and_plain_ddp_is_untouched(runs) -> None:
    rank0 = runs[0][0]
    assert rank0["s2"]["bucket_view"] and rank0["auto"]["bucket_view"] and rank0["sketch"]["bucket_view"]
    assert not rank0["dense"]["bucket_view"]


def test_the_s2_hook_looks_tables_up_sparsely_and_the_optimizer_sees_dense_gradients(runs) -> None:
    """A table read by its embedding alone trains with sparse lookups (no [V, H] pass in its backward), its
    gradient dense again at every optimizer step and the embedding restored after the fit; a tied table stays
    dense."""
    rank0 = runs[0][0]
    for name in ("s2", "auto", "sketch", "s2_accumulated"):
        assert rank0[name]["sparse_lookups"] is True and rank0[name]["sparse_after"] is False, name
        assert rank0[name]["dense_at_steps"], name
    assert rank0["s2_tied"]["sparse_lookups"] is False and rank0["dense"]["sparse_lookups"] is False


def test_sparse_methods_move_fewer_embedding_bytes_and_auto_explains_itself(runs) -> None:
    rank0 = runs[0][0]
    assert rank0["s2"]["wire"]["embedding"] > 0
    assert any("union" in reason for reason in rank0["auto"]["decisions"])


def test_embrace_checkpoint_holds_the_full_table_and_the_seed(runs) -> None:
    results, checkpoint = runs
    saved = torch.load(checkpoint, weights_only=False)
    assert "embed.shard" not in saved["state_dict"]
    torch.testing.assert_close(saved["state_dict"]["embed.weight"], results[0]["embrace"]["full_table"])
    (state,) = [v for k, v in saved["callbacks"].items() if "SparseCommunication" in k]
    assert state["seed"] == 0


def test_a_weights_only_embrace_checkpoint_holds_the_full_table_too(runs) -> None:
    # Lightning runs no callback hook for a weights-only save (ModelCheckpoint(save_weights_only=True))
    results, checkpoint = runs
    saved = torch.load(checkpoint.with_suffix(".weights.ckpt"), weights_only=False)
    assert "embed.shard" not in saved["state_dict"] and "optimizer_states" not in saved
    torch.testing.assert_close(saved["state_dict"]["embed.weight"], results[0]["embrace"]["full_table"])
