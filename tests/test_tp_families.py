"""Every transformers family the pipeline tracer cuts also splits at tensor_parallel=2 exactly.

Whole tiny models (2 blocks, hidden 32, vocab 128) split over 2 gloo ranks against the same model
in one process: logits, loss and every parameter gradient (shards gathered into the original layout).
One spawn, all families inside the rank function, so process start-up is paid once.
"""

from __future__ import annotations

import pytest
import torch

from lightning_merak.testing import run_distributed

VOCAB = 128
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(SMALL, num_key_value_heads=2)),
    "llama-multi-query": ("llama", dict(SMALL, num_key_value_heads=1)),
    "mistral": ("mistral", dict(SMALL, num_key_value_heads=2)),
    # a window shorter than the sequence: the mask path repeats the one key/value head per local query head
    "mistral-multi-query-window": ("mistral", dict(SMALL, num_key_value_heads=1, sliding_window=4)),
    "qwen2": ("qwen2", dict(SMALL, num_key_value_heads=2)),
    "qwen3": ("qwen3", dict(SMALL, num_key_value_heads=2, head_dim=8)),
    "gemma": ("gemma", dict(SMALL, num_key_value_heads=1, head_dim=8)),
    "gemma2": ("gemma2", dict(SMALL, num_key_value_heads=2, head_dim=8)),
    "gemma2-multi-query-window": ("gemma2", dict(SMALL, num_key_value_heads=1, head_dim=8, sliding_window=4)),
    "gemma3_text": ("gemma3_text", dict(SMALL, num_key_value_heads=2, head_dim=8)),
    "phi": ("phi", SMALL),
    "phi3": ("phi3", dict(SMALL, num_key_value_heads=2, pad_token_id=0)),
    "phi3-multi-query": ("phi3", dict(SMALL, num_key_value_heads=1, pad_token_id=0)),
    "gpt2": ("gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4}),
    "gpt_neox": ("gpt_neox", SMALL),
    "gptj": ("gptj", {"n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4}),
    "gpt_bigcode": ("gpt_bigcode", {"n_embd": 32, "n_layer": 2, "n_head": 4, "multi_query": True}),
    "falcon": ("falcon", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}),
    "falcon-new-architecture": ("falcon", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                           "new_decoder_architecture": True, "num_kv_heads": 1}),
    "bloom": ("bloom", {"hidden_size": 32, "n_layer": 2, "n_head": 4}),
    "olmo": ("olmo", dict(SMALL, num_key_value_heads=2)),
    "olmo2": ("olmo2", dict(SMALL, num_key_value_heads=2)),
    "olmo2-multi-query": ("olmo2", dict(SMALL, num_key_value_heads=1)),
    "gpt_oss": ("gpt_oss", dict(SMALL, num_key_value_heads=2, head_dim=8)),
    "cpmant": ("cpmant", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}),
    "stablelm": ("stablelm", dict(SMALL, num_key_value_heads=2)),
    "starcoder2": ("starcoder2", dict(SMALL, num_key_value_heads=2)),
    "opt": ("opt", {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "word_embed_proj_dim": 32}),
    "cohere": ("cohere", dict(SMALL, num_key_value_heads=2)),
    "granite": ("granite", dict(SMALL, num_key_value_heads=2)),
    "mpt": ("mpt", {"d_model": 32, "n_layers": 2, "n_heads": 4, "expansion_ratio": 2}),
    # blocks of two structures: a dense block, then MoE ones (each structure split by its own plan)
    "qwen3_moe-dense-first": ("qwen3_moe", dict(SMALL, num_hidden_layers=3, num_key_value_heads=2, head_dim=8,
                                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                mlp_only_layers=[0])),
    "glm4_moe-dense-first": ("glm4_moe", dict(SMALL, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                              n_group=2, topk_group=1, first_k_dense_replace=1)),
}


