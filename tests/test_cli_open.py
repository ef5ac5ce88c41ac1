"""``merak-train`` open to a user's own pieces (#50): module and datamodule by ``_target_``, loggers, Trainer
arguments and the ``optim`` group; its first error is the fix; the Python API and ``merak-export`` match what
transformers and PEFT users expect.

The runs are ``merak-train`` subprocesses (a few, short: each start costs ~10 s here); the refusals that need no
process run ``merak-train``'s command line in this process with ``Trainer.fit`` replaced by a failure.
"""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.cli.config import register_configs
from lightning_merak.cli.overrides import ConfigError, _compose, check_overrides
from lightning_merak.cli.train import validate_run
from lightning_merak.modules.config import OptimConfig, Schedule, TrainerConfig

from .cli_user_module import UserLanguageModel, UserTokenData
from .test_train import refused

REPOSITORY = Path(__file__).resolve().parents[1]
QUIET = ["trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1", "trainer.max_steps=3"]


def _merak_train(*overrides: str, run_dir: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY), "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "lightning_merak.cli.train", *overrides, f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=timeout, cwd=REPOSITORY, env=environment)


def _losses(metrics: Path) -> list[float]:
    with metrics.open() as file:
        return [float(row["train/loss"]) for row in csv.DictReader(file) if row.get("train/loss")]


def _done_line_paths(stdout: str) -> list[Path]:
    (line,) = [line for line in stdout.splitlines() if line.startswith("merak-train: done.")]
    return [Path(path) for path in re.findall(r": (/[^,\s]+)", line.split("—", 1)[1])]


# Runs ---------------------------------------------------------------------------------------------------------

def _reference_losses(steps: int) -> list[float]:
    """The user module trained on one process, as merak-train seeds and feeds it: Lightning shuffles a training
    set under a distributed strategy, with the global seed (one data-parallel replica here)."""
    from torch.utils.data import DistributedSampler

    pl.seed_everything(1234, workers=True, verbose=False)
    module, data = UserLanguageModel(vocab_size=64), UserTokenData()
    optimizer = module.configure_optimizers()
    dataset = data.train_dataloader().dataset
    loader = DataLoader(dataset, batch_size=data.batch_size,
                        sampler=DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=1234))
    losses = []
    for batch, _ in zip(loader, range(steps)):
        optimizer.zero_grad()
        loss = module.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.distributed
