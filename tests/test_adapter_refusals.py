"""Q-BaRA / QA-HiRA configs and INT4 quantization: bad values refused with a message naming the value and the fix,
before any layer is wrapped; the documented ``init="kaiming"`` of QA-HiRA and valid boundary values work."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_merak.adapters import QAHiRAConfig, QBaRAConfig, QuantLinearInt4, quantize_model
from lightning_merak.adapters.moe import add_moe_adapters, moe_adapter_config
from lightning_merak.cli.options.adapter import QAHiRAAdapterConfig, Quantization
from lightning_merak.plugins.moe.experts import tiny_moe_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)
TARGETS = ["q_proj", "v_proj"]


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY))


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    return model(ids, labels=ids).loss


def qahira_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if "qahira_H" in name]


# --- init: a class constant of each method, not a field ---------------------------------------------------------


def test_qahira_kaiming_init_perturbs_the_model_and_zero_stays_the_default() -> None:
    kaiming = QAHiRAConfig(target_modules=TARGETS, lambda_in=16, init="kaiming")
    assert kaiming.init_choices == ("zero", "kaiming")
    adapted = get_peft_model(tiny_llama(), kaiming)
    weights = qahira_weights(adapted)
    assert weights and all(w.abs().sum() > 0 for w in weights)
    assert not torch.allclose(loss_of(adapted), loss_of(tiny_llama()))

    default = QAHiRAConfig(target_modules=TARGETS, lambda_in=16)
    assert default.init == "zero"
    assert all(w.abs().sum() == 0 for w in qahira_weights(get_peft_model(tiny_llama(), default)))
    with pytest.raises(ValueError, match=r"Q-BaRA: init must be one of \('zero',\), got 'kaiming'"):
        QBaRAConfig(target_modules=TARGETS, init="kaiming")  # Q-BaRA's A is always Kaiming, its B zero


def test_qahira_kaiming_through_the_cli_option() -> None:
    option = QAHiRAAdapterConfig(init="kaiming", target_modules=TARGETS, quantization=Quantization.none,
                                 lambda_in=16)
    weights = qahira_weights(option.apply(tiny_llama()))
    assert weights and all(w.abs().sum() > 0 for w in weights)


def test_class_constants_are_not_saved_and_legacy_configs_load_silently(tmp_path: Path) -> None:
    adapted = get_peft_model(tiny_llama(), QAHiRAConfig(target_modules=TARGETS, lambda_in=16, init="kaiming"))
    adapted.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert "init_choices" not in saved and "method_name" not in saved
    saved["init_choices"] = ["zero"]  # what earlier versions wrote
    (tmp_path / "adapter_config.json").write_text(json.dumps(saved))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = PeftModel.from_pretrained(tiny_llama(), str(tmp_path))
    assert not [w for w in caught if "init_choices" in str(w.message)]
    config = loaded.peft_config["default"]
    assert isinstance(config, QAHiRAConfig) and config.init == "kaiming"
    assert config.init_choices == ("zero", "kaiming")
    torch.testing.assert_close(loss_of(loaded), loss_of(adapted))


# --- field values refused when the config is built -------------------------------------------------------------

BAD_FIELDS = [
    ({"r": 0}, r"r must be positive and an integer .*, got r=0; e\.g\. r=8"),
    ({"r": -1}, r"r must be positive and an integer .*, got r=-1;"),
    ({"r": 1.5}, r"r must be positive and an integer .*, got r=1\.5;"),
    ({"r": True}, r"r must be positive and an integer .*, got r=True;"),
    ({"alpha": math.nan}, r"alpha=nan must be a finite non-zero number .* e\.g\. alpha=16\.0"),
    ({"alpha": math.inf}, r"alpha=inf must be a finite non-zero number"),
    ({"alpha": 0}, r"alpha=0 must be a finite non-zero number .*0 leaves the model unchanged"),
    ({"alpha": 0.0}, r"alpha=0\.0 must be a finite non-zero number"),
    ({"alpha": True}, r"alpha=True must be a finite non-zero number"),
    ({"dropout": math.nan}, r"dropout=nan must be a number in \[0, 1\), e\.g\. dropout=0\.0"),
    ({"dropout": 1.0}, r"dropout=1\.0 must be a number in \[0, 1\)"),
    ({"dropout": "0.1"}, r"dropout='0\.1' must be a number in \[0, 1\)"),
    ({"lambda_in": 2.0}, r"lambda_in=2\.0 must be a positive integer .* e\.g\. lambda_in=2"),
    ({"lambda_out": 2.0}, r"lambda_out=2\.0 must be a positive integer .* e\.g\. lambda_out=2"),
    ({"lambda_in": 0}, r"lambda_in=0 must be a positive integer"),
    ({"lambda_out": True}, r"lambda_out=True must be a positive integer"),
    ({"lambda_overrides": {"q_proj": [2]}}, r"lambda_overrides\['q_proj'\]=\[2\] must be two positive integers"),
    ({"lambda_overrides": {"q_proj": [2.0, 2]}}, r"lambda_overrides\['q_proj'\]=\[2\.0, 2\] must be two positive"),
    ({"lambda_overrides": {"q_proj": [0, 2]}}, r"lambda_overrides\['q_proj'\]=\[0, 2\] must be two positive"),
    ({"lambda_overrides": {"q_proj": [True, 2]}}, r"lambda_overrides\['q_proj'\]=\[True, 2\] must be two positive"),
    ({"lambda_overrides": {"q_proj": 2}}, r"lambda_overrides\['q_proj'\]=2 must be two positive integers .*"
                                          r"e\.g\. lambda_overrides=\{'q_proj': \[2, 2\]\}"),
    ({"lambda_overrides": [("q_proj", [2, 2])]}, r"lambda_overrides=.* must map module-name suffixes"),
]


@pytest.mark.parametrize("config_class", [QBaRAConfig, QAHiRAConfig])
@pytest.mark.parametrize(("fields", "message"), BAD_FIELDS, ids=[repr(fields) for fields, _ in BAD_FIELDS])
def test_bad_field_values_are_refused(config_class: type, fields: dict, message: str) -> None:
    method = "Q-BaRA" if config_class is QBaRAConfig else "QA-HiRA"
    with pytest.raises(ValueError, match=f"^{method}: {message}"):
        config_class(target_modules=TARGETS, **fields)


BOUNDARIES = [  # (accepted values, the refused value just past one of them)
    ({"r": 1, "alpha": -16.0}, {"r": True}),  # a negative alpha only flips the update's sign
    ({"alpha": 1e-3, "dropout": 0.999}, {"alpha": 0.0}),
    ({"alpha": 8, "dropout": 0.0, "lambda_in": 1, "lambda_out": 1}, {"lambda_in": 1.0}),
    ({"lambda_overrides": {"v_proj": (1, 1)}}, {"lambda_overrides": {"v_proj": (1, 1.0)}}),
]


@pytest.mark.parametrize(("fields", "refused"), BOUNDARIES, ids=[repr(fields) for fields, _ in BOUNDARIES])
def test_boundary_values_train_and_the_next_value_is_refused(fields: dict, refused: dict) -> None:
    config = QBaRAConfig(target_modules=TARGETS, **fields)
    adapted = get_peft_model(tiny_llama(), config)
    loss = loss_of(adapted)
    loss.backward()
    assert torch.isfinite(loss)
    assert config.scaling == fields.get("alpha", 16.0) / fields.get("r", 8)
    with pytest.raises(ValueError, match=f"^Q-BaRA: .*{next(iter(refused))}"):
        QBaRAConfig(target_modules=TARGETS, **{**fields, **refused})


# --- lambda_overrides keys checked against the model ------------------------------------------------------------


def test_override_key_naming_no_adapted_module_is_refused_before_wrapping() -> None:
    model = tiny_llama()
    config = QBaRAConfig(target_modules=TARGETS, lambda_overrides={"q_proj": [2, 2], "nonexistent_proj": [2, 2],
                                                                     "k_proj": [1, 1]})
    with pytest.raises(ValueError, match=r"^Q-BaRA: lambda_overrides keys \['nonexistent_proj', 'k_proj'\] match no "
                                         r"adapted module .* the adapted modules end in q_proj, v_proj\. "):
        get_peft_model(model, config)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


@pytest.mark.parametrize(("key", "near_miss"), [
    ("q_proj", "_proj"),  # a key is a whole name component, not any tail
    ("self_attn.q_proj", "attn.q_proj"),
    ("model.layers.1.self_attn.q_proj", "model.layers.2.self_attn.q_proj"),  # the model has 2 layers
])
def test_override_keys_naming_adapted_modules_apply_and_near_misses_are_refused(key: str, near_miss: str) -> None:
    adapted = get_peft_model(tiny_llama(), QBaRAConfig(target_modules=TARGETS, lambda_overrides={key: [4, 1]}))
    assert adapted.base_model.model.model.layers[1].self_attn.q_proj.lambda_in["default"] == 4
    assert adapted.base_model.model.model.layers[1].self_attn.v_proj.lambda_in["default"] == 2
    with pytest.raises(ValueError, match=rf"keys \['{near_miss}'\] match no adapted module"):
        get_peft_model(tiny_llama(), QBaRAConfig(target_modules=TARGETS, lambda_overrides={near_miss: [4, 1]}))


def test_override_keys_checked_against_all_linear_targets() -> None:
    adapted = get_peft_model(tiny_llama(), QBaRAConfig(target_modules="all-linear",
                                                       lambda_overrides={"down_proj": [4, 1]}))
    assert adapted.base_model.model.model.layers[0].mlp.down_proj.lambda_in["default"] == 4
    with pytest.raises(ValueError, match=r"keys \['lm_head'\] match no adapted module .* down_proj, gate_proj"):
        get_peft_model(tiny_llama(), QBaRAConfig(target_modules="all-linear", lambda_overrides={"lm_head": [1, 1]}))


def test_override_keys_checked_against_fused_expert_targets() -> None:
    model = tiny_moe_model("qwen3_moe")
    config = moe_adapter_config(model, "qbara", r=4, lambda_overrides={"down_proj": [1, 1]})
    assert add_moe_adapters(model, config) is not None
    model = tiny_moe_model("qwen3_moe")
    config = moe_adapter_config(model, "qbara", r=4, attention=False, lambda_overrides={"q_proj": [1, 1]})
    with pytest.raises(ValueError, match=r"keys \['q_proj'\] match no adapted module .* end in down_proj"):
        add_moe_adapters(model, config)


def test_target_parameters_naming_no_expert_weight_are_refused() -> None:
    """PEFT would adapt nothing for them, without a word: a dense model has no fused expert weights at all."""
    with pytest.raises(ValueError, match=r"Q-BaRA: target_parameters \['experts.gate_up_proj'\] name no fused expert "
                                         r"weight of LlamaForCausalLM; it has none \(a dense model"):
        get_peft_model(tiny_llama(), QBaRAConfig(r=4, target_modules=TARGETS,
                                                 target_parameters=["experts.gate_up_proj"]))
    model = tiny_moe_model("qwen3_moe")
    config = QBaRAConfig(r=4, target_modules=TARGETS, target_parameters=["mlp.experts.down_proj", "shared.down_proj"])
    with pytest.raises(ValueError, match=r"\['shared.down_proj'\] name no fused expert weight of .*; its expert "
                                         r"weights end in experts.down_proj, experts.gate_up_proj"):
        add_moe_adapters(model, config)


# --- INT4 group size ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_size", [32.0, True, 0, -32, 3, "32"], ids=repr)
def test_int4_group_size_must_be_an_even_positive_integer(group_size: object) -> None:
    model = tiny_llama()
    message = rf"INT4 group_size must be an even integer >= 2 .* got {group_size!r}; e\.g\. group_size=32"
    with pytest.raises(ValueError, match=message):
        quantize_model(model, "int4", group_size=group_size)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    with pytest.raises(ValueError, match=message):
        QuantLinearInt4(64, 64, group_size)


def test_int4_smallest_group_size_works_but_not_as_a_float() -> None:
    model = quantize_model(tiny_llama(), "int4", group_size=2)
    assert model.model.layers[0].self_attn.q_proj.group_size == 2
    assert torch.isfinite(loss_of(model))
    with pytest.raises(ValueError, match=r"group_size must be an even integer >= 2 .* got 2\.0"):
        quantize_model(tiny_llama(), "int4", group_size=2.0)
