"""Adapters on a base quantised per tensor-parallel shard, against the whole model's quantisation and training.

Built on meta, each rank materialises its blocks, splits them, loads its slices of the float weights and then
quantises its own shard of every frozen base layer (:mod:`lightning_merak.parallel.tensor.quantized_shards`). Where
the quantisation block divides the shard, the shard's dequantised weight is the whole model's, sliced, bit for bit
(NF4/FP4 without double quantisation, which is refused, the project's INT4, and int8 with the whole row's absmax).
So losses and adapter gradients at tp2 equal the single-process quantised model's to the float tolerance of the
tensor-parallel tests: only the order in which the row layers' partial sums are added differs.
"""

from __future__ import annotations

import itertools
from unittest import mock

import pytest
import torch
from torch import nn

from lightning_merak.adapters.meta import attach_on_meta
from lightning_merak.adapters.quantize import quantized_shard, shard_quantization_problem
from lightning_merak.cli.options.adapter import LoRAAdapterConfig, QAHiRAAdapterConfig, QBaRAAdapterConfig, Quantization
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.pipeline.trace import find_trunk
from lightning_merak.parallel.tensor.adapters import check_adapter_split
from lightning_merak.parallel.tensor.blocks import TensorParallelPlan
from lightning_merak.parallel.tensor.quantized_shards import quantized_split_problem
from lightning_merak.testing import TrainingTrace, assert_traces_match, merge_rank_traces, run_distributed
from tests import test_adapters_meta as adapters_meta
from tests.test_adapters_meta import OPTIONS, PP2, TARGETS, _meta_rank, _reference
from tests.test_adapters_tp import LAYOUTS
from tests.test_merak3d import STEPS, VOCAB

# wide enough that every row layer's shard at tp2 holds whole 64-weight blocks (o_proj 128 -> 64, down 256 -> 128)
WIDE = ModelConfig(name="llama", model_type="llama", config={
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "tie_word_embeddings": False})
OPTIONS.update({  # beside test_adapters_meta's, on the wide model
    "wide-qbara-nf4": lambda: QBaRAAdapterConfig(r=2, quantization=Quantization.nf4, double_quant=False,
                                                 target_modules=list(TARGETS)),
    "wide-lora-nf4": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.nf4, double_quant=False,
                                               target_modules=list(TARGETS)),
    "wide-qahira-int4": lambda: QAHiRAAdapterConfig(r=2, quantization=Quantization.int4, group_size=32, lambda_in=32,
                                                    target_modules=list(TARGETS)),
    "wide-lora-int8": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.int8, target_modules=list(TARGETS)),
    "wide-qbara-fp4": lambda: QBaRAAdapterConfig(r=2, quantization=Quantization.fp4, double_quant=False,
                                                 target_modules=list(TARGETS)),
})
# (option, layout, first step, last step, checkpoint saved, checkpoint resumed): the dequantised shards are the whole
# model's, so only the order in which the row layers' partial sums are added differs, as in the float tests
# (tests/test_adapters_tp.py): losses to 1e-5 (measured 2e-7), adapter gradients to 1e-4 of their largest entry
# (measured 1.1e-5, int8; 1.7e-6 the others) after Adam's steps. QA-HiRA on INT4 is saved after 3 steps, resumed at tp2
# and saved again, for the export, and resumed at pp2 (tensor_parallel=1: the shards joined into the whole layer's
# INT4, which the rebuilt base must equal bit for bit); QLoRA on NF4 is saved for the export too.
RESUMED_AT = 3
RUNS = (
    ("wide-qbara-nf4", "tp2", 0, STEPS, None, None),
    ("wide-lora-nf4", "tp2sp", 0, STEPS, "nf4", None),
    ("wide-qahira-int4", "tp2", 0, RESUMED_AT, "three", None),
    ("wide-qahira-int4", "tp2", RESUMED_AT, STEPS, "final", "three"),
    ("wide-lora-int8", "tp2", 0, STEPS, None, None),
    ("wide-qbara-fp4", "tp2sp", 0, STEPS, None, None),
    ("wide-qahira-int4", "pp2", RESUMED_AT, STEPS, None, "three"),  # the tp2 shards joined at tensor_parallel=1
)
LAYOUTS = {**LAYOUTS, "pp2": (2, PP2)}


