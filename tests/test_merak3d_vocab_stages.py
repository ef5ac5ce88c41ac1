"""The LM head split by vocabulary rows over the pipeline ranks (``vocab_stages``) against one process: per-step
losses, every gradient, and the exported checkpoint's head; what it refuses, before any work."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file

from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.pipeline.trace import trace_model
from lightning_merak.parallel.pipeline.vocab_stages import HeadShape, vocab_stages_config_problem, vocab_stages_problem
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import assert_traces_match, merge_rank_traces, record_reference_trace, run_distributed
from lightning_merak.testing.causal_lm import FixedOptimizerModule
from lightning_merak.testing.compare import LayoutTraceRecorder, TrainingTrace
from lightning_merak.testing.data import ReplicaBatches
from lightning_merak.util.row_shards import row_shard_range

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 1024
"""A vocabulary of 1024 rows at width 32: the head holds more parameters than the four blocks together."""


def _config(tied: bool = False) -> ModelConfig:
    return ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": tied})


def _batches() -> torch.Tensor:
    return torch.randint(VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(5))


def _module(on_meta: bool = False, tied: bool = False, frozen: bool = False) -> FixedOptimizerModule:
    """The test model; ``on_meta``: built in ``configure_model()`` (on the meta device under merak3d); ``tied``:
    one weight for the input embedding and the LM head; ``frozen``: both tables frozen (as adapters leave them)."""
    torch.manual_seed(0)

    def build() -> torch.nn.Module:
        model = build_causal_lm(_config(tied), vocab_size=VOCAB)
        model.config.use_cache = False
        if frozen:
            model.get_input_embeddings().weight.requires_grad_(False)
            model.get_output_embeddings().weight.requires_grad_(False)
        return model

    return FixedOptimizerModule(None, model_factory=build) if on_meta else FixedOptimizerModule(build())


def _evaluated(module: CausalLMModule, replicas: int) -> tuple[float, torch.Tensor]:
    """An evaluation loss and the logits of ``predict`` on the first batch's first rows, after training."""
    batch = _batches()[0][:BATCH // replicas]
    module.eval()
    with torch.no_grad():
        return float(module.compute_loss((batch,))), module(batch)


def _reference(tied: bool = False, frozen: bool = False
               ) -> tuple[TrainingTrace, dict[str, torch.Tensor], FixedOptimizerModule]:
    module = _module(tied=tied, frozen=frozen)
    trace = record_reference_trace(module.model, [(batch,) for batch in _batches()],
                                   lambda model, batch: module.compute_loss(batch),
                                   torch.optim.SGD(module.model.parameters(), lr=0.5))
    return trace, {name: param.detach().clone() for name, param in module.model.named_parameters()}, module


def _train_rank(rank: int, world_size: int, layout: dict, save_to: str | None, on_meta: bool, first_step: int = 0,
                last_step: int = STEPS, resume_from: str | None = None, tied: bool = False,
                frozen: bool = False) -> tuple:
    recorder = LayoutTraceRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
        max_epochs=1 if resume_from is None else 2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder])
    module = _module(on_meta, tied, frozen)
    trainer.fit(module, datamodule=ReplicaBatches(_batches(), first_step, last_step), ckpt_path=resume_from)
    stages = module.model  # the rows live in the last stage's model (its first stage's, for the embedding)
    head = next(part for part in reversed(stages) if type(part.net.lm_head).__name__ == "VocabularySlice").net.lm_head
    tp = layout.get("tensor_parallel", 1)  # rows split over the pipeline x tensor-parallel ranks, stage-major
    rows = row_shard_range(VOCAB, layout["pipeline_parallel"] * tp,
                           trainer.strategy.pipeline_rank * tp + trainer.strategy.groups.tensor_rank)
    assert (head.start, head.end) == rows
    if "zero_bubble" in layout.get("schedule", "1f1b"):  # its weight pass misses looked-up rows: the table stays
        assert all(type(part.net.model.embed_tokens).__name__ != "EmbeddingRows" for part in stages)
        if save_to is not None:
            trainer.save_checkpoint(save_to)
        return recorder.losses, recorder.gradients, _evaluated(module, layout["data_parallel"])
    embedding = next(part for part in stages
                     if type(part.net.model.embed_tokens).__name__ == "EmbeddingRows").net.model.embed_tokens
    assert type(embedding).__name__ == "EmbeddingRows"
    assert (head.weight is embedding.weight) == tied
    assert not frozen or not (head.weight.requires_grad or embedding.weight.requires_grad)
    assert (embedding.start, embedding.end) == rows
    assert embedding.weight.to_local().shape == (rows[1] - rows[0], 32)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return recorder.losses, recorder.gradients, _evaluated(module, layout["data_parallel"])


