"""AutoPipe prices the optimizer work that runs after the pipeline's flush (Muon's Newton–Schulz iterations):
the delay model, the pricing of nodes by their parameters, the cut it changes, and the timing of each matrix."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from lightning_merak.modules.muon import MuonWithAdamW, newton_schulz_seconds
from lightning_merak.parallel import pipeline
from lightning_merak.parallel.pipeline import BlockCost, optimizer_delays_s, with_optimizer_seconds


def test_a_stage_hides_its_optimizer_step_behind_the_stages_before_it() -> None:
    # stage 1 finishes its last backward 2 s before stage 0 and is needed 1 s after it: 3 s of slack
    assert optimizer_delays_s([1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [4.0, 5.0, 5.0]) == [4.0, 2.0, 0.0]
    assert optimizer_delays_s([1.0], [2.0], [0.0]) == [0.0]


def test_nodes_are_priced_by_their_parameters_once_over_the_ranks() -> None:
    shared, own = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3, 3))
    costs = [BlockCost("a", 1.0, 2.0, 0, 0, 0), BlockCost("b", 1.0, 2.0, 0, 0, 0)]
    priced = with_optimizer_seconds(costs, [[shared], [shared, own]], {id(shared): 4.0, id(own): 2.0}, ranks=2)
    assert [cost.optimizer_s for cost in priced] == [2.0, 1.0]
    assert [cost.forward_s for cost in priced] == [1.0, 1.0]
    with pytest.raises(ValueError, match="1 nodes' parameters for 2 nodes"):
        with_optimizer_seconds(costs, [[own]], {})
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        with_optimizer_seconds(costs, [[shared], [own]], {}, ranks=0)
    with pytest.raises(ValueError, match="optimizer_s must be >= 0"):
        BlockCost("a", 1.0, 2.0, 0, 0, 0, optimizer_s=-1.0)


def _model(optimizer_s: float) -> list[BlockCost]:
    """An embedding, eight equal blocks and a head as heavy as three of them, whose optimizer step has none."""
    blocks = [BlockCost(f"layers.{index}", 1.0, 2.0, 100, 10, 10, optimizer_s=optimizer_s) for index in range(8)]
    return [BlockCost("prefix", 0.1, 0.2, 50, 10, 10, is_embedding=True), *blocks,
            BlockCost("suffix", 3.0, 6.0, 300, 10, 10)]


def _step_s(partition: pipeline.Partition, blocks: list[BlockCost], micro_batches: int) -> float:
    """The iteration with its optimizer tail, for ``partition``'s cut of ``blocks``."""
    return pipeline.predicted_step_s(pipeline.build_partition(blocks, partition.boundaries, "check"), micro_batches)


def test_autopipe_moves_blocks_off_the_stage_whose_optimizer_step_delays_the_next() -> None:
    micro_batches = 4
    blind = pipeline.partition_autopipe(_model(0.0), 2, micro_batches)
    priced_blocks = _model(6.0)
    priced = pipeline.partition_autopipe(priced_blocks, 2, micro_batches)
    assert blind.stage_optimizer_s is None
    assert priced.stage_optimizer_s is not None and len(priced.stage_optimizer_s) == 2
    assert priced.boundaries[1] < blind.boundaries[1], "the first stage, whose step nothing hides, takes fewer blocks"
    assert _step_s(priced, priced_blocks, micro_batches) < _step_s(blind, priced_blocks, micro_batches)


def test_the_predicted_step_adds_the_slowest_stages_optimizer_delay() -> None:
    blocks = _model(6.0)
    cut = pipeline.build_partition(blocks, [0, 5], "check")
    iteration = pipeline.simulate_schedule(cut.stage_forward_s, cut.stage_backward_s, 4).iteration_s
    assert cut.stage_optimizer_s == (24.0, 24.0)  # four blocks each
    # the first stage's 24 s wait whole; the second's hide behind the first stage's 0.3 + 12 s of compute
    assert pipeline.predicted_step_s(cut, 4) == pytest.approx(iteration + 24.0)
    blind = pipeline.build_partition(_model(0.0), [0, 5], "check")
    assert blind.stage_optimizer_s is None and pipeline.predicted_step_s(blind, 4) == pytest.approx(iteration)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 12, bias=True)
        self.experts = nn.Parameter(torch.randn(3, 12, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)


def test_newton_schulz_seconds_time_muons_matrices_only() -> None:
    net = _Net()
    muon = MuonWithAdamW([{"params": list(net.parameters())}], lr=0.01, momentum=0.95,
                         adamw_only={id(net.embed.weight), id(net.head.weight)}, newton_schulz_dtype="float32")
    seconds = newton_schulz_seconds([LightningOptimizer(muon)], torch.device("cpu"))
    assert set(seconds) == {id(net.proj.weight), id(net.experts)}
    assert seconds[id(net.proj.weight)] > 0
    # the stack of three experts' 12 x 8 matrices: three times the one 12 x 8 matrix, timed once per shape
    assert seconds[id(net.experts)] == pytest.approx(3 * seconds[id(net.proj.weight)])
    assert newton_schulz_seconds([torch.optim.AdamW(net.parameters())], torch.device("cpu")) == {}


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="this torch has no torch.optim.Muon")
def test_torch_muon_is_timed_in_bfloat16_on_a_meta_parameter_by_its_shape() -> None:
    weight = nn.Parameter(torch.empty(16, 8, device="meta"))
    seconds = newton_schulz_seconds([torch.optim.Muon([weight])], torch.device("cpu"))
    assert list(seconds) == [id(weight)] and seconds[id(weight)] > 0