def _wide_base() -> nn.Module:
    torch.manual_seed(0)
    model = build_causal_lm(WIDE, vocab_size=VOCAB)
    model.config.use_cache = False
    return model


def _quantised_tp_rank(rank: int, world_size: int, directory: str) -> list[tuple]:
    results = []
    with mock.patch.object(adapters_meta, "_base", _wide_base):
        for option_name, layout_name, first, last, saves, resumes in RUNS:
            trace, (_, _, _, _, _, quantised) = _meta_rank(
                rank, world_size, option_name, LAYOUTS[layout_name][1], first_step=first, last_step=last,
                epochs=2 if resumes else 1, save_to=saves and f"{directory}/{saves}.ckpt",
                resume_from=resumes and f"{directory}/{resumes}.ckpt")
            results.append((trace, quantised))
    return results


def _dequantised(layer: nn.Module) -> torch.Tensor:
    import bitsandbytes as bnb

    if isinstance(layer, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    if isinstance(layer, bnb.nn.Linear8bitLt):
        return layer.weight.CB.float() * layer.weight.SCB.unsqueeze(1) / 127
    return layer.dequantize()


def _linear(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return linear


@pytest.mark.parametrize("quantization", ["nf4", "fp4", "int4", "int8"])
def test_a_shard_quantised_alone_is_the_whole_models_quantisation_sliced(quantization):
    """Column shards (output rows) and row shards (input columns, 64 wide and more) at tp 2 and 4: the dequantised
    shards, put together, are the whole layer's dequantised weight, bit for bit."""
    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    expected = _dequantised(quantized_shard(_linear(weight), quantization, double_quant=False))
    for tp in (2, 4):
        rows, columns = weight.chunk(tp, 0), weight.chunk(tp, 1)
        absmax = torch.stack([part.to(torch.float16).abs().amax(1).float() for part in columns]).amax(0)
        column_shards = [quantized_shard(_linear(part), quantization, double_quant=False) for part in rows]
        row_shards = [quantized_shard(_linear(part), quantization, double_quant=False,
                                      whole_row_absmax=lambda local: absmax) for part in columns]
        for shards, dim in ((column_shards, 0), (row_shards, 1)):
            joined = torch.cat([_dequantised(shard) for shard in shards], dim)
            assert torch.equal(joined, expected), (quantization, tp, dim)
    if quantization == "int8":  # a row shard scaled by its own absmax would be another quantisation
        alone = _dequantised(quantized_shard(_linear(weight.chunk(2, 1)[0]), "int8"))
        assert not torch.equal(alone, expected.chunk(2, 1)[0])


@pytest.mark.parametrize("quantization", ["nf4", "fp4"])
def test_the_4bit_shard_rule_is_what_bitsandbytes_dequantises_exactly(quantization):
    """Every column and row split of layers ``in`` a multiple of 16 wide: the rule accepts exactly the splits whose
    shards, each quantised alone, dequantise to the whole layer's slice. A column shard needs whole 64-weight blocks
    in every row (bitsandbytes' CPU kernel reads a row's block statistics by the row's index), even where the
    shard's own weights are whole blocks (32 rows of 96: 3072)."""
    for out_features, in_features, tp in itertools.product((32, 64), (32, 48, 96, 128, 192, 256), (2, 4)):
        weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(in_features)) * 0.02
        whole = _dequantised(quantized_shard(_linear(weight), quantization, double_quant=False))
        for column, dim in ((True, 0), (False, 1)):
            shards = [_dequantised(quantized_shard(_linear(part), quantization, double_quant=False))
                      for part in weight.chunk(tp, dim)]
            exact = all(torch.equal(shard, part) for shard, part in zip(shards, whole.chunk(tp, dim)))
            accepted = shard_quantization_problem(quantization, "layer", in_features, out_features, tp,
                                                  column=column) is None
            assert accepted == exact, (out_features, in_features, tp, column)


def test_shards_whose_blocks_would_cross_are_refused_naming_the_fix():
    assert shard_quantization_problem("nf4", "o_proj", 128, 128, 2, column=False) is None
    assert shard_quantization_problem("nf4", "q_proj", 64, 32, 2, column=True) is None
    problem = shard_quantization_problem("nf4", "mlp.down_proj", 96, 32, 2, column=False)
    assert problem == ("tensor_parallel=2 splits mlp.down_proj's 96 input columns into 48, not a multiple of nf4's "
                       "block of 64 (each shard is quantised on its own); use tensor_parallel=1, or quantization=none")
    problem = shard_quantization_problem("int4", "o_proj", 128, 128, 8, column=False, group_size=32)
    assert "into 16, not a multiple of int4's group_size=32" in problem and "use tensor_parallel=4" in problem
    assert shard_quantization_problem("int4", "q_proj", 96, 96, 2, column=True) is None  # groups lie in one row
    problem = shard_quantization_problem("nf4", "self_attn.q_proj", 96, 96, 2, column=True)  # 48 rows of 96: 4608
    assert problem == ("tensor_parallel=2 splits self_attn.q_proj by its output rows, whose 96 inputs are not a "
                       "multiple of nf4's block of 64: a block runs on into the next row, and bitsandbytes "
                       "dequantises a row's blocks by the row's index in its shard (each shard is quantised on its "
                       "own); use tensor_parallel=1, or quantization=none")
    assert "reordered rows" in shard_quantization_problem("fp4", "qkv", 96, 96, 2, column=True, contiguous=False)
    assert shard_quantization_problem("int8", "down_proj", 96, 32, 2, column=False) is None
    assert "set adapter.double_quant=false" in shard_quantization_problem("nf4", "o_proj", 128, 128, 2, column=True,
                                                                          double_quant=True)
    with torch.device("meta"):  # double quantisation (the default) is refused before launch, in every role
        doubled = attach_on_meta(QBaRAAdapterConfig(r=2, quantization=Quantization.nf4, target_modules=list(TARGETS)),
                                 build_causal_lm(WIDE, vocab_size=VOCAB))
    with pytest.raises(ValueError, match="tensor_parallel=2 would round .* set adapter.double_quant=false"):
        check_adapter_split(doubled, 2)
    with torch.device("meta"):  # the narrow test model: o_proj's 32 inputs split into 16
        narrow = attach_on_meta(OPTIONS["wide-qbara-nf4"](), build_causal_lm(adapters_meta.MODELS["llama"],
                                                                             vocab_size=VOCAB))
        wide = attach_on_meta(OPTIONS["wide-qbara-nf4"](), build_causal_lm(WIDE, vocab_size=VOCAB))
    # before launch the roles are unknown, but 32 inputs split neither as a row layer (16) nor as a column layer
    with pytest.raises(ValueError, match=r"splits \S*self_attn.q_proj\S*'s 32 input columns into 16, not a "
                                         "multiple of nf4's block of 64"):
        check_adapter_split(narrow, 2)
    plan = TensorParallelPlan(column=["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                      "mlp.up_proj"], row=["self_attn.o_proj", "mlp.down_proj"], column_groups=[],
                              units={"self_attn.q_proj": [tuple(range(head * 8, head * 8 + 8)) for head in range(4)]})
    block = find_trunk(narrow)[1][0]  # q_proj's units keep its rows in order: its split is contiguous
    problem = quantized_split_problem(narrow, block, plan, 2)  # every layer's problem in one message
    assert problem.startswith("7 problems with the adapter at tensor parallelism: (1) ")
    assert ("tensor_parallel=2 splits self_attn.q_proj by its output rows, whose 32 inputs are not a multiple of nf4's "
            "block of 64: a block runs on into the next row, and bitsandbytes dequantises a row's blocks by the row's "
            "index in its shard (each shard is quantised on its own); use tensor_parallel=1, or quantization=none"
            ) in problem
    assert "mlp.down_proj" in problem
    assert quantized_split_problem(wide, find_trunk(wide)[1][0], plan, 2) is None
    check_adapter_split(wide, 2)


def test_a_resumed_meta_model_reads_the_tensors_its_float_weight_was_rewritten_into():
    """A float weight the checkpoint lacks: the INT4 codes, scales and zeros saved instead (whole at tp=1 and pp),
    or this rank's quantised shard; shards of another degree are all read, to be joined by the split the checkpoint
    records, and refused without it, naming the degree that wrote them."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

    from lightning_merak.checkpoint.rewritten import saved_storage_where_rewritten

    def saved(*names: str) -> Metadata:
        return Metadata({f"model.{name}": TensorStorageMetadata(TensorProperties(dtype=torch.uint8), torch.Size([4]),
                                                                []) for name in names})

    whole = saved("q.base_layer.qweight", "q.base_layer.scales", "q.base_layer.zeros", "q.qahira_H")
    state = {"q.base_layer.weight": torch.empty(4, 4), "q.qahira_H": torch.empty(4)}
    saved_storage_where_rewritten(state, whole, None)
    assert sorted(state) == ["q.base_layer.qweight", "q.base_layer.scales", "q.base_layer.zeros", "q.qahira_H"]
    assert state["q.base_layer.qweight"].dtype == torch.uint8
    shards = saved(*[f"q.base_layer.shard_tp{rank}of2.{name}" for rank in range(2) for name in ("qweight", "scales")])
    state = {"q.base_layer.weight": torch.empty(4, 4)}
    saved_storage_where_rewritten(state, shards, (1, 2))
    assert sorted(state) == ["q.base_layer.shard_tp1of2.qweight", "q.base_layer.shard_tp1of2.scales"]
    with pytest.raises(ValueError, match="q.base_layer's quantised base as 2 tensor-parallel shards, each quantised "
                                         "alone, and does not record how the layer was split.*resume it at "
                                         r"tensor_parallel=2 \(this run: 1\)"):
        saved_storage_where_rewritten({"q.base_layer.weight": torch.empty(4, 4)}, shards, None)
    split = {"dim": 1, "degree": 2, "shape": [4, 8], "rows": None}
    state = {"q.base_layer.weight": torch.empty(4, 4)}
    (join,) = saved_storage_where_rewritten(state, shards, None, {"base_layer": {}, "q.base_layer": split})
    assert sorted(state) == sorted(f"q.base_layer.shard_tp{rank}of2.{name}" for rank in range(2)
                                   for name in ("qweight", "scales"))  # every shard, joined once loaded
    assert (join.layer, join.kind, join.split) == ("q.base_layer", "int4", split)
    state = {"q.base_layer.weight": torch.empty(4, 4)}  # at tp4 too: this rank's shard is cut once the model is split
    assert saved_storage_where_rewritten(state, shards, (0, 4), {"q.base_layer": split}) == [join]
    assert len(state) == 4


@pytest.mark.parametrize("quantization", ["nf4", "fp4", "int4", "int8"])
def test_the_whole_layers_codes_and_statistics_are_its_shards_re_sliced(quantization):
    """Column shards in rank order, row shards (each whole row the shards' pieces side by side: bitsandbytes packs
    the row-major weight, so its codes and block absmax interleave by row) and reordered column shards: the shards'
    codes and statistics, joined, are the whole layer's quantisation, every tensor bit for bit."""
    from lightning_merak.adapters.shard_join import join_quantized_shards

    weight = torch.randn(128, 128, generator=torch.Generator().manual_seed(2)) * 0.02
    whole = quantized_shard(_linear(weight), quantization, double_quant=False).state_dict()
    absmax = weight.to(torch.float16).abs().amax(1).float()
    rows = [[*range(0, 32), *range(64, 96)], [*range(32, 64), *range(96, 128)]]
    for parts, split, whole_row_absmax in (
            (weight.chunk(2, 0), {"dim": 0, "rows": None}, None),
            (weight.chunk(2, 1), {"dim": 1, "rows": None}, lambda local: absmax),
            ([weight[part] for part in rows], {"dim": 0, "rows": rows}, None)):
        shards = [quantized_shard(_linear(part), quantization, double_quant=False,
                                  whole_row_absmax=whole_row_absmax).state_dict() for part in parts]
        joined = join_quantized_shards(quantization, {**split, "degree": 2, "shape": [128, 128]}, shards)
        assert sorted(joined) == sorted(whole)
        for name, tensor in whole.items():
            assert torch.equal(joined[name], tensor), (quantization, split, name)
        if split["dim"] == 1 and quantization != "int8":  # concatenated flat, the rows would be interleaved wrongly
            flat = torch.cat([shard[next(iter(shard))].reshape(-1) for shard in shards])
            assert not torch.equal(flat, whole[next(iter(whole))].reshape(-1))


def test_column_shards_of_4bit_rows_that_are_not_whole_blocks_are_neither_joined_nor_cut():
    """96 inputs: a contiguous column shard's flat entries are whole blocks (32 rows: 3072 weights), but its rows
    are not, so it is not the whole layer's quantisation (the rule above); joining or cutting such shards is
    refused, not done by runs of the flat weight."""
    from lightning_merak.adapters.shard_join import cut_quantized_whole, join_quantized_shards

    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(5)) * 0.02
    split = {"dim": 0, "degree": 2, "shape": [64, 96], "rows": None}
    whole = quantized_shard(_linear(weight), "nf4", double_quant=False).state_dict()
    with pytest.raises(ValueError, match="an entry per 64 weights, which straddle this run's shards of 32x96"):
        cut_quantized_whole("nf4", split, 1, whole)
    shards = [quantized_shard(_linear(part), "nf4", double_quant=False).state_dict() for part in weight.chunk(2)]
    with pytest.raises(ValueError, match="an entry stands for 64 weights, which straddle the shards' rows of 96"):
        join_quantized_shards("nf4", split, shards)


class _Tensors:
    """A checkpoint's tensors as the export reads them (``entries``, ``read``, the model record), held in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor], record: dict) -> None:
        from lightning_merak.checkpoint.names import MODEL_RECORD_KEY

        self.path, self.tensors, self.metadata = "memory", tensors, {MODEL_RECORD_KEY: record}
        self.entries = {key: (tuple(value.shape), value.dtype) for key, value in tensors.items()}

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key]


@pytest.mark.parametrize("quantization", ["nf4", "int4"])
def test_shards_of_a_column_layer_whose_rows_the_split_reorders_dequantise_to_the_whole_layer(quantization):
    """A fused projection split by units (gate and up rows, each rank holding its part of both): the shards' codes
    and statistics, their rows put back at their original places, dequantise to the whole layer's weight bit for
    bit; shards without the recorded split are refused naming --adapter-only."""
    from lightning_merak.adapters.resume import quantized_layers
    from lightning_merak.checkpoint.names import QUANTIZED_SPLITS_KEY
    from lightning_merak.hf.dequantised import DequantisedSource

    weight = torch.randn(128, 64, generator=torch.Generator().manual_seed(1)) * 0.02  # a row is one 64-weight block
    expected = _dequantised(quantized_shard(_linear(weight), quantization, double_quant=False))
    rows = [[*range(0, 32), *range(64, 96)], [*range(32, 64), *range(96, 128)]]
    tensors = {}
    for rank, part in enumerate(rows):
        shard = quantized_shard(_linear(weight[part]), quantization, double_quant=False)
        tensors.update({f"mlp.gate_up.base_layer.shard_tp{rank}of2.{key}": value
                        for key, value in shard.state_dict().items()})
    split = {"dim": 0, "degree": 2, "shape": [128, 64], "rows": rows}
    quantized = quantized_layers(tensors)
    source = DequantisedSource(_Tensors(tensors, {QUANTIZED_SPLITS_KEY: {"mlp.gate_up.base_layer": split}}), quantized)
    assert sorted(source.entries) == ["mlp.gate_up.base_layer.weight"]
    assert source.entries["mlp.gate_up.base_layer.weight"][0] == (128, 64)
    assert torch.equal(source.read("mlp.gate_up.base_layer.weight"), expected)
    contiguous = torch.cat([_dequantised(quantized_shard(_linear(part), quantization, double_quant=False))
                            for part in weight[torch.tensor(rows).flatten()].chunk(2)])
    assert not torch.equal(contiguous, expected)  # joined in rank order instead, the rows would be misplaced
    with pytest.raises(ValueError, match="does not record how the layer was split.*--adapter-only"):
        DequantisedSource(_Tensors(tensors, {}), quantized)


@pytest.mark.distributed
def test_adapters_on_a_base_quantised_per_shard_train_like_the_whole_quantised_model(tmp_path):
    """Q-BaRA on NF4 and FP4, QLoRA on NF4, QA-HiRA on INT4 and LoRA on int8 at tp2 (with sequence parallelism for
    two): every base layer in the blocks quantised per shard. QA-HiRA resumes at tp2 from its checkpoint (the shards
    rebuilt from the float weights must equal the saved ones), refuses another degree without the recorded split
    (tests/test_adapters_tp_quantized_resume.py resumes at other degrees), and resumes at pp2 (the joined shards are
    the whole model's INT4: the rebuilt base equals them, and the losses and gradients continue as the uninterrupted
    run's). The final INT4 checkpoint and the NF4 one export the adapters, which load onto the whole model's
    quantised base, and export merged: the shards dequantised and put back together, the exported model computes
    that quantised model's logits."""
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    from lightning_merak.adapters import quantize_model
    from lightning_merak.checkpoint.rewritten import saved_storage_where_rewritten
    from lightning_merak.hf.export import export_adapter, export_checkpoint

    results = run_distributed(_quantised_tp_rank, 2, args=(str(tmp_path),), timeout_s=300)
    with mock.patch.object(adapters_meta, "_base", _wide_base):
        references = {name: _reference(name) for name in dict.fromkeys(run[0] for run in RUNS)}
    for index, (option_name, _, first, last, _, _) in enumerate(RUNS):
        reference = references[option_name][0]
        assert all(result[index][1] for result in results), f"{option_name}: no base layer was quantised"
        assert_traces_match(TrainingTrace(reference.losses[first:last], reference.gradients[first:last]),
                            merge_rank_traces([result[index][0] for result in results]), loss_rtol=1e-5,
                            grad_rtol=1e-4)
    three, final = tmp_path / "three.ckpt", tmp_path / "final.ckpt"
    metadata = FileSystemReader(str(three)).read_metadata()  # what the ranks saved: each its own shard
    layer = "model.base_model.model.model.layers.0.mlp.down_proj.base_layer"
    with pytest.raises(ValueError, match="as 2 tensor-parallel shards.*resume it at tensor_parallel=2 .this run: 4"):
        saved_storage_where_rewritten({f"{layer}.weight": torch.empty(128, 256)}, metadata, (1, 4))
    state = {f"{layer}.weight": torch.empty(128, 256)}
    saved_storage_where_rewritten(state, metadata, (1, 2))
    assert sorted(state) == [f"{layer}.shard_tp1of2.{name}" for name in ("qweight", "scales", "zeros")]
    tokens = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for checkpoint, option_name, kind in ((final, "wide-qahira-int4", "int4"), (tmp_path / "nf4.ckpt",
                                                                              "wide-lora-nf4", "nf4")):
        export_adapter(checkpoint, tmp_path / kind / "adapter")
        trained = references[option_name][1]
        # the whole model's quantisation: its shards, put together; the tp2 run's adapters on it
        adapted = PeftModel.from_pretrained(quantize_model(_wide_base(), kind, group_size=32, double_quant=False),
                                            tmp_path / kind / "adapter")
        expected = {name: param for name, param in trained.named_parameters() if param.requires_grad}
        loaded = {name: param for name, param in adapted.named_parameters() if param.requires_grad
                  or any(f"{infix}_" in name for infix in ("qahira", "lora"))}
        assert sorted(loaded) == sorted(expected)
        for name, value in expected.items():  # Adam's steps amplify summation-order differences in small gradients
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=5e-5)
        # the merged export of the shards: each dequantised with its own statistics, put back together, the adapter
        # merged in float, computes the quantised model with the checkpoint's adapters
        export_checkpoint(checkpoint, tmp_path / kind / "merged", merge_adapters=True)
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / kind / "merged")
        adapted.train()  # bitsandbytes' dequantise-and-matmul path (its CPU eval path repacks the codes)
        with torch.no_grad():
            torch.testing.assert_close(exported(tokens).logits, adapted(tokens).logits, rtol=1e-5, atol=1e-5)