@pytest.mark.distributed
@pytest.mark.parametrize("stages,replicas,schedule,on_meta,tied,frozen,tp,sharding,cp",
                         [(2, 1, "gpipe", True, False, True, 1, "none", 1),
                          (4, 1, "1f1b", False, True, False, 1, "none", 1),
                          (2, 2, "interleaved_1f1b", False, False, False, 1, "none", 1),
                          (2, 1, "1f1b", False, True, False, 2, "none", 1),
                          (2, 2, "1f1b", False, True, False, 1, "full", 1),
                          (2, 2, "1f1b", False, True, False, 1, "optimizer", 1),  # gathers overlap lookups
                          (2, 1, "interleaved_zero_bubble", False, False, False, 1, "none", 1),
                          (4, 1, "shifted_critical_path", False, True, False, 1, "none", 1),
                          (2, 1, "1f1b", False, True, False, 1, "none", 2),
                          (2, 1, "interleaved_1f1b", False, False, False, 1, "none", 2),
                          (2, 1, "1f1b", False, True, False, 2, "none", 2)])
def test_split_head_matches_single_process(tmp_path, stages: int, replicas: int, schedule: str, on_meta: bool,
                                           tied: bool, frozen: bool, tp: int, sharding: str, cp: int):
    """Loss and every gradient (the head's and the embedding's rows gathered; tied, one weight; frozen, none)
    equal one process's at each step, and so do an evaluation loss and predict's logits afterwards; the checkpoint
    holds the head and the embedding whole under their own names, and the Hugging Face export writes them as the
    trained model's."""
    from lightning_merak.hf.export import export_checkpoint

    layout = {"data_parallel": replicas, "pipeline_parallel": stages, "tensor_parallel": tp, "micro_batches": 4,
              "schedule": schedule, "vocab_stages": "on", "data_parallel_sharding": sharding, "context_parallel": cp,
              "sequence_parallel": tp > 1,  # the blocks' sequence split gathers before the split head
              "virtual_stages": 2 if schedule.startswith("interleaved") else 1}
    checkpoint = str(tmp_path / "split.ckpt")
    results = run_distributed(_train_rank, stages * replicas * tp * cp, args=(layout, checkpoint, on_meta),
                              kwargs={"tied": tied, "frozen": frozen}, timeout_s=300)
    expected, trained, reference = _reference(tied, frozen)
    assert_traces_match(expected, merge_rank_traces([(losses, grads) for losses, grads, _ in results]),
                        check_gradients=sharding != "optimizer")  # ZeRO-1 keeps only its slices' gradients
    loss, logits = _evaluated(reference, replicas)
    for _, _, (rank_loss, rank_logits) in results:
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        torch.testing.assert_close(rank_logits, logits, rtol=1e-5, atol=1e-5)
    export_checkpoint(checkpoint, tmp_path / "hf")
    exported = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(shard))
    assert exported["model.embed_tokens.weight"].shape == (VOCAB, 32)
    for name in ("model.norm.weight", "model.embed_tokens.weight") + (() if tied else ("lm_head.weight",)):
        torch.testing.assert_close(exported[name], trained[name], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_split_vocabulary_resumes_across_a_change_of_pipeline_degree(tmp_path):
    """Saved after an epoch of two steps with the head and the embedding split over two stages, resumed split over
    four: the loss of the third step is one process's (each rank reads its rows back from the unsplit tables the
    checkpoint holds)."""
    layout = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1, "micro_batches": 4,
              "vocab_stages": "on"}
    checkpoint = str(tmp_path / "epoch0.ckpt")
    run_distributed(_train_rank, 2, args=(layout, checkpoint, False), kwargs={"last_step": 2}, timeout_s=300)
    resumed = run_distributed(_train_rank, 4, args=({**layout, "pipeline_parallel": 4}, None, False), timeout_s=300,
                              kwargs={"first_step": 2, "resume_from": checkpoint})
    assert resumed[0][0] == pytest.approx(_reference()[0].losses[2:], rel=1e-5)


