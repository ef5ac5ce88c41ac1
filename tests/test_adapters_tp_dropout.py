"""LoRA dropout under tensor parallelism: a column layer's ranks draw one mask, a row layer's ranks the slices
of one; the split block then computes what the whole block computes under those masks."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_merak.parallel.tensor import adapters as tensor_parallel_adapters
from tests.test_merak3d import VOCAB

COLUMN, ROW = ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"), ("self_attn.o_proj", "mlp.down_proj")


class _ReplayedDropout(nn.Module):
    """Stands for ``nn.Dropout`` in the whole model: multiplies by the next of the masks the split layer drew."""

    def __init__(self, masks: list[torch.Tensor]) -> None:
        super().__init__()
        self.masks = masks

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor * self.masks.pop(0)


def _dropout_block_rank(rank: int, world_size: int, dropout: float) -> dict:
    """A Llama block with LoRA (non-zero ``B``, ``lora_dropout=dropout``) on q/v/up (column) and o/down (row),
    split over the ranks and run twice in training mode; the whole block replays the masks the split drew.
    The first forward is then run again under activation checkpointing."""
    from peft import LoraConfig, get_peft_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_merak.parallel.tensor.blocks import apply_tensor_parallel, find_tensor_parallel_plan

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=VOCAB)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, target_modules=[name.split(".")[1] for name in COLUMN + ROW]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    decoder = model.base_model.model.model
    block = decoder.layers[0]
    hidden = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    rotary = decoder.rotary_emb(hidden, torch.arange(8).unsqueeze(0))

    def run(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        output = module(inputs, position_embeddings=rotary)
        return output[0] if isinstance(output, tuple) else output

    whole = copy.deepcopy(block)
    plan = find_tensor_parallel_plan(block.eval(), lambda: run(block, hidden), 32)
    split = block.train()
    apply_tensor_parallel(split, plan, init_device_mesh("cpu", (world_size,)))
    names = {id(module): name for name, module in split.named_modules()}
    drawn: dict[str, list[torch.Tensor]] = {name: [] for name in COLUMN + ROW}
    original = tensor_parallel_adapters._LoRAParts.dropout_mask

    def recording(self: nn.Module, tensor: torch.Tensor):
        mask = original(self, tensor)
        if mask is not None:
            drawn[names[id(self)]].append(mask)
        return mask

    direction = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    split_results = []
    torch.manual_seed(3)  # the shared stream: alike on every rank, as Lightning seeds them
    with mock.patch.object(tensor_parallel_adapters._LoRAParts, "dropout_mask", recording):
        for _ in range(2):  # two forwards: each draws new masks
            inputs = hidden.clone().requires_grad_(True)
            output = run(split, inputs)
            output.backward(direction)
            split_results.append((output.detach(), inputs.grad))

    gathered = {}
    for name, masks in drawn.items():
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, masks)
        gathered[name] = per_rank
    if dropout:
        for name, masks in gathered.items():
            whole_layer = whole.get_submodule(name)
            replayed = (list(masks[0]) if name in COLUMN  # one mask, the ranks' alike
                        else [torch.cat(slices, dim=-1) for slices in zip(*masks)])  # row: the ranks' slices
            whole_layer.lora_dropout["default"] = _ReplayedDropout(replayed)
    whole.train()
    whole_results = []
    for _ in range(2):
        inputs = hidden.clone().requires_grad_(True)
        output = run(whole, inputs)
        output.backward(direction)
        whole_results.append((output.detach(), inputs.grad))
    torch.manual_seed(3)  # the first forward again, recomputed in the backward: the same masks are replayed
    inputs = hidden.clone().requires_grad_(True)
    output = checkpoint(run, split, inputs, use_reentrant=False)
    output.backward(direction)
    recomputed = (output.detach(), inputs.grad)
    return {"masks": gathered, "split": split_results, "whole": whole_results, "recomputed": recomputed}


@pytest.mark.distributed
@pytest.mark.parametrize("dropout", [0.25, 0.0])
def test_column_lora_ranks_share_one_dropout_mask_and_the_split_equals_the_whole_block(dropout: float) -> None:
    from lightning_merak.testing import run_distributed

    results = run_distributed(_dropout_block_rank, 2, args=(dropout,), timeout_s=120)
    for result in results:  # summation order differs: 1.5e-6 measured
        for (split_output, split_grad), (whole_output, whole_grad) in zip(result["split"], result["whole"]):
            torch.testing.assert_close(split_output, whole_output, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(split_grad, whole_grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(result["recomputed"], result["split"][0], rtol=0, atol=0)
    masks = results[0]["masks"]
    if not dropout:
        assert all(not per_rank[0] and not per_rank[1] for per_rank in masks.values()), "p=0 draws nothing"
        return
    for name in COLUMN:
        first, second = masks[name]
        assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, second)), f"{name}: ranks differ"
        assert not torch.equal(first[0], first[1]), f"{name}: the two forwards drew one mask"
        assert (first[0] == 0).any() and (first[0] != 0).any()
    assert not torch.equal(masks["self_attn.q_proj"][0][0], masks["mlp.up_proj"][0][0])
    assert not torch.equal(masks["self_attn.q_proj"][0][0], masks["self_attn.v_proj"][0][0]), "layers alike"
    for name in ROW:
        first, second = masks[name]
        assert not torch.equal(first[0], second[0]), f"{name}: a row layer's ranks drew one pattern"
