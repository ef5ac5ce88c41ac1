"""`merak-train` end to end (2 real processes) and its refusals of bad input."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_merak.config import StrategyConfig, TrainerConfig
from lightning_merak.train import build_strategy, validate_run

FAST = [
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
    "data.num_sequences=256",
]


def _merak_train(*overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_merak.train", *overrides],
        capture_output=True, text=True, timeout=timeout,
    )


def test_two_process_smoke_run(tmp_path):
    result = _merak_train(*FAST, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Starting with 2 processes" in result.stdout + result.stderr
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith("merak-train: done. Outputs in") and str(tmp_path) in last_line
    assert (tmp_path / "checkpoints" / "final.ckpt" / "lightning.ckpt").is_file()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    with (tmp_path / "csv" / "metrics.csv").open() as metrics:
        losses = [float(row["train/loss"]) for row in csv.DictReader(metrics) if row.get("train/loss")]
    assert len(losses) == 6


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data=text", "data.path=/nonexistent/corpus.txt"], "data.path='/nonexistent/corpus.txt' does not exist"),
        (["model=hf", "model.model_type=llamaa"], "is not a transformers model type"),
        (["model=llama_huge"], "Could not find 'model/llama_huge'"),
        (["trainer.max_step=5"], "Key 'max_step' not in 'TrainerConfig'"),
        (["trainer.accelerator=gpu"], "GPU(s); set trainer.devices"),
        (["strategy.name=ddpp"], "is not a registered strategy"),
        (["trainer.devices=3", "strategy.tensor_parallel=3"], "tensor_parallel=3 does not divide num_attention_heads=4"),
        (["strategy.data_parallel=3"], "world size 2 is not divisible by the fixed degrees"),
        (["trainer.devices=8", "strategy.pipeline_parallel=8"], "8 pipeline stages (pipeline_parallel × virtual_stages) exceed the 6 nodes"),
        (["strategy.schedule=zigzag"], "schedule='zigzag' is not supported"),
    ],
)
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


def test_python_quickstart_example_runs():
    example = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"
    result = subprocess.run(
        [sys.executable, str(example), "--devices", "1", "--max-steps", "5"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final train loss" in result.stdout
