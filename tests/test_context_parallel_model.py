"""A transformers model with context parallelism installed, on real gloo ranks, equals the same model on one
process: loss and every parameter gradient (summed over the group, as the data-parallel reduction does), for
Llama, Llama under PEFT LoRA, a GQA family with a sliding window, a MoE family with its router aux loss, packed and
padded rows, with and without labels."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from lightning_merak.distributed.sub_batches import SubBatchForward
from lightning_merak.parallel.context.model import check_context_parallel_model, install_context_parallel, segment_ids
from lightning_merak.testing import run_distributed

TOLERANCE = 1e-5
SEQ, BATCH, VOCAB = 2048, 2, 97
DOCUMENTS = (800, 480, 768)  # a packed row's document lengths
PADDING = 560  # the second row's padded tail


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=SEQ, attn_implementation="sdpa")
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, **common))
    if family == "llama_lora":  # a PEFT model: its adapters wrap the layers, its forward calls the base model's
        from peft import LoraConfig, get_peft_model

        base = LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common))
        return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"],
                                               init_lora_weights=False))
    if family == "mixtral":  # its loss with labels adds the router aux loss over the whole batch's tokens
        return MixtralForCausalLM(MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                                output_router_logits=True, router_aux_loss_coef=0.5, **common))
    # GQA (2 key/value heads) and a window shorter than a shard, so blocks are cut by it
    return MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=384, **common))


def _batch(kind: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = input_ids.clone()
    batch = {"input_ids": input_ids, "labels": labels}
    if kind in ("packed", "packed_masked"):  # three documents per row, positions restarting at each
        batch["position_ids"] = torch.cat([torch.arange(length) for length in DOCUMENTS])[None]
        if kind == "packed_masked":  # transformers then keeps the documents together: one sequence per row
            batch["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        starts = [sum(DOCUMENTS[:index]) for index in range(1, len(DOCUMENTS))]
        labels[:, starts] = -100  # no target across a document boundary
    elif kind == "padded":  # the second row's tail is padding
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, -PADDING:] = 0
        batch["attention_mask"] = mask
        labels[1, -PADDING:] = -100
    elif kind == "left_padded":  # the second row's head is padding, which its tokens must not see
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, :PADDING] = 0
        batch["attention_mask"] = mask
        labels[1, :PADDING + 1] = -100  # the first real token would be the last padding's target
    return batch


def _reference(family: str, kind: str, with_labels: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model = _model(family)
    batch = _batch(kind)
    if kind == "packed":  # one process: each document alone is what packing means
        loss = _packed_reference_loss(model, batch)
    else:
        loss = _loss(model, batch, with_labels)
    loss.backward()
    return float(loss), _gradients(model)


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}


def _packed_reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ends = [sum(DOCUMENTS[:index + 1]) for index in range(len(DOCUMENTS))]
    bounds = list(zip([0, *ends[:-1]], ends))
    total, count = torch.zeros(()), 0
    for start, end in bounds:
        logits = model(input_ids=batch["input_ids"][:, start:end]).logits
        targets = torch.cat([batch["labels"][:, start + 1:end], torch.full((BATCH, 1), -100)], dim=1)
        total = total + F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
        count += int((targets != -100).sum())
    next_doc = batch["labels"][:, 1:]  # targets across document ends were masked in the batch
    assert count == int((next_doc != -100).sum())
    return total / count


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], with_labels: bool) -> torch.Tensor:
    if with_labels:
        return model(**batch).loss
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))


def _rank(rank: int, world_size: int, family: str, kind: str, method: str, with_labels: bool, sub_batches: int):
    model = _model(family)
    if sub_batches > 1:  # as merak3d's tp_overlap: each sub-batch of rows in its turn, inside the split sequence
        model.forward = SubBatchForward(model, sub_batches)
    install_context_parallel(model, dist.group.WORLD, method)
    loss = _loss(model, _batch(kind), with_labels)
    loss.backward()
    grads = _gradients(model)
    for grad in grads.values():  # the data-parallel average over the cp ranks
        dist.all_reduce(grad)
        grad /= world_size
    return float(loss), grads


CASES = [
    ("llama", "plain", "ring", True, 2, 1),
    ("llama", "plain", "all_to_all", True, 2, 1),
    ("llama", "packed", "ring", True, 2, 1),
    ("llama", "plain", "ring", False, 2, 1),
    ("mistral", "plain", "ring", True, 4, 1),
    ("mistral", "packed", "all_to_all", True, 2, 1),
    ("llama_lora", "packed", "ring", True, 2, 1),
    ("mixtral", "padded", "ring", True, 2, 1),  # padding, and the router aux loss over every rank's tokens
    # one row per sub-batch: each attention call reads its rows' documents, the router logits leave each region
    ("mixtral", "left_padded", "ring", True, 2, 2),
    ("mistral", "packed", "all_to_all", True, 2, 2),
    ("llama", "packed_masked", "ring", True, 2, 1),
]


@pytest.mark.distributed
@pytest.mark.parametrize("family, kind, method, with_labels, ranks, sub_batches", CASES,
                         ids=["-".join(map(str, case)) for case in CASES])
def test_context_parallel_model_equals_one_process(family, kind, method, with_labels, ranks, sub_batches) -> None:
    expected_loss, expected_grads = _reference(family, kind, with_labels)
    results = run_distributed(_rank, world_size=ranks, args=(family, kind, method, with_labels, sub_batches),
                              timeout_s=240)
    for loss, grads in results:
        assert abs(loss - expected_loss) <= TOLERANCE * abs(expected_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected_grads[name], atol=TOLERANCE, rtol=TOLERANCE, msg=name)


def test_segments_follow_restarting_positions_and_padding() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert segment_ids(None, positions, 1, 6).tolist() == [[0, 0, 0, 1, 1, 2]]
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]])
    assert segment_ids(mask, None, 2, 6).tolist() == [[0, 0, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1]]
    assert segment_ids(torch.ones(2, 6), torch.arange(6)[None], 2, 6) is None


def test_models_it_cannot_run_exactly_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="attention interface"):
        check_context_parallel_model(torch.nn.Linear(2, 2), 2, "ring")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.1))
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        check_context_parallel_model(model, 2, "ring")
    model.config.attention_dropout = 0.0
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2))  # attn_pdrop=0.1 by default
    with pytest.raises(ValueError, match=r"attn_pdrop=0.1\); set the model's attn_pdrop=0 \(model.config.attn_pdrop=0"):
        check_context_parallel_model(gpt2, 2, "ring")
    with pytest.raises(ValueError, match="1 key/value heads"):
        check_context_parallel_model(model, 2, "all_to_all")
    with pytest.raises(ValueError, match="choose one of ring, all_to_all"):
        check_context_parallel_model(model, 2, "ulysses")
