"""Adapters under merak3d built on the meta device: no rank holds the whole model, results equal the whole-model path.

The adapter attaches to the meta model (PEFT needs no weights); each rank materialises only its part, its
adapter weights drawn by their method's own init, loads its weights through the pretrained seam and then
quantises its own frozen base, one layer at a time, as the whole-model path does. With the same float
weights loaded, per-step losses and adapter gradients equal the single-process model built whole, adapted
and quantised (quantisation is per layer and per block, so splitting the model by stage changes nothing).
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_merak.adapters.meta import MATERIALIZE_INIT, attach_on_meta
from lightning_merak.cli.options.adapter import LoRAAdapterConfig, QAHiRAAdapterConfig, QBaRAAdapterConfig, Quantization
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.parallel.materialize import Materializer, copy_full_tensors, init_owners
from lightning_merak.parallel.pipeline.trace import find_trunk
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import TrainingTrace, assert_traces_match, merge_rank_traces, run_distributed
from tests.test_merak3d import MODELS, STEPS, VOCAB, _batches, _make_optimizer, _Recorder, _ShardedData, _TestModule
from tests.test_meta_init import _observed_peak, _Watch

TARGETS = ("q_proj", "v_proj", "down_proj")
OPTIONS = {
    "lora-fp32": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.none, target_modules=list(TARGETS)),
    "qbara-nf4": lambda: QBaRAAdapterConfig(r=2, quantization=Quantization.nf4, target_modules=list(TARGETS)),
    "qahira-int4": lambda: QAHiRAAdapterConfig(r=2, quantization=Quantization.int4, group_size=16, lambda_in=16,
                                               target_modules=list(TARGETS)),
    "lora-int8": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.int8, target_modules=list(TARGETS)),
    "lora-head-fp32": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.none,
                                                target_modules=[*TARGETS, "lm_head", "embed_tokens"]),
    "lora-head-nf4": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.nf4,
                                               target_modules=[*TARGETS, "lm_head", "embed_tokens"]),
    "lora-lm-head-fp32": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.none,
                                                   target_modules=["q_proj", "v_proj", "lm_head"]),
    "qbara-fp32": lambda: QBaRAAdapterConfig(r=2, quantization=Quantization.none, target_modules=list(TARGETS)),
    "qahira-fp32": lambda: QAHiRAAdapterConfig(r=2, quantization=Quantization.none, group_size=16, lambda_in=16,
                                               target_modules=list(TARGETS)),
}


def _base() -> nn.Module:
    torch.manual_seed(0)
    model = build_causal_lm(MODELS["llama"], vocab_size=VOCAB)
    model.config.use_cache = False
    return model


def _adapter_names(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if param.requires_grad]


def _weights(option_name: str) -> dict[str, torch.Tensor]:
    """The float weights both paths start from, by the adapted model's names: the base's, and adapter weights drawn
    non-zero (so the adapters change the logits from the first step)."""
    unquantised = copy.deepcopy(OPTIONS[option_name]())
    unquantised.quantization = Quantization.none
    model = unquantised.apply(_base())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in _adapter_names(model):
            param = model.get_parameter(name)
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _reference(option_name: str, base: nn.Module | None = None, steps: int = STEPS,
               optimizer: str = "adam") -> tuple[TrainingTrace, nn.Module]:
    """One process, the whole-model path: build (or take ``base``), quantise, wrap; the adapter weights loaded;
    ``steps`` steps of ``optimizer`` trained. The trained model too."""
    weights = _weights(option_name)
    model = OPTIONS[option_name]().apply(_base() if base is None else base)
    with torch.no_grad():
        for name in _adapter_names(model):
            model.get_parameter(name).copy_(weights[name])
    module = _TestModule(model)
    optimizer_ = _make_optimizer([p for p in model.parameters() if p.requires_grad], optimizer)
    trace = TrainingTrace()
    for batch in _batches()[:steps]:
        optimizer_.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        trace.append(loss.item(), {name: model.get_parameter(name).grad.detach().clone()
                                   for name in _adapter_names(model)})
        optimizer_.step()
    return trace, model


class _MetaAdapterModule(_TestModule):
    """Builds the adapted model on meta in ``configure_model``; the seam loads ``weights`` (float, unsplit)."""

    optimizer_kind = "adam"

    def __init__(self, option_name: str, weights: dict[str, torch.Tensor]) -> None:
        super().__init__(None,
                         model_factory=lambda: attach_on_meta(OPTIONS[option_name](), _base()))
        self.weights = weights

    def configure_model(self) -> None:
        super().configure_model()
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())

    def load_pretrained_weights(self, tensors, layout_changes) -> None:
        self.float_share = sum(t.numel() * t.element_size() for t in tensors.values())  # before quantisation
        copy_full_tensors(tensors, layout_changes, self.weights)

    def configure_optimizers(self):
        return _make_optimizer([p for p in self.model.parameters() if p.requires_grad], self.optimizer_kind)


def _meta_rank(rank: int, world_size: int, option_name: str, layout: dict, save_to: str | None = None,
               first_step: int = 0, last_step: int = STEPS, epochs: int = 1, resume_from: str | None = None) -> tuple:
    peak = _observed_peak()
    whole = _base()
    trunk = find_trunk(whole)[1]
    block = sum(p.numel() * p.element_size() for p in trunk[0].parameters())
    outside = sum(p.numel() * p.element_size() for p in whole.parameters()) - len(trunk) * block
    del whole, trunk
    module = _MetaAdapterModule(option_name, _weights(option_name))
    recorder = _Recorder([])
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder, _Watch(peak)],
    )
    trainer.fit(module, datamodule=_ShardedData(first_step, last_step), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    quantised = sorted({type(m).__name__ for m in module.model.modules()
                        if type(m).__name__ in ("Linear4bit", "Linear8bitLt", "QuantLinearInt4")})
    return (recorder.losses, recorder.gradients), (module.built_on_meta, peak.bytes, module.float_share, block,
                                                   outside,
                                                   quantised)


PP2 = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1, "partition": "uniform"}  # two blocks a stage


@pytest.mark.distributed
@pytest.mark.parametrize("option_name", ["lora-fp32", "qbara-nf4", "qahira-int4"])
def test_an_adapter_run_built_on_meta_at_pp2_holds_its_share_and_trains_like_the_whole_model(option_name, tmp_path):
    """(LoRA on a float base also exports merged: the stages' checkpoint equals the trained whole model merged.)"""
    checkpoint = str(tmp_path / "pp2.ckpt") if option_name == "lora-fp32" else None
    results = run_distributed(_meta_rank, 2, args=(option_name, PP2), kwargs={"save_to": checkpoint}, timeout_s=300)
    for rank, (_, (on_meta, peak, share, block, outside, quantised)) in enumerate(results):
        assert on_meta, "configure_model did not build on the meta device"
        assert peak <= share + block + outside, f"rank {rank} held {peak} bytes, its float share is {share}"
        assert share < 0.75 * (4 * block + outside), f"rank {rank} kept more than its stage"
        assert bool(quantised) == (option_name != "lora-fp32"), quantised
    exact = option_name == "lora-fp32"
    reference, trained = _reference(option_name)
    assert_traces_match(reference, merge_rank_traces([trace for trace, _ in results]),
                        loss_rtol=1e-6 if exact else 1e-5, grad_rtol=1e-5 if exact else 1e-4)
    if checkpoint is not None:
        from transformers import AutoModelForCausalLM

        from lightning_merak.hf.export import export_checkpoint

        export_checkpoint(checkpoint, tmp_path / "hf", merge_adapters=True)
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
        merged = trained.merge_and_unload().state_dict()
        assert sorted(exported) == sorted(merged)
        for name, value in merged.items():  # Adam's steps amplify summation-order differences in small gradients
            torch.testing.assert_close(exported[name], value, rtol=0, atol=5e-5, msg=name)


def test_adapter_weights_materialise_with_their_methods_init():
    """LoRA and Q-BaRA: ``A`` Kaiming-uniform, ``B`` zero; QA-HiRA: ``H`` zero — the model's own init never runs."""
    for option_name in ("lora-fp32", "qbara-nf4", "qahira-int4"):
        with torch.device("meta"):
            model = attach_on_meta(OPTIONS[option_name](), build_causal_lm(MODELS["llama"], vocab_size=VOCAB))
        marked = [name for name, m in model.named_modules() if getattr(m, MATERIALIZE_INIT, None) is not None]
        assert len(marked) == 4 * len(TARGETS) * (1 if option_name == "qahira-int4" else 2), (option_name, marked)
        Materializer(torch.device("cpu"), 0, init_owners(model)).materialize(model, "")
        for name in _adapter_names(model):
            value = model.get_parameter(name)
            if "_B" in name or "qahira_H" in name:
                assert torch.count_nonzero(value) == 0, name
            else:
                bound = 1 / value.shape[1] ** 0.5  # Kaiming-uniform with a=√5
                assert 0 < value.abs().max() <= bound, name


def test_quantising_a_part_equals_quantising_the_whole_model():
    """The deferred quantisation of a materialised part gives the layers, classes and bytes the whole-model path
    gives (LoRA on int8 or nf4 moves to PEFT's bitsandbytes layer, keeping its adapter weights; LoRA on the
    embedding and the float head keeps its layer and weights)."""
    for option_name in ("qbara-nf4", "lora-int8", "qahira-int4", "lora-head-nf4"):
        weights = _weights(option_name)
        expected = OPTIONS[option_name]().apply(_base())
        with torch.device("meta"):
            model = attach_on_meta(OPTIONS[option_name](), build_causal_lm(MODELS["llama"], vocab_size=VOCAB))
        Materializer(torch.device("cpu"), 0, init_owners(model)).materialize(model, "")
        model.load_state_dict(weights)
        model.after_materialize(model)
        assert {n: type(m).__name__ for n, m in model.named_modules()} == {
            n: type(m).__name__ for n, m in expected.named_modules()}, option_name
        expected_state, state = expected.state_dict(), model.state_dict()
        assert sorted(state) == sorted(expected_state), option_name
        for name, tensor in state.items():
            reference = expected_state[name]
            if "lora_" in name or "qbara_" in name or "qahira_" in name:
                reference = weights[name]
            assert torch.equal(tensor, reference), (option_name, name)


def _pretrained_rank(rank: int, world_size: int, directory: str, option_name: str) -> tuple:
    """The product's path: ``CausalLMModule`` with ``pretrained_path``, the adapter attached on meta."""
    from lightning_merak.hf import pretrained_causal_lm
    from lightning_merak.modules.causal_lm import CausalLMModule

    adapters = {name: tensor for name, tensor in _weights(option_name).items()
                if any(key in name for key in ("lora_", "qbara_", "qahira_"))}

    class Module(CausalLMModule):
        def load_pretrained_weights(self, tensors, layout_changes) -> None:
            self.share = sum(t.numel() * t.element_size() for t in tensors.values())
            super().load_pretrained_weights(tensors, layout_changes)  # the base, read from the directory
            copy_full_tensors({name: t for name, t in tensors.items() if name in adapters}, {}, adapters)

        def configure_optimizers(self):
            return _make_optimizer([p for p in self.model.parameters() if p.requires_grad], "adam")

    module = Module(None, pretrained_path=directory, model_factory=lambda: (
        attach_on_meta(OPTIONS[option_name](), pretrained_causal_lm(directory, VOCAB, weights=False))))
    recorder = _Recorder([])
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**PP2, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder],
    )
    trainer.fit(module, datamodule=_ShardedData(0, STEPS))
    return (recorder.losses, recorder.gradients), module.share