def _split_against_whole(model_type: str, config: dict, mesh) -> dict[str, float]:
    """Largest relative error of the split model's logits, loss and gradients against the whole model's."""
    import copy

    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.parallel.tensor.blocks import apply_tensor_parallel, region_partial_parameters
    from lightning_merak.strategies.merak3d.block_splits import block_structures, tensor_parallel_plan
    from lightning_merak.strategies.merak3d.build import call_model
    from lightning_merak.util.model_outputs import logits_of

    torch.manual_seed(0)
    whole = build_causal_lm(ModelConfig(name=model_type, model_type=model_type, config=config), vocab_size=VOCAB)
    whole.config.use_cache = False
    whole.eval()
    tokens = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    split = copy.deepcopy(whole)
    trace = trace_model(split, tokens, call_model, profile=False)
    trunk = split.get_submodule(trace.trunk_path)
    structure_of = block_structures(trunk)
    plans = {index: tensor_parallel_plan(trunk[index], trace) for index in set(structure_of.values())}
    changes, partial = {}, []
    for index, block in enumerate(trunk):
        found = apply_tensor_parallel(block, plans[structure_of[index]], mesh)
        changes.update({f"{trace.trunk_path}.{index}.{name}": change for name, change in found.items()})
        partial += region_partial_parameters(block, plans[structure_of[index]])
    results = []
    for model in (whole, split):
        logits = logits_of(model(tokens))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        results.append((logits.detach(), loss.detach()))
    for param in partial:
        dist.all_reduce(param.grad, group=mesh.get_group())

    reference = {name: param.grad for name, param in whole.named_parameters() if param.grad is not None}
    # a gradient that is zero up to rounding (a key bias: softmax ignores a shift shared by all keys)
    # is measured against the largest gradient
    floor = 1e-3 * max(float(grad.norm()) for grad in reference.values())

    def relative(value: torch.Tensor, expected: torch.Tensor, least: float = 1e-12) -> float:
        return float((value - expected).norm()) / max(float(expected.norm()), least)

    errors = {"logits": relative(results[1][0], results[0][0]), "loss": relative(results[1][1], results[0][1])}
    for name, param in split.named_parameters():
        if param.grad is None:
            errors[name] = 0.0 if name not in reference else float("inf")
            continue
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grad = changes[name].to_original(grad) if name in changes else grad
        errors[name] = relative(grad, reference[name], floor)
    return errors


def _families_rank(rank: int, world_size: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    outcomes: dict[str, object] = {}
    for family, (model_type, config) in FAMILIES.items():
        try:
            outcomes[family] = _split_against_whole(model_type, config, mesh)
        except Exception as error:  # reported per family by the test
            outcomes[family] = f"{type(error).__name__}: {error}"
    return outcomes


@pytest.mark.distributed
def test_every_traced_family_splits_at_tensor_parallel_2_exactly():
    """Fused (Phi-3, GPT-2, MPT) and interleaved (GPT-NeoX, BLOOM, Falcon) projections, multi-query
    key/value heads held by both ranks (Gemma, GPTBigCode, Falcon, Phi-3, OLMo 2; Mistral and Gemma 2 under a
    sliding window), ALiBi and learned
    relative position biases sliced per rank (BLOOM, MPT, CPM-Ant), attention sinks (gpt-oss) and
    OLMo 2's norms over the whole projection, and trunks of dense and MoE blocks (Qwen3-MoE's mlp_only_layers,
    GLM-4.5's first_k_dense_replace), each structure split by its own plan: the split model computes what the
    whole one does."""
    outcomes = run_distributed(_families_rank, 2, timeout_s=300)[0]
    failed = {family: outcome for family, outcome in outcomes.items() if isinstance(outcome, str)}
    assert not failed, failed
    for family, errors in outcomes.items():
        worst = max(errors, key=errors.get)
        assert errors[worst] < 1e-4, (family, worst, errors[worst])


def test_layout_change_round_trips_rows_several_ranks_hold():
    """Rank 0 holds original rows 0, 1 and the shared 4, 5; rank 1 rows 2, 3 and 4, 5 again."""
    from lightning_merak.parallel.tensor.blocks import LayoutChange

    change = LayoutChange(transposed=True, rows=(0, 1, 4, 5, 2, 3, 4, 5))
    original = torch.arange(18.0).view(3, 6)  # a Conv1D weight, (in, out)
    sharded = change.from_original(original)
    assert sharded.shape == (8, 3) and torch.equal(sharded[2], original[:, 4])
    assert torch.equal(change.to_original(sharded), original)
    assert change.local_rows(1, 2) == [2, 3, 4, 5]


def test_fused_rows_follow_the_data_flow():
    """Phi-3's qkv_proj with one key/value head over 2 ranks: each rank's query rows and the shared
    key and value rows, in the original order; gate_up_proj: each rank's gate rows and up rows."""
    from lightning_merak.modules.causal_lm import build_causal_lm
    from lightning_merak.modules.config import ModelConfig
    from lightning_merak.parallel.pipeline.trace import trace_model
    from lightning_merak.parallel.tensor.rows import rank_rows
    from lightning_merak.strategies.merak3d.block_splits import tensor_parallel_plan
    from lightning_merak.strategies.merak3d.build import call_model

    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name="phi3", model_type="phi3", config=dict(
        SMALL, num_key_value_heads=1, pad_token_id=0)), vocab_size=VOCAB)
    model.config.use_cache = False
    trace = trace_model(model, torch.randint(VOCAB, (2, 8)), call_model, profile=False)
    plan = tensor_parallel_plan(model.model.layers[0], trace)
    qkv, gate_up = plan.units["self_attn.qkv_proj"], plan.units["mlp.gate_up_proj"]
    assert rank_rows(qkv, 0, 2) == [*range(16), *range(32, 48)]
    assert rank_rows(qkv, 1, 2) == [*range(16, 48)]
    assert rank_rows(gate_up, 1, 2) == [*range(32, 64), *range(96, 128)]
