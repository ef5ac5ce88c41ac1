"""A drop-in swap gives the same run: merak3d starts from the weights the eager (DDP) build draws.

With the same seed, a model built on the meta device and materialised part by part (any layout) holds
exactly the tensors ``AutoModelForCausalLM.from_config`` draws eagerly, gathered and compared by name; and
merak3d at dp2 trains like DDP from each strategy's own initialisation, on the same batches per rank.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import DataConfig, ModelConfig, OptimConfig
from lightning_merak.parallel.init_parity import eager_init_of, eager_init_suspended
from lightning_merak.parallel.materialize import Materializer, init_owners, meta_device
from lightning_merak.parallel.pipeline.stage import RankStages
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import run_distributed

SEED, VOCAB, STEPS = 7, 64, 20
FAMILIES = {
    "llama": ModelConfig(name="llama", model_type="llama", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "tie_word_embeddings": False}),
    "mixtral": ModelConfig(name="mixtral", model_type="mixtral", config={
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False}),
    "qwen3_moe": ModelConfig(name="qwen3_moe", model_type="qwen3_moe", config={
        "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
        "num_experts_per_tok": 2, "tie_word_embeddings": False}),
    # a tied head, and a block whose init rescales its children's output projections
    "gpt2": ModelConfig(name="gpt2", model_type="gpt2", config={"n_embd": 32, "n_layer": 2, "n_head": 4}),
}
LAYOUTS = {
    "dp2": {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1},
    "pp2": {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1},
    "tp2": {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2},
    "dp2-full": {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1, "data_parallel_sharding": "full"},
    "dp2-optimizer": {"data_parallel": 2, "pipeline_parallel": 1, "tensor_parallel": 1,
                      "data_parallel_sharding": "optimizer"},
}
LAYOUT_CASES = [*((family, layout) for family in ("llama", "mixtral") for layout in ("dp2", "pp2", "tp2")),
                ("llama", "dp2-full"), ("llama", "dp2-optimizer"), ("qwen3_moe", "tp2"), ("gpt2", "dp2")]


def _eager_weights(family: str) -> dict[str, torch.Tensor]:
    """What ``strategy=ddp`` trains from: the model built eagerly right after ``seed_everything(SEED)`` (whose torch
    part is ``manual_seed``; this process does not set Lightning's seed, which later tests' ranks would inherit)."""
    torch.manual_seed(SEED)
    return {name: param.detach() for name, param in build_causal_lm(FAMILIES[family], VOCAB).named_parameters()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_meta_build_materialised_piece_by_piece_equals_the_eager_build(family):
    """Module by module, in any order (as pipeline stages and tensor-parallel blocks materialise them), and
    leaving the CPU generator where the eager build leaves it."""
    expected = _eager_weights(family)
    after_eager = torch.rand(4)
    torch.manual_seed(SEED)
    with meta_device():
        model = build_causal_lm(FAMILIES[family], VOCAB)
    after_meta = torch.rand(4)
    torch.manual_seed(SEED + 1)  # materialising later, whatever was drawn meanwhile
    materialize = Materializer(torch.device("cpu"), 0, init_owners(model)).materialize
    for name, child in reversed(list(model.named_children())):
        materialize(child, name)
    actual = dict(model.named_parameters())
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
    assert torch.equal(after_meta, after_eager)


def test_a_suspended_stream_draws_and_records_nothing():
    """For a model whose weights a checkpoint replaces: the meta build costs no draws."""
    torch.manual_seed(SEED)
    expected = torch.rand(4)
    torch.manual_seed(SEED)
    with meta_device(), eager_init_suspended():
        model = build_causal_lm(FAMILIES["llama"], VOCAB)
    assert torch.equal(torch.rand(4), expected)
    assert not any(eager_init_of(module) is not None for module in model.modules())
    Materializer(torch.device("cpu"), 0, init_owners(model)).materialize(model, "")
    assert all(torch.isfinite(param).all() for param in model.parameters())


def test_an_init_that_reads_values_on_meta_falls_back_to_per_module_seeds_with_a_warning():
    from transformers import PretrainedConfig, PreTrainedModel

    class ReadingConfig(PretrainedConfig):
        model_type = "merak_value_reading"

    class ValueReading(PreTrainedModel):
        config_class = ReadingConfig

        def __init__(self, config: ReadingConfig) -> None:
            super().__init__(config)
            self.proj = torch.nn.Linear(4, 4)
            self.post_init()

        def _init_weights(self, module: torch.nn.Module) -> None:
            if isinstance(module, torch.nn.Linear):
                std = 0.02 / max(1.0, float(module.weight.abs().max()))  # reads values, which meta tensors lack
                module.weight.normal_(std=std)
                module.bias.zero_()

    with pytest.warns(UserWarning, match=r"ValueReading\._init_weights cannot run on the meta device"):
        with meta_device():
            model = ValueReading(ReadingConfig())
    Materializer(torch.device("cpu"), 0, init_owners(model)).materialize(model, "")
    assert torch.isfinite(model.proj.weight).all() and torch.equal(model.proj.bias, torch.zeros(4))


def _layout_weights(strategy: Merak3DStrategy, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters under the unsplit model's names, shards gathered whole in the unsplit layout."""
    weights = {}
    for name, param in model.named_parameters():
        original = model.original_name(name) if isinstance(model, RankStages) else name
        value = param.detach()
        if isinstance(value, DTensor):
            value = strategy.to_original_layout(original, value.full_tensor())
        weights[original] = value.clone()
    return weights