@pytest.mark.distributed
def test_a_pretrained_checkpoint_fine_tunes_with_a_quantised_adapter_at_pp2(tmp_path):
    """``model.path`` with Q-BaRA on NF4 at pp2: each rank reads only its stages' weights into its float share,
    quantises them, and trains as ``from_pretrained`` + the whole-model adapter path does."""
    from transformers import AutoModelForCausalLM

    _base().save_pretrained(tmp_path)
    results = run_distributed(_pretrained_rank, 2, args=(str(tmp_path), "qbara-nf4"), timeout_s=300)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert all(share < 0.75 * whole_bytes for _, share in results), [share for _, share in results]
    whole.config.use_cache = False
    reference, _ = _reference("qbara-nf4", base=whole)
    assert_traces_match(reference, merge_rank_traces([trace for trace, _ in results]), loss_rtol=1e-5,
                        grad_rtol=1e-4)


def test_a_doubly_quantised_base_at_tensor_parallel_is_refused_before_any_work():
    """Bases quantised per tensor-parallel shard train (``tests/test_adapters_tp_quantized.py``); bitsandbytes' double
    quantisation, whose statistics span the whole weight, does not split."""
    with torch.device("meta"):
        model = attach_on_meta(OPTIONS["qbara-nf4"](), build_causal_lm(MODELS["llama"], vocab_size=VOCAB))
    with pytest.raises(ValueError, match="tensor_parallel=2 would round .*double_quant=false.* tensor_parallel=1"):
        Merak3DStrategy(tensor_parallel=2)._arguments.check_model(model, 1, 2)