@pytest.mark.parametrize("module", ["UserLanguageModel", "InlineLossLanguageModel"])
def test_user_module_and_datamodule_train_under_merak3d_pp2(module, tmp_path):
    """A transformers model called with labels, and a loss computed inline from its logits: both as on one process."""
    result = _merak_train(f"module._target_=tests.cli_user_module.{module}", "module.vocab_size=64",
                          "data._target_=tests.cli_user_module.UserTokenData", "strategy.pipeline_parallel=2",
                          "trainer.gradient_clip_val=null", *QUIET, run_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "pipeline_parallel=2" in result.stdout + result.stderr
    losses = _losses(tmp_path / "csv" / "metrics.csv")
    assert losses == pytest.approx(_reference_losses(3), abs=1e-4)
    assert all(path.exists() for path in _done_line_paths(result.stdout))
    hparams = (tmp_path / "csv" / "hparams.yaml").read_text()
    assert f"_target_: tests.cli_user_module.{module}" in hparams and "pipeline_parallel: 2" in hparams


@pytest.mark.distributed
def test_wandb_offline_and_mlflow_file_store_record_the_loss(tmp_path):
    result = _merak_train("logger=[csv,wandb,mlflow]", "logger.wandb.offline=true", "strategy=ddp",
                          "trainer.devices=1", "trainer.limit_train_batches=5", "optim=sgd", *QUIET, run_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"train/loss" in run.read_bytes()
    (mlflow_loss,) = (tmp_path / "mlruns").glob("*/*/metrics/train/loss")
    assert len(mlflow_loss.read_text().splitlines()) == 3
    (optimizer,) = (tmp_path / "mlruns").glob("*/*/params/optim/name")
    assert optimizer.read_text() == "sgd"
    assert len(_losses(tmp_path / "csv" / "metrics.csv")) == 3
    paths = _done_line_paths(result.stdout)
    assert tmp_path / "csv" / "metrics.csv" in paths and all(path.exists() for path in paths)
    assert run.parent in paths  # the W&B run's own folder, which `wandb sync` takes
    assert result.stdout.strip().splitlines()[-1].startswith("merak-train: done.")  # W&B finished before it


@pytest.mark.distributed
def test_a_cli_error_prints_the_fix_first_without_a_traceback(tmp_path):
    """As a process: the first line is the fix, the exit status 2, no traceback anywhere (the other cases below run
    the same command line in this process)."""
    result = _merak_train("trainer.max_step=5", run_dir=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    first_line = "trainer.max_step is not a key of trainer; did you mean trainer.max_steps?"
    assert result.stderr.splitlines()[0].startswith(f"merak-train: error: {first_line}"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.distributed
def test_data_too_small_for_the_run_is_refused_before_launch_without_a_traceback(tmp_path):
    """With the byte-level tokenizer the token count is known without tokenising: refused once, before any rank
    starts, naming the fix, with status 2."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("too short\n")
    result = _merak_train("data=text", f"data.path={corpus}", "trainer.max_steps=2", run_dir=tmp_path / "run",
                          timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    refusal = f"merak-train: error: data.path='{corpus}' yields"
    assert [line.startswith(refusal) for line in result.stderr.splitlines()].count(True) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(("overrides", "first_line"), [
    (["model.config.hidden_size=30"], "model.config for model.model_type='llama' is not a valid configuration: The "
                                      "hidden size (30) is not a multiple of the number of attention heads (4)"),
    (["strategy=merak3dd"], "strategy=merak3dd is not an option of strategy; did you mean strategy=merak3d?"),
    (["model=hf", "model.model_type=lama"], "model.model_type='lama' is not a transformers model type; did you "
                                            "mean llama?"),
    (["trainer.learning_rate=0.1"], "trainer.learning_rate moved to optim.learning_rate"),
    (["trainer.fast_dev_rn=true"], "trainer.fast_dev_rn is not a key of trainer; did you mean trainer.fast_dev_run?"),
])
def test_cli_errors_print_the_fix_first_without_a_traceback(overrides, first_line, tmp_path, monkeypatch, capsys):
    code, output = refused(overrides, tmp_path, monkeypatch, capsys)
    assert code == 2, output.err[-3000:]
    assert output.err.splitlines()[0].startswith(f"merak-train: error: {first_line}"), output.err[-3000:]
    assert "Traceback" not in output.err + output.out


# Refusals in this process -----------------------------------------------------------------------------------------

def _refusal(overrides: list[str], run_dir: Path, monkeypatch, capsys) -> str:
    """What merak-train's command line prints on stderr when it refuses ``overrides`` (exit status 2)."""
    code, output = refused(overrides, run_dir, monkeypatch, capsys)
    assert code == 2, output.out + output.err
    return output.err


@pytest.mark.parametrize(("overrides", "message"), [
    (["module._target_=tests.cli_user_module.Missing"], "module._target_=tests.cli_user_module.Missing does not "
                                                       "import (AttributeError"),
    (["module._target_=tests.cli_user_module.NotAModule"], "is not a lightning.pytorch.core.module.LightningModule "
                                                          "subclass"),
    (["module._target_=tests.cli_user_module.UserLanguageModel"], "UserLanguageModel needs the argument "
                                                                  "'vocab_size'; add module.vocab_size=..."),
    (["module._target_=tests.cli_user_module.UserLanguageModel", "module.vocab_size=64", "module.hiden_size=8"],
     "module.hiden_size: UserLanguageModel takes no argument 'hiden_size'; did you mean module.hidden_size?"),
    (["data._target_=tests.cli_user_module.UserTokenData", "data.seq_lenn=8"], "did you mean data.seq_len?"),
    (["module._target_=tests.cli_user_module.UserLanguageModel", "module.vocab_size=64", "adapter=lora"],
     "adapter=lora transforms the built-in causal LM's model"),
    (["callbacks=[{_target_: lightning.pytorch.callbacks.EarlyStopping, monitr: val/loss}]"],
     "callbacks[0].monitr: EarlyStopping takes no argument 'monitr'; did you mean callbacks[0].monitor?"),
    (["logger.csv.save_dirr=/tmp"], "did you mean logger.csv.save_dir?"),
    (["logger=wandb", "+logger.wandb.projekt=x"], "WandbLogger takes no argument 'projekt'; did you mean "
                                                  "logger.wandb.project?"),  # **kwargs go on to wandb.init
    (["logger=tensorboard", "+logger.tensorboard.flush_sec=5"], "did you mean logger.tensorboard.flush_secs?"),
    (["trainer.logger=false"], "merak-train sets Trainer's logger itself; use logger=..."),
    (["optim=muon", "optim.lr_schedule=cosin"],
     "optim.lr_schedule=cosin: 'cosin' is not one of cosine, linear, constant"),
    (["data.lengths=variable"], "data.lengths=variable yields global batches of samples of their own lengths, which "
                                "only merak3d's micro-batching consumes"),  # before launch, not on every rank
    (["data.lengths=variable", "strategy.pipeline_parallel=2", "strategy.micro_batching=pack"],
     "micro_batching=pack needs a model whose blocks take an attention mask on every batch; this one uses "
     "attn_implementation='sdpa'"),
    # the DeepSpeed-MoE layer's experts spread over each stage's data-parallel ranks: one at pp=2 on 2 ranks
    (["model=mixtral_tiny", "moe=deepspeed", "strategy.pipeline_parallel=2"],
     "moe.ep_size=2 does not divide the 1 data-parallel ranks the experts are spread over; choose a divisor of 1"),
    (["comm=embrace", "strategy.pipeline_parallel=2"], "method='embrace' under merak3d needs pipeline_parallel=1"),
])
def test_open_cli_refusals_name_the_fix(overrides, message, tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPOSITORY))
    output = _refusal(overrides, tmp_path, monkeypatch, capsys)
    assert output.startswith("merak-train: error: ") and message in output, output[-3000:]


def test_module_merak3d_cannot_run_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    """The strategy's own check before launch runs on a user's module: what merak3d needs is named then."""
    monkeypatch.syspath_prepend(str(REPOSITORY))
    output = _refusal(["module._target_=tests.cli_user_module.BareModule", "strategy.pipeline_parallel=2",
                       "data._target_=tests.cli_user_module.UserTokenData"], tmp_path, monkeypatch, capsys)
    assert "finds none among BareModule's children: hold it as an attribute" in output, output[-3000:]


def test_overrides_are_put_as_hydra_takes_them():
    register_configs()
    assert check_overrides(["trainer.fast_dev_run=true", "model.config.rope_theta=1e4", "--cfg", "job"]) == [
        "--cfg", "job", "+trainer.kwargs.fast_dev_run=true", "+model.config.rope_theta=1e4"]
    assert check_overrides(["data._target_=pkg.Data", "data.path=/x"]) == [
        "data=custom", "+data._target_=pkg.Data", "+data.path=/x"]
    model = check_overrides(["model=hf", "+model.config={hidden_size:64,num_hidden_layers:2}"])
    assert model == ["model=hf", "++model.config={hidden_size:64,num_hidden_layers:2}"], "a dict merges, new keys too"
    assert check_overrides(model) == model
    merged = check_overrides(["model.config={hidden_size:64,rope_theta:1e4}"])
    config = _compose(merged).model.config
    assert (config.hidden_size, config.rope_theta, config.num_hidden_layers) == (64, 1e4, 4)  # the preset's other keys
    again = check_overrides(["+trainer.kwargs.limit_train_batches=5"])
    assert again == ["+trainer.kwargs.limit_train_batches=5"], "checking twice (the early ranks) changes nothing"
    with pytest.raises(ConfigError, match="logger=wandbb is not an option of logger; did you mean logger=wandb?"):
        check_overrides(["logger=[csv,wandbb]"])


# Python parity ----------------------------------------------------------------------------------------------------

def _tiny_fit(optim: OptimConfig, max_steps: int) -> tuple[pl.Trainer, float]:
    from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
    from lightning_merak.modules.config import ModelConfig

    pl.seed_everything(0, verbose=False)
    model = build_causal_lm(ModelConfig(name="tiny", model_type="llama", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1}), vocab_size=64)
    tokens = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(0))
    module = CausalLMModule(model, optim)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=8))
    return trainer, float(trainer.callback_metrics["train/loss"])