def test_vocab_stages_refuses_before_work():
    with pytest.raises(ValueError, match="choose 'off', 'on' or 'auto'"):
        Merak3DStrategy(pipeline_parallel=2, vocab_stages="yes")
    torch.manual_seed(0)
    tied = build_causal_lm(_config(tied=True), vocab_size=64)
    tied.config.use_cache = False
    trace = trace_model(tied, torch.randint(64, (2, 8)), profile=False)
    assert vocab_stages_problem(tied, trace, schedule="1f1b") is None
    tied.model.embed_tokens.max_norm = 1.0  # a lookup that rewrites the rows it reads
    problem = vocab_stages_problem(tied, trace, schedule="1f1b")
    assert problem is not None and "tied to the input embedding" in problem and "max_norm" in problem


def test_an_embedding_that_computes_more_than_a_lookup_stays_on_the_first_stage():
    from lightning_merak.strategies.merak3d.vocab_stages_build import splittable_embedding

    class ScaledEmbedding(torch.nn.Embedding):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return super().forward(input_ids) * 2.0

    model = build_causal_lm(_config(), vocab_size=64)
    model.config.use_cache = False
    trace = trace_model(model, torch.randint(64, (2, 8)), profile=False)
    head = HeadShape("lm_head", 64, 32, False, torch.float32)
    assert splittable_embedding(model, trace, head) == "model.embed_tokens"
    model.model.embed_tokens = ScaledEmbedding(64, 32)
    assert splittable_embedding(model, trace, head) is None


def _scatter_rank(rank: int, world_size: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    from lightning_merak.parallel.pipeline.row_scatter import scatter_rows

    table = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    bias = torch.arange(10, dtype=torch.float32)
    source = world_size - 1
    group = dist.group.WORLD
    return [scatter_rows(table if rank == source else None, 10, (3,), torch.float32, torch.device("cpu"), group,
                         source),
            scatter_rows(bias if rank == source else None, 10, (), torch.float32, torch.device("cpu"), group, source)]


@pytest.mark.distributed
def test_each_rank_receives_only_its_rows_of_a_table_split_unevenly():
    """10 rows over 4 ranks: 3, 3, 3 and the last rank's 1 (its share padded on the wire), matrices and vectors."""
    table = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    results = run_distributed(_scatter_rank, 4, timeout_s=120)
    for rank, (rows, bias) in enumerate(results):
        start, end = row_shard_range(10, 4, rank)
        torch.testing.assert_close(rows, table[start:end], rtol=0, atol=0)
        torch.testing.assert_close(bias, torch.arange(10, dtype=torch.float32)[start:end], rtol=0, atol=0)
    assert [len(rows) for rows, _ in results] == [3, 3, 3, 1]


def _embedding_rows_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_merak.parallel.pipeline.embedding_stages import EmbeddingExchange, EmbeddingRows

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("pp",))
    table = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)
    weight = torch.nn.Parameter(DTensor.from_local(table.clone(), mesh, [Shard(0)], run_check=False))
    rows = EmbeddingRows(weight, padding_idx=0)
    exchange = EmbeddingExchange(rows, dist.group.WORLD, 0, True, torch.device("cpu"))
    ids = torch.tensor([[0, 3, 3, 7]])
    exchange.begin(ids, backward=True)
    looked_up = rows(ids)
    looked_up.sum().backward()
    outside = None
    try:
        rows(torch.tensor([[5]]))
    except RuntimeError as error:
        outside = str(error)
    exchange.end(backward=True)
    return {"looked_up": looked_up.detach(), "grad": weight.grad.to_local().clone(), "outside": outside,
            "cleared": rows.table is None and rows.tokens is None}


@pytest.mark.distributed
def test_the_split_embedding_looks_up_the_steps_rows_and_returns_their_gradient():
    """One rank's exchange: lookups equal the table's rows, a token outside the step's batch is refused, and the
    gradient counts each occurrence, the padding row excepted (nn.Embedding's padding_idx)."""
    (result,) = run_distributed(_embedding_rows_rank, 1, timeout_s=120)
    table = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)
    torch.testing.assert_close(result["looked_up"], table[torch.tensor([[0, 3, 3, 7]])])
    expected = torch.zeros(10, 4)
    expected[3], expected[7] = 2.0, 1.0  # row 0 is the padding row: no gradient
    torch.testing.assert_close(result["grad"], expected)
    assert "outside the step's batch" in result["outside"]
    assert result["cleared"]