def test_an_int4_pooling_misaligned_with_its_groups_is_refused_on_meta():
    option = QAHiRAAdapterConfig(r=2, quantization=Quantization.int4, group_size=16, lambda_in=8,
                                 target_modules=list(TARGETS))
    with torch.device("meta"), pytest.raises(ValueError, match="misaligned with lambda_in=8.*lambda_in=16"):
        attach_on_meta(option, build_causal_lm(MODELS["llama"], vocab_size=VOCAB))


@pytest.mark.distributed
def test_a_quantised_adapter_run_resumes_on_meta(tmp_path):
    """The checkpoint holds the packed base: a resumed meta build rebuilds the float part as the first run did,
    quantises it, requires the frozen tensors to equal the checkpoint's, then takes its adapter weights and Adam's
    state, so the last steps continue the uninterrupted single-process run."""
    checkpoint = str(tmp_path / "three.ckpt")
    reference, _ = _reference("qbara-nf4")
    first = run_distributed(_meta_rank, 2, args=("qbara-nf4", PP2), kwargs={"last_step": 3, "save_to": checkpoint},
                            timeout_s=300)
    assert first[0][0][0] == pytest.approx(reference.losses[:3], rel=1e-5)
    resumed = run_distributed(_meta_rank, 2, args=("qbara-nf4", PP2), timeout_s=300,
                              kwargs={"first_step": 3, "epochs": 2, "resume_from": checkpoint})
    assert resumed[0][0][0] == pytest.approx(reference.losses[3:], rel=1e-5)


