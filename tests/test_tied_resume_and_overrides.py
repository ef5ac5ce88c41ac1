"""Tied weights across layouts: resuming a tied model at pipeline_parallel=2 from a checkpoint saved without stages,
and ``model.config.tie_word_embeddings=true`` over a pretrained checkpoint.

A layout without stages saves a tied embedding's optimizer state once, under the embedding's name; a last stage names
its copy of the weight by the LM head, so the head's copy must find the state under its tie partner's name, else its
momentum restarts and the two copies drift apart. An untied checkpoint whose head differs from its embedding cannot
load into one tied parameter (the last tensor read would win, a different one per stage): it is refused, naming the
option; equal copies load as ``from_pretrained`` ties them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.checkpoint.sharded import ShardedCheckpointer, _torch_optimizer_state
from lightning_merak.hf import load_pretrained, pretrained_causal_lm
from lightning_merak.modules.causal_lm import CausalLMModule
from lightning_merak.modules.config import OptimConfig, Schedule
from lightning_merak.testing import module_losses, run_distributed
from lightning_merak.testing.data import ReplicaBatches

VOCAB, BATCH, SEQ, STEPS, SAVED_AT = 128, 4, 16, 4, 2
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _config(tied: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                max_position_embeddings=64, tie_word_embeddings=tied, pad_token_id=0)


def _save_pretrained(directory: Path, tied: bool, head_equals_embedding: bool = False) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(tied))
    if head_equals_embedding:
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(directory)
    return directory


def _optim() -> OptimConfig:
    return OptimConfig(name="sgd", learning_rate=0.2, momentum=0.9, weight_decay=0.0, warmup_steps=0,
                       lr_schedule=Schedule.constant, total_steps=100)


def _batches() -> torch.Tensor:
    return torch.randint(3, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def _momentum_after_step(model: nn.Module) -> torch.optim.Optimizer:
    """One SGD-with-momentum step of ``model`` on random logits' sum, so every parameter has a momentum."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randint(0, VOCAB, (2, 8))).logits.square().mean().backward()
    optimizer.step()
    return optimizer


# Resume ------------------------------------------------------------------------------------------------------------


def test_each_tied_copy_resumes_the_state_saved_under_the_embedding_name() -> None:
    """A file's optimizer state over the whole tied model (one entry, named by the embedding) placed on a first
    stage's embedding and a last stage's head (each a module holding the one copy): both get the saved momentum."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(_config(tied=True))
    saved = _momentum_after_step(whole).state_dict()
    names = [name for name, _ in whole.named_parameters()]
    assert HEAD not in names  # named once, by the embedding
    checkpointer = ShardedCheckpointer(lambda: (0, (1, 1, 1)))
    checkpointer.find_experts(whole)
    named = checkpointer.named_optimizer_state(saved, names)
    expected = named["state"][EMBED]["momentum_buffer"]
    for stage_name in ("embed", "head"):
        stage = nn.Module()
        if stage_name == "embed":
            stage.model = nn.Module()
            stage.model.embed_tokens = nn.Embedding(VOCAB, 32)
        else:
            stage.lm_head = nn.Linear(32, VOCAB, bias=False)
        optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
        checkpointer.load_optimizer_state(optimizer, named, stage)
        (param,) = stage.parameters()
        assert torch.equal(optimizer.state[param]["momentum_buffer"], expected), stage_name


def test_a_staged_checkpoint_of_a_tied_model_numbers_one_entry_per_parameter_for_ddp() -> None:
    """A pipeline layout saves the tied weight under both names; a DDP model (the weight named once) gets one entry,
    numbered by the embedding's place, with the saved state."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(_config(tied=True))
    checkpointer = ShardedCheckpointer(lambda: (0, (1, 1, 1)))
    checkpointer.find_experts(whole)
    momentum = torch.randn(VOCAB, 32)
    order = {name: index for index, (name, _) in enumerate(whole.named_parameters())}
    staged = {"state": {EMBED: {"momentum_buffer": momentum}, HEAD: {"momentum_buffer": momentum.clone()}},
              "param_groups": [{"lr": 0.1, "params": [EMBED, "model.norm.weight", HEAD]}]}
    state = _torch_optimizer_state(staged, order, checkpointer)
    assert state["param_groups"][0]["params"] == sorted([order[EMBED], order["model.norm.weight"]])
    assert list(state["state"]) == [order[EMBED]]
    assert torch.equal(state["state"][order[EMBED]]["momentum_buffer"], momentum)


def _reference(source: Path) -> list[float]:
    """The uninterrupted single-process run: from_pretrained, the module's loss, ``STEPS`` steps."""
    torch.manual_seed(0)
    module = CausalLMModule(pretrained_causal_lm(source, VOCAB), _optim())
    module.model.config.use_cache = False
    return module_losses(module, _batches())


class _Record(pl.Callback):
    """The losses, and the momentum of this rank's copy of the tied weight as resumed (before the first step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.resumed: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.losses or self.resumed:
            return
        state = trainer.optimizers[0].state
        for name, param in pl_module.named_parameters():
            if name.endswith((EMBED, HEAD)) and param in state:
                self.resumed[EMBED if name.endswith(EMBED) else HEAD] = state[param]["momentum_buffer"].clone()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _single_process_file(source: Path, path: Path) -> list[float]:
    """Lightning's single-device fit of the first ``SAVED_AT`` steps, saved as a ``.ckpt`` file (a DDP run's
    format): the tied weight's state is numbered once, as the embedding."""
    torch.manual_seed(0)
    module = CausalLMModule(pretrained_causal_lm(source, VOCAB), _optim())
    module.model.config.use_cache = False
    record = _Record()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[record])
    data = DataLoader(TensorDataset(_batches()[:SAVED_AT].reshape(-1, SEQ)), batch_size=BATCH, shuffle=False)
    trainer.fit(module, train_dataloaders=data)
    trainer.save_checkpoint(path)
    return record.losses


