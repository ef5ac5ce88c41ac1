"""Adapters on a quantised frozen base under merak3d's data-parallel sharding, against the single-process model.

``data_parallel_sharding="full"`` shards the adapters (and their gradients and Adam state), the frozen float
parts, a 4-bit base's packed codes and the project INT4 base (codes, scales and zero-points) with FSDP2; the
bitsandbytes codes' statistics stay whole on every rank, and so does an int8 base (``docs/guides/adapters.md``).
ZeRO-1/2 shard only the trainable parameters. Every run starts from the same float weights, so losses, adapter
gradients and updated adapter weights equal the single-process quantised model's (fp32 compute). One launch trains
them all in turn; checkpoints resume from ``full`` under ZeRO-1, from ZeRO-2 under ``full`` and, INT4, from ``full``
under ``full``.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_merak.adapters import QuantLinearInt4
from lightning_merak.cli.options.adapter import LoRAAdapterConfig, QAHiRAAdapterConfig, Quantization
from lightning_merak.strategies.merak3d import Merak3DStrategy
from lightning_merak.testing import LayoutTraceRecorder, TrainingTrace, assert_traces_match, run_distributed
from tests.test_adapters_meta import OPTIONS, TARGETS, _base, _MetaAdapterModule, _reference, _weights
from tests.test_merak3d import STEPS, VOCAB, _ShardedData

OPTIONS.update({  # beside test_adapters_meta's: QA-HiRA and LoRA (QLoRA) on bitsandbytes NF4
    "qahira-nf4": lambda: QAHiRAAdapterConfig(r=2, quantization=Quantization.nf4, lambda_in=4, lambda_out=2,
                                              target_modules=list(TARGETS)),
    "lora-nf4": lambda: LoRAAdapterConfig(r=4, quantization=Quantization.nf4, target_modules=list(TARGETS)),
})
RESUMED_AT = 3
RUNS = (  # (option, data_parallel_sharding, first step, last step, saves, resumes): checkpoints by option
    ("qbara-nf4", "full", 0, RESUMED_AT, True, False),
    ("qbara-nf4", "optimizer", RESUMED_AT, STEPS, False, True),
    ("qahira-nf4", "gradients", 0, RESUMED_AT, True, False),
    ("qahira-nf4", "full", RESUMED_AT, STEPS, False, True),
    ("lora-nf4", "full", 0, STEPS, False, False),
    ("lora-int8", "full", 0, STEPS, False, False),
    ("qahira-int4", "full", 0, RESUMED_AT, True, False),
    ("qahira-int4", "full", RESUMED_AT, STEPS, False, True),
)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a ``DTensor``'s ``numel()`` is its whole tensor's)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _fit(world_size: int, option_name: str, mode: str, first_step: int, last_step: int, saves: bool, resumes: bool,
         directory: str) -> dict:
    checkpoint = f"{directory}/{option_name}.ckpt"
    module = _MetaAdapterModule(option_name, _weights(option_name))
    trace = LayoutTraceRecorder()  # ZeRO's shard parameters keep no gradients to record
    strategy = Merak3DStrategy(data_parallel=2, data_parallel_sharding=mode, timeout_s=120)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world_size, strategy=strategy, max_epochs=2 if resumes else 1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, use_distributed_sampler=False, callbacks=[trace],
    )
    trainer.fit(module, datamodule=_ShardedData(first_step, last_step), ckpt_path=checkpoint if resumes else None)
    if saves:
        trainer.save_checkpoint(checkpoint)
    adapters = [(name, param) for name, param in module.model.named_parameters() if param.requires_grad]
    local = sum(_local(param).numel() for _, param in adapters)
    import bitsandbytes as bnb  # after the model: importing it is heavy

    layers = [layer for layer in module.model.modules()
              if isinstance(layer, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt, QuantLinearInt4))]
    # the frozen base's storage: bitsandbytes' codes, INT4's codes, scales and zero-points
    stored = [tensor for layer in layers for tensor in (
        (layer.qweight, layer.scales, layer.zeros) if isinstance(layer, QuantLinearInt4) else (layer.weight,))]
    state = [value for optimizer in strategy.optimizers for entry in optimizer.state.values()
             for value in entry.values() if isinstance(value, torch.Tensor) and value.ndim > 0]
    return {
        "losses": trace.losses, "gradients": trace.gradients,
        "weights": {name: (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
                    for name, param in adapters},
        "adapter_share": local / sum(param.numel() for _, param in adapters),
        "adam_share": sum(_local(value).numel() for value in state) / (2 * sum(param.numel() for _, param in adapters)),
        "base": sorted({type(layer).__name__ for layer in layers}),
        "codes_share": sum(_local(tensor).numel() for tensor in stored) / sum(tensor.numel() for tensor in stored),
        "frozen_base": not any(tensor.requires_grad for tensor in stored),
        # each 4-bit layer's statistics, whole: on its weight, or under full on the layer (set on the gathered codes)
        "statistics": all(any(getattr(holder, "quant_state", None) is not None for holder in (layer.weight, layer))
                          for layer in layers if isinstance(layer, bnb.nn.Linear4bit)),
    }


def _sharded_rank(rank: int, world_size: int, directory: str) -> list[dict]:
    return [_fit(world_size, *run, directory=directory) for run in RUNS]


@pytest.mark.distributed
def test_quantised_adapters_under_full_and_zero_sharding_equal_the_single_process_model(tmp_path):
    """NF4 / int8 / INT4 bases with Q-BaRA, QA-HiRA and LoRA at dp2: ``full`` (adapters, Adam state, NF4 codes and
    INT4 codes with their scales and zero-points halved, NF4 statistics whole; int8 whole), ZeRO-1 and ZeRO-2 (the
    base whole), NF4 resumed in another mode, INT4 under ``full`` again."""
    results = run_distributed(_sharded_rank, 2, args=(str(tmp_path),), timeout_s=300)
    references: dict[str, tuple[TrainingTrace, dict[str, torch.Tensor]]] = {}
    for index, (option_name, mode, first, last, _, _) in enumerate(RUNS):
        if option_name not in references:
            trace, trained = _reference(option_name)
            references[option_name] = (trace, {name: param.detach().clone()
                                               for name, param in trained.named_parameters() if param.requires_grad})
        trace, weights = references[option_name]
        runs = [result[index] for result in results]
        steps = TrainingTrace(trace.losses[first:last], trace.gradients[first:last])
        for run in runs:  # ZeRO's parameters hold no gradients after the step: only the full runs record them
            recorded = TrainingTrace(run["losses"], run["gradients"] if mode == "full" else [{}] * (last - first))
            # Two ranks' halves of the batch summed in another order than one process's: LoRA's A gradients came
            # within 1.4e-5 (NF4, an AVX512 host) and 7.2e-6 (int8, an AVX2 host) of the largest entry, so 2e-5
            try:
                assert_traces_match(steps, recorded, loss_rtol=1e-5, grad_rtol=2e-5, check_gradients=mode == "full")
            except AssertionError as error:
                raise AssertionError(f"{option_name} under {mode}: {error}") from None
            int8 = "int8" in option_name
            base = "Linear8bitLt" if int8 else "QuantLinearInt4" if "int4" in option_name else "Linear4bit"
            assert run["base"] == [base], run["base"]
            assert run["statistics"] and run["frozen_base"], (option_name, mode)
            # full shards the 4-bit codes (and INT4's statistics); int8 codes, and every base under ZeRO, stay whole
            codes_share = 0.5 if mode == "full" and not int8 else 1.0
            assert run["codes_share"] == pytest.approx(codes_share, abs=0.02), (option_name, mode)
            assert run["adapter_share"] == pytest.approx(1.0 if mode != "full" else 0.5, abs=0.02), (option_name, mode)
            assert run["adam_share"] == pytest.approx(0.5, abs=0.02), (option_name, mode)
        if last == STEPS:  # the weights the last step left (a ZeRO run's are gathered on every rank)
            # Adam's steps turn summation-order differences in the smallest gradients into ~1e-6 (measured: 1.9e-6)
            for name, expected in weights.items():
                for run in runs:
                    torch.testing.assert_close(run["weights"][name], expected, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{option_name} {mode} {name}: {m}")


def test_prepared_bitsandbytes_layers_compute_and_save_from_bare_codes():
    """What FSDP2 registers in a 4-bit layer — its codes as a plain tensor, without their statistics — writes the
    same state dict and computes the same logits once the layers are prepared, and stays registered (bitsandbytes'
    own fallback would replace it); int8 weights are left whole."""
    import bitsandbytes as bnb

    from lightning_merak.adapters.quantize import prepare_fully_shard

    model = OPTIONS["lora-nf4"]().apply(_base())
    tokens = torch.randint(VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    expected, expected_state = model(tokens).logits, model.state_dict()
    assert prepare_fully_shard(model) == []
    layers = [layer for layer in model.modules() if isinstance(layer, bnb.nn.Linear4bit)]
    assert layers

    def bare_codes() -> list[nn.Parameter]:
        for layer in layers:
            layer.weight = nn.Parameter(torch.Tensor(layer.weight.data.clone()), requires_grad=False)
        return [layer.weight for layer in layers]

    registered = bare_codes()
    torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=0)
    assert all(layer.weight is weight for layer, weight in zip(layers, registered))
    bare_codes()
    state = model.state_dict()
    assert sorted(state) == sorted(expected_state)
    for name, tensor in expected_state.items():
        assert torch.equal(state[name], tensor), name
    int8 = OPTIONS["lora-int8"]().apply(_base())
    whole = prepare_fully_shard(int8)
    assert whole and all(isinstance(param, bnb.nn.Int8Params) for param in whole)
    assert len(whole) == sum(isinstance(layer, bnb.nn.Linear8bitLt) for layer in int8.modules())
