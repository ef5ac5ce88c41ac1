"""LoRA under tensor parallelism: adapters split with their base layers, results equal the whole-model path.

The adapted model is built on meta (``tests/test_adapters_meta.py``'s module and reference); each rank
materialises its blocks one at a time and splits them, LoRA's ``A`` and ``B`` following the base layer's
split (:mod:`lightning_merak.parallel.tensor.adapters`). Per-step losses and adapter gradients
equal the single-process model built whole; what is not split yet is refused before any work.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from lightning_merak.adapters.meta import attach_on_meta
from lightning_merak.distributed.dtensors import local_tensor
from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.parallel.materialize import copy_full_tensors
from lightning_merak.parallel.tensor.adapters import check_adapter_split
from lightning_merak.strategies.merak3d.arguments import Merak3DArguments
from lightning_merak.testing import assert_traces_match, merge_rank_traces, run_distributed
from tests import test_adapters_meta as adapters_meta
from tests.test_adapters_meta import OPTIONS, _base, _meta_rank, _MetaAdapterModule, _pretrained_rank, _reference
from tests.test_merak3d import MODELS, VOCAB

LAYOUTS = {
    "tp2": (2, {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2}),
    "tp2sp": (2, {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2, "sequence_parallel": True}),
    "pp2xtp2": (4, {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2, "partition": "uniform"}),
}


def _load_counting_local_bytes(self: _MetaAdapterModule, tensors: dict, layout_changes: dict) -> None:
    """The module's pretrained seam, its share counted in local bytes (a DTensor's ``numel`` is the whole's)."""
    self.float_share = sum(local_tensor(t).numel() * t.element_size() for t in tensors.values())
    copy_full_tensors(tensors, layout_changes, self.weights)


def _tp_rank(*args, **kwargs) -> tuple:
    with mock.patch.object(_MetaAdapterModule, "load_pretrained_weights", _load_counting_local_bytes):
        return _meta_rank(*args, **kwargs)


@pytest.mark.distributed
@pytest.mark.parametrize(("layout_name", "option_name"),
                         [("tp2", "lora-fp32"), ("tp2sp", "lora-head-fp32"), ("pp2xtp2", "lora-fp32"),
                          ("tp2", "qbara-fp32"), ("tp2sp", "qahira-fp32")])
