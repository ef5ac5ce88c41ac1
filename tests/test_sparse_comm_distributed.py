"""S2 hook, excluded-table path and EmbRace on real gloo ranks, against dense all-reduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_merak.callbacks.sparse_comm import (
    CountSketch,
    S2Reducer,
    ShardedEmbedding,
    error_bound,
    failure_probability,
    s2_comm_hook,
    shard_embeddings,
)
from lightning_merak.callbacks.sparse_comm.bytes_counter import CommLedger
from lightning_merak.testing import run_distributed

pytestmark = pytest.mark.distributed  # every test here runs gloo ranks or a subprocess

VOCAB, DIM, PADDING = 3000, 6, 0  # DIM 6 over 4 ranks: uneven column shards


class TinyLM(nn.Module):
    """An embedding-heavy token model: table, one dense layer, optionally a tied head."""

    def __init__(self, sparse: bool = False, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM, padding_idx=PADDING, sparse=sparse)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB if tied else 4, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


def _batch(rank: int, step: int, tokens: int = 40) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(1, VOCAB, (tokens,), generator=generator)
    if rank == 1 and step == 1:
        ids = torch.full((tokens,), PADDING)  # this rank touches no trainable row
    return ids


def _ddp_gradients(model: nn.Module, ids: torch.Tensor, hook_state: S2Reducer | None) -> dict[str, torch.Tensor]:
    ddp = DistributedDataParallel(model)
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, s2_comm_hook)
    ddp(ids).square().mean().backward()
    return {name: p.grad.to_dense().clone() for name, p in model.named_parameters()}


def compare_hook_with_dense(rank: int, world_size: int, method: str, sparse: bool) -> float:
    """Largest |hooked - dense| over all gradients and steps (exact methods must give 0)."""
    worst = 0.0
    for step in range(3):
        torch.manual_seed(0)
        reference = TinyLM(sparse=sparse)
        torch.manual_seed(0)
        candidate = TinyLM(sparse=sparse)
        reducer = S2Reducer({id(candidate.embed.weight): "embed"}, CountSketch(3, 7), method=method)
        ids = _batch(rank, step)
        expected = _ddp_gradients(reference, ids, None)
        actual = _ddp_gradients(candidate, ids, reducer)
        if sparse:
            assert candidate.embed.weight.grad.is_sparse
        for name, tensor in expected.items():
            worst = max(worst, (actual[name] - tensor).abs().max().item())
    return worst




def sketch_errors(rank: int, world_size: int) -> tuple[int, int, float]:
    """Decode error of the approximate mode: (entries over the bound, entries, allowed fraction)."""
    generator = torch.Generator().manual_seed(rank)
    gradient = torch.zeros(VOCAB, DIM, dtype=torch.float64)
    rows = torch.randperm(VOCAB, generator=generator)[:300]
    gradient[rows] = torch.randn(300, DIM, generator=generator, dtype=torch.float64)
    reducer = S2Reducer({}, CountSketch(5, 3), method="s2_sketch", column_factor=0.5)
    (decoded,) = reducer.reduce_now([("embed", gradient, gradient.shape)])
    mean = gradient.clone()
    dist.all_reduce(mean)
    mean /= world_size
    union = mean.ne(0).any(dim=1).nonzero().flatten()
    columns = max(1, int(0.5 * union.numel() + 0.999999))
    bound = error_bound(mean[union], columns, deviations=3.0)
    over = int(((decoded[union] - mean[union]).abs() > bound).sum())
    outside = decoded[mean.eq(0).all(dim=1)].abs().max().item()
    assert outside == 0.0, "rows outside the union must decode to exactly zero"
    return over, union.numel() * DIM, failure_probability(5, 3.0)




def excluded_table_path(rank: int, world_size: int) -> float:
    """``reduce_now`` on a dedicated group with sparse gradients (one rank empty) vs dense mean."""
    group = dist.new_group(ranks=list(range(world_size)))
    ledger = CommLedger(world_size)
    torch.manual_seed(0)
    model = TinyLM(sparse=True)
    ids = _batch(rank, step=1)
    model(ids).square().mean().backward()
    gradient = model.embed.weight.grad
    reducer = S2Reducer({}, CountSketch(3, 0), method="s2_exact", process_group=group, ledger=ledger)
    (reduced,) = reducer.reduce_now([("embed", gradient, gradient.shape)])
    dense = gradient.to_dense()
    dist.all_reduce(dense)
    assert reduced.is_sparse and ledger.snapshot()["embedding"] > 0
    return (reduced.to_dense() - dense / world_size).abs().max().item()




def _gather_columns(shard: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """The full ``[V, H]`` tensor from every rank's columns (widths may differ by one)."""
    widest = max(widths)
    padded = torch.nn.functional.pad(shard, (0, widest - shard.shape[1])).contiguous()
    gathered = torch.empty(len(widths) * padded.numel())
    dist.all_gather_single(gathered, padded.view(-1))
    blocks = gathered.view(len(widths), shard.shape[0], widest)
    return torch.cat([blocks[rank, :, :width] for rank, width in enumerate(widths)], dim=1)


