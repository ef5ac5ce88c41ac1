"""TrainingMetrics: a 3-step run's CSV and TensorBoard hold every metric and the memory figure; the gradient norm
is clip_grad_norm_'s; on two gloo ranks the global throughput counts each replica's batches once, and matches a
single process's run of the same global batch."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_merak.callbacks import TrainingMetrics
from lightning_merak.callbacks.profiler import MerakTraceProfiler, Trace
from lightning_merak.callbacks.profiler.timeline import idle_fraction, step_bars, step_waits
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.planning.flops import training_flops_per_token, transformer_shape
from lightning_merak.testing import NormBeforeClipping, run_distributed
from tests.test_training_metrics_steps import _Regression

VOCAB, SEQ, BATCH, STEPS = 64, 16, 4, 3
MODEL = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "attention_dropout": 0.0})
EVERY_METRIC = {"perf/step_time_s", "perf/tokens_per_s", "perf/samples_per_s", "perf/mfu_measured_peak",
                "perf/model_tflops_per_s", "perf/peak_tflops", "train/grad_norm", "memory/peak_MiB/max",
                "memory/peak_MiB/rank0"}



def _module() -> CausalLMModule:
    torch.manual_seed(0)
    model = build_causal_lm(MODEL, vocab_size=VOCAB)
    model.config.use_cache = False
    return CausalLMModule(model)


def _data(replicas: int) -> TensorDataset:
    return TensorDataset(torch.randint(VOCAB, (STEPS * BATCH * replicas, SEQ),
                                       generator=torch.Generator().manual_seed(1)))


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as handle:
        return list(csv.DictReader(handle))


def _column(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


def test_three_steps_write_every_metric_to_csv_and_tensorboard(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = [CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tensorboard")]
    reference = NormBeforeClipping()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=loggers, gradient_clip_val=1e-3,
                         callbacks=[TrainingMetrics(), reference], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = _module()
    trainer.fit(module, DataLoader(_data(1), batch_size=BATCH))

    rows = _rows(Path(loggers[0].log_dir) / "metrics.csv")  # 3 < log_every_n_steps (50): written at the end
    logged = {key for row in rows for key, value in row.items() if value}
    assert EVERY_METRIC <= logged
    (tokens_per_s,), (samples_per_s,) = _column(rows, "perf/tokens_per_s"), _column(rows, "perf/samples_per_s")
    (step_time,), (model_tflops,) = _column(rows, "perf/step_time_s"), _column(rows, "perf/model_tflops_per_s")
    assert tokens_per_s == pytest.approx(SEQ * samples_per_s)
    assert tokens_per_s * step_time * STEPS == pytest.approx(STEPS * BATCH * SEQ)
    flops_per_token = training_flops_per_token(transformer_shape(module.model.config), SEQ)
    assert model_tflops * 1e12 == pytest.approx(flops_per_token * tokens_per_s)
    assert 0 < _column(rows, "perf/mfu_measured_peak")[0] < 1
    assert _column(rows, "memory/peak_MiB/rank0")[0] > 10  # the process's resident set: torch alone is more
    # before clipping: the reference's norm of the last step, far above the 1e-3 the gradients were clipped to
    assert _column(rows, "train/grad_norm") == [pytest.approx(reference.norms[-1], rel=1e-6)]
    assert reference.norms[-1] > 1e-2
    figures = list((Path(loggers[0].log_dir) / "figures").glob("memory_over_steps-step2.png"))
    assert len(figures) == 1 and figures[0].stat().st_size > 0

    events = EventAccumulator(str(loggers[1].log_dir))
    events.Reload()
    assert EVERY_METRIC <= set(events.Tags()["scalars"])
    assert "memory/over_steps" in events.Tags()["images"]


def test_without_a_transformers_config_mfu_is_left_out_with_a_warning(tmp_path: Path):
    logger = CSVLogger(tmp_path, name="csv")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=logger, log_every_n_steps=2,
                         callbacks=[TrainingMetrics()], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
    with pytest.warns(UserWarning, match="no MFU.*no transformers config"):
        trainer.fit(_Regression(), data)
    rows = _rows(Path(logger.log_dir) / "metrics.csv")
    assert [int(row["step"]) for row in rows if row.get("perf/samples_per_s")] == [1, 3]
    assert all(not row.get("perf/mfu_measured_peak") for row in rows)
    assert _column(rows, "perf/samples_per_s")[0] > 0


def test_bad_arguments_are_refused_naming_the_fix():
    with pytest.raises(TypeError, match=r"length_fn=.*takes a function"):
        TrainingMetrics(length_fn=16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ranks_per_rank_metrics"):
        TrainingMetrics(ranks_per_rank_metrics=-1)


class _FullyShardedLM(CausalLMModule):
    """FSDP2 over ModelParallelStrategy's data-parallel mesh, per decoder layer then the root: sharded gradients."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


