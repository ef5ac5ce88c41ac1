"""Pure parts of sparse_comm: count sketch, bitmaps, error bound, cost model, ledger, Hydra options."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.callbacks.sparse_comm.sketch import (
    HASH_PRIME,
    CountSketch,
    bitmap_counts,
    bitmap_rows,
    check_row_ids_hashable,
    error_bound,
    failure_probability,
    merge_bitmaps,
    nonzero_rows,
    pack_bitmap,
    unpack_bitmap,
)
from lightning_merak.callbacks.sparse_comm.wire_cost_model import (
    NetworkModel,
    TableTraffic,
    choose_method,
    method_costs,
)


def test_hashes_match_exact_integer_arithmetic_for_the_largest_row_ids() -> None:
    sketch = CountSketch(num_rows=3, seed=11)
    ids = torch.tensor([0, 1, 12345, HASH_PRIME - 2, HASH_PRIME - 3, 2**30 + 7])
    columns = 997
    multipliers, offsets, sign_coefficients = sketch._coefficients
    buckets = sketch.buckets(ids, columns)
    signs = sketch.signs(ids, torch.float64)
    for t in range(3):
        for position, row in enumerate(ids.tolist()):
            expected_bucket = ((int(multipliers[t]) * row + int(offsets[t])) % HASH_PRIME) % columns
            c0, c1, c2, c3 = (int(c) for c in sign_coefficients[t])
            expected_sign = 1 - 2 * ((((c0 * row + c1) * row + c2) * row + c3) % HASH_PRIME % 2)
            assert int(buckets[t, position]) == expected_bucket
            assert int(signs[t, position]) == expected_sign


def test_equal_seeds_give_equal_hashes_and_other_seeds_do_not() -> None:
    ids = torch.arange(1000)
    assert torch.equal(CountSketch(3, 5).buckets(ids, 64), CountSketch(3, 5).buckets(ids, 64))
    assert not torch.equal(CountSketch(3, 5).buckets(ids, 64), CountSketch(3, 6).buckets(ids, 64))


def test_bad_sketch_shapes_and_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="odd"):
        CountSketch(num_rows=2, seed=0)
    with pytest.raises(ValueError, match="split the table"):
        check_row_ids_hashable(HASH_PRIME)


def test_bitmaps_pack_unpack_and_merge() -> None:
    a, b = torch.tensor([0, 7, 8, 20]), torch.tensor([3, 7, 21])
    packed_a, packed_b = pack_bitmap(a, 22), pack_bitmap(b, 22)
    assert packed_a.dtype == torch.uint8 and packed_a.numel() == 3
    assert unpack_bitmap(packed_a, 22).nonzero().flatten().tolist() == a.tolist()
    merged = merge_bitmaps(torch.stack([packed_a, packed_b]))
    assert bitmap_rows(merged, 22).tolist() == [0, 3, 7, 8, 20, 21]
    assert bitmap_rows(pack_bitmap(torch.empty(0, dtype=torch.int64), 22), 22).numel() == 0
    assert bitmap_counts(torch.stack([packed_a, packed_b, merged])).tolist() == [4, 3, 6]


def test_sparse_lookups_densify_into_one_kept_tensor_and_restore_the_embedding() -> None:
    from lightning_merak.callbacks.sparse_comm.s2_hook import SparseLookups

    embedding = torch.nn.Embedding(50, 4)
    lookups = SparseLookups([embedding])
    kept = None
    for step, ids in enumerate((torch.tensor([[1, 2, 2, 9]]), torch.tensor([[3, 49, 3]]))):
        embedding.weight.grad = None
        (embedding(ids) * (step + 1)).sum().backward()
        assert embedding.weight.grad.is_sparse
        expected = embedding.weight.grad.to_dense()
        lookups.densify()
        assert not embedding.weight.grad.is_sparse and torch.equal(embedding.weight.grad, expected)
        kept = kept if kept is not None else embedding.weight.grad.data_ptr()
        assert embedding.weight.grad.data_ptr() == kept  # the second step reuses the first step's tensor
    embedding.weight.grad.zero_()  # zero_grad(set_to_none=False): the next backward must start from no gradient
    lookups.clear_stale()
    assert embedding.weight.grad is None
    lookups.restore()
    assert embedding.sparse is False


def test_nonzero_rows_of_dense_and_sparse_gradients() -> None:
    dense = torch.zeros(6, 2)
    dense[[1, 4]] = torch.tensor([[1.0, 0.0], [0.0, -2.0]])
    ids, rows = nonzero_rows(dense)
    assert ids.tolist() == [1, 4] and torch.equal(rows, dense[[1, 4]])
    sparse = torch.sparse_coo_tensor(torch.tensor([[4, 1, 4]]), torch.ones(3, 2), (6, 2), check_invariants=True)
    ids, rows = nonzero_rows(sparse)
    assert ids.tolist() == [1, 4] and rows.tolist() == [[1.0, 1.0], [2.0, 2.0]]


def test_sketch_is_linear_so_summed_sketches_sketch_the_sum() -> None:
    torch.manual_seed(0)
    sketch = CountSketch(3, 1)
    ids_a, ids_b = torch.tensor([1, 5, 9]), torch.tensor([5, 11])
    rows_a, rows_b = torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)
    summed = torch.zeros(12, 4, dtype=torch.float64)
    summed.index_add_(0, ids_a, rows_a).index_add_(0, ids_b, rows_b)
    union = torch.tensor([1, 5, 9, 11])
    expected = sketch.encode(union, summed[union], 7)
    torch.testing.assert_close(sketch.encode(ids_a, rows_a, 7) + sketch.encode(ids_b, rows_b, 7), expected)


def test_decode_is_exact_without_collisions() -> None:
    torch.manual_seed(0)
    sketch = CountSketch(3, 2)
    ids = torch.tensor([3, 40, 500, 7000])
    rows = torch.randn(4, 8)
    decoded = sketch.decode(sketch.encode(ids, rows, 1_000_003), ids)
    torch.testing.assert_close(decoded, rows)


@pytest.mark.parametrize("sketch_rows", [3, 5])
def test_approximate_decode_stays_within_its_bound(sketch_rows: int) -> None:
    deviations = 3.0
    allowed = failure_probability(sketch_rows, deviations)
    violations, entries = 0, 0
    for seed in range(8):
        generator = torch.Generator().manual_seed(100 + seed)
        union = torch.randperm(50_000, generator=generator)[:400].sort().values
        rows = torch.randn(400, 16, generator=generator, dtype=torch.float64)
        sketch = CountSketch(sketch_rows, seed)
        columns = 200  # alpha = 0.5: half a bucket per row, many collisions
        decoded = sketch.decode(sketch.encode(union, rows, columns), union)
        bound = error_bound(rows, columns, deviations)
        violations += int(((decoded - rows).abs() > bound).sum())
        entries += rows.numel()
    assert violations / entries <= allowed, (violations / entries, allowed)


def test_failure_probability_is_the_binomial_tail() -> None:
    assert failure_probability(1, 3.0) == pytest.approx(1 / 9)
    assert failure_probability(3, math.sqrt(3)) == pytest.approx(7 / 27)
    assert failure_probability(5, 3.0) < failure_probability(3, 3.0) < failure_probability(1, 3.0)


def _traffic(local_rows: tuple[int, ...], union_rows: int, num_rows: int = 100_000) -> TableTraffic:
    return TableTraffic("embed", num_rows, 64, 4, local_rows, union_rows, tokens_per_rank=512)


def test_cost_model_prefers_sparse_methods_for_sparse_tables_and_dense_for_dense_ones() -> None:
    network = NetworkModel.from_gbit(1.0)
    overlapping = choose_method(_traffic((300, 300, 300, 300), 350), network, 3, 2.0)
    assert overlapping.method == "s2_exact"
    assert "union 350 of 100000" in overlapping.reason and "dense" in overlapping.reason
    # two ranks: gathering max(k) rows never moves more than all-reducing U >= max(k) rows
    assert choose_method(_traffic((300, 300), 350), network, 3, 2.0).method == "allgather"
    assert choose_method(_traffic((100, 100, 100, 100), 400), network, 3, 2.0).method == "allgather"
    assert choose_method(_traffic((100_000, 100_000), 100_000), network, 3, 2.0).method == "dense"


def test_cost_formulas_match_the_spec() -> None:
    costs = method_costs(_traffic((300, 250), 400), NetworkModel.from_gbit(10.0), 3, 2.0)
    row = 64 * 4
    bitmap = math.ceil(100_000 / 8)
    assert costs["dense"].wire_bytes == pytest.approx(100_000 * row)
    assert costs["s2_exact"].wire_bytes == pytest.approx(bitmap + 400 * row)
    assert costs["s2_sketch"].wire_bytes == pytest.approx(bitmap + 3 * 800 * row)
    assert costs["allgather"].wire_bytes == pytest.approx(bitmap + 300 * row)
    assert costs["embrace"].wire_bytes == pytest.approx(512 * 8 + 2 * 0.5 * 512 * row)
    bigger = method_costs(_traffic((300, 250), 400, num_rows=10_000_000), NetworkModel.from_gbit(10.0), 3, 2.0)
    assert bigger["embrace"].wire_bytes == costs["embrace"].wire_bytes


def test_unknown_candidates_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown methods"):
        choose_method(_traffic((1, 1), 1), NetworkModel.from_gbit(1.0), 3, 2.0, candidates=("embrace",))


def test_ledger_uses_ring_formulas_per_category() -> None:
    ledger = CommLedger(world_size=4)
    ledger.record("all_reduce", 1000, "dense")
    ledger.record("all_gather", 100, "embedding")
    ledger.record("all_to_all", 400, "embedding")
    assert ledger.snapshot() == {"dense": 1500.0, "embedding": 300.0 + 300.0}
    with pytest.raises(ValueError, match="unknown collective"):
        ledger.record("broadcast", 1, "dense")


def test_callback_refuses_bad_arguments_before_training() -> None:
    from lightning_merak.callbacks.sparse_comm import SparseCommunication

    with pytest.raises(ValueError, match="method must be"):
        SparseCommunication("sparse")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="odd"):
        SparseCommunication("s2", sketch_rows=4)
    with pytest.raises(ValueError, match="lossy"):
        SparseCommunication("auto", mode="sketch")
    with pytest.raises(ValueError, match="method='embrace'"):
        SparseCommunication("s2", priority=True)


def test_priority_chunks_put_the_next_batch_rows_first_and_cover_every_token_once() -> None:
    from lightning_merak.callbacks.sparse_comm.embrace_exchange import exchange_chunks

    all_ids = torch.tensor([5, 9, 5, 2, 7, 9, 1])
    chunks = exchange_chunks(all_ids, torch.tensor([9, 1, 100]))
    assert [priority for priority, _ in chunks] == [True, False]
    assert all_ids[chunks[0][1]].tolist() == [9, 9, 1]
    assert all_ids[chunks[1][1]].tolist() == [5, 5, 2, 7]
    assert [p for p, _ in exchange_chunks(all_ids, torch.empty(0, dtype=torch.int64))] == [False]
    assert [p for p, _ in exchange_chunks(all_ids, all_ids)] == [True]
    assert exchange_chunks(torch.empty(0, dtype=torch.int64), all_ids) == []


def test_lookahead_yields_the_same_items_and_peeks_one_ahead() -> None:
    from lightning_merak.callbacks.sparse_comm.lookahead import Lookahead

    items = Lookahead(iter([1, 2, 3]))
    assert next(items) == 1
    assert items.peek() == 2 and items.peek() == 2
    assert list(items) == [2, 3]
    assert items.peek() is None
    with pytest.raises(StopIteration):
        next(items)


def test_callback_state_round_trips_the_seed() -> None:
    from lightning_merak.callbacks.sparse_comm import SparseCommunication

    saved = SparseCommunication("s2", mode="sketch", seed=1234, sketch_rows=5).state_dict()
    restored = SparseCommunication("s2", mode="sketch", seed=0)
    restored.load_state_dict(saved)
    assert restored.seed == 1234 and restored.sketch.num_rows == 5


@pytest.mark.parametrize("option", ["s2", "embrace", "auto", "dense"])
def test_hydra_comm_options_compose_and_build(option: str) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_merak.callbacks.sparse_comm import SparseCommunication
    from lightning_merak.cli.options.comm import register

    register()
    conf_dir = Path(__file__).resolve().parents[1] / "lightning_merak" / "conf"
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        config = compose(overrides=[f"+comm={option}"])
    options = OmegaConf.to_object(config.comm)
    callbacks = options.build_callbacks()
    if option == "dense":
        assert callbacks == []
    else:
        assert [type(c) for c in callbacks] == [SparseCommunication] and callbacks[0].method == option


def _default_run(*overrides: str) -> tuple[Any, Any]:
    """merak-train's composed config (the embedded default model unless overridden) and its LightningModule."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    from lightning_merak.cli.config import register_configs
    from lightning_merak.modules.causal_lm import CausalLMModule, build_causal_lm

    register_configs()
    with initialize_config_module(config_module="lightning_merak.conf", version_base="1.3"):
        config = OmegaConf.to_object(compose(config_name="config", overrides=["output_dir=/tmp/unused", *overrides]))
    return config, CausalLMModule(build_causal_lm(config.model, vocab_size=config.data.vocab_size), config.optim)


