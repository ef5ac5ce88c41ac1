"""merak3d on the meta device: no rank ever holds more than its share, and training is unchanged.

A model created in ``configure_model()`` (merak3d's sharded context is the meta device) is traced,
cut and split on meta; each rank materialises only its part, one block at a time. Materialised
parameter bytes are counted on every rank at every point of the build (each materialisation, each
tensor-parallel split, the first training step) and must stay within the rank's final share plus
one whole block plus the embedding and the head; while the model is traced, no embedding table is
ever whole on a rank (only the rows the traced batch looks up). With the same weights loaded through
the pretrained seam, losses and gradients equal the single-process reference.
"""

from __future__ import annotations

import gc
import weakref

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_merak.modules.causal_lm import build_causal_lm
from lightning_merak.parallel.materialize import Materializer, copy_full_tensors, init_owners
from lightning_merak.parallel.pipeline.stage import tied_parameter_names
from lightning_merak.parallel.pipeline.trace import find_trunk
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import assert_traces_match, merge_rank_traces, run_distributed
from tests.test_merak3d import MODELS, STEPS, VOCAB, _Recorder, _reference, _ShardedData, _TestModule


def _materialised_bytes() -> int:
    """Bytes of every live parameter with storage in this process (a DTensor's local shard)."""
    gc.collect()
    total = 0
    for obj in gc.get_objects():
        if type(obj) in (nn.Parameter, DTensor) and not obj.is_meta and isinstance(obj, nn.Parameter):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            total += local.numel() * local.element_size()
    return total


def _whole_tables(shapes: set[tuple[int, ...]]) -> set[tuple[int, ...]]:
    """Shapes among ``shapes`` of the embedding tables (nn.Embedding) materialised whole in this process."""
    return {tuple(obj.weight.shape) for obj in gc.get_objects()
            if isinstance(obj, nn.Embedding) and not obj.weight.is_meta and tuple(obj.weight.shape) in shapes}


def _whole_parameters(shapes: set[tuple[int, ...]]) -> set[tuple[int, ...]]:
    """Shapes among ``shapes`` of the plain (unsplit) parameters materialised in this process."""
    return {tuple(obj.shape) for obj in gc.get_objects()
            if type(obj) is nn.Parameter and not obj.is_meta and tuple(obj.shape) in shapes}


class _Peak:
    """Peak materialised parameter bytes and the vocabulary-sized parameters ever whole (shapes among
    ``table_shapes``); while ``tracing``, also the trace's peak and the tables it held whole."""

    def __init__(self) -> None:
        self.bytes = self.trace_bytes = 0
        self.tracing = False
        self.table_shapes: set[tuple[int, ...]] = set()
        self.whole_tables: set[tuple[int, ...]] = set()
        self.whole_vocabulary: set[tuple[int, ...]] = set()

    def __call__(self) -> None:
        held = _materialised_bytes()
        self.bytes = max(self.bytes, held)
        self.whole_vocabulary |= _whole_parameters(self.table_shapes)
        if self.tracing:
            self.trace_bytes = max(self.trace_bytes, held)
            self.whole_tables |= _whole_tables(self.table_shapes)


class _MetaModule(_TestModule):
    """Builds its model in ``configure_model`` and loads ``state_dict`` through the pretrained seam."""

    def __init__(self, model_name: str, state_dict: dict[str, torch.Tensor]) -> None:
        super().__init__(None,
                         model_factory=lambda: build_causal_lm(MODELS[model_name], vocab_size=VOCAB))
        self.state_dict_to_load = state_dict
        self.loaded_names: list[str] = []

    def configure_model(self) -> None:
        super().configure_model()
        self.model.config.use_cache = False
        self.built_on_meta = all(p.is_meta for p in self.model.parameters())

    def load_pretrained_weights(self, tensors, layout_changes) -> None:
        self.loaded_names = sorted(tensors)
        copy_full_tensors(tensors, layout_changes, self.state_dict_to_load)


