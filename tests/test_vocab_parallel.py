"""Vocabulary parallelism: split embedding and LM head against the unsplit model on real gloo ranks."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.parallel.tensor.vocab import (
    check_vocabulary_split,
    pad_vocab_shard,
    padded_vocab_size,
    vocab_shard_range,
)
from lightning_merak.testing import run_distributed

VOCAB, BATCH, SEQ = 131, 2, 8  # a vocabulary tp=2 does not divide


def test_shard_ranges_are_chunks_of_the_padded_vocabulary():
    assert padded_vocab_size(131, 2) == 132 and padded_vocab_size(128, 4) == 128
    assert [vocab_shard_range(131, 2, r) for r in range(2)] == [(0, 66), (66, 131)]
    assert [vocab_shard_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    chunks = torch.arange(131).chunk(2)
    assert [(int(c[0]), int(c[-1]) + 1) for c in chunks] == [vocab_shard_range(131, 2, r) for r in range(2)]


def test_a_vocabulary_leaving_a_rank_without_rows_is_refused():
    with pytest.raises(ValueError, match="leaves the last rank without rows; use vocab_parallel=False"):
        check_vocabulary_split(5, 4)
    check_vocabulary_split(131, 2)


def test_padding_columns_are_minus_infinity():
    padded = pad_vocab_shard(torch.zeros(2, 3, 65), 66)
    assert padded.shape == (2, 3, 66)
    assert torch.isneginf(padded[..., 65]).all() and (padded[..., :65] == 0).all()
    assert pad_vocab_shard(torch.zeros(2, 66), 66).shape == (2, 66)


def _model(tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, use_cache=False)
    return LlamaForCausalLM(config)


def _stock_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """CausalLMModule.loss_from_logits, as users write it."""
    from lightning_merak.modules.causal_lm import CausalLMModule

    return CausalLMModule(torch.nn.Identity()).loss_from_logits(logits, targets)


def _mixing_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A loss that multiplies the logits by a plain tensor, which a DTensor refuses."""
    weights = torch.linspace(0.5, 1.5, logits.shape[-1])
    return (torch.log_softmax(logits.float(), -1) * weights).mean() + 0.0 * targets.sum()


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return grads


def _split_case(rank: int, world_size: int, mesh, tied: bool, loss_name: str) -> dict:
    from torch.distributed.tensor import DTensor

    from lightning_merak.parallel.tensor import vocab as vocab_parallel
    from lightning_merak.parallel.tensor.vocab import split_vocabulary, vocab_parallel_loss

    loss_fn = {"stock": _stock_loss, "mixing": _mixing_loss}[loss_name]
    ids = torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    reference = _model(tied)
    expected = loss_fn(reference(ids).logits, ids)
    expected.backward()
    with torch.no_grad():
        expected_logits = reference(ids).logits

    model = _model(tied)
    replaced = split_vocabulary([model], mesh)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    loss = vocab_parallel_loss(loss_fn, model)
    logits = model(ids).logits
    start, end = vocab_shard_range(VOCAB, world_size, rank)
    sharded = isinstance(logits, DTensor) and logits.to_local().shape[-1] == end - start
    value = loss(logits, ids)
    plain_loss = not isinstance(value, DTensor)
    value.backward()
    with torch.no_grad():
        full = model(ids).logits
    return {
        "loss": (float(value), float(expected)),
        "grads": (_gradients(model), _gradients(reference)),
        "logits": (full, expected_logits),
        "sharded": sharded, "plain_loss": plain_loss,
        "tied_once": (embedding.weight is head.weight) == tied,
        "replaced": len(replaced) == (1 if tied else 2),
        "global_rows": {tuple(t.shape)[0] for name, t in model.state_dict().items()
                        if "embed" in name or "lm_head" in name},
        "loss_parallel_left": vocab_parallel._loss_parallel_users == 0,
    }


CASES = [(tied, loss) for tied in (False, True) for loss in ("stock", "mixing")]


