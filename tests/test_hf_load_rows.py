"""A layout-changed shard reads only the file rows its own rows come from (single process, no process group)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

from lightning_merak.hf import load_pretrained
from lightning_merak.hf.checkpoint import _copy_changed, _Read, _segments
from lightning_merak.parallel.tensor.blocks import LayoutChange
from lightning_merak.testing import run_distributed


def test_segments_are_the_stretches_that_count_up_by_one():
    assert _segments([4, 5, 0, 1, 2, 5, 9]) == [(0, 4, 2), (2, 0, 3), (5, 5, 1), (6, 9, 1)]
    assert _segments(range(3, 7)) == [(0, 3, 4)]
    assert _segments([2, 2]) == [(0, 2, 1), (1, 2, 1)]
    assert _segments([]) == []


class _RecordingSlice:
    """A safetensors slice that remembers how many elements each read asked for."""

    def __init__(self, part) -> None:
        self.part, self.elements = part, 0

    def __getitem__(self, box):
        data = self.part[box]
        self.elements += data.numel()
        return data


def _boxes(global_shape: tuple[int, ...], tensor_parallel: int, dim: int) -> list[tuple[tuple, tuple]]:
    """``(shape, offset)`` of each rank's even shard along ``dim``."""
    step = global_shape[dim] // tensor_parallel
    return [(tuple(step if d == dim else n for d, n in enumerate(global_shape)),
             tuple(rank * step if d == dim else 0 for d in range(len(global_shape))))
            for rank in range(tensor_parallel)]


# Fused [q | k | v] with 4 query rows and one key/value row each (multi-query), split over 2 ranks:
# the key/value rows (4 and 5) are held by both ranks.
MQA_ROWS = (0, 1, 4, 5, 2, 3, 4, 5)
CASES = {
    "regrouped": (LayoutChange(rows=(0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11)), (12, 6), 0),
    "shared-kv-rows": (LayoutChange(rows=MQA_ROWS), (6, 5), 0),
    "conv1d-regrouped": (LayoutChange(transposed=True, rows=MQA_ROWS), (5, 6), 0),
    "conv1d-row-layer": (LayoutChange(transposed=True), (6, 4), 1),
    "conv1d-column-layer": (LayoutChange(transposed=True), (6, 4), 0),
    "bias-regrouped": (LayoutChange(transposed=True, rows=MQA_ROWS), (6,), 0),
}


@pytest.mark.parametrize("case", CASES)
def test_each_shard_equals_the_changed_full_tensor_and_reads_only_its_rows(tmp_path, case):
    change, file_shape, dim = CASES[case]
    stored = torch.randn(file_shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    save_file({"w": stored}, tmp_path / "w.safetensors")
    full = change.from_original(stored)
    for shape, offset in _boxes(tuple(full.shape), 2, dim):
        local = torch.full(shape, float("nan"))
        with safe_open(tmp_path / "w.safetensors", "pt") as handle:
            part = _RecordingSlice(handle.get_slice("w"))
            read = _Read("w", local, "w", tuple(full.shape), shape, offset, change)
            read_bytes = _copy_changed(part, file_shape, read)
        box = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        assert torch.equal(local, full[box].float())
        assert part.elements == local.numel() and read_bytes == 8 * local.numel()  # only this shard's rows


def test_rows_past_the_file_are_zero(tmp_path):
    """A padded vocabulary under a row change: the model's extra rows have no file row and stay zero."""
    stored = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    save_file({"w": stored}, tmp_path / "w.safetensors")
    change = LayoutChange(rows=(0, 1, 2, 3, 4, 5))
    local = torch.full((3, 3), float("nan"))
    with safe_open(tmp_path / "w.safetensors", "pt") as handle:
        _copy_changed(handle.get_slice("w"), (5, 3), _Read("w", local, "w", (6, 3), (3, 3), (3, 0), change))
    assert torch.equal(local, torch.cat([stored[3:], torch.zeros(1, 3)]))


def test_layout_changes_that_do_not_fit_are_refused_before_any_read(tmp_path):
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=64, max_position_embeddings=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    target = torch.full((32, 32), 7.0)
    with pytest.raises(ValueError, match=r"lists 31 rows, the model's tensor has 32"):
        load_pretrained({name: target}, tmp_path, {name: LayoutChange(rows=tuple(range(31)))})
    with pytest.raises(ValueError, match="is not a LayoutChange"):
        load_pretrained({name: target}, tmp_path, {name: object()})
    assert torch.equal(target, torch.full((32, 32), 7.0))


@pytest.mark.distributed
def test_fused_multi_query_checkpoint_loads_exactly_at_tp2(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj regrouped per rank, its one key/value head held by both ranks."""
    from tests.test_hf_distributed import VOCAB, _predict_pretrained_rank

    config = Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="40KB")
    batches = torch.randint(VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(batches).logits
    layout = {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2}
    for logits in run_distributed(_predict_pretrained_rank, 2, args=(str(tmp_path), layout), timeout_s=180):
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
