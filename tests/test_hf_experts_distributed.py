"""Pretrained MoE experts on 2 gloo ranks: each rank loads its half, all-gathered equals from_pretrained; the
expert-parallel checkpoint exports bit-exact in save_pretrained's layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_merak.testing import run_distributed
from tests.test_hf_experts import save_family, save_fused, stored

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks

ROUND_TRIP = {"mixtral": "per-expert", "qwen2_moe": "fused", "qwen3_moe": "per-expert", "olmoe": "per-expert",
              "deepseek_v3": "fused"}


def _load_and_save_rank(rank: int, world_size: int, root: str) -> dict[str, int]:
    """Per family: meta build → enable_expert_parallel → to_empty → this rank's experts loaded → compared with
    from_pretrained (all-gathered) → saved as a merak3d checkpoint (experts a DTensor over the expert group)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_merak.checkpoint.names import MODEL_RECORD_KEY, build_meta_model, load_config, model_record
    from lightning_merak.checkpoint.sharded import LIGHTNING_CHECKPOINT
    from lightning_merak.hf.pretrained import load_rank_pretrained
    from lightning_merak.plugins.moe.experts.enable import enable_expert_parallel

    mesh = init_device_mesh("cpu", (world_size,))
    expert_bytes = {}
    for family in ROUND_TRIP:
        source = Path(root) / family / "source"
        model = build_meta_model(load_config(source))
        report = enable_expert_parallel(model)
        model.to_empty(device="cpu")
        tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        loaded = load_rank_pretrained(model, tensors, source)  # this rank's place read from the experts modules
        assert loaded.experts == report.local_experts
        expert_bytes[family] = loaded.expert_bytes_read
        reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
        for name, tensor in model.state_dict().items():
            if name in report.expert_parameters:
                pieces = [torch.empty_like(tensor) for _ in range(world_size)]
                dist.all_gather(pieces, tensor.contiguous())
                tensor = torch.cat(pieces)
            assert torch.equal(tensor, reference[name]), (family, name)
        state = {f"model.{name}": DTensor.from_local(tensor, mesh, [Shard(0)], run_check=False)
                 if name in report.expert_parameters else tensor for name, tensor in model.state_dict().items()}
        checkpoint = Path(root) / family / "merak3d.ckpt"
        dcp.save({"model": state, "optim": {}}, checkpoint_id=checkpoint)
        if rank == 0:
            torch.save({MODEL_RECORD_KEY: model_record(model)}, checkpoint / LIGHTNING_CHECKPOINT)
        dist.barrier()
    return expert_bytes


def test_ranks_load_their_experts_and_the_checkpoint_exports_bit_exact(tmp_path):
    from lightning_merak.cli.export import main

    for family, layout in ROUND_TRIP.items():
        (save_family if layout == "per-expert" else save_fused)(family, tmp_path / family / "source")
        save_family(family, tmp_path / family / "saved")
    per_rank = run_distributed(_load_and_save_rank, 2, args=(str(tmp_path),), timeout_s=120)
    for family in ROUND_TRIP:
        saved = stored(tmp_path / family / "saved")
        total = sum(tensor.numel() * tensor.element_size() for key, tensor in saved.items() if ".experts." in key)
        assert [bytes_read[family] for bytes_read in per_rank] == [total // 2, total // 2]
        main([str(tmp_path / family / "merak3d.ckpt"), str(tmp_path / family / "out"), "--max-shard-size", "30KB"])
        exported = stored(tmp_path / family / "out")
        assert sorted(exported) == sorted(saved), family
        for key, tensor in saved.items():
            assert exported[key].dtype == tensor.dtype and torch.equal(exported[key].view(torch.uint8),
                                                                       tensor.view(torch.uint8)), (family, key)
        AutoModelForCausalLM.from_pretrained(tmp_path / family / "out")
