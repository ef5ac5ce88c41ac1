"""A resume into a changed run is refused before anything trains: another architecture than the checkpoint records
(merak3d would load the tensors the model names and train another function), another sampler order or pass length
part-way through a pass (other samples at the same steps), another optimizer (its state fails deep in torch). Before
launch from merak-train's configuration, and again where a Python user's run reads the checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import DistributedSampler

from lightning_merak.checkpoint.compatible import check_resume_shapes, unexpected_names
from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, model_record
from lightning_merak.checkpoint.saved_setup import (
    architecture_differences,
    optimizer_settings_problem,
)
from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT, MERAK3D_OPTIMIZERS, ShardedCheckpointer
from lightning_merak.cli.checks import check_batches_before_launch, check_resumed_optimizer
from lightning_merak.cli.config import register_configs
from lightning_merak.cli.overrides import ConfigError
from lightning_merak.cli.train import prepare
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import DataConfig, DataError, ModelConfig, OptimConfig
from lightning_merak.modules.muon import MuonWithAdamW
from lightning_merak.modules.resumable import ResumableDataLoader, check_batch_shape

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2}
RUN = [f"++model.config={{{','.join(f'{key}:{value}' for key, value in TINY.items())}}}", "data.vocab_size=64",
       "data.seq_len=16", "data.batch_size=4", "data.num_sequences=64", "strategy=ddp", "trainer.devices=1",
       "optim.total_steps=8", "optim.warmup_steps=2", "logger=[csv]"]


def _config(tmp_path: Path, *overrides: str) -> Any:
    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config",
                                           overrides=[*RUN, f"output_dir={tmp_path / 'out'}", *overrides]))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """merak-train's tiny Llama and data trained 2 steps of a 16-batch pass on one device, saved by Lightning."""
    tmp_path = tmp_path_factory.mktemp("saved")
    run = prepare(_config(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    trainer.fit(run.module, datamodule=run.data)
    trainer.save_checkpoint(tmp_path / "step=2.ckpt")
    return tmp_path / "step=2.ckpt"


def test_merak_train_resumes_its_own_checkpoint(saved_run: Path, tmp_path: Path) -> None:
    assert prepare(_config(tmp_path, f"resume='{saved_run}'")).resume_from == saved_run


@pytest.mark.parametrize("overrides, refusal", [
    (["model.config.num_hidden_layers=1"], r"num_hidden_layers is 2 there and 1 here; .* trained with "
                                           r"\(model\.config\.num_hidden_layers=2\)"),
    (["model.config.num_attention_heads=2", "model.config.num_key_value_heads=1"],
     r"num_attention_heads is 4 there and 2 here; num_key_value_heads is 2 there and 1 here; head_dim is 8 there "
     r"and 16 here"),
    (["++model.config.tie_word_embeddings=true"], r"tie_word_embeddings is False there and True here"),
    (["model=gpt2_tiny"], r"model_type is 'llama' there and 'gpt2' here; .*\(a llama model: the model option"),
])
def test_merak_train_refuses_another_architecture_before_launch(saved_run: Path, tmp_path: Path,
                                                                overrides: list[str], refusal: str) -> None:
    with pytest.raises(ValueError, match=rf"resume=.*step=2\.ckpt: the checkpoint was saved from another model: "
                                         rf"{refusal}"):
        prepare(_config(tmp_path, f"resume='{saved_run}'", *overrides))


def test_merak_train_refuses_a_mid_pass_resume_over_another_data_size_before_launch(saved_run: Path,
                                                                                     tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"stopped 2 batches into a pass, and its pass was 16 batches, this run's "
                                          r"is 32 \(another data size: data\.num_sequences"):
        prepare(_config(tmp_path, f"resume='{saved_run}'", "data.num_sequences=128"))
    with pytest.raises(ConfigError, match=r"its pass was 16 batches, this run's is 3 .*trainer\.limit_train_batches"):
        prepare(_config(tmp_path, f"resume='{saved_run}'", "+trainer.kwargs.limit_train_batches=3"))
    prepare(_config(tmp_path, f"resume='{saved_run}'", "+trainer.kwargs.limit_train_batches=20"))  # the same 16


def test_merak_train_refuses_another_optimizer_before_launch(saved_run: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"optim\.name=muon: the checkpoint's optimizer has 2 parameter groups "
                                          r"\['matrices', 'biases_and_norms'\], this run's 4 \['muon/matrices', .*; "
                                          r"resume with optim=adamw,"):
        prepare(_config(tmp_path, f"resume='{saved_run}'", "optim=muon", "optim.newton_schulz_dtype=float32"))


def test_merak_train_refuses_sgd_over_an_adamw_checkpoint_of_the_same_group_names(saved_run: Path,
                                                                                     tmp_path: Path) -> None:
    # the groups' names agree; their settings (betas, eps, not momentum) tell AdamW's state from SGD's
    with pytest.raises(ConfigError, match=r"optim\.name=sgd: the checkpoint's optimizer groups hold settings this "
                                          r"optimizer has not \(amsgrad, betas, .*resume with optim=adamw,"):
        prepare(_config(tmp_path, f"resume='{saved_run}'", "optim=sgd"))


def test_optimizers_are_told_apart_by_their_own_settings_older_releases_included() -> None:
    adamw = [{"name": "m", "lr": 1.0, "betas": (0.9, 0.99), "eps": 1e-8, "decoupled_weight_decay": True}]
    sgd = [{"name": "m", "lr": 1.0, "momentum": 0.9, "nesterov": False, "dampening": 0.0}]
    assert optimizer_settings_problem(adamw, adamw, "fix") is None
    older_adamw = [{"name": "m", "lr": 1.0, "betas": (0.9, 0.99), "eps": 1e-8}]  # before decoupled_weight_decay
    assert optimizer_settings_problem(older_adamw, adamw, "fix") is None
    assert optimizer_settings_problem(adamw, older_adamw, "fix") is None  # a newer release's state
    problem = optimizer_settings_problem(older_adamw, sgd, "the fix")
    assert problem is not None and problem.endswith("has not (betas, eps) and lack its own (dampening, momentum, "
                                                    "nesterov): it was trained with another optimizer, whose state "
                                                    "this one cannot take; the fix")


def test_a_muon_checkpoint_resumed_with_adamw_is_refused_before_launch(tmp_path: Path) -> None:
    groups = [{"name": name, "params": []} for name in ("muon/matrices", "muon/biases_and_norms", "adamw/matrices",
                                                         "adamw/biases_and_norms")]
    directory = tmp_path / "step=4.ckpt"
    directory.mkdir()
    torch.save({MERAK3D_OPTIMIZERS: [{"param_groups": groups, "entries": {}}]}, directory / LIGHTNING_CHECKPOINT)
    module = SimpleNamespace(optim=OptimConfig(name="adamw"))
    with pytest.raises(ConfigError, match=r"optim\.name=adamw: the checkpoint's optimizer has 4 parameter groups .* "
                                          r"this run's 2 \['matrices', 'biases_and_norms'\].*resume with optim=muon,"):
        check_resumed_optimizer(module, directory)
    check_resumed_optimizer(SimpleNamespace(optim=OptimConfig(name="muon")), directory)


# the pass a checkpoint stopped in: the same order and length, or refused

def _state(**changes: Any) -> dict[str, Any]:
    return {"pass": 0, "batches": 4, "replicas": 2, "batch_size": 8, "pass_length": 32, "order": ["randperm", 1234],
            **changes}


def test_a_mid_pass_resume_in_another_order_or_of_another_length_is_refused() -> None:
    check_batch_shape(_state(), 2, 8, ["randperm", 1234], 32)
    with pytest.raises(DataError, match=r"ordered the pass \['randperm', 1234\], this run's orders it "
                                        r"\['randperm', 7\] \(another trainer\.seed"):
        check_batch_shape(_state(), 2, 8, ["randperm", 7], 32)
    with pytest.raises(DataError, match=r"its pass was 32 batches, this run's is 64 \(another data size"):
        check_batch_shape(_state(), 2, 8, ["randperm", 1234], 64)
    check_batch_shape(_state(), 2, 8, ["randperm", 1234], None)  # a length not known yet: the launcher's to check
    check_batch_shape(_state(batch_size=None), 2, 4, ["randperm", 7], 64)  # an older checkpoint's: let through


def _ddp_config(seed: int) -> SimpleNamespace:
    data = DataConfig(name="synthetic", batch_size=8, num_sequences=512)
    return SimpleNamespace(data=data, trainer=SimpleNamespace(kwargs={}, seed=seed))


def test_a_mid_pass_resume_at_another_trainer_seed_is_refused_before_launch(tmp_path: Path) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    path = tmp_path / "step=4.ckpt"
    torch.save({"loops": {"fit_loop": {"state_dict": {"combined_loader": [_state()]}}}}, path)
    check_batches_before_launch(_ddp_config(1234), DDPStrategy(), None, 2, path)
    with pytest.raises(ConfigError, match=r"step=4\.ckpt: the checkpoint stopped 4 batches into a pass, and its "
                                          r"distributed sampler ordered the pass \['randperm', 1234\], this run's "
                                          r"orders it \['randperm', 7\]"):
        check_batches_before_launch(_ddp_config(7), DDPStrategy(), None, 2, path)
    finished = tmp_path / "end.ckpt"
    torch.save({"loops": {"fit_loop": {"state_dict": {"combined_loader": [_state(batches=32)]}}}}, finished)
    check_batches_before_launch(_ddp_config(7), DDPStrategy(), None, 2, finished)


def _sampled_loader(seed: int, samples: int) -> ResumableDataLoader:
    sampler = DistributedSampler(list(range(samples)), num_replicas=2, rank=0, shuffle=True, seed=seed)
    return ResumableDataLoader(list(range(samples)), batch_size=4, sampler=sampler, epoch=lambda: 0,
                               trained_batches=lambda: 2, shuffle_seed=seed)


def test_a_restored_loader_refuses_another_sampler_seed_or_data_size() -> None:
    saved = _sampled_loader(1234, 32).state_dict()
    _sampled_loader(1234, 32).load_state_dict(saved)
    with pytest.raises(DataError, match=r"\['randperm', 1234\], this run's orders it \['randperm', 7\]"):
        _sampled_loader(7, 32).load_state_dict(saved)
    with pytest.raises(DataError, match=r"its pass was 4 batches, this run's is 8"):
        _sampled_loader(1234, 64).load_state_dict(saved)


# where a Python user's run reads the checkpoint: merak3d's sharded load, its optimizer state

def _llama(**config: Any) -> nn.Module:
    holder = nn.Module()
    holder.model = build_causal_lm(ModelConfig(name="tiny", model_type="llama", config={**TINY, **config}),
                                   vocab_size=64)
    return holder


def _sharded(tmp_path: Path, module: nn.Module) -> Path:
    directory = tmp_path / "step=2.ckpt"
    dcp.save({"model": dict(module.state_dict())}, checkpoint_id=directory, no_dist=True)
    torch.save({"global_step": 2, MODEL_RECORD_KEY: model_record(module.model), MERAK3D_OPTIMIZERS: []},
               directory / LIGHTNING_CHECKPOINT)
    return directory


def _checkpointer() -> ShardedCheckpointer:
    return ShardedCheckpointer(lambda: (0, (1, 1, 1)))


def test_merak3ds_load_refuses_a_model_of_fewer_layers(tmp_path: Path) -> None:
    directory = _sharded(tmp_path, _llama())
    loaded = _checkpointer().load(directory, _llama())
    assert set(loaded["state_dict"]) == set(_llama().state_dict())
    with pytest.raises(ValueError, match=r"step=2\.ckpt: the checkpoint was saved from another model: "
                                         r"num_hidden_layers is 2 there and 1 here"):
        _checkpointer().load(directory, _llama(num_hidden_layers=1))


def test_a_saved_optimizer_state_of_other_groups_is_refused_before_it_is_paired() -> None:
    model = nn.Linear(4, 4)
    adamw = torch.optim.AdamW([{"params": [model.weight], "name": "matrices"},
                               {"params": [model.bias], "name": "biases_and_norms"}])
    muon = MuonWithAdamW([{"params": [model.weight], "name": "matrices"},
                          {"params": [model.bias], "name": "biases_and_norms"}], lr=0.01, momentum=0.9)

    def consolidated(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {"merak3d_consolidated": True, "state": {}, "param_groups": [
            {**{key: value for key, value in group.items() if key != "params"}, "params": []}
            for group in optimizer.param_groups]}

    checkpointer = _checkpointer()
    checkpointer.load_optimizer_state(adamw, consolidated(adamw), model)
    for saved, run, counts in ((adamw, muon, "2 parameter groups .* this run's 4"),
                               (muon, adamw, "4 parameter groups .* this run's 2")):
        with pytest.raises(ValueError, match=rf"the checkpoint's optimizer has {counts} .* resume with the "
                                             r"configure_optimizers \(optim\.name\) it was trained with"):
            checkpointer.load_optimizer_state(run, consolidated(saved), model)
    sgd = torch.optim.SGD([{"params": [model.weight], "name": "matrices"},
                           {"params": [model.bias], "name": "biases_and_norms"}], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"hold settings this optimizer has not \(amsgrad, betas, .*\) and lack its "
                                         r"own \(dampening, momentum, nesterov\)"):  # the same names, another class
        checkpointer.load_optimizer_state(sgd, consolidated(adamw), model)


def test_only_architecture_fields_count_and_a_model_without_a_config_compares_names(tmp_path: Path) -> None:
    assert architecture_differences({"model_type": "llama", "num_hidden_layers": 2, "attention_dropout": 0.0},
                                    {"model_type": "llama", "num_hidden_layers": 2, "attention_dropout": 0.2}) == []
    assert unexpected_names({"a.weight": (2,), "a.weight.absmax": (1,), "b.weight": (2,)}, {"a.weight": (2,)}) == \
        ["b.weight"]
    saved = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    file = tmp_path / "run.ckpt"
    torch.save({"state_dict": saved.state_dict()}, file)
    check_resume_shapes(file, saved)
    with pytest.raises(ValueError, match=r"holds tensors this model has no place for: 1\.bias, 1\.weight; resume "
                                         r"with the model it was trained with"):
        check_resume_shapes(file, nn.Sequential(nn.Linear(2, 2)))


def test_the_resume_checks_read_a_checkpoint_file_once_and_a_rewritten_one_again(
        saved_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_merak.checkpoint import compatible

    reads: list[Path] = []
    load = compatible.load_torch_file
    monkeypatch.setattr(compatible, "load_torch_file",
                        lambda file, **kwargs: reads.append(file) or load(file, **kwargs))
    compatible._read_lightning_state.cache_clear()
    for _ in range(2):
        compatible.saved_model_config(saved_run)
        compatible.saved_tensor_shapes(saved_run)
        compatible.saved_loader_states(saved_run)
        compatible.saved_optimizer_groups(saved_run)
        compatible.check_resume_expert_parallel(saved_run, torch.nn.Linear(1, 1))
    assert len(reads) == 1
    os.utime(saved_run, ns=(saved_run.stat().st_atime_ns, saved_run.stat().st_mtime_ns + 1))
    compatible.saved_loader_states(saved_run)
    assert len(reads) == 2