def _checkpoint_round_trip(mesh, directory: str) -> bool:
    """A split model's sharded checkpoint (DCP) loads into the unsplit model: the rows are the real vocabulary."""
    import torch.distributed.checkpoint as dcp

    from lightning_merak.parallel.tensor.vocab import split_vocabulary

    split = _model(tied=False)
    with torch.no_grad():
        for param in split.parameters():
            param.add_(0.5)  # differ from the fresh model the checkpoint is read into
    split_vocabulary([split], mesh)
    dcp.save(split.state_dict(), checkpoint_id=directory)
    whole = _model(tied=False)
    state = whole.state_dict()
    dcp.load(state, checkpoint_id=directory)
    return all(torch.equal(state[name], value.full_tensor() if hasattr(value, "full_tensor") else value)
               for name, value in split.state_dict().items())


def _split_rank(rank: int, world_size: int, directory: str) -> tuple[list[dict], bool]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    cases = [_split_case(rank, world_size, mesh, tied, loss) for tied, loss in CASES]
    return cases, _checkpoint_round_trip(mesh, directory)


@pytest.mark.distributed
def test_split_vocabulary_matches_the_unsplit_model(tmp_path):
    """Tied and untied, the stock loss (sharded logits) and one that needs them gathered: loss, every gradient
    and the no-grad logits equal the unsplit model's; checkpoints hold the real vocabulary."""
    for rank_results, round_trip in run_distributed(_split_rank, 2, args=(str(tmp_path),), timeout_s=120):
        assert round_trip, "the sharded checkpoint should load into the unsplit model"
        for (tied, loss_name), result in zip(CASES, rank_results):
            case = f"tied={tied} loss={loss_name}"
            assert result["sharded"], f"{case}: training logits should stay sharded over the vocabulary"
            for check in ("plain_loss", "tied_once", "replaced", "loss_parallel_left"):
                assert result[check], f"{case}: {check}"
            loss, expected = result["loss"]
            assert loss == pytest.approx(expected, rel=1e-5), case
            grads, expected_grads = result["grads"]
            assert grads.keys() == expected_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=f"{case} {name}")
            full, expected_logits = result["logits"]
            assert full.shape[-1] == VOCAB and torch.isfinite(full).all(), case
            torch.testing.assert_close(full, expected_logits, rtol=1e-5, atol=1e-5)
            assert result["global_rows"] == {VOCAB}, case


class _WireVocabLoss(pl.Callback):
    """Wires the loss as the strategy's build does for pp=1, once the first batch built the layout."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from lightning_merak.parallel.tensor.vocab import vocab_parallel_loss

        if "loss_from_logits" not in vars(pl_module):
            pl_module.loss_from_logits = vocab_parallel_loss(pl_module.loss_from_logits, pl_module.model)


STEPS = 2


def _fit_rank(rank: int, world_size: int) -> tuple[list[float], list[dict]]:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.parallel.tensor import vocab as vocab_parallel
    from lightning_merak.strategies.merak3d import Merak3DStrategy
    from tests.test_merak3d import _Recorder, _TestModule

    module = _TestModule(_model(tied=True))
    recorder = _Recorder([])
    data = torch.randint(VOCAB, (STEPS * 4, SEQ), generator=torch.Generator().manual_seed(2))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, max_epochs=1, logger=False, enable_checkpointing=False,
        strategy=Merak3DStrategy(data_parallel=1, tensor_parallel=2, timeout_s=120),
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        use_distributed_sampler=False, callbacks=[_WireVocabLoss(), recorder],
    )
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=4))
    heads = [m for m in module.model.modules() if isinstance(m, vocab_parallel.VocabParallelLMHead)]
    assert len(heads) == 1 and heads[0].shard_logits and vocab_parallel._loss_parallel_users == 0
    return recorder.losses, recorder.gradients


@pytest.mark.distributed
def test_lightning_fit_with_the_loss_on_sharded_logits_matches_one_process():
    """tp=2 through Lightning, the loss wired on sharded logits (tied weights, a vocabulary tp does not divide)."""
    from tests.test_merak3d import _TestModule

    module = _TestModule(_model(tied=True))
    optimizer = module.configure_optimizers()
    data = torch.randint(VOCAB, (STEPS * 4, SEQ), generator=torch.Generator().manual_seed(2))
    expected = []
    for batch in data.split(4):
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        expected.append((float(loss.detach()), {n: p.grad.clone() for n, p in module.model.named_parameters()}))
        optimizer.step()
    for losses, gradients in run_distributed(_fit_rank, 2, timeout_s=120):
        for (loss, grads), (want, want_grads) in zip(zip(losses, gradients), expected, strict=True):
            assert loss == pytest.approx(want, rel=1e-5)
            for name, grad in want_grads.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