def test_lora_split_by_tensor_parallelism_holds_its_share_and_trains_like_the_whole_model(layout_name, option_name,
                                                                                          tmp_path):
    """q/v (column layers, GQA) and down (row layer) adapted by LoRA, Q-BaRA or QA-HiRA; with sequence parallelism
    LoRA also on the LM head and the input embedding (whole on every rank); the tp checkpoint exports merged."""
    world_size, layout = LAYOUTS[layout_name]
    checkpoint = str(tmp_path / "tp.ckpt")
    results = run_distributed(_tp_rank, world_size, args=(option_name, layout), kwargs={"save_to": checkpoint},
                              timeout_s=300)
    for rank, (_, (on_meta, peak, share, block, outside, quantised)) in enumerate(results):
        assert on_meta, "configure_model did not build on the meta device"
        assert peak <= share + block + outside, f"rank {rank} held {peak} bytes, its share is {share}"
        assert share < 0.75 * (4 * block + outside), f"rank {rank} kept more than its shard"
        assert not quantised
    reference, trained = _reference(option_name)
    # the first step's gradients agree to 1e-6; Adam's steps then amplify summation-order differences of ~1e-7
    # in small gradients (tp2 measured: losses 1e-7, later adapter gradients up to 4e-5 of the largest entry)
    assert_traces_match(reference, merge_rank_traces([trace for trace, _ in results]), loss_rtol=1e-5,
                        grad_rtol=1e-4)
    from transformers import AutoModelForCausalLM

    from lightning_merak.hf.export import export_checkpoint

    export_checkpoint(checkpoint, tmp_path / "hf", merge_adapters=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    merged = trained.merge_and_unload().state_dict()
    assert sorted(exported) == sorted(merged)
    for name, value in merged.items():  # Adam's steps amplify summation-order differences in small gradients
        torch.testing.assert_close(exported[name], value, rtol=0, atol=5e-5, msg=name)


def _pretrained_tp_rank(rank: int, world_size: int, directory: str) -> tuple:
    """The product's path (``CausalLMModule`` with ``pretrained_path``, LoRA attached on meta) at tp2: each rank
    reads its slices of the base layers from the directory."""
    with mock.patch.object(adapters_meta, "PP2", LAYOUTS["tp2"][1]):
        return _pretrained_rank(rank, world_size, directory, "lora-fp32")[0]


@pytest.mark.distributed
def test_a_pretrained_checkpoint_fine_tunes_with_lora_at_tp2(tmp_path):
    from transformers import AutoModelForCausalLM

    _base().save_pretrained(tmp_path)
    results = run_distributed(_pretrained_tp_rank, 2, args=(str(tmp_path),), timeout_s=300)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    whole.config.use_cache = False
    reference, _ = _reference("lora-fp32", base=whole)
    assert_traces_match(reference, merge_rank_traces(results), loss_rtol=1e-5, grad_rtol=1e-4)


def _lora_block_rank(rank: int, world_size: int) -> list[list[str]]:
    """A multi-query Llama block (one key/value head, held by both ranks), LoRA on all seven projections with
    non-zero ``B``: the split's output, input gradient and every gradient checked against the whole block."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_merak.parallel.tensor.blocks import find_tensor_parallel_plan, verify_tensor_parallel_plan

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=1, vocab_size=VOCAB)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    decoder = model.base_model.model.model
    block, hidden = decoder.layers[0], torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    rotary = decoder.rotary_emb(hidden, torch.arange(8).unsqueeze(0))

    def run(module: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        output = module(inputs, position_embeddings=rotary)
        return output[0] if isinstance(output, tuple) else output

    plan = find_tensor_parallel_plan(block, lambda: run(block, hidden), 32)
    verify_tensor_parallel_plan(block, plan, init_device_mesh("cpu", (world_size,)), run, hidden)
    return plan.column_groups + [plan.row]


@pytest.mark.distributed
def test_a_lora_block_with_shared_key_value_rows_splits_exactly():
    for groups in run_distributed(_lora_block_rank, 2, timeout_s=120):
        assert groups == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                          ["mlp.gate_proj", "mlp.up_proj"], ["self_attn.o_proj", "mlp.down_proj"]]


def _on_meta(option) -> torch.nn.Module:
    with torch.device("meta"):
        return attach_on_meta(option, build_causal_lm(MODELS["llama"], vocab_size=VOCAB))


def test_what_tensor_parallelism_does_not_split_is_refused_naming_the_fix():
    """Double quantisation of a 4-bit base (per-shard bases: ``tests/test_adapters_tp_quantized.py``), and dropout on
    a pooled adapter: before any work."""
    lora = _on_meta(OPTIONS["lora-fp32"]())
    check_adapter_split(lora, 2)
    with pytest.raises(ValueError, match="set adapter.double_quant=false .*, or tensor_parallel=1"):
        check_adapter_split(_on_meta(OPTIONS["qbara-nf4"]()), 2)
    for name in ("qahira-int4", "lora-int8"):  # quantised per shard after the split
        check_adapter_split(_on_meta(OPTIONS[name]()), 2)
    check_adapter_split(_on_meta(OPTIONS["qbara-fp32"]()), 2)
    qbara = OPTIONS["qbara-fp32"]()
    qbara.dropout = 0.1
    with pytest.raises(ValueError, match="dropout=0; use tensor_parallel=1"):
        check_adapter_split(_on_meta(qbara), 2)
    check_adapter_split(_on_meta(OPTIONS["lora-head-fp32"]()), 2)  # the head's and embedding's stay whole
    Merak3DArguments(tensor_parallel=2, sequence_parallel=True).check_model(lora, 1, 2)
    Merak3DArguments(tensor_parallel=2).check_model(lora, 1, 2)
