"""Each thing is declared once: merak3d's options (with their descriptions), the CLI reference generated from the
schemas, and the module contract as one Protocol. Fast, in this process."""

from __future__ import annotations

import dataclasses
import inspect
import re
import string
from pathlib import Path

import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from lightning_merak.cli import reference
from lightning_merak.cli.config import register_configs
from lightning_merak.cli.options.strategy import Merak3DStrategyConfig
from lightning_merak.protocols.module_contract import MEMBERS, Merak3DModule, contract_name
from lightning_merak.strategies.merak3d.options import Merak3DOptions
from lightning_merak.util.fields import description, summary

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dataclasses.fields(Merak3DOptions)


def _compose(*overrides: str, hydra: bool = False):
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=hydra)


# 1. merak3d's options --------------------------------------------------------------------------------------------

def test_strategy_signature_is_the_options():
    """Names, order and defaults: the signature repeats Merak3DOptions for readers and IDEs, nothing more."""
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    parameters = list(inspect.signature(Merak3DStrategy.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in parameters] == [(item.name, item.default) for item in OPTIONS]


def test_every_option_is_described_once():
    from lightning_merak.strategies.merak3d import strategy

    for item in OPTIONS:
        text = description(item)
        assert text and text == " ".join(text.split()), f"{item.name}: describe it in Merak3DOptions, on one line"
        assert 1 <= len(re.findall(r"[.!?](?:\s|$)", text)) <= 4, f"{item.name}: one to three sentences"
    doc = strategy.Merak3DStrategy.__doc__ or ""
    assert "Merak3DOptions" in doc and "docs/reference/cli.md" in doc
    assert not any(f"{item.name}:" in doc for item in OPTIONS), "the strategy's docstring repeats an option"
    assert len(Path(strategy.__file__).read_text().splitlines()) <= 600


def test_the_hydra_schema_carries_each_description():
    schema_fields = {item.name: item for item in dataclasses.fields(Merak3DStrategyConfig)}
    for item in OPTIONS:
        assert schema_fields[item.name].default == item.default
        assert description(schema_fields[item.name]) == description(item)


def test_the_yaml_declares_no_option_and_composes_to_the_defaults():
    declared = yaml.safe_load((ROOT / "lightning_merak/conf/strategy/merak3d.yaml").read_text())
    assert set(declared) == {"defaults"}, "strategy/merak3d.yaml repeats keys its schema declares"
    composed = OmegaConf.to_container(_compose("output_dir=/tmp/unused").strategy)
    assert {item.name: composed[item.name] for item in OPTIONS} == {
        item.name: item.default for item in OPTIONS}


# 2. The CLI reference and --help -----------------------------------------------------------------------------------

def test_cli_reference_is_current(capsys):
    assert reference.main(["--check"]) == 0, capsys.readouterr().err
    page = reference.REFERENCE.read_text()
    for item in OPTIONS:
        assert f"| `strategy.{item.name}` |" in page and description(item) in page


def test_help_describes_each_key_and_hides_the_schemas():
    """What Hydra's app_help prints: the template, resolved by OmegaConf, then filled in by string.Template."""
    reference.register_help()
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        config = compose(config_name="config", overrides=["strategy.pipeline_parallel=2"], return_hydra_config=True)
        template = config.hydra.help.template
    text = string.Template(template).substitute(FLAGS_HELP="", HYDRA_CONFIG_GROUPS="", APP_CONFIG_GROUPS="",
                                                CONFIG="")
    assert "schema/" not in text and "== Configuration groups ==" in text
    assert "strategy: ddp, [merak3d]\n" in text and "model: gpt2_tiny, hf, [llama_tiny], mixtral_tiny\n" in text
    assert "output_dir: ${hydra:runtime.output_dir}" in text
    lines = text.splitlines()
    for item in OPTIONS:
        (line,) = [line for line in lines if line.startswith(f"  {item.name}: ")]
        first_words = " ".join(summary(description(item)).split()[:3])
        assert f"# {first_words}" in line, line
    assert any(line.startswith("  pipeline_parallel: 2 ") for line in lines)


# 3. The module contract --------------------------------------------------------------------------------------------

def test_the_protocol_names_its_members_once():
    own = {name for name, value in vars(Merak3DModule).items() if callable(value) and not name.startswith("_")}
    assert set(MEMBERS) == own | set(Merak3DModule.__annotations__)
    assert contract_name() == "lightning_merak.protocols.module_contract.Merak3DModule"


def test_causal_lm_module_implements_the_protocol():
    from torch import nn

    from lightning_merak.modules import CausalLMModule

    module = CausalLMModule(nn.Linear(2, 2))
    assert isinstance(module, Merak3DModule)
    for name in MEMBERS[1:]:
        wanted = list(inspect.signature(getattr(Merak3DModule, name)).parameters)
        assert list(inspect.signature(getattr(CausalLMModule, name)).parameters) == wanted, name


def test_a_module_with_some_members_uses_them_and_infers_the_rest():
    """The members are optional: a module with ``split_batch`` alone is read through it, and is no Merak3DModule."""
    import lightning.pytorch as pl
    import torch

    from lightning_merak.strategies.merak3d.network import module_view

    class Partial(pl.LightningModule):
        def split_batch(self, batch):
            return batch["tokens"], batch["tokens"]

    module = Partial()
    assert not isinstance(module, Merak3DModule)
    view = module_view(module, 1, 1)
    tokens = torch.arange(4).view(1, 4)
    assert view.attribute is None and not view.contract and view.split_batch({"tokens": tokens})[0] is tokens
