"""PEFT integration of Q-BaRA / QA-HiRA on float, INT4 and bitsandbytes bases of a tiny Llama."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_merak.adapters import (
    QAHiRAConfig,
    QBaRAConfig,
    QBaRALinear,
    load_int4_model,
    quantize_model,
    register_peft_methods,
    save_int4_model,
)

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128,
)


def tiny_llama(quantization: str = "none", group_size: int = 16, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    return quantize_model(model, quantization, group_size=group_size)


def randomize_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """Give the (zero-initialised) adapters a non-trivial value so merges have something to check."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _name, parameter in model.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


def trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def inputs() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def test_registration_is_idempotent_and_keeps_peft_names() -> None:
    from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING

    register_peft_methods()
    register_peft_methods()
    assert PEFT_TYPE_TO_PREFIX_MAPPING["QBARA"] == "qbara_"
    assert PEFT_TYPE_TO_PREFIX_MAPPING["QAHIRA"] == "qahira_"
    assert PEFT_TYPE_TO_PREFIX_MAPPING["HIRA"] == "hira_"


@pytest.mark.parametrize("lam,r", [(2, 4), (4, 2), (2, 8)])
def test_qbara_trainable_parameters_equal_lora(lam: int, r: int) -> None:
    lora = get_peft_model(tiny_llama(), LoraConfig(r=r, target_modules=ALL_LINEAR))
    qbara = get_peft_model(tiny_llama(), QBaRAConfig(r=r, lambda_in=lam, lambda_out=lam, target_modules=ALL_LINEAR))
    assert trainable(qbara) == trainable(lora)
    layer = qbara.base_model.model.model.layers[0].self_attn.k_proj
    assert isinstance(layer, QBaRALinear) and layer.rank("default") == lam * r
    assert layer.qbara_A["default"].shape == (lam * r, 64 // lam)
    assert layer.qbara_B["default"].shape == (32 // lam, lam * r)
    assert all("qbara_" in n for n, p in qbara.named_parameters() if p.requires_grad)


def test_qahira_shapes_and_zero_init() -> None:
    model = get_peft_model(tiny_llama("int4"), QAHiRAConfig(lambda_in=16, lambda_out=2, target_modules=ALL_LINEAR))
    down = model.base_model.model.model.layers[1].mlp.down_proj
    assert down.qahira_H["default"].shape == (64 // 2, 128 // 16)
    assert trainable(model) == 2 * sum(
        o * i // 32 for o, i in [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)]
    )
    ids = inputs()
    with model.disable_adapter():
        base = model(ids).logits
    torch.testing.assert_close(model(ids).logits, base, rtol=0, atol=0)


@pytest.mark.parametrize("config_cls", [QBaRAConfig, QAHiRAConfig])
def test_forward_equals_base_plus_delta_weight(config_cls: type) -> None:
    torch.manual_seed(0)
    model = get_peft_model(tiny_llama(), config_cls(r=4, lambda_in=4, lambda_out=2, target_modules=ALL_LINEAR))
    randomize_adapters(model)
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    x = torch.randn(3, 5, 64)
    expected = layer.base_layer(x) + x @ layer.get_delta_weight("default").T
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "quantization,config",
    [
        ("none", QBaRAConfig(r=4, target_modules=ALL_LINEAR)),
        ("none", QAHiRAConfig(lambda_in=4, lambda_out=2, target_modules=ALL_LINEAR)),
        ("int4", QBaRAConfig(r=4, lambda_in=16, lambda_out=16, target_modules=ALL_LINEAR)),
        ("int4", QAHiRAConfig(lambda_in=16, lambda_out=1, target_modules=ALL_LINEAR)),
    ],
)
def test_merge_is_exact_into_float_and_int4(quantization: str, config: QBaRAConfig) -> None:
    model = get_peft_model(tiny_llama(quantization), config)
    randomize_adapters(model)
    ids = inputs()
    with torch.no_grad():
        adapted = model(ids).logits
        model.merge_adapter()
        merged_in_place = model(ids).logits
        model.unmerge_adapter()
        unmerged = model(ids).logits
        merged = model.merge_and_unload()(ids).logits
    scale = adapted.abs().max()
    assert (merged - adapted).abs().max() <= 1e-5 * scale
    assert (merged_in_place - adapted).abs().max() <= 1e-5 * scale
    assert (unmerged - adapted).abs().max() <= 1e-5 * scale


def test_int4_export_of_merged_model_round_trips(tmp_path) -> None:
    model = get_peft_model(tiny_llama("int4"), QAHiRAConfig(lambda_in=16, target_modules=ALL_LINEAR))
    randomize_adapters(model)
    ids = inputs()
    with torch.no_grad():
        adapted = model(ids).logits
        save_int4_model(model.merge_and_unload(), tmp_path / "merged")
        reloaded = load_int4_model(tmp_path / "merged")(ids).logits
    assert (reloaded - adapted).abs().max() <= 1e-5 * adapted.abs().max()
    manifest = json.loads((tmp_path / "merged" / "merak_int4.json").read_text())
    assert manifest["format"] == "merak-int4-asym" and len(manifest["modules"]) == 14


@pytest.mark.parametrize("quantization", ["none", "int4", "nf4"])
def test_save_load_round_trip_is_bit_exact(tmp_path, quantization: str) -> None:
    lambdas = dict(lambda_in=16, lambda_out=1) if quantization == "int4" else {}
    model = get_peft_model(
        tiny_llama(quantization),
        QAHiRAConfig(target_modules=ALL_LINEAR, **lambdas) if lambdas else QBaRAConfig(r=4, target_modules=ALL_LINEAR),
    )
    randomize_adapters(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["peft_type"] in ("QBARA", "QAHIRA")
    reloaded = PeftModel.from_pretrained(tiny_llama(quantization), tmp_path)
    assert type(reloaded.peft_config["default"]) is type(model.peft_config["default"])
    original = {n: p for n, p in model.named_parameters() if "qbara_" in n or "qahira_" in n}
    restored = dict(reloaded.named_parameters())
    assert original and all(torch.equal(p, restored[n]) for n, p in original.items())
    model.train()
    reloaded.train()  # bitsandbytes' CPU eval path differs from its train path; compare like with like
    ids = inputs()
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_multiple_named_adapters() -> None:
    model = get_peft_model(tiny_llama(), QBaRAConfig(r=2, target_modules=["q_proj", "v_proj"]), adapter_name="first")
    model.add_adapter("second", QBaRAConfig(r=4, lambda_in=4, lambda_out=4, target_modules=["q_proj", "v_proj"]))
    randomize_adapters(model)
    model.set_adapter("second")
    randomize_adapters(model, seed=7)
    ids = inputs()
    with torch.no_grad():
        outputs = {}
        for name in ("first", "second"):
            model.set_adapter(name)
            outputs[name] = model(ids).logits
    assert not torch.allclose(outputs["first"], outputs["second"])
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.rank("first") == 4 and layer.rank("second") == 16
    with torch.no_grad():
        merged = model.merge_and_unload(adapter_names=["second"])(ids).logits
    assert (merged - outputs["second"]).abs().max() <= 1e-5 * merged.abs().max()


@pytest.mark.parametrize("quantization", ["nf4", "fp4"])
def test_bnb_merge_survives_cpu_repacking(quantization: str) -> None:
    """An eval forward repacks bnb 4-bit weights in place on AVX512-BF16 CPUs; the merge must undo it first."""
    def merged_logits(eval_forward_first: bool) -> torch.Tensor:
        model = get_peft_model(tiny_llama(quantization), QBaRAConfig(r=4, target_modules=ALL_LINEAR))
        randomize_adapters(model)
        if eval_forward_first:
            model.eval()
            with torch.no_grad():
                model(inputs())
        merged = model.merge_and_unload().train()
        with torch.no_grad():
            return merged(inputs()).logits

    reference, after_eval = merged_logits(False), merged_logits(True)
    assert (after_eval - reference).abs().max() <= 0.05 * reference.abs().max()


def test_bnb_merge_is_close_to_the_float_merge() -> None:
    """Merging into NF4 re-quantizes: lossy, within the NF4 quantization error of the merged weight."""
    float_model = get_peft_model(tiny_llama(), QBaRAConfig(r=4, target_modules=ALL_LINEAR))
    nf4_model = get_peft_model(tiny_llama("nf4"), QBaRAConfig(r=4, target_modules=ALL_LINEAR))
    randomize_adapters(float_model)
    randomize_adapters(nf4_model)
    nf4_layer = nf4_model.base_model.model.model.layers[0].self_attn.q_proj
    float_layer = float_model.base_model.model.model.layers[0].self_attn.q_proj
    expected = nf4_layer.get_base_weight().clone() + float_layer.get_delta_weight("default")
    nf4_layer.merge()
    merged = nf4_layer.get_base_weight()
    relative = (merged - expected).norm() / expected.norm()
    assert 0 < relative < 0.15


def test_int8_smoke() -> None:
    model = get_peft_model(tiny_llama("int8"), QBaRAConfig(r=4, target_modules=ALL_LINEAR))
    randomize_adapters(model)
    ids = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapted = model(ids).logits
        merged = model.merge_and_unload()(ids).logits
    assert torch.isfinite(merged).all()
    assert (merged - adapted).abs().max() <= 0.1 * adapted.abs().max()


def test_indivisible_pooling_names_the_layer_before_wrapping() -> None:
    model = tiny_llama()
    with pytest.raises(
        ValueError, match=r"layer 'model.layers.0.self_attn.k_proj' has out_features=32.*lambda_overrides"
    ):
        get_peft_model(model, QBaRAConfig(r=4, lambda_in=1, lambda_out=64, target_modules=ALL_LINEAR))
    assert not any("qbara_" in n for n, _ in model.named_parameters())
    fixed = QBaRAConfig(
        r=4, lambda_in=1, lambda_out=64, target_modules=ALL_LINEAR,
        lambda_overrides={"k_proj": [1, 32], "v_proj": [1, 32]},
    )
    get_peft_model(tiny_llama(), fixed)


def test_misaligned_int4_groups_are_rejected_for_qahira() -> None:
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.q_proj' is INT4 with group_size=16, misaligned with lambda_in=8"
    ):
        get_peft_model(tiny_llama("int4"), QAHiRAConfig(lambda_in=8, target_modules=ALL_LINEAR))


def test_qbara_merge_into_misaligned_int4_is_refused() -> None:
    model = get_peft_model(tiny_llama("int4"), QBaRAConfig(r=4, lambda_in=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"cannot merge exactly into INT4 layer 'model.layers.0.self_attn.q_proj'"):
        model.merge_and_unload()


def test_unsupported_layer_type_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"layer 'model.embed_tokens' is a Embedding.*exclude_modules"):
        get_peft_model(tiny_llama(), QBaRAConfig(r=4, lambda_in=1, lambda_out=1, target_modules=["embed_tokens"]))


def test_bad_config_values_fail_early() -> None:
    with pytest.raises(ValueError, match="init must be one of"):
        QBaRAConfig(init="kaiming")
    with pytest.raises(ValueError, match="r must be positive"):
        QAHiRAConfig(r=0)
