"""Pretrained MoE experts (single process): each expert-parallel rank reads exactly its experts, export round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    OlmoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from lightning_merak.hf import export_checkpoint, model_record
from lightning_merak.hf.experts import expert_parameters, export_layout, load_pretrained_experts
from lightning_merak.modules.causal_lm import CausalLMModule

VOCAB = 128
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 1,
          "pad_token_id": 2}
_MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
        "intermediate_size": 48, "moe_intermediate_size": 24, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1,
        **{**COMMON, "num_key_value_heads": 4}}
FAMILIES = {
    "mixtral": MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": Qwen2MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, shared_expert_intermediate_size=40),
    "qwen3_moe": Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, head_dim=8),
    "olmoe": OlmoeConfig(**COMMON, intermediate_size=24, num_experts=4, num_experts_per_tok=2),
    "deepseek_v2": DeepseekV2Config(**_MLA),
    "deepseek_v3": DeepseekV3Config(**_MLA),
}


def save_family(family: str, directory: Path, seed: int = 0, **kwargs) -> Path:
    """A tiny checkpoint of ``family`` as transformers' own save_pretrained writes it (experts per expert)."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(FAMILIES[family]).save_pretrained(directory, **kwargs)
    return directory


def save_fused(family: str, directory: Path, seed: int = 0) -> Path:
    """The same model with its experts stored fused, under the module's own names (as newer checkpoints ship)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family])
    model.config.save_pretrained(directory)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def rank_tensors(family: str, ep_rank: int, ep_size: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """A fresh model's parameters and buffers, expert parameters cut to this rank's experts (as EP leaves them)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family])
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, shape in expert_parameters(model).items():
        per_rank = shape[0] // ep_size
        tensors[name] = torch.full((per_rank, *shape[1:]), float("nan"))
    return tensors


def expected_slice(full: torch.Tensor, ep_rank: int, ep_size: int) -> torch.Tensor:
    per_rank = full.shape[0] // ep_size
    return full[ep_rank * per_rank:(ep_rank + 1) * per_rank]


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_exactly_its_slice_of_from_pretrained(tmp_path, family, layout):
    directory = (save_family if layout == "per-expert" else save_fused)(family, tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    with safe_open(directory / "model.safetensors", "pt") as handle:
        fused_on_disk = any(key.endswith("experts.gate_up_proj") for key in handle.keys())
    assert fused_on_disk == (layout == "fused")
    experts = expert_parameters(AutoModelForCausalLM.from_config(FAMILIES[family]))
    assert experts and all(len(shape) == 3 and shape[0] == 4 for shape in experts.values())
    for ep_rank in range(2):
        tensors = rank_tensors(family, ep_rank, 2)
        report = load_pretrained_experts(tensors, directory, ep_rank=ep_rank, ep_size=2)
        assert report.experts == range(2 * ep_rank, 2 * ep_rank + 2)
        assert sorted(report.expert_tensors) == sorted(experts)
        for name, tensor in tensors.items():
            if name in reference:
                expected = expected_slice(reference[name], ep_rank, 2) if name in experts else reference[name]
                assert torch.equal(tensor, expected), (name, ep_rank)


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_a_rank_reads_its_share_of_the_expert_bytes(tmp_path, layout):
    """ep=4 of 4 experts: each rank reads one expert's bytes of every expert tensor, plus every other tensor."""
    directory = (save_family if layout == "per-expert" else save_fused)("qwen3_moe", tmp_path)
    model = AutoModelForCausalLM.from_config(FAMILIES["qwen3_moe"])
    experts = expert_parameters(model)
    expert_bytes = sum(torch.Size(shape).numel() * 4 for shape in experts.values())
    other_bytes = sum(tensor.numel() * 4 for name, tensor in model.state_dict().items() if name not in experts)
    for ep_rank in range(4):
        report = load_pretrained_experts(rank_tensors("qwen3_moe", ep_rank, 4), directory, ep_rank=ep_rank, ep_size=4)
        assert report.expert_bytes_read == expert_bytes // 4
        assert report.bytes_read == expert_bytes // 4 + other_bytes


def test_ep1_under_lightning_names_gives_from_pretrained_logits(tmp_path):
    """ep_size=1 reads every expert (merak3d without expert parallelism); Lightning's ``model.`` prefix is stripped."""
    directory = save_family("deepseek_v3", tmp_path, max_shard_size="30KB")
    assert (directory / "model.safetensors.index.json").is_file()
    reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(FAMILIES["deepseek_v3"]).eval()
    tensors = {f"model.{name}": tensor for name, tensor in {**dict(model.named_parameters()),
                                                              **dict(model.named_buffers())}.items()}
    report = load_pretrained_experts(tensors, directory)
    assert report.experts == range(4)
    ids = torch.randint(VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)


def test_refusals_name_the_fix_before_reading(tmp_path):
    directory = save_family("mixtral", tmp_path)
    tensors = rank_tensors("mixtral", 0, 2)
    name = next(iter(expert_parameters(AutoModelForCausalLM.from_config(FAMILIES["mixtral"]))))
    with pytest.raises(ValueError, match=r"ep_rank=0 of ep_size=4.*need \(1, "):
        load_pretrained_experts(tensors, directory, ep_rank=0, ep_size=4)
    assert torch.isnan(tensors[name]).all()  # nothing read
    with pytest.raises(ValueError, match="do not split evenly"):
        load_pretrained_experts(tensors, directory, ep_rank=0, ep_size=3)
    tensors[name] = torch.empty(tensors[name].shape, device="meta")
    with pytest.raises(ValueError, match="meta device; materialise"):
        load_pretrained_experts(tensors, directory, ep_rank=0, ep_size=2)
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text((directory / "config.json").read_text())
    save_file({key: value for key, value in stored(directory).items() if ".experts.3.w2." not in key},
              incomplete / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"holds experts \[0, 1, 2\], the model has 4"):
        load_pretrained_experts(rank_tensors("mixtral", 0, 2), incomplete, ep_rank=0, ep_size=2)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_layout_is_what_save_pretrained_writes(tmp_path, family):
    directory = save_family(family, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(directory)
    plain, experts = export_layout(model)
    written = {key for layout in experts.values() for key in layout.keys()} | set(plain.values())
    assert written == set(stored(directory))


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_export_of_a_ddp_checkpoint_is_bit_exact(tmp_path, family, layout):
    """load → Lightning checkpoint → merak-export: save_pretrained's per-expert tensors, bit for bit, in its
    layout whichever layout was loaded, split over several files."""
    source = (save_family if layout == "per-expert" else save_fused)(family, tmp_path / "source")
    save_family(family, tmp_path / "saved")  # what save_pretrained writes for the same weights
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    checkpoint = tmp_path / "ddp.ckpt"
    torch.save({"state_dict": CausalLMModule(model).state_dict(), "hf_model": model_record(model)},
               checkpoint)
    report = export_checkpoint(checkpoint, tmp_path / "out", max_shard_size="20KB")
    original, exported = stored(tmp_path / "saved"), stored(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key].view(torch.uint8),
                                                                   tensor.view(torch.uint8)), key
    assert len(report.files) > 4 and report.largest_shard_bytes <= 20_000
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(reloaded[name], tensor) for name, tensor in model.state_dict().items())