def _lora_head_rank(rank: int, world_size: int, layout: dict, save_to: str, steps: int) -> tuple:
    """LoRA on q_proj, v_proj and the LM head, built on meta, trained ``steps`` steps of SGD in ``layout`` with the
    head split; this rank's trace, and an evaluation loss and predict's logits afterwards."""
    from tests.test_adapters_meta import _MetaAdapterModule, _weights
    from tests.test_merak3d import _batches as adapter_batches
    from tests.test_merak3d import _Recorder, _ShardedData

    module = _MetaAdapterModule("lora-lm-head-fp32", _weights("lora-lm-head-fp32"))
    module.optimizer_kind = "sgd"
    recorder = _Recorder([])
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[recorder])
    trainer.fit(module, datamodule=_ShardedData(0, steps))
    head = next(part for part in reversed(module.model) if hasattr(part.net.base_model.model.lm_head, "lora"))
    assert type(head.net.base_model.model.lm_head).__name__ == "LoRAHeadRows"
    trainer.save_checkpoint(save_to)
    module.eval()
    batch = adapter_batches()[0]
    with torch.no_grad():
        evaluated = float(module.compute_loss((batch,))), module(batch)
    return (recorder.losses, recorder.gradients), evaluated


@pytest.mark.distributed
def test_lora_on_the_split_head_trains_and_exports_like_one_process(tmp_path):
    """LoRA on q_proj, v_proj and the LM head, the head (its base and lora_B rows) split over two stages of two
    replicas fully sharded (FSDP2 leaves the frozen rows and the head's factors to the split), built on meta: loss
    and every adapter gradient (the head's lora_A and lora_B included) equal one process's over three steps of SGD
    (Adam turns the split softmax's summation order into larger drift), and so do an evaluation loss and predict's
    logits afterwards; the checkpoint exports the unsplit factors: ``--adapter-only`` as the trained PEFT model
    saves it (the head's factors and base weight), ``--merge-adapters`` as it merges."""
    from peft.utils import get_peft_model_state_dict

    from lightning_merak.hf.export import export_adapter, export_checkpoint
    from tests.test_adapters_meta import PP2
    from tests.test_adapters_meta import _reference as adapter_reference
    from tests.test_merak3d import _batches as adapter_batches
    from tests.test_merak3d import _TestModule

    steps, checkpoint = 3, str(tmp_path / "lora.ckpt")
    layout = {**PP2, "data_parallel": 2, "data_parallel_sharding": "full", "vocab_stages": "on"}
    results = run_distributed(_lora_head_rank, 4, args=(layout, checkpoint, steps), timeout_s=300)
    expected, trained = adapter_reference("lora-lm-head-fp32", steps=steps, optimizer="sgd")
    assert {"base_model.model.lm_head.lora_A.default.weight",
            "base_model.model.lm_head.lora_B.default.weight"} <= set(expected.gradients[0])
    assert_traces_match(expected, merge_rank_traces([trace for trace, _ in results]))
    reference = _TestModule(trained).eval()
    batch = adapter_batches()[0]
    with torch.no_grad():
        loss, logits = float(reference.compute_loss((batch,))), reference(batch)
    for _, (rank_loss, rank_logits) in results:
        assert rank_loss == pytest.approx(loss, rel=1e-5)
        torch.testing.assert_close(rank_logits, logits, rtol=1e-5, atol=1e-5)
    export_adapter(checkpoint, tmp_path / "adapter")
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    adapter = get_peft_model_state_dict(trained)  # the head's factors and, as PEFT writes them, its base weight
    assert sorted(exported) == sorted(adapter) and "base_model.model.lm_head.lora_B.weight" in adapter
    assert "base_model.model.lm_head.base_layer.weight" in adapter
    for name, value in adapter.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-6, msg=name)
    export_checkpoint(checkpoint, tmp_path / "hf", merge_adapters=True)
    merged = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        merged.update(load_file(shard))
    torch.testing.assert_close(merged["lm_head.weight"], trained.merge_and_unload().state_dict()["lm_head.weight"],
                               rtol=1e-5, atol=1e-6)


