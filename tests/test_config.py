import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from lightning_merak.cli.config import GROUPS, CallbackOptionConfig, TrainConfig, register_configs, reject_unknown_keys


def _compose(*overrides: str):
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_composes_to_typed_objects():
    config = OmegaConf.to_object(_compose("output_dir=/tmp/unused"))
    assert isinstance(config, TrainConfig)
    assert config.model.model_type == "llama"
    assert config.trainer.devices == 2 and config.trainer.accelerator == "cpu"
    assert config.strategy.name == "merak3d" and config.strategy.data_parallel == "auto"
    assert isinstance(config.memory, CallbackOptionConfig) and config.memory.build_callbacks() == []


def test_every_group_has_an_option():
    config = _compose("output_dir=/tmp/unused")
    for group in GROUPS:
        assert config[group] is not None


def test_misspelled_key_fails_at_composition():
    with pytest.raises(ConfigCompositionException, match="max_step"):
        _compose("trainer.max_step=5")


def test_wrong_type_fails_at_composition():
    with pytest.raises((ConfigCompositionException, ValidationError), match="devices"):
        _compose("trainer.devices=two")


def test_unknown_option_lists_the_available_ones():
    with pytest.raises(ConfigCompositionException, match="llama_tiny"):
        _compose("model=llama_huge")


def test_gpt2_and_any_transformers_model():
    assert _compose("model=gpt2_tiny").model.model_type == "gpt2"
    config = _compose("model=hf", "model.model_type=mistral", "+model.config.hidden_size=64")
    assert config.model.model_type == "mistral" and config.model.config.hidden_size == 64


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+strategy.pipline_parallel=2", "strategy.pipline_parallel: .* did you mean strategy.pipeline_parallel"),
        ("+trainer.nodes=2", "unknown option trainer.nodes"),
        ("+memory.budgett=1GiB", "unknown option memory.budgett"),
        ("+foo=1", "unknown option foo"),
    ],
)
def test_keys_added_with_plus_are_refused_unless_a_schema_declares_them(override, message):
    with pytest.raises(ValueError, match=message):
        reject_unknown_keys(_compose("output_dir=/tmp/unused", override))


def test_free_form_dicts_accept_new_keys():
    reject_unknown_keys(_compose("output_dir=/tmp/unused", "+model.config.rope_theta=1e4",
                                 "+strategy.kwargs.timeout_s=60"))


@pytest.mark.distributed
def test_help_lists_the_groups():
    """The groups without Hydra's schema/* entries, and each key with its description (tests/test_declared_once.py
    checks them in this process)."""
    result = subprocess.run(
        [sys.executable, "-m", "lightning_merak.cli.train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for group in GROUPS:
        assert f"\n{group}: " in result.stdout
    assert "merak-train" in result.stdout and "schema/" not in result.stdout
    assert "  pipeline_parallel: 1 " in result.stdout and "# Pipeline stages the model is cut into" in result.stdout


def test_merak3d_options_reach_the_strategy():
    from lightning_merak.cli.train import build_strategy

    config = OmegaConf.to_object(_compose("output_dir=/tmp/unused", "strategy.tensor_parallel=2",
                                          "strategy.tp_overlap=2", "strategy.sequence_parallel=true"))
    strategy = build_strategy(config.strategy)
    assert strategy.sequence_parallel and strategy.tp_overlap == 2



@pytest.mark.parametrize(("overrides", "message"), [
    (["+strategy.kwargs.compil=true"], r"strategy.kwargs.compil: Merak3DStrategy takes no argument 'compil'; did you "
                                       r"mean strategy.kwargs.compile\?"),
    (["strategy=ddp", "+strategy.kwargs.find_unused_parameter=true"],
     r"DDPStrategy takes no argument 'find_unused_parameter'; did you mean strategy.kwargs.find_unused_parameters\?"),
])
def test_a_misspelt_strategy_keyword_is_refused_naming_the_one_meant(overrides: list[str], message: str):
    from lightning_merak.cli.overrides import ConfigError
    from lightning_merak.cli.train import build_strategy

    config = OmegaConf.to_object(_compose("output_dir=/tmp/unused", *overrides))
    with pytest.raises(ConfigError, match=message):
        build_strategy(config.strategy)
