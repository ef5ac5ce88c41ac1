"""`merak-train`'s refusals of bad input, before any process starts; its runs are in test_readme.py.

Each refusal runs merak-train's own command line in this process — its check of the overrides, Hydra's
composition, then every check made before the ranks begin work — with ``Trainer.fit`` replaced by a failure, so
a check that stopped refusing fails the test instead of training. That the command line prints the refusal once, exits
non-zero and leaves no early-started rank behind is tests/test_prelaunch.py's subprocess run.
"""

import sys
from typing import Any

import lightning.pytorch as pl
import pytest

import lightning_merak.cli.train as merak_train
from lightning_merak.cli.config import StrategyConfig, register_configs
from lightning_merak.cli.train import build_strategy, validate_run
from lightning_merak.modules.config import TrainerConfig


def refused(overrides: list[str], run_dir, monkeypatch, capsys) -> tuple[object, Any]:
    """The exit status and captured output of ``merak-train *overrides`` refusing to start, in this process;
    fails if it would have trained."""

    def reached_fit(*args, **kwargs):
        raise AssertionError(f"merak-train {' '.join(overrides)} was not refused before training")

    monkeypatch.setattr(pl.Trainer, "fit", reached_fit)
    monkeypatch.setattr(merak_train, "prelaunch_local_ranks", lambda devices, num_nodes: None)
    monkeypatch.setattr(sys, "argv", ["merak-train", *overrides, f"hydra.run.dir={run_dir}"])
    register_configs()
    with pytest.raises(SystemExit) as exit_:
        merak_train.run_command_line()
    return exit_.value.code, capsys.readouterr()


def _refusal(overrides: list[str], run_dir, monkeypatch, capsys) -> str:
    """What ``merak-train *overrides`` prints when it refuses to start."""
    code, output = refused(overrides, run_dir, monkeypatch, capsys)
    assert code not in (0, None), output.out + output.err
    return output.out + output.err


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data=text", "data.path=/nonexistent/corpus.txt"], "data.path='/nonexistent/corpus.txt' does not exist"),
        (["model=hf", "model.model_type=llamaa"], "is not a transformers model type"),
        (["model=llama_huge"], "model=llama_huge is not an option of model"),
        (["trainer.max_step=5"], "trainer.max_step is not a key of trainer; did you mean trainer.max_steps?"),
        (["trainer.accelerator=gpu"], "trainer.accelerator=gpu but this machine has no GPU"),
        (["strategy.name=ddpp"], "is not a registered strategy"),
        (["trainer.devices=3", "strategy.tensor_parallel=3"],
         "tensor_parallel=3 does not divide num_attention_heads=4"),
        (["strategy.data_parallel=3"], "world size 2 is not divisible by the fixed degrees"),
        (["trainer.devices=8", "strategy.pipeline_parallel=8"],
         "8 pipeline stages (pipeline_parallel × virtual_stages) exceed the 6 nodes"),
        (["strategy.schedule=zigzag"], "schedule='zigzag' is not supported"),
        (["+strategy.pipline_parallel=2"], "strategy.pipline_parallel is not a key of strategy; did you mean "
                                           "strategy.pipeline_parallel?"),
        (["+trainer.max_stepz=2"], "trainer.max_stepz is not a key of trainer"),
        (["model=mixtral_tiny", "moe=prophet", "moe.experts=merak_ep", "strategy.data_parallel_sharding=optimizer"],
         "moe.experts=merak_ep under merak3d refused: data_parallel_sharding='optimizer'"),
        (["model=mixtral_tiny", "moe=prophet", "moe.experts=merak_ep", "moe.lancet_scope=block"],
         "moe.lancet_scope=block with moe.experts=merak_ep under merak3d is not built"),
        (["model=mixtral_tiny", "moe=shadowing", "moe.experts=merak_ep"],
         "moe.placement=shadowing with moe.experts=merak_ep re-plans replicas under DDP"),
        (["model=mixtral_tiny", "strategy.pipeline_parallel=2", "+model.config.output_router_logits=true",
          "strategy.micro_batching=dynamic", "data.lengths=variable"],
         "output_router_logits=True with micro_batching='dynamic'"),
        (["strategy.pipeline_parallel=3", "trainer.devices=3"], "batch size 16 is not divisible by micro_batches=6"),
        (["strategy.data_parallel=1", "strategy.tensor_parallel=auto", "model.config.hidden_size=48",
          "model.config.num_attention_heads=6", "model.config.num_key_value_heads=3",
          "model.config.intermediate_size=64"],
         "tensor_parallel=2 is left out (tensor_parallel=2 neither divides nor is a multiple of the 3 key/value heads"),
    ],
)
def test_bad_input_fails_before_training(overrides, message, tmp_path, monkeypatch, capsys):
    output = _refusal(overrides, tmp_path, monkeypatch, capsys)
    assert message in output, output[-3000:]
    assert "was not refused before training" not in output, output[-3000:]


def test_launcher_world_size_must_match(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="launcher started 3 processes .* 1 × 2 = 2"):
        validate_run(TrainerConfig(devices=2, num_nodes=1))


def test_devices_must_be_positive():
    with pytest.raises(ValueError, match="must be at least 1"):
        validate_run(TrainerConfig(devices=0))


def test_strategy_kwargs_override_registered_defaults():
    strategy = build_strategy(StrategyConfig(name="ddp", kwargs={"find_unused_parameters": True}))
    assert strategy._ddp_kwargs["find_unused_parameters"] is True

