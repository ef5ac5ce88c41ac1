"""Adapters on ``merak_ep`` experts under merak3d (#30 item 5): LoRA on attention and on the fused experts of a tiny
Qwen3-MoE (16 experts, top-8), each expert's adapter on the rank owning the expert.

pp=2 × dp=2 (4 gloo ranks, each stage's experts over its two data-parallel ranks) trains like the single-process
adapted model with transformers' own expert loop: losses and every adapter gradient (expert factors as each rank's
slice in PEFT's layout). Checkpoints store every expert factor whole, as its slice of the single-process factor, Adam's
moments included, and resume in another layout (another ep, another pp, another dp, Lightning's DDP) on the
uninterrupted trajectory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_merak.testing import run_distributed
from lightning_merak.testing.causal_lm import FixedOptimizerModule
from lightning_merak.testing.data import ReplicaBatches

STEPS, SAVED_AT, BATCH, SEQ, VOCAB = 4, 2, 8, 8, 128
LOSS_RTOL = 1e-6
ADAM_ATOL = 1e-4
"""Factors after Adam steps (lr 0.01): wherever a gradient is near 0, Adam's step m / (sqrt(v) + eps) turns on its
rounding, which differs between layouts and CPUs (1.8e-5 measured on AMD EPYC); a wrong slice is off by ~lr."""


def _model(int4: bool = False) -> torch.nn.Module:
    """The tiny Qwen3-MoE with LoRA (r=4, random B so every factor gets a gradient) on attention and experts, or
    (``int4``) QA-HiRA over INT4 experts (G=16), its factors random alike."""
    from lightning_merak.adapters import quantize_model
    from lightning_merak.adapters.moe import add_moe_adapters, moe_adapter_config
    from lightning_merak.plugins.moe.experts import tiny_moe_model

    base = tiny_moe_model("qwen3_moe", hidden=32, layers=2, vocab=VOCAB, seed=0)
    base.config.use_cache = False
    torch.manual_seed(11)
    if not int4:
        return add_moe_adapters(base, moe_adapter_config(base, r=4, alpha=8, init_lora_weights=False))
    quantize_model(base, "int4", 16, experts=True)
    model = add_moe_adapters(base, moe_adapter_config(base, "qahira", r=2, lambda_in=16, lambda_out=1))
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.normal_(0.0, 0.05)
    return model


def _batches() -> torch.Tensor:
    return torch.randint(3, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(5))



def _reference(optimizer: str, int4: bool = False) -> tuple[list[float], list[dict[str, torch.Tensor]],
                                                           dict[str, torch.Tensor]]:
    """The uninterrupted single-process run on the whole batches: losses and adapter gradients per step, and the
    adapter factors after ``SAVED_AT`` steps."""
    from lightning_merak.testing import snapshot_gradients

    module = FixedOptimizerModule(_model(int4), optimizer=optimizer)
    opt = module.configure_optimizers()
    losses, grads, saved = [], [], {}
    for step, batch in enumerate(_batches()):
        if step == SAVED_AT:
            saved = {name: p.detach().clone() for name, p in module.model.named_parameters() if p.requires_grad}
        opt.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        losses.append(loss.item())
        grads.append(snapshot_gradients(module.model))
        opt.step()
    return losses, grads, saved


class _Recorder(pl.Callback):
    """Per step: the logged loss and (``gradients``) this rank's gradients by unsplit name."""

    def __init__(self, gradients: bool) -> None:
        self.losses: list[float] = []
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.keep_gradients = gradients

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from lightning_merak.testing import layout_gradients

        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        if self.keep_gradients:
            self.gradients.append(layout_gradients(trainer.strategy, pl_module.model))