REPLICAS = {"ddp": 2, "fsdp2": 2, "merak3d_pp2": 1, "merak3d_pp2_clipped": 1}


def _train(rank: int, world_size: int, strategy_name: str, out: str, batch: int,
           clip: Optional[float] = 1.0) -> list[float]:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from lightning_merak.strategies.merak3d import Merak3DStrategy

    strategy: Any = "auto"
    module = _module()
    if strategy_name == "ddp":
        strategy = DDPStrategy(process_group_backend="gloo")
    elif strategy_name == "fsdp2":
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        module = _FullyShardedLM(module.model)
    elif strategy_name.startswith("merak3d_pp2"):
        strategy = Merak3DStrategy(pipeline_parallel=2, micro_batches=2)
    reference = NormBeforeClipping()
    traced = strategy_name in ("ddp", "merak3d_pp2")
    profiler = MerakTraceProfiler(dirpath=out, skip_steps=1, steps=1, untraced_steps=0) if traced else None
    # the clipped pipeline run starts with a sanity-check batch, so merak3d builds its stages before training
    sanity = 1 if strategy_name == "merak3d_pp2_clipped" else 0
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS,
                         logger=CSVLogger(out, name=strategy_name), log_every_n_steps=2, gradient_clip_val=clip,
                         callbacks=[TrainingMetrics(), reference], profiler=profiler, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=sanity,
                         limit_val_batches=sanity, use_distributed_sampler=False)
    data = _data(2)  # each DDP rank takes every other sample, in order: the single process's batches, split
    sampler = DistributedSampler(data, 2, rank, shuffle=False) if REPLICAS.get(strategy_name) == 2 else None
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    trainer.fit(module, loader, val_dataloaders=loader if sanity else None)
    return reference.norms


def _tokens_per_step(rows: list[dict[str, str]]) -> list[float]:
    """Tokens each logged interval counted per optimizer step: tokens/s × seconds per step."""
    return [row_tokens * step_time for row_tokens, step_time in
            zip(_column(rows, "perf/tokens_per_s"), _column(rows, "perf/step_time_s"))]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy_name", list(REPLICAS))
def test_two_ranks_count_the_global_batch(tmp_path: Path, strategy_name: str):
    replicas = REPLICAS[strategy_name]
    clip = None if strategy_name == "merak3d_pp2" else 1.0  # merak3d's own norm without clipping, its clipping's with
    run_distributed(_train, 2, args=(strategy_name, str(tmp_path), BATCH, clip), timeout_s=180)
    run_distributed(_train, 1, args=("single", str(tmp_path), replicas * BATCH, clip), timeout_s=120)
    rows = _rows(next((tmp_path / strategy_name).glob("version_*/metrics.csv")))
    single = _rows(next((tmp_path / "single").glob("version_*/metrics.csv")))
    # intervals of 2 steps and 1 (the end of the run); DDP: both ranks' batches, pp2: one replica's batch once
    assert _tokens_per_step(rows) == [pytest.approx(replicas * BATCH * SEQ)] * 2
    assert _tokens_per_step(single) == [pytest.approx(replicas * BATCH * SEQ)] * 2
    # the single process ran the same global batch: the same gradients (merak3d's norm is its clipping's, FSDP2's
    # gradients are shards whose norm is gathered)
    assert _column(rows, "train/grad_norm") == pytest.approx(_column(single, "train/grad_norm"), rel=1e-4)
    assert len(_column(rows, "memory/peak_MiB/rank1")) == 2 and _column(rows, "memory/peak_MiB/max")
    assert len(_column(rows, "perf/mfu_measured_peak")) == 2  # from the model's config, stages or not
    bubbles = _column(rows, "perf/pipeline_bubble")
    if strategy_name.startswith("merak3d_pp2"):  # two stages, two micro-batches: each stage waits for the other
        assert len(bubbles) == 2 and all(0.0 < bubble < 1.0 for bubble in bubbles), bubbles
    else:
        assert not bubbles, "a bubble without pipeline stages"
    if strategy_name in ("fsdp2", "merak3d_pp2_clipped"):
        return
    # the profiler's traced step: a PNG next to the trace, and a copy in the CSV logger's figures
    assert (tmp_path / "merak_trace.timeline.png").stat().st_size > 0
    assert list((tmp_path / strategy_name).glob("version_*/figures/profiler_step_timeline-step*.png"))
    trace = Trace.load(tmp_path / "merak_trace.json")
    bars, waits = step_bars(trace, trace.steps()[-1]), step_waits(trace, trace.steps()[-1])
    if strategy_name == "merak3d_pp2":  # each rank's bars are its stage's chunks, two micro-batches each way
        assert [sorted(s.name for s in row) for row in bars] == [
            sorted(f"stage {stage} {way} mb{mb}" for way in ("forward", "backward") for mb in (0, 1))
            for stage in (0, 1)]
    else:
        assert [[s.name for s in row] for row in bars] == [["training_step", "backward", "optimizer_step"]] * 2
    assert all(waits), "every rank waited for communication: a receive, or DDP's all-reduce"
    idle = idle_fraction(bars, waits)
    assert 0.0 < idle < 1.0 and idle > idle_fraction(bars, [[] for _ in bars])  # waits are not busy time