def test_vocab_stages_refuses_other_adapters_on_the_head_before_work():
    """Q-BaRA and DoRA on the LM head cannot split by vocabulary rows, nor LoRA with dropout at tensor_parallel>1:
    refused with the fix, no process started; plain LoRA splits."""
    from peft import LoraConfig, get_peft_model

    from lightning_merak.cli.options.adapter import QBaRAAdapterConfig, Quantization
    from lightning_merak.parallel.pipeline.head_adapters import HeadLoRA, head_lora_layout_problem

    def problem(adapt) -> str | None:
        torch.manual_seed(0)
        model = build_causal_lm(_config(), vocab_size=64)
        model.config.use_cache = False
        model = adapt(model)
        trace = trace_model(model, torch.randint(64, (2, 8)), profile=False)
        return vocab_stages_problem(model, trace, schedule="1f1b")

    targets = ["q_proj", "lm_head"]
    assert problem(lambda model: get_peft_model(model, LoraConfig(r=4, target_modules=targets))) is None
    fix = "set vocab_stages='off' or leave the LM head out of the adapter's target_modules"
    qbara = problem(QBaRAAdapterConfig(r=2, quantization=Quantization.none, target_modules=targets).apply)
    assert qbara is not None and "plain LoRA" in qbara and fix in qbara, qbara
    dora = problem(lambda model: get_peft_model(model, LoraConfig(r=4, target_modules=targets, use_dora=True)))
    assert dora is not None and "DoRA" in dora and fix in dora, dora
    dropout = HeadLoRA("default", 4, 2.0, dropout=0.1)
    assert head_lora_layout_problem(dropout, tensor_parallel=1) is None
    assert "tensor_parallel=1" in head_lora_layout_problem(dropout, tensor_parallel=2)
    # the check before launch finds the same without a trace
    lora_dropout = get_peft_model(build_causal_lm(_config(), vocab_size=64),
                                  LoraConfig(r=4, target_modules=targets, lora_dropout=0.1))
    assert vocab_stages_config_problem(lora_dropout, "1f1b", tensor_parallel=1) is None
    assert "tensor_parallel=1" in vocab_stages_config_problem(lora_dropout, "1f1b", tensor_parallel=2)
    qbara_model = QBaRAAdapterConfig(r=2, quantization=Quantization.none, target_modules=targets).apply(
        build_causal_lm(_config(), vocab_size=64))
    assert fix in vocab_stages_config_problem(qbara_model, "1f1b")


def _rows_check_rank(rank: int, world_size: int, writes: list[bool]) -> str:
    """Rows allocated for a loader on two ranks, the loader writing them on the ranks ``writes`` says: the check
    passes where every rank's were written, and is refused on every rank otherwise."""
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_merak.parallel.pipeline.vocab_stages import VocabularyExchange, VocabularySlice
    from lightning_merak.strategies.merak3d.vocab_stages_build import check_rows_loaded

    mesh = init_device_mesh("cpu", (world_size,))
    head = VocabularySlice(torch.empty(4, 8), None, 8, mesh)
    stages = SimpleNamespace(vocabulary=VocabularyExchange(head, mesh.get_group(), 0, rank == 1, torch.device("cpu")),
                             embedding=None)

    def load() -> None:
        if writes[rank]:
            with torch.no_grad():  # as the loader writes
                head.weight.to_local().copy_(torch.ones(4, 8))

    try:
        check_rows_loaded(stages, load)
    except ValueError as refused:
        return str(refused)
    return "loaded"


@pytest.mark.distributed
def test_rows_a_loader_left_unwritten_are_refused_on_every_rank():
    assert run_distributed(_rows_check_rank, 2, args=([True, True],), timeout_s=60) == ["loaded", "loaded"]
    refusals = run_distributed(_rows_check_rank, 2, args=([True, False],), timeout_s=60)
    assert all("set vocab_stages='off'" in refusal for refusal in refusals)


def test_merak_train_refuses_qbara_on_the_split_head_before_launch(tmp_path, monkeypatch, capsys):
    """Q-BaRA on the LM head under vocab_stages='on': refused with the fix before any rank starts (the build's
    check, made before launch)."""
    from .test_cli_late_refusals import TINY, _refusal

    error = _refusal([*TINY, "strategy.pipeline_parallel=2", "strategy.vocab_stages=on", "adapter=qbara",
                      "adapter.quantization=none", "adapter.target_modules=[q_proj,lm_head]"], tmp_path, monkeypatch,
                     capsys)
    assert "vocab_stages splits plain LoRA on the LM head, not QBaRALinear" in error, error
    assert "leave the LM head out of the adapter's target_modules" in error, error
