"""Modules the prefix and the head both call, and block arguments a pipeline cannot carry.

nanochat calls one parameterless norm right after the embedding and again after the last block: the first stage
keeps it as well as the last. A shared module with parameters would be trained as two copies unless the model ties
them under two names, whose gradients the stages sum; otherwise it is refused when the stages are built. Gemma 4's
blocks always share key/value states through a ``KVSharingDict``: refused before launch, and by the trace, naming
that cause rather than the KV cache.
"""

from __future__ import annotations

import copy

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_merak import testing
from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm
from lightning_merak.modules.config import ModelConfig
from lightning_merak.parallel.pipeline.stage import build_stage_module, tied_parameter_names
from lightning_merak.parallel.pipeline.trace import TraceError, trace_model
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.util.model_outputs import logits_of
from tests.test_merak3d import VOCAB, _Recorder, _reference, _ShardedData, _TestModule

SEQ, WIDTH, DEPTH = 8, 16, 4
TRAINED_STEPS = 3
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(torch.tanh(x))


class SharedNormNet(nn.Module):
    """Calls ``norm`` on the embedding's output and on the last block's, as nanochat does. ``norm``: ``"plain"``
    has no parameters, ``"weighted"`` has some, ``"tied"`` has some and is registered under a second name too."""

    def __init__(self, norm: str = "plain") -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(DEPTH))
        self.norm = nn.RMSNorm(WIDTH, elementwise_affine=False) if norm == "plain" else nn.LayerNorm(WIDTH)
        if norm == "tied":
            self.input_norm = self.norm
        self.head = nn.Linear(WIDTH, VOCAB)
        if norm != "plain":
            with torch.no_grad():  # not the identity, so that its gradient is not the only thing tested
                self.norm.weight.uniform_(0.5, 1.5)
                self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embedding(ids))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _model(norm: str) -> nn.Module:
    torch.manual_seed(0)
    return SharedNormNet(norm)


def _tiny(model_type: str) -> nn.Module:
    torch.manual_seed(0)
    model = build_causal_lm(ModelConfig(name=model_type, model_type=model_type, config=dict(SMALL)), vocab_size=VOCAB)
    model.config.use_cache = False
    return model


