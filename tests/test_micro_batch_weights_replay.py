"""A replayed ``training_step`` loss on micro-batches, one of which scores no label (every label ``-100``).

Its mean loss is NaN (0/0); it weighs 0 and the other micro-batches' mean is re-normalised, so the step's loss,
gradients and logged values are those of the micro-batches that score a label, not NaN.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_merak.strategies.merak3d.step_replay import StepReplay

MICRO_BATCHES, VOCAB = 4, 11


class _SmoothedLoss(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Embedding(VOCAB, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch["input_ids"])
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), label_smoothing=0.1)
        self.log("train/loss", loss)
        return loss


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(VOCAB, (MICRO_BATCHES * 2, 6), generator=generator)
    labels = ids.clone()
    labels[2:4] = -100  # micro-batch 1 scores nothing
    labels[0, 3:] = -100
    return {"input_ids": ids, "labels": labels}


def _replayed(module: _SmoothedLoss, batch: dict) -> tuple[torch.Tensor, StepReplay]:
    """The schedule's mean of the micro-batches' replayed losses, each backpropagated as the schedule does (the
    step then divides the summed gradients by the micro-batches)."""
    replay = StepReplay(module, module.net, lambda logits: logits, ((0,), {}), "net")
    replay.weigh_micro_batches(batch, MICRO_BATCHES)
    losses = []
    for index in torch.tensor_split(torch.arange(len(batch["input_ids"])), MICRO_BATCHES):
        samples = {key: value[index] for key, value in batch.items()}
        loss = replay.score(module.net(samples["input_ids"]), samples)
        loss.backward()
        losses.append(loss.detach())
    assert replay.error is None
    return torch.stack(losses).mean(), replay


def test_micro_batch_without_labels_weighs_nothing() -> None:
    torch.manual_seed(0)
    module, batch = _SmoothedLoss(), _batch()
    loss, replay = _replayed(module, batch)
    replayed_gradient = module.net.weight.grad / MICRO_BATCHES
    module.net.weight.grad = None
    module.log = lambda *args, **kwargs: None  # the unsplit steps below log nothing
    scoring = [index for index in torch.tensor_split(torch.arange(8), MICRO_BATCHES)
               if (batch["labels"][index] != -100).any()]
    expected = torch.stack([module.training_step({key: value[index] for key, value in batch.items()}, 0)
                            for index in scoring]).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    torch.testing.assert_close(replayed_gradient, module.net.weight.grad)
    logged: list[torch.Tensor] = []
    module.log = lambda name, value, *args, **kwargs: logged.append(value)
    replay.logged.log_means(module, MICRO_BATCHES)
    torch.testing.assert_close(logged[0], expected.detach())


def test_every_micro_batch_scoring_keeps_the_plain_mean() -> None:
    torch.manual_seed(0)
    module, batch = _SmoothedLoss(), _batch()
    batch["labels"] = batch["input_ids"].clone()
    loss, _ = _replayed(module, batch)
    module.log = lambda *args, **kwargs: None
    parts = torch.tensor_split(torch.arange(8), MICRO_BATCHES)
    expected = torch.stack([module.training_step({key: value[index] for key, value in batch.items()}, 0)
                            for index in parts]).mean()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
