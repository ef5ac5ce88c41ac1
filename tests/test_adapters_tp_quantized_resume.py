"""A checkpoint of a base quantised per tensor-parallel shard resumed at another tensor-parallel degree.

Each shard is its slice of the whole layer's quantisation, so the shards joined are the whole layer's codes and
statistics, and the whole cut by another degree's split is each of that degree's shards as quantising it alone gives
them, bit for bit (:func:`~lightning_merak.adapters.shard_join.cut_quantized_whole`). A resume at any degree reads
every shard, joins them, and once the model is split requires each rank's rebuilt shard to equal its cut of the whole
(:class:`~lightning_merak.parallel.materialize.RestoreAfterRewrite`); a ``tensor_parallel=1`` checkpoint is cut the
same way.
"""

from __future__ import annotations

from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_merak.adapters.quantize import quantized_shard
from lightning_merak.adapters.shard_join import cut_quantized_whole, join_quantized_shards
from lightning_merak.parallel.materialize import RestoreAfterRewrite
from lightning_merak.parallel.tensor.quantized_shards import QuantizedShard
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import TrainingTrace, assert_traces_match, merge_rank_traces, run_distributed
from tests import test_adapters_meta as adapters_meta
from tests.test_adapters_meta import _MetaAdapterModule, _reference, _weights
from tests.test_adapters_tp_quantized import _linear, _wide_base
from tests.test_merak3d import STEPS, _Recorder, _ShardedData