class _Watch(pl.Callback):
    def __init__(self, peak: _Peak) -> None:
        self.peak = peak

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.peak()

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.peak()


def _observed_peak() -> _Peak:
    """A :class:`_Peak` taken after every materialisation and every block's split, and told when the trace runs."""
    from lightning_merak.parallel.pipeline import meta_trace
    from lightning_merak.parallel.tensor import blocks as tensor_parallel
    from lightning_merak.strategies.merak3d import build

    gc.freeze()  # what the imports made: never a parameter, and not scanned again
    peak = _Peak()
    Materializer.observer = peak
    for owner in (tensor_parallel, build):  # the split check's copies and each block's split
        split = owner.apply_tensor_parallel

        def observed(*args, split=split, **kwargs):
            changes = split(*args, **kwargs)
            peak()
            return changes
        owner.apply_tensor_parallel = observed
    trace_meta_model = meta_trace.trace_meta_model

    def traced(*args, **kwargs):
        peak.tracing = True
        try:
            return trace_meta_model(*args, **kwargs)
        finally:
            peak.tracing = False
    meta_trace.trace_meta_model = traced
    return peak


def _meta_rank(rank: int, world_size: int, model_name: str, layout: dict) -> tuple:
    peak = _observed_peak()
    torch.manual_seed(0)
    reference = build_causal_lm(MODELS[model_name], vocab_size=VOCAB)
    peak.table_shapes = {tuple(m.weight.shape) for m in reference.modules() if isinstance(m, nn.Embedding)}
    state_dict = {name: tensor.detach().clone() for name, tensor in reference.state_dict().items()}
    tied = tied_parameter_names(reference)
    trunk = find_trunk(reference)[1]
    block = sum(p.numel() * p.element_size() for p in trunk[0].parameters())
    outside = sum(p.numel() * p.element_size() for p in reference.parameters()) - len(trunk) * block
    del reference, trunk
    module = _MetaModule(model_name, state_dict)
    recorder = _Recorder(tied)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120), max_epochs=1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder, _Watch(peak)],
    )
    trainer.fit(module, datamodule=_ShardedData(0, STEPS))
    share = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                for p in module.model.parameters())
    return (recorder.losses, recorder.gradients), (module.built_on_meta, peak.bytes, share, block, outside,
                                                   module.loaded_names, peak.trace_bytes, peak.whole_tables,
                                                   peak.whole_vocabulary)


PP2 = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 1}
TP2 = {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2}


@pytest.mark.distributed
@pytest.mark.parametrize(("model_name", "layout"), [("llama", PP2), ("llama", TP2), ("gpt2", PP2)],
                         ids=["llama-pp2", "llama-tp2", "gpt2-tied-pp2"])
def test_meta_build_holds_only_its_share_and_trains_like_the_reference(model_name, layout):
    results = run_distributed(_meta_rank, 2, args=(model_name, layout), timeout_s=300)
    for rank, (_, (on_meta, peak, share, block, outside, loaded, trace_peak, whole, vocabulary)) in enumerate(
            results):
        assert on_meta, "configure_model did not build on the meta device"
        assert loaded, "the pretrained seam was not called"
        assert trace_peak > 0, "the trace was not observed"
        assert not whole, f"rank {rank} materialised whole embedding tables {sorted(whole)} while tracing"
        assert peak <= share + block + outside, f"rank {rank} held {peak} bytes, its share is {share}"
        if layout["tensor_parallel"] == 2:  # the vocabulary is split before it is materialised
            assert not vocabulary, f"rank {rank} materialised whole vocabulary tensors {sorted(vocabulary)}"
            assert peak <= share + block, f"rank {rank} held {peak} bytes, its share is {share}"
        if layout["pipeline_parallel"] == 2:
            # the other stage holds at least one of the 4 blocks, whichever cut AutoPipe's timing chose
            assert share <= 3 * block + outside, f"rank {rank} kept more than its stage"
    assert_traces_match(_reference(model_name), merge_rank_traces([trace for trace, _ in results]), loss_rtol=1e-5,
                        grad_rtol=1e-4)