def embrace_against_unsharded(rank: int, world_size: int, tied: bool) -> float:
    """Sharded forward and backward vs the unsharded model (gradients averaged over ranks)."""
    torch.manual_seed(0)
    reference = TinyLM(tied=tied)
    torch.manual_seed(0)
    candidate = TinyLM(tied=tied)
    tables = shard_embeddings(candidate, ["embed"])
    assert isinstance(candidate.embed, ShardedEmbedding)
    worst = 0.0
    for step in range(2):
        ids = _batch(rank, step, tokens=30 + 7 * rank).view(-1, 1)  # ranks differ in token count
        expected_out = reference(ids)
        actual_out = candidate(ids)
        worst = max(worst, (actual_out - expected_out).abs().max().item())
        reference.zero_grad()
        candidate.zero_grad()
        expected_out.square().mean().backward()
        actual_out.square().mean().backward()
        expected = {name: p.grad.clone() for name, p in reference.named_parameters()}
        for gradient in expected.values():
            dist.all_reduce(gradient)
            gradient /= world_size
        full = tables["embed"].full_weight()
        worst = max(worst, (full - reference.embed.weight).abs().max().item())
        sharded_grad = _gather_columns(candidate.embed.shard.grad, tables["embed"].widths)
        worst = max(worst, (sharded_grad - expected["embed.weight"]).abs().max().item())
        worst = max(worst, (candidate.mix.weight.grad - reference.mix.weight.grad).abs().max().item())
    return worst


def embrace_priority_against_plain(rank: int, world_size: int) -> dict[str, object]:
    """The priority exchange (next batch's rows first, on the table's own group) against the
    plain exchange and the unsharded embedding, over three steps with a next batch each."""
    group = dist.new_group(ranks=list(range(world_size)))
    torch.manual_seed(0)
    reference = TinyLM()
    models = {}
    for name in ("plain", "priority"):
        torch.manual_seed(0)
        models[name] = TinyLM()
        shard_embeddings(models[name], ["embed"], group)
    worst_vs_unsharded, worst_vs_plain, timings = 0.0, 0.0, []
    for step in range(3):
        ids = _batch(rank, step, tokens=30 + 7 * rank)
        upcoming = torch.cat([ids[: 3 + rank], _batch(rank, step + 1)[:5]])  # overlaps this batch, like real text
        models["priority"].embed.prioritize(upcoming)
        outputs = {name: model(ids) for name, model in models.items()}
        expected = reference(ids)
        for model in (*models.values(), reference):
            model.zero_grad()
        expected.square().mean().backward()
        for output in outputs.values():
            output.square().mean().backward()
        dist.all_reduce(reference.embed.weight.grad)
        start, stop = models["priority"].embed.bounds[rank]
        expected_columns = reference.embed.weight.grad[:, start:stop] / world_size
        priority_grad = models["priority"].embed.shard.grad
        worst_vs_unsharded = max(worst_vs_unsharded, (priority_grad - expected_columns).abs().max().item(),
                                 (outputs["priority"] - expected).abs().max().item())
        worst_vs_plain = max(worst_vs_plain, (priority_grad - models["plain"].embed.shard.grad).abs().max().item())
        timings.append(models["priority"].embed.last_exchange)
    return {"vs_unsharded": worst_vs_unsharded, "vs_plain": worst_vs_plain, "timings": timings,
            "plain_timing": models["plain"].embed.last_exchange}