def test_a_rank_cuts_its_entries_of_the_whole_layer_by_the_split():
    """By hand, a 4x8 INT4 layer (two codes a byte, a scale per group of four): a row layer's rank 1 takes the right
    half of every row, a reordered column layer's rank its rows, a contiguous one its run of the flat entries; a group
    wider than the shard's columns is refused naming the group size."""
    whole = {"qweight": torch.arange(16).reshape(4, 4), "scales": torch.arange(8.0).reshape(4, 2)}
    row = cut_quantized_whole("int4", {"dim": 1, "degree": 2, "shape": [4, 8], "rows": None}, 1, whole)
    assert row["qweight"].tolist() == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert row["scales"].tolist() == [[1.0], [3.0], [5.0], [7.0]]
    reordered = cut_quantized_whole("int4", {"dim": 0, "degree": 2, "shape": [4, 8], "rows": [[0, 2], [1, 3]]}, 1,
                                    whole)
    assert reordered["qweight"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert reordered["scales"].tolist() == [[2.0, 3.0], [6.0, 7.0]]
    absmax = {"weight.absmax": torch.arange(8.0)}  # a 4-bit statistic, one entry per 4 weights of the flat weight
    column = cut_quantized_whole("nf4", {"dim": 0, "degree": 4, "shape": [4, 8], "rows": None}, 2, absmax)
    assert column["weight.absmax"].tolist() == [4.0, 5.0]
    with pytest.raises(ValueError, match="an entry per 8 weights, which straddle this run's shards of 4x4; resume "
                                         "with the quantization and group_size of the run that wrote it"):
        cut_quantized_whole("int4", {"dim": 1, "degree": 2, "shape": [4, 8], "rows": None}, 0,
                            {"scales": torch.ones(4, 1)})


@pytest.mark.parametrize("quantization", ["nf4", "fp4", "int4", "int8"])
def test_the_whole_layers_quantisation_cut_by_any_degree_is_that_degrees_shards(quantization):
    """Column shards, row shards, reordered rows and rows shared by two ranks, at tp 2 and 4: the whole layer's codes
    and statistics cut for each rank equal that rank's shard quantised alone, every tensor bit for bit; joined again
    at one degree and cut at the other, the shards of either degree come back."""
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    whole = quantized_shard(_linear(weight), quantization, double_quant=False).state_dict()
    absmax = weight.to(torch.float16).abs().amax(1).float()
    splits = {}
    for tp in (2, 4):
        units = [[*range(r * 64 // tp, (r + 1) * 64 // tp), *range(64 + r * 64 // tp, 64 + (r + 1) * 64 // tp)]
                 for r in range(tp)]  # a fused projection of two units of 64 rows, each rank its part of both
        splits[tp] = [({"dim": 0, "rows": None}, list(weight.chunk(tp, 0)), None),
                      ({"dim": 1, "rows": None}, list(weight.chunk(tp, 1)), lambda local: absmax),
                      ({"dim": 0, "rows": units}, [weight[part] for part in units], None)]
    shared = [list(range(0, 64))] * 2 + [list(range(64, 128))] * 2  # more ranks than key/value heads
    splits[4].append(({"dim": 0, "rows": shared}, [weight[part] for part in shared], None))
    shards = {}
    for tp, cases in splits.items():
        for role, (split, parts, whole_row_absmax) in enumerate(cases):
            split = {**split, "degree": tp, "shape": [128, 256]}
            own = [quantized_shard(_linear(part), quantization, double_quant=False,
                                   whole_row_absmax=whole_row_absmax).state_dict() for part in parts]
            shards[tp, role] = split, own
            for rank, expected in enumerate(own):
                cut = cut_quantized_whole(quantization, split, rank, whole)
                assert sorted(cut) == sorted(expected)
                for name, tensor in expected.items():
                    assert cut[name].dtype == tensor.dtype and torch.equal(cut[name], tensor), (tp, role, rank, name)
    for role in range(3):  # saved at one degree, resumed at the other
        for saved, resumed in ((2, 4), (4, 2)):
            joined = join_quantized_shards(quantization, *shards[saved, role])
            split, expected = shards[resumed, role]
            for rank, shard in enumerate(expected):
                cut = cut_quantized_whole(quantization, split, rank, joined)
                assert all(torch.equal(cut[name], tensor) for name, tensor in shard.items()), (saved, resumed, role)


def test_a_resume_cuts_this_ranks_shard_from_the_whole_layer_and_requires_the_rebuilt_one_to_equal_it():
    """The checkpoint holds the whole layer's INT4 (written at tensor_parallel=1, or its shards joined): rank 1 of 4
    of a row layer cuts its codes, scales and zeros from it and takes the adapter; a base quantised from other
    weights is refused."""
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.02
    whole = {f"q.base_layer.{name}": tensor for name, tensor in
             quantized_shard(_linear(weight), "int4", group_size=32).state_dict().items()}
    shard = QuantizedShard("q.base_layer", "int4", 1, {"dim": 1, "degree": 4, "shape": [64, 128], "rows": None})
    rebuilt = {f"{shard.prefix}{name}": nn.Parameter(tensor, requires_grad=False) for name, tensor in
               quantized_shard(_linear(weight[:, 32:64]), "int4", group_size=32).state_dict().items()}
    adapter = nn.Parameter(torch.zeros(2, 32))
    RestoreAfterRewrite(None, {**whole, "q.lora_A": torch.ones(2, 32)}).restore(
        {**rebuilt, "q.lora_A": adapter}, {}, [shard])
    assert torch.equal(adapter.detach(), torch.ones(2, 32))
    other = {**whole, "q.base_layer.zeros": whole["q.base_layer.zeros"] + 1}
    with pytest.raises(ValueError, match=r"q.base_layer.shard_tp1of4.zeros is frozen but differs"):
        RestoreAfterRewrite(None, {**other, "q.lora_A": torch.ones(2, 32)}).restore(
            {**rebuilt, "q.lora_A": adapter}, {}, [shard])
    with pytest.raises(ValueError, match="q.base_layer.shard_tp1of4.qweight is this rank's tensor-parallel shard "
                                         "of a quantised base, which the checkpoint holds neither as this shard nor "
                                         "whole"):
        RestoreAfterRewrite(None, {"q.lora_A": torch.ones(2, 32)}).restore({**rebuilt, "q.lora_A": adapter}, {},
                                                                           [shard])


def test_a_double_quantised_base_is_refused_before_it_is_read_by_a_run_that_does_not_double_quantise():
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    from lightning_merak.checkpoint.rewritten import saved_storage_where_rewritten

    layer = "q.base_layer"
    metadata = Metadata({f"model.{layer}.{name}": TensorStorageMetadata(TensorProperties(dtype=torch.uint8),
                                                                        torch.Size(size), [])
                         for name, size in (("weight", (512, 1)), ("weight.absmax", (16,)),
                                            ("weight.nested_absmax", (1,)))})
    state = {f"{layer}.weight": torch.empty(32, 32)}
    saved_storage_where_rewritten(state, metadata, (0, 2), None, double_quant=True)
    assert state[f"{layer}.weight"].shape == (512, 1)
    with pytest.raises(ValueError, match=r"q.base_layer's base double-quantised .* which this run does not "
                                         r"\(adapter.double_quant=false, as tensor_parallel>1 needs\); resume it at "
                                         "tensor_parallel=1 with adapter.double_quant=true"):
        saved_storage_where_rewritten({f"{layer}.weight": torch.empty(32, 32)}, metadata, (0, 2), None,
                                      double_quant=False)


# (option, layout, first step, last step, checkpoint saved, checkpoint resumed) on four ranks: QA-HiRA on INT4 saved
# at tp4 and at dp2 x tp2 after 3 steps, each resumed at the other degree (tp4's key/value rows shared by two ranks),
# the tp4 one at pp2 x tp2 too; QLoRA on NF4 saved at tensor_parallel=1 (dp4), resumed at dp2 x tp2. Each resumed
# layout also runs from the start, for its shards.
RESUMED_AT = 3
TP4 = {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 4}
DP2TP2 = {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 2}
PP2TP2 = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2, "partition": "uniform"}
DP4 = {"data_parallel": 4, "pipeline_parallel": 1, "tensor_parallel": 1}
RUNS = (
    ("wide-qahira-int4", TP4, 0, RESUMED_AT, "int4-tp4", None),
    ("wide-qahira-int4", DP2TP2, 0, RESUMED_AT, "int4-tp2", None),
    ("wide-qahira-int4", PP2TP2, 0, RESUMED_AT, None, None),
    ("wide-qahira-int4", DP2TP2, RESUMED_AT, STEPS, None, "int4-tp4"),
    ("wide-qahira-int4", TP4, RESUMED_AT, STEPS, None, "int4-tp2"),
    ("wide-qahira-int4", PP2TP2, RESUMED_AT, STEPS, None, "int4-tp4"),
    ("wide-lora-nf4", DP4, 0, RESUMED_AT, "nf4-tp1", None),
    ("wide-lora-nf4", DP2TP2, 0, RESUMED_AT, None, None),
    ("wide-lora-nf4", DP2TP2, RESUMED_AT, STEPS, None, "nf4-tp1"),
)
FRESH = {3: 1, 4: 0, 5: 2, 8: 7}
"""Each resumed run's index, and the fresh run at its layout whose quantised shards it must hold."""


def _resharded_rank(rank: int, world_size: int, directory: str) -> list[tuple]:
    """Each of :data:`RUNS`: this rank's losses and gradients, and its quantised shards' every tensor."""
    results = []
    with mock.patch.object(adapters_meta, "_base", _wide_base):
        for option_name, layout, first, last, saves, resumes in RUNS:
            module = _MetaAdapterModule(option_name, _weights(option_name))
            recorder = _Recorder([])
            trainer = pl.Trainer(
                accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
                max_epochs=2 if resumes else 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                use_distributed_sampler=False, callbacks=[recorder])
            trainer.fit(module, datamodule=_ShardedData(first, last),
                        ckpt_path=resumes and f"{directory}/{resumes}.ckpt")
            if saves:
                trainer.save_checkpoint(f"{directory}/{saves}.ckpt")
            shards = {name: tensor.detach().clone() for name, tensor in module.model.state_dict().items()
                      if ".shard_tp" in name}
            results.append(((recorder.losses, recorder.gradients), shards))
    return results


@pytest.mark.distributed
def test_a_checkpoint_quantised_per_shard_resumes_at_another_tensor_parallel_degree(tmp_path):
    """QA-HiRA on INT4 saved at tp4 resumes at dp2 x tp2 and at pp2 x tp2, and saved at dp2 x tp2 resumes at tp4;
    QLoRA on NF4 saved at tensor_parallel=1 resumes at dp2 x tp2. Each resumed rank's quantised shard, every code
    and statistic, equals the fresh run's at that layout (the resume required it to equal its cut of the checkpoint's
    joined shards), and the losses and adapter gradients continue the single-process run's to the tensor-parallel
    tolerance."""
    results = run_distributed(_resharded_rank, 4, args=(str(tmp_path),), timeout_s=600)
    with mock.patch.object(adapters_meta, "_base", _wide_base):
        references = {name: _reference(name)[0] for name in dict.fromkeys(run[0] for run in RUNS)}
    for index, (option_name, _, first, last, _, _) in enumerate(RUNS):
        reference = references[option_name]
        assert_traces_match(TrainingTrace(reference.losses[first:last], reference.gradients[first:last]),
                            merge_rank_traces([result[index][0] for result in results]), loss_rtol=1e-5,
                            grad_rtol=1e-4)
    for resumed, fresh in FRESH.items():
        for result in results:
            expected = result[fresh][1]
            assert expected and sorted(result[resumed][1]) == sorted(expected)
            for name, tensor in expected.items():
                assert torch.equal(result[resumed][1][name], tensor), (RUNS[resumed][0], name)
