"""Legal inputs that used to crash or waste bytes (issue #27, item 7).

* A bitsandbytes 4-bit base whose shape the CPU inference repacking cannot take (the issue's
  ``in_features=96``) crashed in eval mode; it now runs there as it does in training.
* S2's sketch with default settings sent 6x the bytes of exact mode, ``auto`` could pick a method
  sending more bytes than ``s2_exact``, and rows found from lookups were sent with a zero gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.callbacks.sparse_comm.s2_hook import S2Reducer, s2_comm_hook
from lightning_merak.callbacks.sparse_comm.sketch import CountSketch
from lightning_merak.callbacks.sparse_comm.wire_cost_model import (
    NetworkModel,
    TableTraffic,
    all_gather_bytes,
    bitmap_bytes,
    choose_method,
    method_costs,
)
from lightning_merak.testing import run_distributed

bnb = pytest.importorskip("bitsandbytes")


# --- bitsandbytes 4-bit shapes -----------------------------------------------------------------


def test_4bit_bases_back_propagate_after_an_eval_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes repacks a 4-bit weight at an eval forward on AVX512-BF16 hosts (reported on every host here),
    and its repacked kernel has no backward: the adapters' gradients after a validation loop must equal those
    before it (a base with a bias failed outright)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_merak.adapters import quantize_model

    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    model = quantize_model(LlamaForCausalLM(config), "nf4")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                             init_lora_weights=False))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model.train()(input_ids=ids, labels=ids).loss.backward()
        return {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}

    before = gradients()
    with torch.no_grad():
        model.eval()(input_ids=ids)
    after = gradients()
    for name, gradient in before.items():
        torch.testing.assert_close(after[name], gradient, msg=name)


def test_an_evaluation_loop_keeps_a_users_4bit_layers_on_the_training_path() -> None:
    """A bitsandbytes layer the user built (not through quantize_model) is kept off the repacking path when
    CausalLMModule's model enters a validation loop."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_merak.modules.causal_lm import CausalLMModule

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    layer = bnb.nn.Linear4bit(128, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 128), requires_grad=False, quant_type="nf4")
    model.model.layers[0].mlp.down_proj = layer.to("cpu")
    layer.support_avx512bf16_for_cpu = True  # as bitsandbytes sets it on an AVX512-BF16 host
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.validate(CausalLMModule(model), DataLoader(TensorDataset(torch.randint(0, 64, (4, 8))), batch_size=2),
                     verbose=False)
    assert layer.support_avx512bf16_for_cpu is False