def _meta_mixtral() -> nn.Module:
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    with torch.device("meta"):
        return tiny_moe_model("mixtral")


def test_expert_adapters_built_on_meta_materialise_with_their_methods_init_per_expert():
    """Q-BaRA on fused experts: each expert's ``A`` Kaiming-uniform as its own matrix, ``B`` zero."""
    option = QBaRAAdapterConfig(r=2, quantization=Quantization.nf4, target_modules=list(TARGETS), experts=True)
    model = attach_on_meta(option, _meta_mixtral())
    Materializer(torch.device("cpu"), 0, init_owners(model)).materialize(model, "")
    factors = {name: model.get_parameter(name) for name in _adapter_names(model) if ".experts." in name}
    assert factors and all(value.ndim == 3 for value in factors.values()), sorted(factors)
    for name, value in factors.items():
        if "qbara_B" in name:
            assert torch.count_nonzero(value) == 0, name
        else:  # uniform within ±1/sqrt(fan_in) of one expert's matrix: its largest draw lies near the bound
            bound = 1 / value.shape[-1] ** 0.5
            assert 0.7 * bound < value.abs().amax(dim=(1, 2)).min() and value.abs().max() <= bound, name


def test_int4_experts_quantised_after_their_adapters_attach_on_meta_equal_the_whole_model_path():
    """QA-HiRA on INT4 experts: quantising each materialised part under its attached adapters gives the codes,
    scales, zero-points and logits of quantising the whole model first and adapting it after."""
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    option = QAHiRAAdapterConfig(r=2, quantization=Quantization.int4, group_size=16, lambda_in=16,
                                 target_modules=list(TARGETS), experts=True)
    expected = option.apply(tiny_moe_model("mixtral"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # adapters that change the logits
        for name, param in expected.named_parameters():
            if "qahira_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    float_option = copy.deepcopy(option)
    float_option.quantization = Quantization.none
    weights = float_option.apply(tiny_moe_model("mixtral")).state_dict()  # the float base, same adapter names
    weights.update({name: tensor for name, tensor in expected.state_dict().items() if "qahira_" in name})
    model = attach_on_meta(option, _meta_mixtral())
    Materializer(torch.device("cpu"), 0, init_owners(model)).materialize(model, "")
    model.load_state_dict(weights)
    model.after_materialize(model)
    expected_state, state = expected.state_dict(), model.state_dict()
    assert sorted(state) == sorted(expected_state)
    assert any("parametrizations" in name and ".experts." in name for name in state), "the experts are INT4"
    for name, tensor in state.items():
        assert torch.equal(tensor, expected_state[name]), name
    tokens = torch.randint(128, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(tokens).logits, expected(tokens).logits, rtol=0, atol=0)
