"""Input ``merak-train`` used to refuse only once the ranks ran (or with a library's traceback), now refused before
launch with one line naming the key and the fix: a user's module or datamodule missing a member Lightning needs,
``data.max_length`` too short for variable lengths, an empty ``data=hf_dataset`` corpus, a key an option leaves
unset, a decaying schedule in an endless run, non-positive model sizes and a stream's loop settings; and variable
lengths no longer checked against ``data.seq_len``, which they do not use. The command line runs in this process
with ``Trainer.fit`` replaced by a failure (``refused``): no rank starts.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
from omegaconf import OmegaConf

from lightning_merak.cli.checks import batch_shape, check_schedule_end, config_object
from lightning_merak.cli.overrides import ConfigError
from lightning_merak.modules.config import DataConfig, DataError, ModelConfig, OptimConfig, TrainerConfig
from lightning_merak.modules.data import LanguageModelingData
from lightning_merak.modules.hf_data import HFDatasetData

from .cli_user_module import UserLanguageModel
from .test_train import refused

REPOSITORY = Path(__file__).resolve().parents[1]
TINY = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "data.num_sequences=64",
        "trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.val_check_interval=null"]


class NoStepModel(UserLanguageModel):
    """A user module that leaves ``training_step`` as LightningModule's stub."""

    training_step = pl.LightningModule.training_step


class NoOptimizerModel(UserLanguageModel):
    """A user module that leaves ``configure_optimizers`` as LightningModule's stub."""

    configure_optimizers = pl.LightningModule.configure_optimizers


class NoLoaderData(pl.LightningDataModule):
    """A datamodule with a vocabulary but no ``train_dataloader``."""

    vocab_size = 64


def _refusal(overrides: list[str], run_dir: Path, monkeypatch, capsys) -> str:
    """The one line ``merak-train *overrides`` prints refusing the run before launch (exit 2, no traceback)."""
    monkeypatch.syspath_prepend(str(REPOSITORY))
    code, output = refused(overrides, run_dir, monkeypatch, capsys)
    assert code == 2, output.out + output.err
    assert output.err.startswith("merak-train: error: ") and "Traceback" not in output.err, output.err
    return output.err


# Members Lightning needs, checked before launch ---------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "message"), [
    (["module._target_=tests.test_cli_late_refusals.NoStepModel", "module.vocab_size=64",
      "data._target_=tests.cli_user_module.UserTokenData"],
     "module._target_=tests.test_cli_late_refusals.NoStepModel does not define training_step(), which Lightning "
     "needs to train (the LightningModule base class's is a stub); define training_step in NoStepModel"),
    (["module._target_=tests.test_cli_late_refusals.NoOptimizerModel", "module.vocab_size=64",
      "data._target_=tests.cli_user_module.UserTokenData"],
     "does not define configure_optimizers(), which Lightning needs to train"),
    (["data._target_=tests.test_cli_late_refusals.NoLoaderData"],
     "data._target_=tests.test_cli_late_refusals.NoLoaderData does not define train_dataloader(), which Lightning "
     "needs to train (the LightningDataModule base class's is a stub); define train_dataloader in NoLoaderData"),
])
def test_user_targets_missing_a_member_lightning_needs_are_refused_before_launch(overrides, message, tmp_path,
                                                                                 monkeypatch, capsys):
    assert message in _refusal(overrides, tmp_path, monkeypatch, capsys)


# Variable lengths: no seq_len ---------------------------------------------------------------------------------------

def test_variable_lengths_give_the_launch_checks_no_sequence_length() -> None:
    """``data.seq_len`` does not apply to samples of their own lengths; the global batch's size still does (merak3d
    traces a probe of its rows split into micro-batches)."""
    config = SimpleNamespace(data=DataConfig(name="synthetic", seq_len=30, batch_size=3, lengths="variable"),
                             trainer=TrainerConfig())
    data = LanguageModelingData(config.data)
    assert batch_shape(config, data) == {"batch_size": 3, "sequence_length": None, "accumulate_grad_batches": 1}
    fixed = SimpleNamespace(data=DataConfig(name="synthetic", seq_len=30, batch_size=3), trainer=TrainerConfig())
    assert batch_shape(fixed, LanguageModelingData(fixed.data))["sequence_length"] == 30


def test_context_rounds_of_variable_lengths_take_a_seq_len_they_do_not_use(tmp_path, monkeypatch, capsys):
    """``data.seq_len=30`` at cp2 used to be refused (30 % 4), though variable lengths never read it: the run now
    passes every check before launch and reaches ``Trainer.fit``."""
    monkeypatch.syspath_prepend(str(REPOSITORY))
    overrides = [*TINY, "data.batch_size=4", "strategy.context_parallel=2", "data.lengths=variable",
                 "data.max_length=64", "strategy.context_parallel_degree=per_micro_batch", "data.seq_len=30"]
    _, output = refused(overrides, tmp_path, monkeypatch, capsys)
    assert "was not refused before training" in output.err and "merak-train: error" not in output.err, output.err