def _vocabulary_shapes(build) -> set[tuple[int, ...]]:
    with torch.device("meta"):
        model = build()
    return {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Embedding)
            and m.weight.shape[0] == model.config.vocab_size}


def _pretrained_rank(rank: int, world_size: int, source: str, vocab: int, layout: dict) -> tuple:
    """The product's path (``configure_model`` on meta, ``pretrained_path``), watched: peak bytes, share, logits."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_merak.hf import load_pretrained, pretrained_causal_lm
    from lightning_merak.modules.causal_lm import CausalLMModule

    def build():
        model = pretrained_causal_lm(source, vocab, weights=False)
        model.config.use_cache = False
        return model

    peak = _observed_peak()
    peak.table_shapes = _vocabulary_shapes(build)
    module = CausalLMModule(None, model_factory=build, pretrained_path=source)
    read = []

    def load_and_watch(tensors, layout_changes) -> None:  # CausalLMModule's seam, counting the bytes read
        read.append(load_pretrained(tensors, source, layout_changes).bytes_read)
        peak()
    module.load_pretrained_weights = load_and_watch
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(**layout, timeout_s=120),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[_Watch(peak)])
    batches = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = torch.cat(trainer.predict(module, DataLoader(TensorDataset(batches), batch_size=2)))
    share = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                for p in module.model.parameters())
    return logits, peak.bytes, share, peak.whole_vocabulary, sum(read)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["llama", "gemma"], ids=["llama-untied", "gemma-tied-scaled"])
def test_a_pretrained_tp2_build_holds_only_its_vocabulary_rows(tmp_path, family):
    """tp=2, a vocabulary of 4097 rows (uneven halves) that outweighs the blocks: no rank ever materialises a
    whole table or head, nor more than its share plus one block, and reads no more than its share from the file;
    logits equal ``from_pretrained``'s."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    vocab = 4097
    config = CONFIG_MAPPING[family](vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=family == "gemma",
                                    **FAMILIES[family])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    block = _bytes(find_trunk(reference)[1][0].parameters())
    with torch.no_grad():
        expected = reference(torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(1))).logits
    layout = {"data_parallel": 1, "pipeline_parallel": 1, "tensor_parallel": 2}
    results = run_distributed(_pretrained_rank, 2, args=(str(tmp_path), vocab, layout), timeout_s=180)
    for rank, (logits, peak, share, whole, read) in enumerate(results):
        assert not whole, f"rank {rank} materialised whole vocabulary tensors {sorted(whole)}"
        assert peak <= share + block, f"rank {rank} held {peak} bytes: share {share} + one block {block}"
        assert 0 < read <= share, f"rank {rank} read {read} bytes from the checkpoint, its share is {share}"
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def _random_init_rank(rank: int, world_size: int, family: str, config: dict, layout: dict) -> list:
    """A meta model without pretrained weights, built after ``torch.manual_seed(0)``: each rank's vocabulary rows."""
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from lightning_merak.modules.causal_lm import CausalLMModule
    from lightning_merak.parallel.tensor.vocab import VocabParallelEmbedding, VocabParallelLMHead

    def build():
        return AutoModelForCausalLM.from_config(CONFIG_MAPPING[family](**config))

    module = CausalLMModule(None, model_factory=build)
    strategy = Merak3DStrategy(**layout, timeout_s=120)
    torch.manual_seed(0)
    with strategy.model_sharded_context():
        module.configure_model()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False)
    trainer.predict(module, DataLoader(TensorDataset(torch.randint(config["vocab_size"], (4, 8))), batch_size=4))
    rows = [(type(m).__name__, m.start, m.weight.to_local().detach().clone()) for m in module.model.modules()
            if isinstance(m, (VocabParallelEmbedding, VocabParallelLMHead))]
    return rows