@pytest.mark.parametrize(("schedule", "final"), [(Schedule.cosine, 0.1), (Schedule.linear, 0.0),
                                                 (Schedule.constant, 1.0)])
def test_schedule_ends_at_the_trainers_max_steps(schedule, final):
    """max_steps is given once, to the Trainer: the schedule reaches its end value at the Trainer's last step."""
    trainer, _ = _tiny_fit(OptimConfig(learning_rate=1e-2, warmup_steps=2, lr_schedule=schedule), max_steps=7)
    (scheduler,) = [config.scheduler for config in trainer.lr_scheduler_configs]
    assert scheduler.last_epoch == 7
    assert scheduler.get_last_lr()[0] == pytest.approx(1e-2 * final, abs=1e-9)


@pytest.mark.parametrize("name", ["sgd", "muon"])
def test_optimizers_of_the_optim_group_train(name):
    _, untrained = _tiny_fit(OptimConfig(name=name, learning_rate=0.05, warmup_steps=0), max_steps=1)
    trainer, trained = _tiny_fit(OptimConfig(name=name, learning_rate=0.05, warmup_steps=0), max_steps=12)
    assert math.isfinite(trained) and trained < untrained
    optimizer = trainer.optimizers[0]
    optimizer.load_state_dict(optimizer.state_dict())