def _merak3d_initial_weights(rank: int, world_size: int, family: str, layout: dict) -> dict[str, torch.Tensor]:
    """As ``merak-train`` builds it: seeded, then built on meta in ``configure_model()``; built on the first batch."""
    pl.seed_everything(SEED, verbose=False)
    strategy = Merak3DStrategy(**layout, timeout_s=120)
    module = CausalLMModule(None, model_factory=lambda: build_causal_lm(FAMILIES[family], VOCAB))
    with strategy.model_sharded_context():
        module.configure_model()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    batch = torch.randint(VOCAB, (4, 8), generator=torch.Generator().manual_seed(1))
    trainer.predict(module, DataLoader(TensorDataset(batch), batch_size=4))
    return _layout_weights(strategy, module.model)


@pytest.mark.distributed
@pytest.mark.parametrize(("family", "layout"), LAYOUT_CASES)
def test_merak3d_starts_from_the_eager_weights_in_every_layout(family, layout):
    results = run_distributed(_merak3d_initial_weights, 2, args=(family, LAYOUTS[layout]), timeout_s=180)
    gathered: dict[str, torch.Tensor] = {}
    for rank_weights in results:
        gathered.update(rank_weights)
    expected = _eager_weights(family)
    assert sorted(gathered) == sorted(expected)
    differing = [name for name, tensor in expected.items() if not torch.equal(gathered[name], tensor)]
    assert not differing, f"{len(differing)} of {len(expected)} tensors differ from the eager build: {differing}"


class _Seen(pl.Callback):
    """The token ids this rank trained on and its own (unreduced) loss, step by step."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.batches.append(batch[0].detach().clone())
        self.losses.append(float(outputs["loss"]))


def _training_run(rank: int, world_size: int, strategy_name: str,
                  family: str) -> tuple[list[torch.Tensor], list[float]]:
    """``merak-train``'s sequence on generated data, fp32: seed, data, model (eager for DDP, on meta for merak3d)."""
    from lightning_merak.modules.data import LanguageModelingData

    pl.seed_everything(SEED, workers=True, verbose=False)
    data = LanguageModelingData(DataConfig(name="synthetic", seq_len=16, batch_size=4, vocab_size=VOCAB,
                                           num_sequences=256))
    optim = OptimConfig(warmup_steps=2)

    def build() -> torch.nn.Module:
        return build_causal_lm(FAMILIES[family], data.vocab_size)

    if strategy_name == "merak3d":
        strategy = Merak3DStrategy(data_parallel=2, pipeline_parallel=1, tensor_parallel=1, timeout_s=120)
        module = CausalLMModule(None, optim, model_factory=build)
        with strategy.model_sharded_context():
            module.configure_model()
    else:
        strategy, module = "ddp", CausalLMModule(build(), optim)
    seen = _Seen()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS,
                         precision="32-true", gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[seen])
    trainer.fit(module, datamodule=data)
    return seen.batches, seen.losses


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: dropout, so the generators' state at setup counts
def test_merak3d_dp2_trains_like_ddp_from_its_own_initialisation(family: str):
    """Same batches on each data-parallel rank, and the same losses over 20 steps (fp32, within 1e-5)."""
    ddp = run_distributed(_training_run, 2, args=("ddp", family), timeout_s=180)
    merak3d = run_distributed(_training_run, 2, args=("merak3d", family), timeout_s=180)
    for rank, ((ddp_batches, ddp_losses), (batches, losses)) in enumerate(zip(ddp, merak3d)):
        assert len(batches) == len(ddp_batches) == STEPS
        assert all(torch.equal(a, b) for a, b in zip(batches, ddp_batches)), f"rank {rank} saw other batches"
        gaps = [abs(a - b) for a, b in zip(losses, ddp_losses)]
        assert max(gaps) <= 1e-5, f"rank {rank}: losses differ from DDP's by {gaps}"
    assert not torch.equal(merak3d[0][0][0], merak3d[1][0][0]), "both ranks saw the same batch"