def embrace_backward_bytes(rank: int, world_size: int) -> tuple[float, float]:
    """The embedding bytes the ledger records for a lookup's backward exchange, and the bytes this rank sends in it:
    every other owner's columns of its own tokens (ranks differ in token count, so what it receives differs)."""
    torch.manual_seed(0)
    model = TinyLM()
    ledger = CommLedger(world_size)
    table = shard_embeddings(model, ["embed"], ledger=ledger)["embed"]
    tokens = 30 + 7 * rank
    output = model(_batch(rank, 0, tokens))
    ledger.reset()
    output.square().mean().backward()
    others = sum(width for owner, width in enumerate(table.widths) if owner != rank)
    return ledger.snapshot()["embedding"], float(tokens * others * output.element_size())


HOOK_METHODS = ("s2_exact", "allgather", "auto")


def all_checks(rank: int, world_size: int) -> dict[str, object]:
    """Every check at one world size, in one set of processes (spawning ranks dominates the cost)."""
    results: dict[str, object] = {f"hook_{method}": compare_hook_with_dense(rank, world_size, method, False)
                                  for method in HOOK_METHODS}
    results["embrace"] = embrace_against_unsharded(rank, world_size, False)
    results["embrace_priority"] = embrace_priority_against_plain(rank, world_size)
    results["embrace_backward_bytes"] = embrace_backward_bytes(rank, world_size)
    if world_size == 2:
        results["hook_sparse_bucket"] = compare_hook_with_dense(rank, world_size, "s2_exact", True)
        results["excluded"] = excluded_table_path(rank, world_size)
        results["embrace_tied"] = embrace_against_unsharded(rank, world_size, True)
    if world_size == 4:
        results["sketch"] = sketch_errors(rank, world_size)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}ranks")
def checks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, object]]]:
    world_size = request.param
    return world_size, run_distributed(all_checks, world_size, timeout_s=120)


@pytest.mark.parametrize("method", HOOK_METHODS)
def test_exact_hook_equals_dense_all_reduce(checks: tuple[int, list[dict[str, object]]], method: str) -> None:
    world_size, results = checks
    tolerance = 0.0 if world_size == 2 else 1e-7  # two ranks: the same two addends, bit for bit
    assert max(r[f"hook_{method}"] for r in results) <= tolerance


def test_embrace_forward_and_backward_equal_the_unsharded_embedding(
    checks: tuple[int, list[dict[str, object]]],
) -> None:
    _, results = checks
    assert max(r["embrace"] for r in results) <= 1e-6


def test_embrace_priority_exchange_changes_the_order_not_the_gradient(
    checks: tuple[int, list[dict[str, object]]],
) -> None:
    """Each row's contributions travel in one chunk in their original order: bit for bit the
    plain exchange, and the unsharded embedding's averaged gradient."""
    _, results = checks
    for result in results:
        check = result["embrace_priority"]
        assert check["vs_plain"] == 0.0
        assert check["vs_unsharded"] <= 1e-6
        for timing in check["timings"]:
            assert 0 < timing.priority_tokens < timing.tokens
            assert timing.priority_rows_s <= timing.all_rows_s
        assert check["plain_timing"].priority_tokens == 0 and check["plain_timing"].priority_rows_s is None


def test_embrace_ledger_records_the_bytes_a_rank_sends_in_the_backward_exchange(
    checks: tuple[int, list[dict[str, object]]],
) -> None:
    _, results = checks
    for result in results:
        recorded, sent = result["embrace_backward_bytes"]
        assert recorded == sent


def test_two_rank_extras(checks: tuple[int, list[dict[str, object]]]) -> None:
    """Sparse DDP bucket through the hook, the excluded-table path and EmbRace with a tied head."""
    world_size, results = checks
    if world_size != 2:
        pytest.skip("checked on two ranks")
    assert max(r["hook_sparse_bucket"] for r in results) <= 1e-7
    assert max(r["excluded"] for r in results) <= 1e-7
    assert max(r["embrace_tied"] for r in results) <= 1e-6


def test_approximate_mode_is_within_its_bound(checks: tuple[int, list[dict[str, object]]]) -> None:
    world_size, results = checks
    if world_size != 4:
        pytest.skip("checked on four ranks")
    over, entries, allowed = results[0]["sketch"]
    assert over / entries <= allowed