def _experts_of(module: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """``(first expert, end, expert count)`` of each expert adapter on this rank, by its unsplit name."""
    from lightning_merak.adapters.moe import expert_adapters

    model = module.model
    original = getattr(model, "original_name", lambda name: name)
    return {original(adapter.name): (adapter.experts.start, adapter.experts.stop, adapter.num_experts)
            for adapter in expert_adapters(model)}


def _train_rank(rank: int, world_size: int, layout: dict[str, int] | None, ep_size: int | None, optimizer: str,
                first: int, last: int, save_to: str | None, resume_from: str | None,
                int4: bool = False) -> dict[str, Any]:
    """One rank's run over global batches ``first..last`` (resumed from ``resume_from``, saved to ``save_to``).
    ``layout=None``: Lightning's DDP instead of merak3d. ``int4``: QA-HiRA over INT4 experts."""
    from lightning_merak.callbacks.moe.experts import ExpertParallelCallback
    from lightning_merak.checkpoint.checkpoint_io import SafeCheckpointIO
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    module = FixedOptimizerModule(_model(int4), optimizer=optimizer)
    recorder = _Recorder(gradients=resume_from is None and save_to is None)
    strategy = "ddp" if layout is None else Merak3DStrategy(**{"tensor_parallel": 1, **layout}, micro_batches=2,
                                                            partition="uniform", timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=2 if resume_from else 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False,
        callbacks=[ExpertParallelCallback(ep_size=ep_size, log_every_n_steps=1), recorder],
        plugins=[SafeCheckpointIO()] if layout is None else None,  # as merak-train: a PEFT config in the file
    )
    trainer.fit(module, datamodule=ReplicaBatches(_batches(), first, last), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {"losses": recorder.losses, "gradients": recorder.gradients, "experts": _experts_of(module)}


def _expert_factor(name: str, experts: dict[str, tuple[int, int, int]]) -> tuple[str, tuple[int, int, int]] | None:
    """``(A or B, experts)`` when ``name`` is a factor of an expert adapter."""
    for prefix, held in experts.items():
        for kind in ("A", "B"):
            if name.startswith(f"{prefix}.lora_{kind}."):
                return kind, held
    return None


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_pp2_dp2_expert_adapters_equal_one_process() -> None:
    """pp=2 × dp=2 with ep=2: losses and every adapter gradient (experts' as this rank's slice) equal the
    single-process adapted model's, three SGD steps."""
    from lightning_merak.adapters.moe import slice_expert_factor

    results = run_distributed(_train_rank, 4, args=({"pipeline_parallel": 2, "data_parallel": 2}, None, "sgd", 0, 3,
                                                    None, None), timeout_s=100)
    losses, grads, _ = _reference("sgd")
    seen: set[str] = set()
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(losses[:3], rel=1e-5), rank
        assert result["experts"], f"rank {rank} holds no expert adapter"
        for step, step_grads in enumerate(result["gradients"]):
            for name, grad in step_grads.items():
                want = grads[step][name]
                found = _expert_factor(name, result["experts"])
                if found is not None:
                    kind, (start, stop, total) = found
                    assert (start, stop) == ((rank % 2) * total // 2, (rank % 2 + 1) * total // 2), (rank, name)
                    want = slice_expert_factor(kind, want, range(start, stop), total)
                error = (grad - want).abs().max().item()
                assert error <= 1e-5 + 1e-4 * want.abs().max().item(), f"rank {rank} step {step} {name}: {error:.3g}"
                seen.add(name)
    assert seen == set(grads[0]), f"no rank reported {sorted(set(grads[0]) - seen)}"


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [{"pipeline_parallel": 1, "data_parallel": 2}, None], ids=["merak3d-dp2", "ddp"])
def test_int4_experts_at_ep2_train_as_one_process(layout: dict[str, int] | None) -> None:
    """QA-HiRA over INT4 experts, ep=2 over two data-parallel ranks: each rank keeps its own experts' scales and
    zero-points (rank 0's, broadcast at setup, dequantized rank 1's codes wrong), three SGD steps' losses equal."""
    results = run_distributed(_train_rank, 2, args=(layout, None, "sgd", 0, 3, None, None, True), timeout_s=100)
    losses = _reference("sgd", int4=True)[0]
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx(losses[:3], rel=1e-5), rank


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, tuple[Any, ...]]:
    """A checkpoint written at pp=2 × dp=2 (each stage's experts and their adapters over two ranks) after two
    Adam steps."""
    path = tmp_path_factory.mktemp("adapters") / "pp2dp2-ep2.ckpt"
    results = run_distributed(_train_rank, 4, args=({"pipeline_parallel": 2, "data_parallel": 2}, None, "adam", 0,
                                                    SAVED_AT, str(path), None), timeout_s=100)
    reference = _reference("adam")
    for result in results:
        assert result["losses"] == pytest.approx(reference[0][:SAVED_AT], rel=LOSS_RTOL)
    return path, reference


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_expert_factors_are_saved_whole(saved: tuple[Path, tuple[Any, ...]]) -> None:
    """Each expert group wrote its slice of every factor: ``lora_A`` as ``[E·r, in]``, ``lora_B`` as the
    ``[out, r, E]`` view, together the single-process model's factors after two steps; Adam's moments alike."""
    import torch.distributed.checkpoint as dcp

    path, (_, _, factors) = saved
    experts = {name: value for name, value in factors.items() if ".experts." in name}
    assert len(experts) == 8  # 2 layers × 2 fused tensors × (A, B)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    targets = {}
    for name, whole in experts.items():
        stored = tuple(metadata[f"model.model.{name}"].size)
        if ".lora_B." in name:
            assert stored == (whole.shape[0], 4, 16), name  # [out, r, E]
        else:
            assert stored == tuple(whole.shape), name
        assert tuple(metadata[f"optim.0/{name}/exp_avg"].size) == stored, name
        assert len(metadata[f"model.model.{name}"].chunks) == 2, f"{name}: one chunk per expert group"
        targets[f"model.{name}"] = torch.empty(stored)
    dcp.load({"model": targets}, checkpoint_id=str(path))
    for name, whole in experts.items():
        torch.testing.assert_close(targets[f"model.{name}"].reshape(whole.shape), whole, rtol=1e-4, atol=ADAM_ATOL)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world_size", "layout", "ep_size"), [
    (2, {"pipeline_parallel": 1, "data_parallel": 2}, None),
    (4, {"pipeline_parallel": 2, "data_parallel": 2}, 1),
    (4, {"pipeline_parallel": 1, "data_parallel": 4}, None),
    (2, None, None),
], ids=["dp2-ep2", "pp2dp2-ep1", "dp4-ep4", "ddp-ep2"])
def test_resumed_in_another_layout_continues_the_uninterrupted_run(saved: tuple[Path, tuple[Any, ...]],
                                                                   world_size: int, layout: dict[str, int] | None,
                                                                   ep_size: int | None) -> None:
    path, (losses, _, _) = saved
    results = run_distributed(_train_rank, world_size, args=(layout, ep_size, "adam", SAVED_AT, STEPS, None,
                                                             str(path)), timeout_s=100)
    for result in results:
        assert result["losses"] == pytest.approx(losses[SAVED_AT:], rel=LOSS_RTOL)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_ddp_checkpoint_holds_every_expert_factor_and_resumes(tmp_path: Path) -> None:
    """Under DDP rank 0 writes the file: the callback gathers each expert factor (and Adam's moments) whole in
    PEFT's layout first, and each rank keeps its experts' part when the file is read back."""
    from lightning_merak.checkpoint.safe_load import load_torch_file

    path = tmp_path / "ddp.ckpt"
    losses, _, factors = _reference("adam")
    first = run_distributed(_train_rank, 2, args=(None, None, "adam", 0, SAVED_AT, str(path), None), timeout_s=100)
    assert first[0]["losses"] == pytest.approx(losses[:SAVED_AT], rel=LOSS_RTOL)
    state = load_torch_file(path)
    for name, whole in factors.items():
        torch.testing.assert_close(state["state_dict"][f"model.{name}"], whole, rtol=1e-4, atol=ADAM_ATOL)
    moments = [entry["exp_avg"].shape for entry in state["optimizer_states"][0]["state"].values()]
    assert sorted(moments) == sorted(whole.shape for whole in factors.values())
    resumed = run_distributed(_train_rank, 2, args=(None, None, "adam", SAVED_AT, STEPS, None, str(path)),
                              timeout_s=100)
    for result in resumed:
        assert result["losses"] == pytest.approx(losses[SAVED_AT:], rel=LOSS_RTOL)