def test_the_rank_seam_reads_dense_models_as_before(tmp_path):
    """load_rank_pretrained on a model without experts: what load_pretrained reads."""
    from transformers import LlamaConfig

    from lightning_merak.hf import load_pretrained
    from lightning_merak.hf.pretrained import load_rank_pretrained

    config = LlamaConfig(**{**COMMON, "intermediate_size": 64})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    loaded = []
    for load in (lambda model, tensors: load_rank_pretrained(model, tensors, tmp_path),
                 lambda model, tensors: load_pretrained(tensors, tmp_path)):
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(config)
        report = load(model, dict(model.named_parameters()))
        loaded.append((model.state_dict(), report.bytes_read))
    (first, first_bytes), (second, second_bytes) = loaded
    assert first_bytes == second_bytes and all(torch.equal(first[name], second[name]) for name in first)


def test_a_conversion_other_than_stacking_is_refused_naming_the_family(tmp_path, monkeypatch):
    """Expert tensors that transformers would transpose (or convert otherwise) are refused, not guessed."""
    import transformers.conversion_mapping as conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose, WeightConverter

    directory = save_family("qwen3_moe", tmp_path)
    original = conversion_mapping.get_model_conversion_mapping

    def transposing(model, *args, **kwargs):
        transforms = original(model, *args, **kwargs)
        return [WeightConverter(t._original_source_patterns, t._original_target_patterns,
                                operations=[MergeModulelist(dim=0), Concatenate(dim=1), Transpose(1, 2)])
                if isinstance(t, WeightConverter) and len(t.source_patterns) == 2 else t for t in transforms]

    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", transposing)
    with pytest.raises(NotImplementedError, match="'qwen3_moe'.*Transpose.*strategy=ddp"):
        load_pretrained_experts(rank_tensors("qwen3_moe", 0, 2), directory, ep_rank=0, ep_size=2)
