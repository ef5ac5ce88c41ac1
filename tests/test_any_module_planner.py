"""Users' own networks under merak3d's planner and pipelined loss: blocks with no tensor-parallel split, transformers
heads other than causal LMs, and the loss the planner profiles for a module whose ``training_step`` computes it.

The pipelined runs that compare with one process are in ``test_any_module_planner_ranks.py``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

from lightning_merak.planning.measure.layout import profile_model
from lightning_merak.planning.planner import SearchSpace, required_profile_keys
from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
from lightning_merak.strategies.merak3d.build import call_model
from lightning_merak.strategies.merak3d.network import labelled_loss, module_view

VOCAB, SEQ, WIDTH, BATCH = 32, 8, 16, 6


class _TanhBlock(nn.Module):
    """A residual block with one linear layer: no column/row pair for tensor parallelism to split."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden))


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList(_TanhBlock() for _ in range(4))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        hidden = self.inp(features)
        for block in self.blocks:
            hidden = block(hidden)
        return self.out(hidden)


def _keys(tp_degrees: tuple[int, ...]):
    space = SearchSpace(world_size=2, global_batch_size=None, replica_batch_size=4, tp_degrees_allowed=tp_degrees,
                        max_pipeline_stages=2, overlap_choices=(1,))
    return required_profile_keys(space, 4)


def test_planner_times_blocks_without_linear_pairs_where_no_tensor_parallel_is_searched():
    model, features = _Regressor(), torch.randn(4, 4)
    profile = profile_model(model, features, call_model, tensor_parallel_plan, _keys((1,)),
                            lambda params: torch.optim.SGD(params, lr=0.1), repeats=1)
    assert profile.num_blocks == 4
    for times in profile.block_times.values():  # one segment each way: nothing cuts the block
        assert len(times.forward_segments_s) == len(times.backward_segments_s) == 1
        assert times.forward_s > 0
    with pytest.raises(ValueError, match="no column/row linear pairs"):  # a searched split still needs the pairs
        profile_model(model, features, call_model, tensor_parallel_plan, _keys((1, 2)),
                      lambda params: torch.optim.SGD(params, lr=0.1), repeats=1)


def _bert(head: type, **config) -> nn.Module:
    torch.manual_seed(0)
    return head(BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0, **config)).eval()


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=SEQ)).eval()


def _vit() -> nn.Module:
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=2,
                                               intermediate_size=32, image_size=8, patch_size=4, num_channels=3,
                                               num_labels=3)).eval()


def _ids() -> torch.Tensor:
    return torch.randint(VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _ignored(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` with some entries and the whole first half's rows at -100 (a micro-batch that scores nothing)."""
    labels = labels.clone()
    labels[torch.rand(labels.shape, generator=torch.Generator().manual_seed(2)) < 0.4] = -100
    labels[:BATCH // 2] = -100
    return labels


def _heads():
    generator = torch.Generator().manual_seed(3)
    return {
        "sequence": (lambda: _bert(BertForSequenceClassification, num_labels=3), _ids(),
                     torch.randint(3, (BATCH,), generator=generator)),
        "regression": (lambda: _bert(BertForSequenceClassification, num_labels=1), _ids(),
                       torch.randn(BATCH, generator=generator)),
        "multi_label": (lambda: _bert(BertForSequenceClassification, num_labels=3,
                                      problem_type="multi_label_classification"), _ids(),
                        torch.randint(2, (BATCH, 3), generator=generator).float()),
        "token": (lambda: _bert(BertForTokenClassification, num_labels=3), _ids(),
                  _ignored(torch.randint(3, (BATCH, SEQ), generator=generator))),
        "masked_lm": (lambda: _bert(BertForMaskedLM), _ids(), _ignored(_ids())),
        "causal_lm": (_llama, _ids(), _ignored(_ids())),
        "image": (_vit, torch.randn(BATCH, 3, 8, 8, generator=generator),
                  torch.randint(3, (BATCH,), generator=generator)),
    }


class _Holder(pl.LightningModule):
    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.net = network


@pytest.mark.parametrize("head", list(_heads()))
def test_labelled_loss_is_the_models_own_on_the_whole_batch_and_over_micro_batches(head: str):
    build, inputs, labels = _heads()[head]
    network = build()
    with torch.no_grad():
        logits = network(inputs).logits
        expected = network(inputs, labels=labels).loss
        loss = labelled_loss(_Holder(network), "net", network)
        torch.testing.assert_close(loss(logits, labels), expected, rtol=1e-5, atol=1e-6)
        micro_batches = 2
        items = loss.counted(labels) / micro_batches  # as the pipelined call weighs each micro-batch
        parts = [loss(logits[index], labels[index], items)
                 for index in torch.arange(BATCH).tensor_split(micro_batches)]
    torch.testing.assert_close(torch.stack(parts).mean(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head", [BertForQuestionAnswering, BertForPreTraining])
def test_labelled_loss_refuses_heads_whose_loss_needs_more_than_the_logits(head: type):
    network = _bert(head)
    with pytest.raises(TypeError, match="loss_from_outputs"):
        labelled_loss(_Holder(network), "net", network)


class _InlineSmoothed(_Holder):
    """A loss computed in ``training_step`` from the logits of a call without labels, with label smoothing."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        logits = self.net(batch["input_ids"]).logits
        return F.cross_entropy(logits.flatten(0, -2), batch["labels"].flatten(), label_smoothing=0.1)


class _Labelled(_Holder):
    """The model's own loss, from a call with labels."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch["input_ids"], labels=batch["labels"]).loss


@pytest.mark.parametrize("network", [_llama, lambda: _bert(BertForSequenceClassification, num_labels=3)])
def test_planner_profiles_the_loss_training_step_computes(network):
    net = network()
    causal = isinstance(net, LlamaForCausalLM)
    labels = _ids() if causal else torch.randint(3, (BATCH,), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": _ids(), "labels": labels}
    samples = BATCH // 2
    logits = net(batch["input_ids"][:samples]).logits  # the planner scores the first samples' logits
    inline = module_view(_InlineSmoothed(net), None, 1).planning_loss(batch)(logits, samples)
    expected = F.cross_entropy(logits.flatten(0, -2), labels[:samples].flatten(), label_smoothing=0.1)
    torch.testing.assert_close(inline, expected)
    labelled = module_view(_Labelled(net), None, 1).planning_loss(batch)(logits, samples)
    own = net(input_ids=batch["input_ids"][:samples], labels=labels[:samples]).loss
    torch.testing.assert_close(labelled, own, rtol=1e-5, atol=1e-6)
    assert "forward" not in net.__dict__ and not net._forward_pre_hooks  # the replay leaves the network as it was
