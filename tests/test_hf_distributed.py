"""Hugging Face checkpoints on gloo ranks: DTensor shards filled from slices, merak3d checkpoints exported."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks

VOCAB = 96
LLAMA = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)
GPT2 = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _stored(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _load_shards_rank(rank: int, world_size: int, directory: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_merak.hf import load_pretrained
    from lightning_merak.parallel.tensor.blocks import LayoutChange

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(100 + rank)  # each rank starts from different values
    model = AutoModelForCausalLM.from_config(LLAMA)
    placements = {"model.embed_tokens.weight": Shard(0), "lm_head.weight": Shard(0),
                  "model.layers.0.self_attn.q_proj.weight": Shard(0),
                  "model.layers.0.self_attn.o_proj.weight": Shard(1),
                  "model.layers.1.mlp.down_proj.weight": Shard(1), "model.norm.weight": Replicate()}
    # k/v rows regrouped the way the tensor-parallel split records it (each rank's part of the heads)
    rows = tuple(range(0, 8)) + tuple(range(8, 16))
    swapped = tuple(range(8, 16)) + tuple(range(0, 8))
    changes = {"model.layers.1.self_attn.k_proj.weight": LayoutChange(rows=swapped),
               "model.layers.1.self_attn.v_proj.weight": LayoutChange(rows=rows)}
    tensors = {name: distribute_tensor(torch.zeros(model.get_parameter(name).shape), mesh, [placement])
               for name, placement in placements.items()}
    tensors.update({name: distribute_tensor(torch.zeros(16, 32), mesh, [Shard(0)]) for name in changes})
    load_pretrained(tensors, directory, changes)
    stored = _stored(Path(directory))
    for name, tensor in tensors.items():
        full = changes[name].from_original(stored[name]) if name in changes else stored[name]
        expected = distribute_tensor(full, mesh, tensor.placements).to_local()
        assert torch.equal(tensor.to_local(), expected), name


def test_each_rank_fills_its_dtensor_shard_with_its_slice(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LLAMA).save_pretrained(tmp_path, max_shard_size="40KB")
    run_distributed(_load_shards_rank, 2, args=(str(tmp_path),), timeout_s=120)


def _save_merak3d_rank(rank: int, world_size: int, source: str, checkpoint: str, layout: dict) -> None:
    """The pretrained model under merak3d, built by one validation batch (no training step), then saved."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.config.use_cache = False
    module = CausalLMModule(model)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=1)
    batches = torch.randint(VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    trainer.validate(module, DataLoader(TensorDataset(batches), batch_size=4))
    trainer.save_checkpoint(checkpoint)


@pytest.mark.parametrize(("config", "layout"), [
    (GPT2, {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2}),
    (LLAMA, {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1}),
], ids=["gpt2-tp2", "llama-pp2"])
def test_merak3d_checkpoint_exports_bit_exact(tmp_path, config, layout):
    """from_pretrained → merak3d (GPT-2's fused, transposed c_attn split over tp; Llama cut into stages)
    → sharded checkpoint → merak-export: the original tensors, bit for bit, and from_pretrained loads them."""
    from lightning_merak.cli.export import main

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "source", max_shard_size="40KB")
    checkpoint = tmp_path / "merak3d.ckpt"
    run_distributed(_save_merak3d_rank, 2, args=(str(tmp_path / "source"), str(checkpoint), layout), timeout_s=180)
    assert checkpoint.is_dir()
    main([str(checkpoint), str(tmp_path / "out"), "--max-shard-size", "40KB"])
    original, exported = _stored(tmp_path / "source"), _stored(tmp_path / "out")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) > 1
    assert (tmp_path / "out" / "generation_config.json").is_file()
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")


def _predict_pretrained_rank(rank: int, world_size: int, source: str, layout: dict) -> torch.Tensor:
    """The product's path: the model built from the directory's config in ``configure_model`` (on the meta
    device under merak3d), each rank reading its shards from ``source``; then predict."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.hf import pretrained_causal_lm
    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    def build():
        model = pretrained_causal_lm(source, VOCAB, weights=False)
        model.config.use_cache = False
        return model

    module = CausalLMModule(None, model_factory=build, pretrained_path=source)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)  # every replica predicts the whole batch
    batches = torch.randint(VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    logits = torch.cat(trainer.predict(module, DataLoader(TensorDataset(batches), batch_size=4)))
    assert not any(p.is_meta for p in module.parameters()), "a parameter was never materialised"
    return logits


@pytest.mark.parametrize(("config", "layout"), [
    (GPT2, {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2}),
    (LlamaConfig(**{**LLAMA.to_dict(), "tie_word_embeddings": True}),
     {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1}),
    (LLAMA, {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1}),
    (LLAMA, {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2}),
], ids=["gpt2-tp2", "llama-tied-pp2", "llama-dp2", "llama-pp2tp2"])
def test_merak3d_ranks_load_their_shards_and_match_from_pretrained(tmp_path, config, layout):
    """Logits of every layout equal ``from_pretrained``'s to 1e-5."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="40KB")
    batches = torch.randint(VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(batches).logits
    world = layout["data_parallel"] * layout["pipeline_parallel"] * layout["tensor_parallel"]
    for logits in run_distributed(_predict_pretrained_rank, world, args=(str(tmp_path), layout), timeout_s=180):
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def _read_regions_rank(rank: int, world_size: int, source: str, layout: dict) -> tuple[torch.Tensor, dict]:
    """:func:`_predict_pretrained_rank`, recording the shape the loader read of each tensor by name."""
    from lightning_merak.hf import checkpoint

    read: dict[str, tuple[int, ...]] = {}
    region = checkpoint._region

    def recorded(name: str, tensor: torch.Tensor) -> tuple:
        found = region(name, tensor)
        read[name] = found[2]  # the local shape this rank reads
        return found

    checkpoint._region = recorded
    try:
        return _predict_pretrained_rank(rank, world_size, source, layout), read
    finally:
        checkpoint._region = region


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", [{"pipeline_parallel": 2}, {"pipeline_parallel": 2, "tensor_parallel": 2}],
                         ids=["pp2", "pp2tp2"])
def test_split_vocabulary_ranks_read_only_their_rows(tmp_path, layout, tied):
    """vocab_stages on a pretrained meta model: every rank reads its ⌈V/(pp·tp)⌉ rows of the head and the embedding
    and no rank reads a whole table, and the logits equal ``from_pretrained``'s to 1e-5."""
    config = LlamaConfig(**{**LLAMA.to_dict(), "tie_word_embeddings": tied})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, max_shard_size="40KB")
    batches = torch.randint(VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()(batches).logits
    layout = {"data_parallel": 1, "tensor_parallel": 1, **layout, "vocab_stages": "on"}
    parts = layout["pipeline_parallel"] * layout["tensor_parallel"]
    results = run_distributed(_read_regions_rank, parts, args=(str(tmp_path), layout), timeout_s=180)
    for logits, read in results:
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        tables = {name: read[name] for name in ("lm_head.weight", "model.embed_tokens.weight") if name in read}
        assert tables and all(shape == (VOCAB // parts, 32) for shape in tables.values()), tables
        assert ("lm_head.weight" in tables) != tied  # a tied head is the embedding's rows, read once