@pytest.mark.distributed
def test_random_init_rows_equal_the_single_process_init_at_pp2_tp2():
    """Without pretrained weights each rank's rows are those of the table a single process builds eagerly with the
    same seed (GPT-2 ties the head to the embedding: the last stage's head rows are the first stage's embedding
    rows)."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = {"vocab_size": VOCAB + 1, "n_positions": 64, "use_cache": False, **FAMILIES["gpt2"]}
    layout = {"data_parallel": 1, "pipeline_parallel": 2, "tensor_parallel": 2}
    results = run_distributed(_random_init_rank, 4, args=("gpt2", config, layout), timeout_s=180)
    torch.manual_seed(0)
    table = AutoModelForCausalLM.from_config(GPT2Config(**config)).transformer.wte.weight.detach()
    kinds = [kind for rows in results for kind, _, _ in rows]
    assert sorted(set(kinds)) == ["VocabParallelEmbedding", "VocabParallelLMHead"], kinds
    for rows in results:
        for kind, start, local in rows:
            assert torch.equal(local, table[start:start + local.shape[0]]), (kind, start)


FAMILIES = {
    "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4},
    "qwen2": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2},
    "mistral": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2},
    "gpt_neox": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "rotary_pct": 0.5},
    # a scaled embedding (a buffer beside its table) with a zero padding row, tied to the head
    "gemma": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8},
    # learned positions computed inside the table's forward (offset by 2)
    "opt": {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "word_embed_proj_dim": 32},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_materialised_buffers_equal_a_model_built_on_cpu(family):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[family](vocab_size=VOCAB, **FAMILIES[family])
    expected = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    materialize = Materializer(torch.device("cpu"), 0, init_owners(model)).materialize
    for name, child in model.named_children():  # part by part, as a rank materialises its stage
        materialize(child, name)
    buffers = dict(model.named_buffers())
    assert sorted(buffers) == sorted(name for name, _ in expected.named_buffers())
    for name, buffer in expected.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, rtol=0, atol=0, msg=name)
    assert not any(p.is_meta for p in model.parameters())
    if config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_a_parameter_nothing_initialises_is_refused_by_name():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled())
    materializer = Materializer(torch.device("cpu"), 0, init_owners(model))
    materializer.materialize(model[0], "0")
    assert not torch.isnan(model[0].weight).any()
    with pytest.raises(RuntimeError, match=r"1\.scale \(Scaled\).*reset_parameters"):
        materializer.materialize(model[1], "1")


class _SkipNet(nn.Module):
    """No ModuleList of blocks, and a skip connection across its layers: nothing merak3d could pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded = self.embed(ids)
        return self.head(torch.tanh(self.second(torch.tanh(self.first(embedded)))) + embedded)


def _skip_net_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return _SkipNet().state_dict()


class _SkipModule(_TestModule):
    def __init__(self) -> None:
        super().__init__(None, model_factory=_SkipNet)

    def load_pretrained_weights(self, tensors, layout_changes) -> None:
        copy_full_tensors(tensors, layout_changes, _skip_net_state())


def _skip_rank(rank: int, world_size: int) -> tuple:
    module = _SkipModule()
    recorder = _Recorder([])
    strategy = Merak3DStrategy(pipeline_parallel=1, tensor_parallel=1, recompute="auto", timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[recorder],
    )
    trainer.fit(module, datamodule=_ShardedData(0, STEPS))
    return recorder.losses, recorder.gradients