@pytest.mark.parametrize("max_length", [1, 0])
def test_variable_max_length_below_two_is_refused_naming_it(max_length, tmp_path, monkeypatch, capsys):
    error = _refusal([*TINY, "data.lengths=variable", f"data.max_length={max_length}",
                      "strategy.pipeline_parallel=2", "strategy.micro_batching=dynamic"], tmp_path, monkeypatch, capsys)
    assert (f"data.max_length={max_length} with data.lengths=variable must be at least 2 (a sample of fewer tokens "
            "has no next token to learn): raise data.max_length") in error
    LanguageModelingData(DataConfig(name="synthetic", max_length=max_length))  # fixed lengths do not use it


# Empty corpora and unset keys ---------------------------------------------------------------------------------------

def test_an_empty_hf_dataset_file_is_refused_naming_it(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    error = _refusal(["data=hf_dataset", f"data.path={empty}"], tmp_path / "run", monkeypatch, capsys)
    assert f"merak-train: error: data.path='{empty}' holds no records (an empty file); point data.path at a corpus " \
           "with documents" in error


@pytest.mark.parametrize(("overrides", "message"), [
    (["trainer.val_check_interval=null"], "val_check_interval=null"),
    (["+trainer.limit_train_batches=5"], "limit_train_batches=5"),
    (["trainer.max_steps=-1", "trainer.max_epochs=1"], "set the Trainer's max_steps"),
])
def test_a_stream_s_loop_settings_are_refused_before_launch(overrides, message, tmp_path, monkeypatch, capsys):
    """A stream has no length: a run bounded or validated by passes would stop, or never validate, silently."""
    import datasets  # lazy: only this test writes a corpus

    datasets.Dataset.from_dict({"text": ["hello world"] * 50}).to_parquet(str(tmp_path / "corpus.parquet"))
    capsys.readouterr()  # the writer's progress bar
    error = _refusal(["data=hf_dataset", f"data.path={tmp_path / 'corpus.parquet'}", "data.streaming=true",
                      *overrides], tmp_path / "run", monkeypatch, capsys)
    assert message in error


def test_a_folder_of_empty_files_is_refused_naming_them(tmp_path) -> None:
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("")
    with pytest.raises(DataError, match=f"holds no records \\(empty files: {tmp_path}/a.jsonl, {tmp_path}/b.jsonl\\)"):
        HFDatasetData(str(tmp_path))


@pytest.mark.parametrize(("overrides", "message"), [
    (["data=hf_dataset"], "data.path is not set, and this data option reads its corpus from it: set "
                          "data.path=/abs/path"),
])
def test_keys_an_option_leaves_unset_are_refused_naming_the_key(overrides, message, tmp_path, monkeypatch, capsys):
    assert message in _refusal(overrides, tmp_path, monkeypatch, capsys)


def test_any_other_unset_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^strategy.name is not set \(the option chosen leaves it \?\?\?\): set "
                                          r"strategy.name=\.\.\.$"):
        config_object(OmegaConf.create({"strategy": {"name": "???"}}))


# An endless run's schedule ------------------------------------------------------------------------------------------

def _run(module: dict[str, Any] | None = None, **settings: Any) -> SimpleNamespace:
    optim = {key: value for key, value in settings.items() if key in ("lr_schedule", "total_steps")}
    trainer = {key: value for key, value in settings.items() if key not in optim}
    return SimpleNamespace(trainer=TrainerConfig(**trainer), optim=OptimConfig(**optim), module=module or {})


def test_a_decaying_schedule_in_an_endless_run_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    error = _refusal([*TINY, "trainer.max_steps=-1"], tmp_path, monkeypatch, capsys)
    assert ("optim.lr_schedule=cosine decays until the run's last step, but the Trainer has no end: give it "
            "max_steps or max_epochs, or use optim.lr_schedule=constant") in error
    with pytest.raises(ConfigError, match="optim.lr_schedule=linear decays until the run's last step"):
        check_schedule_end(_run(max_steps=-1, lr_schedule="linear"))
    # an end, a schedule that needs none, or a user's module (its own configure_optimizers): not refused
    for run in (_run(max_steps=-1, lr_schedule="constant"), _run(max_steps=-1, total_steps=100),
                _run(max_steps=-1, max_epochs=2), _run(max_steps=-1, kwargs={"fast_dev_run": True}),
                _run({"_target_": "my.Module"}, max_steps=-1)):
        check_schedule_end(run)


# Model sizes --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("sizes", "message"), [
    ({"num_attention_heads": 0}, "model.config.num_attention_heads=0 must be an integer of at least 1"),
    ({"hidden_size": -32}, "model.config.hidden_size=-32 must be an integer of at least 1"),
    ({"num_hidden_layers": -1}, "model.config.num_hidden_layers=-1 must be an integer of at least 0 (0: no layers)"),
    ({"num_key_value_heads": 0}, "model.config.num_key_value_heads=0 must be an integer of at least 1, or null"),
    ({"n_head": True}, "model.config.n_head=True must be an integer of at least 1"),
])
def test_non_positive_model_sizes_are_refused_naming_the_key(sizes, message) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        ModelConfig(name="tiny", model_type="llama", config=sizes)
    # no layers trains (the embedding and head alone); null sizes are derived by transformers
    ModelConfig(name="tiny", model_type="llama", config={"num_hidden_layers": 0, "num_key_value_heads": None})


def test_heads_zero_on_the_command_line_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    error = _refusal(["model.config.num_attention_heads=0"], tmp_path, monkeypatch, capsys)
    assert error.startswith("merak-train: error: model.config.num_attention_heads=0 must be an integer of at least 1")
