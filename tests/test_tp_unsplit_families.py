"""Families tensor parallelism cannot split are refused before launch with their reason; a block with a convolution
mixer is refused by the check of its split without its rows being probed, and a long probe says so; the outputs of
the vocabulary-parallel layers can be updated in place (CTRL), and CTRL trains at tensor_parallel=2 as one process."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.tensor.blocks import check_tensor_parallel_degree, find_tensor_parallel_plan
from lightning_merak.strategies.merak3d.arguments import divides_model
from lightning_merak.strategies.merak3d.planning import tensor_parallel_candidates
from lightning_merak.testing import (
    assert_traces_match,
    layout_gradients,
    merge_rank_traces,
    run_distributed,
)
from lightning_merak.testing.compare import record_reference_trace
from tests.test_train import refused

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}
HYBRID = dict(SMALL, layer_types=["linear_attention", "full_attention"])
MAMBA = {"mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 16, "mamba_chunk_size": 16}
CODEGEN = {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
           "attn_pdrop": 0.0}
LATENT = "multi-head latent attention: every head reads its compressed key/value projection"
LINEAR_LAYERS = r"its linear_attention layers \(layer 0 in config.layer_types\) are state-space, gated delta-net"

REFUSED = [
    ("falcon_h1", dict(SMALL, **MAMBA), "every layer runs a Mamba-2 mixer"),
    ("mamba2", {"hidden_size": 32, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 8}, "Mamba-2 mixers"),
    ("nemotron_h", dict(SMALL, layer_types=["linear_attention", "mlp"]), LINEAR_LAYERS),
    ("qwen3_next", HYBRID, LINEAR_LAYERS),
    ("qwen3_5_text", HYBRID, LINEAR_LAYERS),
    ("granitemoehybrid", dict(SMALL, mamba_n_heads=8, mamba_d_head=8, layer_types=["mamba", "attention"]),
     LINEAR_LAYERS),
    ("lfm2", dict(SMALL, layer_types=["conv", "full_attention"]),
     r"its conv layers \(layer 0 in config.layer_types\) are short-convolution mixers"),
    ("deepseek_v2", SMALL, LATENT),
    ("deepseek_v3", SMALL, LATENT),
    ("minicpm3", SMALL, LATENT),
    ("gemma4_text", SMALL, "keys and values, handed over in a KVSharingDict"),
    ("codegen", CODEGEN, r"fused qkv_proj as mp_num=4 interleaved \[q \| v \| k\] groups"),
    ("stablelm", dict(SMALL, qk_layernorm=True), r"per-head query/key LayerNorms \(qk_layernorm=True"),
]


def _config(model_type: str, values: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **values)


@pytest.mark.parametrize(("model_type", "values", "reason"), REFUSED, ids=[case[0] for case in REFUSED])
def test_a_family_tensor_parallelism_cannot_split_is_refused_with_its_reason_and_left_out_by_the_planner(
        model_type: str, values: dict, reason: str):
    config = _config(model_type, values)
    with pytest.raises(ValueError, match=rf"^tensor_parallel=2: {model_type} cannot be split by tensor parallelism "
                                         rf"\(.*{reason}.*\); use tensor_parallel=1$"):
        check_tensor_parallel_degree(config, 2)
    assert not divides_model(config, 2) and divides_model(config, 1)
    auto = SimpleNamespace(tensor_parallel="auto", sequence_parallel=False, float8=None)
    assert tensor_parallel_candidates(auto, config, world_size=4, num_processes=4, sequence=16) == (1,)


def test_hybrid_families_are_refused_for_their_mixer_layers_only():
    """Granite-4.0's attention-only models and LFM2 with attention layers alone split; their hybrids do not."""
    hybrid = _config("granitemoehybrid", dict(SMALL, mamba_n_heads=8, mamba_d_head=8,
                                              layer_types=["mamba", "attention"]))
    assert not divides_model(hybrid, 2)
    for model_type, values in (("granitemoehybrid", dict(SMALL, mamba_n_heads=8, mamba_d_head=8,
                                                         layer_types=["attention", "attention"])),
                               ("lfm2", dict(SMALL, layer_types=["full_attention", "full_attention"]))):
        assert divides_model(_config(model_type, values), 2)