@pytest.mark.parametrize("option", ["s2", "embrace", "auto"])
def test_comm_option_on_the_default_model_warns_what_it_skipped_and_the_override(option: str) -> None:
    """The default 256-token table is below the yaml's min_table_rows: the run says so, with the fix."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    config, module = _default_run(f"comm={option}")
    (callback,) = config.comm.build_callbacks()
    trainer = SimpleNamespace(strategy=DDPStrategy(), world_size=2)
    with pytest.warns(UserWarning, match="replaces nothing") as warned:
        callback.setup(trainer, module, "fit")  # warns before any collective, so no process group is needed
    message = str(warned[0].message)
    assert "model.model.embed_tokens: 256 rows" in message and "min_table_rows=1024" in message
    assert "comm.min_table_rows=256" in message, message
    assert not callback._active


def test_embrace_refusal_under_merak3d_names_the_strategy_argument_and_the_hydra_override() -> None:
    """EmbRace under merak3d needs one pipeline stage; the default trainer's clipping is fine (merak3d counts
    the shards over the data-parallel group)."""
    from types import SimpleNamespace

    config, _ = _default_run("comm=embrace")
    (callback,) = config.comm.build_callbacks()
    callback._check_layout(SimpleNamespace(pipeline_parallel=1))
    with pytest.raises(ValueError, match=r"strategy\.pipeline_parallel=1"):
        callback._check_layout(SimpleNamespace(pipeline_parallel=2))