def chained_stages_match_the_model(model: nn.Module, boundaries: tuple[int, ...],
                                   ids: torch.Tensor | None = None) -> None:
    """Stages run one after another in one process, each boundary's tensors cut from the graph and their
    gradients handed back by hand, give the model's logits and every gradient."""
    if ids is None:
        ids = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    trace = trace_model(model, ids, profile=False)
    expected_logits = logits_of(model(ids))
    expected_logits.square().mean().backward()
    expected = testing.snapshot_gradients(model)
    stages = [build_stage_module(copy.deepcopy(model), trace, boundaries, index, lambda m, x: m(x))
              for index in range(len(boundaries))]
    carried, received, outputs = (ids,), [], []
    for stage in stages:
        stage.zero_grad()
        output = stage(*carried)
        outputs.append(output)
        if not stage.is_last:
            carried = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in output)
            received.append(carried)
    torch.testing.assert_close(outputs[-1], expected_logits, rtol=1e-5, atol=1e-6)
    outputs[-1].square().mean().backward()
    for output, inputs in reversed(list(zip(outputs, received))):
        pairs = [(out, given.grad) for out, given in zip(output, inputs)
                 if out.requires_grad and given.grad is not None]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    gradients: dict[str, torch.Tensor] = {}
    for stage in stages:  # a parameter tied between the first and the last stage: the stages' gradients summed
        for name, param in stage.named_parameters():
            if param.grad is not None:
                original = stage.original_name(name)
                gradients[original] = gradients.get(original, 0) + param.grad
    assert gradients.keys() == expected.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, expected[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(("model", "boundaries"), [
    ("plain", (0, 3)), ("plain", (0, 2, 4)), ("tied", (0, 3)), ("nanochat", (0, 2))])
def test_a_module_the_prefix_and_the_head_share_runs_on_the_first_and_the_last_stage(model, boundaries):
    """The norm nanochat calls before its first block and after its last is kept by the first stage too (where
    it lived on the last stage only, and the first stage's forward failed calling it)."""
    whole = _tiny("nanochat") if model == "nanochat" else _model(model)
    trace = trace_model(whole, torch.randint(VOCAB, (1, SEQ)), profile=False)
    assert trace.shared_paths == ["model.norm" if model == "nanochat" else "norm"]
    chained_stages_match_the_model(whole, boundaries)


def test_a_head_the_prefix_does_not_call_is_not_shared():
    """A transformers model's inner model runs the blocks and the final norm in one call: not a prefix call."""
    trace = trace_model(_tiny("llama"), torch.randint(VOCAB, (1, SEQ)), profile=False)
    assert trace.shared_paths == [] and "model.norm" in trace.suffix_paths


def test_a_shared_module_with_parameters_under_one_name_is_refused_when_the_stages_are_built():
    """Both stages would train a copy of its weights (tied under a second name, the stages sum their gradients:
    the ``tied`` cases above and below)."""
    model = _model("weighted")
    trace = trace_model(model, torch.randint(VOCAB, (1, SEQ)), profile=False)
    for stage in (0, 1):
        with pytest.raises(TraceError, match=r"norm runs both before the first block of blocks and after its last"
                                             r".*\(norm\.weight, norm\.bias\).*use pipeline_parallel=1"):
            build_stage_module(copy.deepcopy(model), trace, (0, 3), stage, lambda m, x: m(x))


def test_gemma4_is_refused_for_its_shared_key_values_not_the_kv_cache():
    """Gemma 4 passes its blocks a KVSharingDict whatever its config: the refusal names it, before launch too,
    and no longer tells a model whose cache is off to turn it off."""
    model = _tiny("gemma4_text")
    cause = (r"gemma4_text's blocks \(model.layers\) share key/value states through shared_kv_states "
             r"\(a KVSharingDict\), which cannot cross pipeline stages.*use pipeline_parallel=1 and tensor_parallel=1")
    with pytest.raises(TraceError, match=cause) as refused:
        trace_model(model, torch.randint(VOCAB, (1, SEQ)), profile=False)
    assert "use_cache" not in str(refused.value)
    module = CausalLMModule(model)
    with pytest.raises(ValueError, match=cause):
        Merak3DStrategy(pipeline_parallel=2).validate_before_launch(module, 2)
    with pytest.raises(ValueError, match="KVSharingDict.*tensor_parallel=1"):  # tensor parallelism's family check
        Merak3DStrategy(tensor_parallel=2).validate_before_launch(module, 2)
    Merak3DStrategy(data_parallel=2).validate_before_launch(module, 2)


class _Options:
    """Not a tensor, nor a constant."""


class _OptionsBlock(_Block):
    def forward(self, x: torch.Tensor, options: _Options | None = None) -> torch.Tensor:
        return super().forward(x)


class _OptionsNet(SharedNormNet):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_OptionsBlock() for _ in range(DEPTH))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for block in self.blocks:
            x = block(x, options=_Options())
        return self.head(x)


def test_another_object_argument_is_named_with_its_fix():
    with pytest.raises(TraceError, match=r"the blocks of blocks receive options \(a _Options\), neither a tensor nor "
                                         r"a constant.*pass the blocks tensors instead or use pipeline_parallel=1"):
        trace_model(_OptionsNet(), torch.randint(VOCAB, (1, SEQ)), profile=False)


# Trained under merak3d -------------------------------------------------------------------------------------

def _train_rank(rank: int, world_size: int, norms: list[str]) -> list[tuple[list, list]]:
    """Each model of ``norms`` trained at pipeline_parallel=2 on these ranks: its losses and gradients."""
    results = []
    for norm in norms:
        recorder = _Recorder(tied_parameter_names(_model(norm)))
        trainer = pl.Trainer(
            accelerator="cpu", devices=world_size, strategy=Merak3DStrategy(
                pipeline_parallel=2, micro_batches=2, partition="uniform", timeout_s=60),
            max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[recorder],
            use_distributed_sampler=False)
        trainer.fit(_TestModule(_model(norm)), datamodule=_ShardedData(0, TRAINED_STEPS))
        results.append((recorder.losses, recorder.gradients))
    return results


@pytest.mark.distributed
def test_a_shared_norm_trains_at_pp2_as_one_process():
    """The parameterless norm of the first and the last stage, and a weighted one tied under two names (its
    gradients summed between the stages), train as in one process."""
    norms = ["plain", "tied"]
    results = testing.run_distributed(_train_rank, 2, args=(norms,), timeout_s=120)
    for index, norm in enumerate(norms):
        candidate = testing.merge_rank_traces([rank_results[index] for rank_results in results])
        reference = _reference(norm, module=_TestModule(_model(norm)))
        reference = testing.TrainingTrace(reference.losses[:TRAINED_STEPS], reference.gradients[:TRAINED_STEPS])
        testing.assert_traces_match(reference, candidate, loss_rtol=1e-5, grad_rtol=1e-4)
        if norm == "tied":
            assert {"norm.weight", "norm.bias"} <= candidate.gradients[0].keys()