@pytest.mark.distributed
def test_without_pipeline_or_tensor_parallelism_any_model_trains_as_data_parallel():
    """A model DDP trains (no trunk, a skip connection) trains under merak3d at pp=tp=1, planned or not."""
    from lightning_merak.testing import TrainingTrace, snapshot_gradients
    from tests.test_merak3d import _batches, _make_optimizer

    module = _SkipModule()
    module.model = _SkipNet()
    module.model.load_state_dict(_skip_net_state())
    optimizer = _make_optimizer(module.model.parameters(), "sgd")
    reference = TrainingTrace()
    for batch in _batches():
        optimizer.zero_grad()
        loss = module.compute_loss((batch,))
        loss.backward()
        reference.append(loss.item(), snapshot_gradients(module.model))
        optimizer.step()
    results = run_distributed(_skip_rank, 2, timeout_s=300)
    assert_traces_match(reference, merge_rank_traces(results), loss_rtol=1e-5, grad_rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma", "opt"])
def test_a_meta_model_traces_like_the_real_one_and_stays_on_meta(family):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from lightning_merak.parallel.pipeline.trace import trace_model

    config = CONFIG_MAPPING[family](vocab_size=VOCAB, use_cache=False, **FAMILIES[family])
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    expected = trace_model(real, ids, profile=True, profile_repeats=1)
    traced = trace_model(meta, ids, profile=True, profile_repeats=1)
    assert all(p.is_meta for p in meta.parameters())
    assert (traced.trunk_path, traced.num_blocks, traced.block_output_index) == (
        expected.trunk_path, expected.num_blocks, expected.block_output_index)
    assert [(s.module, s.function) for s in traced.head] == [(s.module, s.function) for s in expected.head]
    assert [c.param_bytes for c in traced.costs] == [c.param_bytes for c in expected.costs]
    assert traced.sample_hidden.shape == expected.sample_hidden.shape and not traced.sample_hidden.is_meta
    for side, reference in zip(traced.sample_side_tensors, expected.sample_side_tensors, strict=True):
        torch.testing.assert_close(side, reference)  # masks and rotary tables: computed, not shapes only


def test_a_skip_connection_across_blocks_is_refused_on_meta():
    from lightning_merak.parallel.pipeline.trace import TraceError, trace_model

    class Skipping(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            first = hidden = self.embed(ids)
            for block in self.blocks:
                hidden = block(hidden) + first
            return self.head(hidden)

    with torch.device("meta"):
        model = Skipping()
    with pytest.raises(TraceError, match="compute the mix inside the block that reads it"):
        trace_model(model, torch.randint(VOCAB, (2, 4)), profile=False)


class _Held:
    """What a meta trace materialises: the peak bytes of its live parameters, the embedding tables it held whole
    and (given ``vocab``) every parameter with all ``vocab`` rows."""

    def __init__(self, model: nn.Module, vocab: int = -1) -> None:
        from lightning_merak.parallel.pipeline.trace import default_materializer

        self._base = default_materializer(model, torch.device("cpu"))
        self._shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Embedding)}
        self._vocab = vocab
        self._params: weakref.WeakSet = weakref.WeakSet()
        self.peak, self.whole_tables, self.whole_vocabulary = 0, [], []

    def materialize_with(self, copy_: nn.Module):
        materialize = self._base(copy_)

        def observed(module: nn.Module, name: str, recurse: bool = True) -> None:
            materialize(module, name, recurse)
            self._params.update(p for p in module.parameters() if not p.is_meta)
            self.whole_vocabulary += [name for name, p in module.named_parameters(prefix=name)
                                      if not p.is_meta and p.shape[0] == self._vocab]
            self.whole_tables += [path for path, sub in module.named_modules(prefix=name)
                                  if isinstance(sub, nn.Embedding)
                                  and not sub.weight.is_meta and tuple(sub.weight.shape) in self._shapes]
            gc.collect()
            self.peak = max(self.peak, sum(p.numel() * p.element_size() for p in self._params))
        return observed


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in params}.values())


