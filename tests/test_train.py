"""`merak-train`'s refusals of bad input, before any process starts; its runs are in test_readme.py."""

import subprocess
import sys

import pytest

from lightning_merak.config import StrategyConfig, TrainerConfig
from lightning_merak.train import build_strategy, validate_run


def _merak_train(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_merak.train", *overrides],
        capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data=text", "data.path=/nonexistent/corpus.txt"], "data.path='/nonexistent/corpus.txt' does not exist"),
        (["model=hf", "model.model_type=llamaa"], "is not a transformers model type"),
        (["model=llama_huge"], "Could not find 'model/llama_huge'"),
        (["trainer.max_step=5"], "Key 'max_step' not in 'TrainerConfig'"),
        (["trainer.accelerator=gpu"], "GPU(s); set trainer.devices"),
        (["strategy.name=ddpp"], "is not a registered strategy"),
        (["trainer.devices=3", "strategy.tensor_parallel=3"],
         "tensor_parallel=3 does not divide num_attention_heads=4"),
        (["strategy.data_parallel=3"], "world size 2 is not divisible by the fixed degrees"),
        (["trainer.devices=8", "strategy.pipeline_parallel=8"],
         "8 pipeline stages (pipeline_parallel × virtual_stages) exceed the 6 nodes"),
        (["strategy.schedule=zigzag"], "schedule='zigzag' is not supported"),
        (["+strategy.pipline_parallel=2"], "unknown option strategy.pipline_parallel: Merak3DStrategyConfig has no "
                                           "key 'pipline_parallel'; did you mean strategy.pipeline_parallel?"),
        (["+trainer.max_stepz=2"], "unknown option trainer.max_stepz"),
        (["model=mixtral_tiny", "moe=prophet", "moe.experts=merak_ep", "strategy.data_parallel_sharding=optimizer"],
         "moe.experts=merak_ep under merak3d refused: data_parallel_sharding='optimizer'"),
        (["model=mixtral_tiny", "moe=prophet", "moe.experts=merak_ep", "moe.lancet_scope=block"],
         "moe.lancet_scope=block with moe.experts=merak_ep under merak3d is not built"),
        (["model=mixtral_tiny", "moe=shadowing", "moe.experts=merak_ep"],
         "moe.placement=shadowing with moe.experts=merak_ep re-plans replicas under DDP"),
        (["model=mixtral_tiny", "strategy.pipeline_parallel=2", "+model.config.output_router_logits=true"],
         "output_router_logits=True: the router aux loss"),
    ],
)
@pytest.mark.distributed
def test_bad_input_fails_before_training(overrides, message, tmp_path):
    result = _merak_train(*overrides, f"hydra.run.dir={tmp_path}", timeout=120)
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert "distributed processes registered" not in result.stdout + result.stderr


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