@pytest.mark.parametrize("quantization", ["nf4", "fp4"])
def test_4bit_base_with_in_features_96_runs_in_eval_as_in_train(
    quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's model: hidden 96 (no whole 64-blocks), intermediate 160. bitsandbytes repacks
    weights for eval only on AVX512-BF16 hosts; reporting that host on every host makes the test
    take that path everywhere (it failed before with ``shape '[160, 1]' is invalid``)."""
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_merak.adapters import QBaRAConfig, quantize_model

    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    model = quantize_model(LlamaForCausalLM(config), quantization)
    model = get_peft_model(model, QBaRAConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    train_logits = model.train()(input_ids=ids).logits.detach()
    with torch.no_grad():
        eval_logits = model.eval()(input_ids=ids).logits
    assert torch.equal(eval_logits, train_logits)


# --- S2: what auto and the sketch may send -------------------------------------------------------


def _traffic(local_rows: tuple[int, ...], union_rows: int, num_rows: int, dim: int) -> TableTraffic:
    return TableTraffic("embed", num_rows, dim, 4, local_rows, union_rows)


def _counted_bytes(method: str, traffic: TableTraffic, network: NetworkModel) -> float:
    """Bytes the ledger counts for ``method`` in a step that exchanged bitmaps (dense included)."""
    costs = method_costs(traffic, network, 3, 2.0)
    bitmap = all_gather_bytes(bitmap_bytes(traffic.num_rows), traffic.world_size)
    return costs[method].wire_bytes + (bitmap if method == "dense" else 0.0)


@pytest.mark.parametrize(("traffic", "faster_by_latency"), [
    (_traffic((50, 50, 50, 50), 50, 4096, 64), "allgather"),  # every rank the same rows: 2x exact's bytes
    (_traffic((600, 600, 600, 600), 900, 1024, 16), "dense"),  # a small table: 3 messages fewer, 14% more bytes
])
def test_auto_never_picks_a_method_sending_more_bytes_than_exact(traffic: TableTraffic, faster_by_latency: str) -> None:
    network = NetworkModel.from_gbit(10.0, latency_us=50.0)
    costs = method_costs(traffic, network, 3, 2.0)
    assert costs[faster_by_latency].seconds < costs["s2_exact"].seconds  # the trap: it wins on time
    decision = choose_method(traffic, network, 3, 2.0, candidates=("dense", "s2_exact", "allgather", "s2_sketch"))
    assert _counted_bytes(decision.method, traffic, network) <= _counted_bytes("s2_exact", traffic, network)
    assert "sends more bytes than s2_exact" in decision.reason


def test_auto_still_takes_the_cheaper_methods() -> None:
    network = NetworkModel.from_gbit(10.0)
    assert choose_method(_traffic((300, 300), 350, 100_000, 64), network, 3, 2.0).method == "allgather"
    assert choose_method(_traffic((100_000, 100_000), 100_000, 100_000, 64), network, 3, 2.0).method == "dense"


def test_sketch_pays_only_below_one_sketch_row_per_union_row() -> None:
    from lightning_merak.callbacks.sparse_comm.wire_cost_model import scan_pays, sketch_pays

    assert not sketch_pays(502, 3, 2.0)  # the defaults: 3 x 1004 rows for 502
    assert not sketch_pays(502, 3, 1 / 3)
    assert sketch_pays(502, 3, 0.25) and sketch_pays(502, 1, 0.5)
    network = NetworkModel.from_gbit(10.0)  # 1.25 GB/s: a row sent costs 8x a row scanned at 10 GB/s (2 ranks)
    assert scan_pays(0.2, 2, network, 10e9) and not scan_pays(0.1, 2, network, 10e9)
    assert scan_pays(0.01, 2, network, 1e12)


def test_zero_rows_are_dropped_but_nan_rows_are_kept() -> None:
    from lightning_merak.callbacks.sparse_comm.sketch import drop_zero_rows

    rows = torch.zeros(5, 3)
    rows[1, 2], rows[3, 0], rows[4, 1] = float("nan"), 1.0, -0.5
    ids, kept = drop_zero_rows(torch.arange(10, 15), rows)
    assert ids.tolist() == [11, 13, 14] and kept.shape == (3, 3) and kept[0].isnan().any()


# --- S2 on real ranks -------------------------------------------------------------------------------

VOCAB, DIM, TOKENS, PADDING = 2048, 16, 96, 0


class MaskedTokens(nn.Module):
    """Per-token loss with a mask: a masked token's row gets exactly zero gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PADDING)
        self.proj = nn.Linear(DIM, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (self.proj(self.embed(ids)).square().sum(-1) * mask).mean()


def _masked_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(1, VOCAB, (TOKENS,), generator=generator)
    ids[: TOKENS // 8] = PADDING
    mask = (ids != PADDING).float()
    mask[TOKENS // 8 : TOKENS // 2] = 0.0  # masked (e.g. prompt) tokens: looked up, no gradient
    return ids, mask


def _hooked_run(rank: int, world_size: int, watch: bool, scan_bytes_per_s: float) -> tuple[list[float], dict]:
    """Three DDP steps through the S2 hook; returns embedding bytes per step and the last gradients."""
    torch.manual_seed(0)
    model = MaskedTokens()
    ledger = CommLedger(world_size)
    reducer = S2Reducer(
        {id(model.embed.weight): "embed"}, CountSketch(3, 0), method="s2_exact", ledger=ledger,
        network=NetworkModel.from_gbit(10.0), scan_bytes_per_s=scan_bytes_per_s,
    )
    if watch:
        reducer.watch_lookups("embed", model.embed)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(reducer, s2_comm_hook)
    wire = []
    for step in range(3):
        ledger.reset()
        model.zero_grad()
        ddp(*_masked_batch(rank, step)).backward()
        wire.append(ledger.snapshot()["embedding"])
    return wire, {name: p.grad.clone() for name, p in model.named_parameters()}


def _sketch_and_exact_bytes(rank: int, world_size: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(rank)
    gradient = torch.zeros(VOCAB, DIM)
    gradient[torch.randint(0, VOCAB, (200,), generator=generator)] = torch.randn(200, DIM, generator=generator)
    sent, results = {}, {}
    for method in ("s2_exact", "s2_sketch"):
        ledger = CommLedger(world_size)
        reducer = S2Reducer({}, CountSketch(3, 0), method=method, ledger=ledger)  # default column_factor 2.0
        (results[method],) = reducer.reduce_now([("embed", gradient.clone(), gradient.shape)])
        sent[method] = ledger.snapshot()["embedding"]
    return {"bytes": sent, "same": torch.equal(results["s2_sketch"], results["s2_exact"])}


def s2_inputs(rank: int, world_size: int) -> dict[str, object]:
    torch.use_deterministic_algorithms(True)
    reference_wire, reference_grads = _hooked_run(rank, world_size, watch=False, scan_bytes_per_s=8e9)
    watched_wire, watched_grads = _hooked_run(rank, world_size, watch=True, scan_bytes_per_s=8e9)
    slow_wire, slow_grads = _hooked_run(rank, world_size, watch=True, scan_bytes_per_s=1.0)
    worst = max(
        (grads[name] - reference_grads[name]).abs().max().item()
        for grads in (watched_grads, slow_grads) for name in reference_grads
    )
    return {
        "reference_wire": reference_wire, "watched_wire": watched_wire, "slow_wire": slow_wire,
        "worst_gradient_difference": worst, "sketch": _sketch_and_exact_bytes(rank, world_size),
    }


@pytest.fixture(scope="module")
def s2_results() -> list[dict[str, object]]:
    return run_distributed(s2_inputs, 2, timeout_s=120)


@pytest.mark.distributed
def test_default_sketch_sends_no_more_than_exact_and_is_then_exact(s2_results: list[dict[str, object]]) -> None:
    for result in s2_results:
        sent = result["sketch"]["bytes"]
        assert sent["s2_sketch"] <= sent["s2_exact"], sent
        assert result["sketch"]["same"]


@pytest.mark.distributed
def test_looked_up_rows_with_zero_gradient_are_not_sent(s2_results: list[dict[str, object]]) -> None:
    """Rows from lookup ids, after dropping the padding row and the masked tokens' zero rows, cost
    exactly what scanning the whole gradient costs; the gradients equal the scanned run's."""
    for result in s2_results:
        assert result["worst_gradient_difference"] == 0.0
        assert result["watched_wire"] == result["reference_wire"]


@pytest.mark.distributed
def test_zero_rows_are_sent_when_scanning_for_them_costs_more(s2_results: list[dict[str, object]]) -> None:
    """With scanning priced out, the first step still scans (nothing is known yet), later steps send
    the zero rows rather than look for them; the gradients stay exact."""
    for result in s2_results:
        assert result["slow_wire"][0] == result["reference_wire"][0]
        assert all(slow > ref for slow, ref in zip(result["slow_wire"][1:], result["reference_wire"][1:]))