def test_gpu_preset_uses_every_gpu(monkeypatch):
    from hydra import compose, initialize_config_module

    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        assert compose(config_name="config", overrides=["trainer=gpu"]).trainer.devices == -1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert validate_run(TrainerConfig(accelerator="gpu", devices=-1)) == 4
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="launcher started 8 processes .* 1 × 4 = 4"):
        validate_run(TrainerConfig(accelerator="gpu", devices=-1))
    with pytest.raises(ValueError, match="trainer.devices=-1 means every GPU"):
        validate_run(TrainerConfig(accelerator="cpu", devices=-1))


# merak-export -----------------------------------------------------------------------------------------------------

def _checkpoint(model: torch.nn.Module, path: Path) -> Path:
    """What Lightning writes for a DDP run: the module's state under ``model.``, plus the model record."""
    from lightning_merak.hf import model_record
    from lightning_merak.modules.causal_lm import CausalLMModule

    torch.save({"state_dict": CausalLMModule(model).state_dict(), "hf_model": model_record(model)}, path)
    return path


def _tiny_llama() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False))


def test_export_writes_one_shard_as_model_safetensors(tmp_path):
    from transformers import AutoModelForCausalLM

    from lightning_merak.hf.export import export_checkpoint

    model = _tiny_llama()
    report = export_checkpoint(_checkpoint(model, tmp_path / "ddp.ckpt"), tmp_path / "out")
    assert report.files[0] == "model.safetensors" and not (tmp_path / "out" / "model.safetensors.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, 64, (2, 8))
    assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_adapter_only_export_loads_with_peft(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    from lightning_merak.cli.export import main as merak_export

    adapted = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # a trained adapter: both factors non-zero
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    merak_export([str(_checkpoint(adapted, tmp_path / "lora.ckpt")), str(tmp_path / "adapter"), "--adapter-only"])
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {path.name for path in (tmp_path / "adapter")
                                                                    .iterdir()}
    loaded = PeftModel.from_pretrained(_tiny_llama(), tmp_path / "adapter")
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, adapted(ids).logits, atol=1e-6)
        assert not torch.allclose(_tiny_llama()(ids).logits, adapted(ids).logits, atol=1e-3)


@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], ["embed_tokens", "v_proj"]])
def test_adapter_only_export_of_an_adapted_embedding_writes_what_peft_writes(tmp_path, targets):
    """With the head or the input embedding among the targets, PEFT's save_pretrained writes that layer's base
    weight beside the adapters; the export's folder holds the same tensors under the same names."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from lightning_merak.hf.export import export_adapter

    adapted = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    adapted.save_pretrained(tmp_path / "peft")
    export_adapter(_checkpoint(adapted, tmp_path / "lora.ckpt"), tmp_path / "adapter")
    ours, peft_own = (load_file(tmp_path / folder / "adapter_model.safetensors") for folder in ("adapter", "peft"))
    assert sorted(ours) == sorted(peft_own) and any(".base_layer." in name for name in ours)
    for name, value in peft_own.items():
        assert torch.equal(ours[name], value), name