# Figures to every kind of logger --------------------------------------------------------------------------------


def _loggers(tmp_path: Path, kinds: tuple[str, ...]) -> list[Any]:
    made: list[Any] = []
    for kind in kinds:
        if kind == "csv":
            made.append(CSVLogger(tmp_path, name="csv"))
        elif kind == "tensorboard":
            made.append(TensorBoardLogger(tmp_path, name="tensorboard"))
        elif kind == "mlflow":
            from lightning.pytorch.loggers import MLFlowLogger
            made.append(MLFlowLogger(experiment_name="figures", tracking_uri=f"file:{tmp_path / 'mlruns'}"))
        else:
            from lightning.pytorch.loggers import WandbLogger
            made.append(WandbLogger(save_dir=str(tmp_path), offline=True, project="figures"))
    return made


def test_log_figure_reaches_every_kind_of_logger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the file store: no server, no database
    from lightning_merak.callbacks import log_figure
    from lightning_merak.callbacks.metrics import memory_figure

    loggers = _loggers(tmp_path, ("csv", "tensorboard", "mlflow", "wandb"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=loggers, enable_progress_bar=False)
    figure = memory_figure([1, 2], {0: [10.0, 12.0]}, {0: [9.0, 11.0]}, "host RSS")
    logged = log_figure(trainer, "memory/over_steps", figure, step=2)
    assert len(logged) == 4 and logged[0].endswith("memory_over_steps-step2.png")
    assert Path(logged[0]).stat().st_size > 0
    artifacts = Path(loggers[2].experiment.get_run(loggers[2].run_id).info.artifact_uri.removeprefix("file:"))
    assert (artifacts / "memory_over_steps-step2.png").stat().st_size > 0
    media = list((Path(loggers[3].experiment.dir) / "media" / "images").rglob("*.png"))
    assert media, "W&B kept no image"
    loggers[3].experiment.finish()


def test_moe_heatmap_and_delta_timeline_go_to_the_loggers(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_merak.callbacks.delta.ledger import TimelinePoint
    from lightning_merak.callbacks.delta.plot import save_timeline_plot
    from lightning_merak.callbacks.moe.placement import MoEPlacementCallback

    loggers = _loggers(tmp_path, ("csv", "tensorboard"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=loggers, enable_progress_bar=False)
    assert loggers[0].experiment is not None  # created, as a run's first logged step does
    moe = MoEPlacementCallback(heatmap_in_log_dir=True)
    moe.history = {0: ([[3, 1], [2, 2]], [[2, 2], [2, 2]]), 2: ([[4, 0]], [[2, 2]])}  # two layers, rank 0's
    moe.on_train_end(trainer, None)  # type: ignore[arg-type]
    csv_dir = Path(loggers[0].log_dir)
    assert (csv_dir / MoEPlacementCallback.HEATMAP_FILE).is_file()  # the PNG as before, in the first logger's dir
    assert [p.name for p in sorted((csv_dir / "figures").glob("*.png"))] == ["moe_load_heatmap_layer2-step0.png"]
    points = [TimelinePoint(t_s=0.001 * i, resident_bytes=i * 2**20, label=f"event {i}") for i in range(4)]
    path = save_timeline_plot(str(tmp_path / "delta.png"), {"managed": points}, 2 * 2**20, None, None, trainer)
    assert Path(path).is_file()
    assert list((csv_dir / "figures").glob("delta_memory_timeline-step0.png"))
    loggers[1].save()  # what the end of a run does: TensorBoard's writer flushes
    events = EventAccumulator(str(loggers[1].log_dir))
    events.Reload()
    assert {"moe/load_heatmap/layer0", "moe/load_heatmap/layer2", "delta/memory_timeline"} <= set(
        events.Tags()["images"])