def test_the_strategy_refuses_codegen_before_launch(tmp_path: Path, monkeypatch, capsys):
    """Both doors: ``Merak3DStrategy.validate_before_launch`` and ``merak-train`` (exit 2, no traceback)."""
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    model = build_causal_lm(ModelConfig(name="codegen", model_type="codegen", config=CODEGEN), vocab_size=64)
    with pytest.raises(ValueError, match=r"codegen cannot be split by tensor parallelism \(its attention reads the "
                                         r"fused qkv_proj as mp_num=4"):
        Merak3DStrategy(tensor_parallel=2).validate_before_launch(CausalLMModule(model), 2)
    code, output = refused(["model=hf", "model.model_type=codegen",
                            "+model.config={n_embd:32,n_layer:2,n_head:4,rotary_dim:4}", "trainer.devices=2",
                            "strategy.tensor_parallel=2", "trainer.max_steps=1"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "Traceback" not in output.err, output.err
    assert output.err.startswith("merak-train: error: tensor_parallel=2: codegen cannot be split by tensor "
                                 "parallelism (its attention reads the fused qkv_proj as mp_num=4"), output.err


def _falcon_h1_block() -> tuple[nn.Module, tuple, dict]:
    """The first block of a tiny Falcon-H1 and the arguments it is called with."""
    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name="falcon_h1", model_type="falcon_h1", config=dict(SMALL, **MAMBA)),
                            vocab_size=64)
    model.config.use_cache = False
    block = model.model.layers[0]
    calls: list[tuple[tuple, dict]] = []
    handle = block.register_forward_pre_hook(lambda module, args, kwargs: calls.append((args, kwargs)),
                                             with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(64, (1, 8)))
    handle.remove()
    return block, *calls[0]


def test_a_convolution_between_a_column_layer_and_its_row_partner_is_refused_without_probing(monkeypatch,
                                                                                           single_rank_group):
    """Falcon-H1's Mamba mixer: named by the check of the split, its rows not probed one head slice at a time
    (minutes at its real sizes); the plan still serves the planner's timing of the unsplit block."""
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_merak.parallel.tensor import blocks

    block, args, kwargs = _falcon_h1_block()

    def probed(*unused):
        raise AssertionError("the rows were probed")

    monkeypatch.setattr(blocks, "probe_row_units", probed)
    plan = find_tensor_parallel_plan(block, lambda: block(*args, **kwargs), SMALL["hidden_size"])
    assert ["mamba.in_proj"] in plan.column_groups and "mamba.out_proj" in plan.row
    with pytest.raises(ValueError, match=r"^FalconH1DecoderLayer does not split: mamba holds a convolution "
                                         r"\(mamba\.conv1d\) over the channels projected by mamba\.in_proj for "
                                         r"mamba\.out_proj \(a state-space or short-convolution mixer\).*"
                                         r"use tensor_parallel=1"):
        blocks.verify_tensor_parallel_plan(block, plan, DeviceMesh("cpu", [0]),
                                           lambda module, hidden: module(hidden, *args[1:], **kwargs)[0], args[0])


def test_a_long_probe_is_announced_with_its_estimate(monkeypatch):
    from lightning_merak.parallel.tensor import rows

    said: list[str] = []
    monkeypatch.setattr(rows, "LONG_PROBE_S", 0.0)
    monkeypatch.setattr(rows, "rank_zero_info", said.append)
    block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    hidden = torch.randn(2, 3, 8)
    plan = find_tensor_parallel_plan(block, lambda: block(hidden), 8)
    assert plan.column_groups == [["0"]] and plan.row == ["2"]
    assert len(said) == 1 and said[0].startswith("merak3d: finding which rows of 0 each of the 16 slices of 2's "
                                                 "input reads takes one backward each"), said


def test_the_vocabulary_parallel_embedding_output_can_be_scaled_in_place(single_rank_group):
    """CTRL scales its embeddings in place (``inputs_embeds *= sqrt(d)``): the summed lookups were the all-reduced
    input returned as is, a view autograd forbids updating in place."""
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_merak.parallel.tensor.vocab import VocabParallelEmbedding

    torch.manual_seed(0)
    whole = nn.Embedding(10, 4)
    split = VocabParallelEmbedding(whole, DeviceMesh("cpu", [0]))
    ids = torch.tensor([[1, 7, 3]])
    for embedding in (whole, split):
        embeds = embedding(ids)
        embeds *= 2.0
        embeds.square().sum().backward()
    torch.testing.assert_close(split.weight.grad.full_tensor(), whole.weight.grad)


def test_the_sequence_split_entry_is_a_tensor_of_its_own(single_rank_group):
    """The first sequence-split block may update its input in place; the slice was a view of the whole sequence."""
    from lightning_merak.parallel.tensor.sequence import _EnterSequenceSplit

    hidden = torch.randn(1, 4, 8, requires_grad=True)
    entered = _EnterSequenceSplit.apply(hidden * 1.0, single_rank_group)
    entered *= 3.0
    entered.sum().backward()
    torch.testing.assert_close(hidden.grad, torch.full_like(hidden, 3.0))