@pytest.mark.parametrize("profile", [False, True], ids=["trace", "profile"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma", "opt"])
def test_a_meta_trace_materialises_only_the_embedding_rows_it_looks_up(family, profile):
    """A 4096-row table is never whole: the trace holds the rows its batch looks up (the head's profile holds the
    head, tied or not), and those rows look like a materialised table's (shape, dtype, scale, zero padding row)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from lightning_merak.parallel.pipeline.trace import trace_model

    vocab = 4096
    config = CONFIG_MAPPING[family](vocab_size=vocab, use_cache=False, **FAMILIES[family])
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config).eval()  # no dropout: zeros are padding rows only
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    ids[0, :3] = config.pad_token_id if config.pad_token_id is not None else 0
    held = _Held(meta)
    gc.freeze()  # what exists now is never a parameter the trace made: its collections skip it
    try:
        traced = trace_model(meta, ids, profile=profile, profile_repeats=1, materialize_with=held.materialize_with)
    finally:
        gc.unfreeze()
    expected = trace_model(real, ids, profile=profile, profile_repeats=1)
    assert not held.whole_tables, f"the trace materialised whole tables {held.whole_tables}"
    tables = _bytes(m.weight for m in real.modules() if isinstance(m, nn.Embedding))
    block = _bytes(find_trunk(real)[1][0].parameters())
    head = _bytes(expected.outside_parameters(real)[1])
    assert held.peak <= (block + head if profile else tables / 8), (held.peak, tables, block, head)
    hidden, reference = traced.sample_hidden, expected.sample_hidden
    assert (hidden.shape, hidden.dtype) == (reference.shape, reference.dtype)
    assert 0.7 < (hidden.std() / reference.std()).item() < 1.4, "stand-in rows drawn unlike the table's"
    assert torch.equal(hidden == 0, reference == 0), "a padding row is not zero (or another row is)"
    if profile:
        assert [c.param_bytes for c in traced.costs] == [c.param_bytes for c in expected.costs]
        assert traced.costs[0].forward_s > 0 and traced.costs[0].backward_s >= 0


def test_a_table_read_outside_a_lookup_is_materialised_whole_and_traced():
    from lightning_merak.parallel.pipeline.trace import trace_model

    class Indexed(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.weight[ids]

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = Indexed(VOCAB, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.head = nn.Linear(8, VOCAB)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            hidden = self.embed(ids)
            for block in self.blocks:
                hidden = block(hidden)
            return self.head(hidden)

    with torch.device("meta"):
        model = Net()
    trace = trace_model(model, torch.randint(VOCAB, (2, 4)), profile=True, profile_repeats=1)
    assert not trace.sample_hidden.is_meta and trace.sample_hidden.shape == (2, 4, 8)
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_profiling_times_the_head_on_a_slice_of_its_rows(family, monkeypatch):
    """With a head larger than the slice, no vocabulary-sized tensor is ever whole (Llama untied, GPT-2 tied,
    Gemma 2 soft-capping its logits after the head); saved bytes equal the whole head's, times are positive."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from lightning_merak.parallel.pipeline import meta_trace
    from lightning_merak.parallel.pipeline.trace import trace_model

    vocab = 4096
    options = FAMILIES.get(family, {**FAMILIES["gemma"], "final_logit_softcapping": 30.0})
    config = CONFIG_MAPPING[family](vocab_size=vocab, use_cache=False, **options)
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config).eval()
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config).eval()
    head = _bytes(real.get_output_embeddings().parameters())
    monkeypatch.setattr(meta_trace, "HEAD_SLICE_BYTES", head // 8)
    ids = torch.randint(vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    held = _Held(meta, vocab)
    gc.freeze()
    try:
        traced = trace_model(meta, ids, profile=True, profile_repeats=1, materialize_with=held.materialize_with)
    finally:
        gc.unfreeze()
    expected = trace_model(real, ids, profile=True, profile_repeats=1)
    assert not held.whole_tables and not held.whole_vocabulary, (held.whole_tables, held.whole_vocabulary)
    block = _bytes(find_trunk(real)[1][0].parameters())
    # one node materialised at a time: a block, or a slice of the head
    assert held.peak <= block + head // 4, (held.peak, block, head)
    suffix, reference = traced.costs[-1], expected.costs[-1]
    assert (suffix.param_bytes, suffix.output_bytes, suffix.saved_bytes) == (
        reference.param_bytes, reference.output_bytes, reference.saved_bytes)
    assert suffix.forward_s > 0 and suffix.backward_s > 0