def _resume_rank(rank: int, world_size: int, source: str, resume_from: str) -> dict[str, Any]:
    """Resumed at pipeline_parallel=2 on a model built on meta: the losses, the resumed momentum and the final weight
    of this rank's copy of the tied weight."""
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    torch.manual_seed(0)

    def build() -> nn.Module:
        model = pretrained_causal_lm(source, VOCAB, weights=False)
        model.config.use_cache = False
        return model

    module = CausalLMModule(None, _optim(), model_factory=build, pretrained_path=source)
    record = _Record()
    strategy = Merak3DStrategy(pipeline_parallel=2, data_parallel=1, tensor_parallel=1, micro_batches=2,
                               timeout_s=60)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         callbacks=[record])
    trainer.fit(module, datamodule=ReplicaBatches(_batches(), SAVED_AT, STEPS), ckpt_path=resume_from)
    weights = {name: value.detach().clone() for name, value in module.named_parameters()
               if name.endswith((EMBED, HEAD))}
    return {"losses": record.losses, "resumed": record.resumed, "weights": list(weights.values())}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_tied_model_saved_without_stages_resumes_at_pp2_on_the_uninterrupted_run(tmp_path: Path) -> None:
    """Both stages' copies of the tied weight resume the file's momentum, stay equal, and the resumed losses equal
    the uninterrupted run's (before, the head's momentum restarted from zero: 1.4e-3 off from the 2nd step)."""
    source = _save_pretrained(tmp_path / "tied", tied=True)
    reference = _reference(source)
    path = tmp_path / "single.ckpt"
    assert _single_process_file(source, path) == pytest.approx(reference[:SAVED_AT], rel=1e-5)
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
    order = [name for name, _ in CausalLMModule(pretrained_causal_lm(source, VOCAB), _optim()).model.named_parameters()]
    expected = saved[order.index(EMBED)]["momentum_buffer"]
    results = run_distributed(_resume_rank, 2, args=(str(source), str(path)), timeout_s=90)
    assert [sorted(result["resumed"]) for result in results] == [[EMBED], [HEAD]]
    for result in results:
        assert torch.equal(next(iter(result["resumed"].values())), expected)
        assert result["losses"] == pytest.approx(reference[SAVED_AT:], rel=1e-5)
    first, last = results[0]["weights"][0], results[1]["weights"][0]
    assert torch.allclose(first, last, atol=1e-6, rtol=0)


# tie_word_embeddings over an untied checkpoint ---------------------------------------------------------------------


def test_a_tie_override_loads_an_equal_head_as_from_pretrained_and_refuses_a_different_one(tmp_path: Path) -> None:
    """Head and embedding saved equal (untied): the override ties them as from_pretrained does, and a rank reading
    either copy's key (a first stage's embedding, a last stage's head, both at dp) fills the weight the same. A head
    that differs would keep whichever tensor a rank read last (another per stage), and from_pretrained would leave
    them untied against the config: refused before any process starts, on the meta build (merak3d, every layout)
    and the whole one (DDP) alike, naming the option."""
    from transformers import AutoModelForCausalLM

    equal = _save_pretrained(tmp_path / "equal", tied=False, head_equals_embedding=True)
    expected = AutoModelForCausalLM.from_pretrained(equal, tie_word_embeddings=True)
    assert expected.lm_head.weight is expected.model.embed_tokens.weight
    whole = pretrained_causal_lm(equal, VOCAB, {"tie_word_embeddings": True})
    assert whole.lm_head.weight is whole.model.embed_tokens.weight
    for name, value in whole.state_dict().items():
        assert torch.equal(value, expected.state_dict()[name]), name
    meta = pretrained_causal_lm(equal, VOCAB, {"tie_word_embeddings": True}, weights=False)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    for names in ([EMBED], [HEAD], [EMBED, HEAD]):
        tensors = {name: torch.zeros(VOCAB, 32) for name in names}
        load_pretrained(tensors, equal)
        for tensor in tensors.values():
            assert torch.equal(tensor, expected.model.embed_tokens.weight)
    different = _save_pretrained(tmp_path / "untied", tied=False)
    for weights in (False, True):
        with pytest.raises(ValueError, match=r"lm_head\.weight apart from model\.embed_tokens\.weight.*"
                                             r"model\.config\.tie_word_embeddings=false"):
            pretrained_causal_lm(different, VOCAB, {"tie_word_embeddings": True}, weights=weights)


@pytest.mark.parametrize("layout", [["strategy.pipeline_parallel=2"], ["strategy=ddp", "trainer.devices=1"]],
                         ids=["merak3d-pp2", "ddp"])
def test_merak_train_refuses_the_tie_override_over_a_different_head_before_launch(tmp_path: Path, monkeypatch: Any,
                                                                                  capsys: Any, layout: list[str]
                                                                                  ) -> None:
    """On the command line: exit 2 with the message, no traceback, nothing trained (``model.config`` override)."""
    from tests.test_train import refused

    source = _save_pretrained(tmp_path / "untied", tied=False)
    overrides = ["model=hf", f"model.path={source}", "+model.config.tie_word_embeddings=true",
                 f"data.vocab_size={VOCAB}", "data.seq_len=16", "data.batch_size=4", "data.num_sequences=64", *layout]
    code, output = refused(overrides, tmp_path / "run", monkeypatch, capsys)
    assert code == 2, output.out + output.err
    assert "Traceback" not in output.err
    assert f"merak-train: error: model.path={source}" in output.err
    assert "model.config.tie_word_embeddings=false" in output.err