# CTRL at tensor_parallel=2 against one process ------------------------------------------------------------------

CTRL = ModelConfig(name="ctrl", model_type="ctrl", config={"n_embd": 32, "n_layer": 2, "n_head": 4, "dff": 64,
                                                           "resid_pdrop": 0.0, "embd_pdrop": 0.0})
STEPS, BATCH, SEQ, VOCAB = 2, 4, 16, 131  # a vocabulary tp=2 does not divide


class _SGDModule(CausalLMModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.5)


def _ctrl() -> _SGDModule:
    torch.manual_seed(0)
    model = build_causal_lm(CTRL, vocab_size=VOCAB)
    model.config.use_cache = False
    return _SGDModule(model)


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(3))


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.gradients: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.gradients.append({name: grad.float() for name, grad in
                               layout_gradients(trainer.strategy, pl_module.model).items()})


def _scaled_logits(model: nn.Module) -> torch.Tensor:
    """The logits of the first batch, updated in place as a model may: gathered from the vocabulary shards, as for
    a loss the strategy did not wrap (the module's own is, and takes them sharded)."""
    from lightning_merak.parallel.tensor.vocab import VocabParallelLMHead

    for head in model.modules():
        if isinstance(head, VocabParallelLMHead):
            head.shard_logits = False
    logits = model(_batches()[0]).logits
    logits *= 2.0
    return logits.detach()


def _ctrl_rank(rank: int, world_size: int) -> tuple[tuple[list[float], list[dict]], torch.Tensor]:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    recorder = _Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(tensor_parallel=2,
                                                                                         timeout_s=60),
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                         use_distributed_sampler=False, callbacks=[recorder])
    loader = DataLoader(TensorDataset(_batches().reshape(-1, SEQ)), batch_size=BATCH, shuffle=False)
    module = _ctrl()
    trainer.fit(module, train_dataloaders=loader)
    return (recorder.losses, recorder.gradients), _scaled_logits(module.model)


@pytest.mark.distributed
def test_ctrl_trains_at_tensor_parallel_2_as_one_process():
    """Its embeddings scaled in place after the vocabulary-parallel lookup; its gathered logits updated in place."""
    module = _ctrl()
    reference = record_reference_trace(module.model, _batches(), lambda _, batch: module.compute_loss((batch,)),
                                       module.configure_optimizers())
    results = run_distributed(_ctrl_rank, 2, timeout_s=120)
    candidate = merge_rank_traces([trace for trace, _ in results])
    for expected, actual in zip(reference.gradients, candidate.gradients, strict=True):
        # a key bias shifts every score of a query alike, which softmax ignores: its gradient is rounding noise
        for name in [name for name in expected if name.endswith("Wk.bias")]:
            largest = max(float(grad.abs().max()) for grad in expected.values())
            assert float(actual.pop(name).abs().max()) < 1e-5 * largest > float(expected.pop(name).abs().max())
    assert_traces_match(reference, candidate, loss_rtol=1e-5, grad_rtol=1e-4)
    expected = _scaled_logits(module.model)
    for _, logits in results:
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type, config, reason", [
    ("bloom", {"hidden_size": 32, "n_layer": 2, "n_head": 4}, "BloomAttention"),
    ("mpt", {"d_model": 32, "n_layers": 2, "n_heads": 4}, "MptMLP"),
    ("opt", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "ffn_dim": 64,
             "word_embed_proj_dim": 32}, "fc1 and fc2"),
])
def test_sequence_parallelism_for_a_family_it_does_not_fit_is_refused_before_launch(model_type, config, reason):
    """They split by tensor parallelism alone; with sequence_parallel the first batch refused them, after launch."""
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    module = CausalLMModule(build_causal_lm(ModelConfig(name=model_type, model_type=model_type, config=config), 64))
    Merak3DStrategy(tensor_parallel=2).validate_before_launch(module, 2, batch_size=2, sequence_length=8)
    with pytest.raises(ValueError, match=rf"sequence_parallel with tensor_parallel=2: {model_type} cannot be split "
                                         rf"along the sequence \(.*{reason}.*\); use sequence_parallel=False"):
        Merak3DStrategy(tensor_parallel=2, sequence_parallel=True).validate_before_launch(
            module, 2, batch_size=2, sequence_length=8)