def test_lora_b_view_holds_each_rank_s_experts_in_one_block() -> None:
    """``lora_B [out, r·E]`` (expert fastest) seen as ``[out, r, E]``: a rank's experts are one block of the last
    dimension, equal to its own factor's view; a flat whole factor read back is sliced to the rank's experts."""
    from types import SimpleNamespace

    from lightning_merak.adapters.moe import factor_view, slice_expert_factor
    from lightning_merak.checkpoint.sharded import ExpertSlices

    out, r, experts = 6, 3, 8
    whole = torch.arange(out * r * experts, dtype=torch.float32).reshape(out, r * experts)
    for mine in (range(0, 4), range(4, 8)):
        local = slice_expert_factor("B", whole, mine, experts)
        assert torch.equal(factor_view("B", whole, experts)[:, :, mine.start:mine.stop], factor_view("B", local, 4))
        shard = SimpleNamespace(experts=mine, num_experts=experts, ep_size=2, group=None)
        slices = ExpertSlices({}, {"w": ("B", shard, tuple(local.shape))})
        assert torch.equal(slices.loaded("w", whole), local)  # saved flat: whole, sliced
        assert torch.equal(slices.loaded("w", factor_view("B", local, 4).clone()), local)  # saved as the view
        assert slices.loaded("w", torch.tensor(2.0)).ndim == 0  # Adam's step passes through
