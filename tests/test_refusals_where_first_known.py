"""Refusals where the user's mistake is first known, and ``logger=[]`` as no logger:

- a sequence context parallelism cannot cut is refused on the first batch before any forward, at
  ``pipeline_parallel=1`` and ``tensor_parallel=1`` too;
- per-sample context-parallel degrees whose cost model needs longer samples than ``data.max_length`` allows are
  refused by ``merak-train`` before launch;
- EmbRace refuses a table whose class overrides the lookup (Gemma's scaled embedding) before launch from
  ``merak-train`` and, from Python, first thing in the callback's ``setup``, before any collective;
- ``logger=[]`` trains with no logger;
- the shared test module with a fixed optimizer.

Single process: ``merak-train`` runs in this process with ``Trainer.fit`` replaced, so no rank starts.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

import lightning_merak.cli.train as merak_train
from lightning_merak.callbacks.sparse_comm.callback import SparseCommunication
from lightning_merak.cli.checks import check_context_calibration
from lightning_merak.cli.config import register_configs
from lightning_merak.modules.config import DataConfig
from lightning_merak.parallel.context.rounds import calibration_lengths, short_calibration_problem
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments
from lightning_merak.strategies.merak3d.build import build_model
from lightning_merak.testing.causal_lm import FixedOptimizerModule

from .test_train import refused

TINY = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "data.num_sequences=64",
        "trainer.max_steps=2", "trainer.limit_val_batches=0", "trainer.val_check_interval=null"]
VOCAB = 64


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


def _refusal(overrides: list[str], run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> str:
    """The one line ``merak-train *overrides`` prints refusing the run before launch (exit 2, no traceback)."""
    code, output = refused(overrides, run_dir, monkeypatch, capsys)
    assert code == 2, output.out + output.err
    assert output.err.startswith("merak-train: error: ") and "Traceback" not in output.err, output.err
    return output.err


# 1. Context parallelism at one stage and one tensor-parallel rank: refused on the first batch, before any forward --

def test_an_unsplittable_sequence_at_pp1_tp1_is_refused_before_any_forward() -> None:
    model = _llama()
    forwards: list[int] = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    arguments = Merak3DArguments(context_parallel=2)
    groups = SimpleNamespace(layout=arguments.layout(2))  # data_parallel=2 = context_parallel: pp=1, tp=1
    assert (groups.layout.pipeline_parallel, groups.layout.tensor_parallel) == (1, 1)
    with pytest.raises(ValueError, match=r"^sequence length 30 is not divisible by 2 x context_parallel=2; pad to a "
                                         r"multiple of 4$"):
        build_model(model, torch.randint(VOCAB, (2, 30)), device=torch.device("cpu"), arguments=arguments,
                    groups=groups, global_rank=0, broadcast=lambda value, src: value,
                    verified_tp_degrees=frozenset())
    assert not forwards


# 2. Per-sample degrees: the cost model's samples against data.max_length, before launch ----------------------------

def test_the_calibration_floor_is_four_tokens_and_names_the_setting() -> None:
    assert short_calibration_problem(2, 4, "data.max_length") is None
    assert short_calibration_problem(2, 3, "data.max_length") == (
        "context_parallel_degree='per_micro_batch' measures its cost model on samples of three lengths, whole and "
        "split over context_parallel=2 ranks, the longest at least 4 tokens, but data.max_length=3 allows no longer "
        "sample; set strategy.micro_batching_cost to a fixed cost model instead, or raise data.max_length to at "
        "least 4")
    assert calibration_lengths(4096, 2, longest=12) == [4, 8, 12]
    assert calibration_lengths(4096, 2, longest=11) == [2, 5, 11]  # under three whole chunks: spread, padded
    with pytest.raises(ValueError, match="the longest sample the model and data allow has 3; set strategy"):
        calibration_lengths(4096, 2, longest=3)  # the same floor at the first step


def _context_rounds_run(max_length: int, cost: Any = None) -> tuple[SimpleNamespace, Merak3DStrategy]:
    strategy = Merak3DStrategy(context_parallel=4, context_parallel_degree="per_micro_batch",
                               micro_batching_cost=cost)
    config = SimpleNamespace(data=DataConfig(name="synthetic", lengths="variable", max_length=max_length),
                             strategy=SimpleNamespace(strategy_kwargs=lambda: {"context_parallel": 4}))
    return config, strategy


def test_the_launch_check_refuses_only_what_the_first_step_would() -> None:
    with pytest.raises(ValueError, match=r"data.max_length=3 allows no longer sample; .* at least 4$"):
        check_context_calibration(*_context_rounds_run(3))
    check_context_calibration(*_context_rounds_run(4))
    check_context_calibration(*_context_rounds_run(23))  # under 6 x context_parallel=4: measured on spread lengths
    check_context_calibration(*_context_rounds_run(3, cost=(1e-6, 1e-9, 1e-3)))  # a fixed cost: nothing measured
    fixed = SimpleNamespace(data=DataConfig(name="synthetic", seq_len=8), strategy=None)
    check_context_calibration(fixed, Merak3DStrategy(context_parallel=2))  # no per-sample degrees
    with pytest.raises(ValueError, match="but data.lengths=fixed yields blocks of data.seq_len tokens: set "
                                         "data.lengths=variable"):
        check_context_calibration(fixed, Merak3DStrategy(context_parallel=2, context_parallel_degree="per_micro_batch"))


def test_merak_train_refuses_a_max_length_too_short_to_measure_before_launch(tmp_path: Path, monkeypatch,
                                                                             capsys) -> None:
    error = _refusal([*TINY, "data.batch_size=4", "data.lengths=variable", "data.max_length=3",
                      "strategy.context_parallel=2", "strategy.context_parallel_degree=per_micro_batch"],
                     tmp_path, monkeypatch, capsys)
    assert ("but data.max_length=3 allows no longer sample; set strategy.micro_batching_cost to a fixed cost model "
            "instead, or raise data.max_length to at least 4") in error


def test_merak_train_refuses_fixed_length_data_for_per_sample_degrees_before_launch(tmp_path: Path, monkeypatch,
                                                                                     capsys) -> None:
    error = _refusal([*TINY, "data.batch_size=4", "data.seq_len=8", "strategy.context_parallel=2",
                      "strategy.context_parallel_degree=per_micro_batch"], tmp_path, monkeypatch, capsys)
    assert ("data.lengths=fixed yields blocks of data.seq_len tokens: set data.lengths=variable (samples of up to "
            "data.max_length tokens), or strategy.context_parallel_degree=fixed") in error


# 3. EmbRace and an embedding whose class changes the lookup --------------------------------------------------------

class _ScaledEmbeddingModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Gemma2TextScaledWordEmbedding(VOCAB, 8, padding_idx=0, embed_scale=8**0.5)


SCALED = r"cannot shard embed \(.*Gemma2TextScaledWordEmbedding\): its class overrides nn\.Embedding\.forward"


def test_embrace_refuses_at_setup_before_any_collective() -> None:
    comm = SparseCommunication("embrace", min_table_rows=VOCAB, bandwidth_gbit=1.0)
    comm.check_tables(nn.Module())  # nothing to shard: nothing refused
    trainer = SimpleNamespace(strategy=DDPStrategy(), world_size=2)
    assert not dist.is_initialized()  # any group or broadcast before the check would fail here
    with pytest.raises(ValueError, match=SCALED + r".*method='s2' \(merak-train: comm=s2\)"):
        comm.setup(trainer, _ScaledEmbeddingModule(), "fit")
    assert not comm.sharded_tables
    SparseCommunication("s2", min_table_rows=VOCAB).check_tables(_ScaledEmbeddingModule())  # S2 keeps the lookup


GEMMA2 = ["model=hf", "model.model_type=gemma2", "+model.config={hidden_size:32,intermediate_size:64,"
          "num_hidden_layers:1,num_attention_heads:4,num_key_value_heads:2,head_dim:8}", "comm=embrace",
          "comm.min_table_rows=256", "trainer.max_steps=1"]


@pytest.mark.parametrize("strategy", ["strategy=merak3d", "strategy=ddp"])
def test_merak_train_refuses_embrace_on_a_scaled_embedding_before_launch(strategy: str, tmp_path: Path, monkeypatch,
                                                                         capsys) -> None:
    error = _refusal([*GEMMA2, strategy], tmp_path, monkeypatch, capsys)
    assert "EmbRace cannot shard model.model.embed_tokens (transformers.models.gemma2.modeling_gemma2." \
           "Gemma2TextScaledWordEmbedding): its class overrides nn.Embedding.forward" in error
    assert "use method='s2' (merak-train: comm=s2)" in error


# 4. logger=[]: no logger ------------------------------------------------------------------------------------------

def test_an_empty_logger_list_trains_with_no_logger(tmp_path: Path, monkeypatch) -> None:
    prepared: list[merak_train.PreparedRun] = []
    monkeypatch.setattr(merak_train, "fit", lambda run, prelaunched=None: prepared.append(run))
    monkeypatch.setattr(merak_train, "prelaunch_local_ranks", lambda devices, num_nodes: None)
    monkeypatch.setattr("sys.argv", ["merak-train", *TINY, "logger=[]", "trainer.devices=1",
                                     f"hydra.run.dir={tmp_path}"])
    register_configs()
    merak_train.run_command_line()
    (run,) = prepared
    assert run.trainer.loggers == [] and run.trainer.logger is None
    assert not any(isinstance(callback, LearningRateMonitor) for callback in run.trainer.callbacks)
    final = tmp_path / "checkpoints" / "final.ckpt"
    final.parent.mkdir()
    final.write_bytes(b"")
    from lightning_merak.cli.outputs import outputs

    assert outputs(run.trainer, final) == [f"checkpoint: {final}"]  # the done line: no metrics files


# 5. The shared module with a fixed optimizer ----------------------------------------------------------------------

def test_the_fixed_optimizer_module_steps_its_trainable_parameters_at_one_rate() -> None:
    model = _llama()
    model.get_input_embeddings().weight.requires_grad_(False)
    trainable = [param for param in model.parameters() if param.requires_grad]
    sgd = FixedOptimizerModule(model).configure_optimizers()
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["lr"] == 0.5
    assert sgd.param_groups[0]["params"] == trainable
    adam = FixedOptimizerModule(model, optimizer="adam").configure_optimizers()
    assert type(adam) is torch.optim.Adam and adam.param_groups[0]["lr"] == 0.01
    assert FixedOptimizerModule(model, lr=0.1).configure_optimizers().param_groups[0]["lr"] == 0.1
    with pytest.raises(ValueError, match=r"optimizer='lbfgs'; choose one of sgd, adam"):
        FixedOptimizerModule(model, optimizer="lbfgs")


# 6. A uniform partition with more stages than blocks: before launch ------------------------------------------------

def test_a_uniform_partition_with_more_stages_than_blocks_is_refused_before_launch() -> None:
    model = _llama()  # one decoder layer
    with pytest.raises(ValueError, match=r"^partition='uniform' puts a transformer block on every stage, but 2 "
                                         r"pipeline stages .* exceed the model's 1 blocks; use at most 1 stages, or "
                                         r"partition='autopipe'$"):
        Merak3DArguments(pipeline_parallel=2, partition="uniform").check_model(model, 2, 1)
    Merak3DArguments(pipeline_parallel=2).check_model(model, 2, 1)  # AutoPipe cuts the embedding and head apart
