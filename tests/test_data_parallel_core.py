"""The pure parts of data-parallel reduction and sharding: buckets, their shards, readiness, release."""

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_merak.distributed.gradient_buffer import GradientBuffer
from lightning_merak.parallel.data.buckets import check_precision, check_shardable_optimizer
from tests.test_gradient_buffer import _loss, _model


def test_buckets_close_at_the_size_pad_to_the_shards_and_their_shards_tile_every_parameter() -> None:
    model = _model()
    buffer = GradientBuffer(list(model.parameters()), bucket_bytes=60, shards=3)
    assert len(buffer.buckets) > 1
    assert [p for p in buffer.params] == list(reversed(list(model.parameters())))
    for bucket in buffer.buckets:
        assert bucket.flat.numel() % 3 == 0
        covered = {id(p): torch.zeros(p.numel(), dtype=torch.int64) for p in bucket.params}
        for shard in range(3):
            for piece in bucket.shard_slices(shard):
                assert 0 <= piece.offset and piece.offset + piece.stop - piece.start <= bucket.shard_numel
                covered[id(piece.param)][piece.start:piece.stop] += 1
        assert all(bool((count == 1).all()) for count in covered.values())


def test_a_bucket_is_ready_once_every_parameter_saw_the_steps_backward_passes() -> None:
    model = _model()
    ready = []
    late = [model[0].bias]
    buffer = GradientBuffer(list(model.parameters()), bucket_bytes=40, late=late, on_ready=ready.append)
    buffer.arm(2)
    _loss(model, 1).backward()
    assert ready == []
    _loss(model, 2).backward()
    early = [bucket for bucket in buffer.buckets if not bucket.late]
    assert ready == early and all(all(p is not model[0].bias for p in bucket.params) for bucket in ready)
    with pytest.raises(RuntimeError, match="overlap_grad_reduce=False"):
        _loss(model, 3).backward()


def test_a_released_bucket_comes_back_zeroed_and_adopts_new_gradients() -> None:
    model = _model()
    buffer = GradientBuffer(list(model.parameters()))
    (bucket,) = buffer.buckets
    _loss(model, 1).backward()
    buffer.drop_gradients(bucket)
    bucket.release()
    assert bucket.released and all(p.grad is None for p in model.parameters())
    _loss(model, 2).backward()
    assert not bucket.released
    reference = _model()
    _loss(reference, 2).backward()
    for expected, param in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=0)


def test_loss_scaling_and_non_elementwise_optimizers_are_refused_with_the_fix() -> None:
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="bf16-mixed"):
        check_precision(scaled, "optimizer")
    check_precision(MixedPrecision("bf16-mixed", "cpu"), "optimizer")
    with pytest.raises(ValueError, match="LBFGS does not update element by element"):
        check_shardable_optimizer(torch.optim.LBFGS(_model().parameters()), "gradients")
    check_shardable_optimizer(torch.optim.AdamW(_model().parameters()), "gradients")


def test_callbacks_fsdp2_cannot_host_are_refused_with_full_sharding() -> None:
    from types import SimpleNamespace

    from lightning_merak.callbacks import DeltaMemory, SparseCommunication
    from lightning_merak.parallel.data.buckets import check_sharding

    full = SimpleNamespace(data_parallel_sharding="full", data_parallel=2)
    for callback in (DeltaMemory(budget="auto", plot=False), SparseCommunication("s2")):
        refusal = f"{type(callback).__name__} cannot run with data_parallel_sharding='full'"
        with pytest.raises(ValueError, match=refusal):
            check_sharding(full, [], None, [callback])
        check_sharding(SimpleNamespace(data_parallel_sharding="gradients", data_parallel=2), [], None, [callback])


def test_overlapped_parameter_gathering_needs_zero1() -> None:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    with pytest.raises(ValueError, match="use 'optimizer' or overlap_param_gather=False"):
        Merak3DStrategy(data_parallel_sharding="gradients", overlap_param_gather=True)
    Merak3DStrategy(data_parallel_sharding="optimizer", overlap_param_gather=True)


def _uneven_use_rank(rank: int, world_size: int) -> list[float]:
    """Two buckets; rank 1's batch skips the layer of the first bucket (its gradients never become ready there)."""
    import copy
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch import nn

    from lightning_merak.parallel.data.buckets import DataParallelGradients

    torch.manual_seed(0)
    first, second = nn.Linear(16, 8), nn.Linear(8, 8)
    params = [*first.parameters(), *second.parameters()]
    groups = SimpleNamespace(layout=SimpleNamespace(data_parallel=world_size, data_parallel_sharding="none"),
                             data_parallel_group=dist.group.WORLD)
    reduction = DataParallelGradients(params, [], groups=groups, mode="none", shards=1, overlap=True,
                                      bucket_bytes=8 * 8 * 4)
    assert [len(bucket.params) for bucket in reduction.buffer.buckets] == [2, 2]  # second's, then first's
    errors = []
    for step in range(3):  # the first step confirms the parameters; later ones overlap
        inputs = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        reference = [copy.deepcopy(first), copy.deepcopy(second)]

        def loss_of(layers: list[nn.Module]) -> torch.Tensor:
            hidden = layers[0](inputs)
            return (layers[1](hidden) if rank == 0 else hidden).square().sum()

        expected = torch.autograd.grad(loss_of(reference), [p for layer in reference for p in layer.parameters()],
                                       allow_unused=True)
        expected = [torch.zeros_like(p) if g is None else g for p, g in zip(params, expected)]
        for grad in expected:
            dist.all_reduce(grad)
            grad /= world_size
        for param in params:
            param.grad = None
        reduction.arm(1)
        loss_of([first, second]).backward()
        reduction.finish()
        averaged = {id(p): view for bucket in reduction.buffer.buckets for p, view in zip(bucket.params, bucket.views)}
        errors.append(max((averaged[id(p)] - g).abs().max().item() for p, g in zip(params, expected)))
    return errors


@pytest.mark.distributed
def test_buckets_start_in_order_when_ranks_finish_them_in_another_order() -> None:
    """A parameter one rank's batch does not use keeps its bucket from being ready there; the later bucket, ready on
    both ranks, must still start after it, or the ranks' collectives pair different buckets."""
    from lightning_merak.testing import run_distributed

    for errors in run_distributed(_uneven_use_rank, 2, timeout_s=60):
        assert max(errors) < 1e-6


def test_loss_scaling_is_refused_with_pipeline_tensor_or_full_sharding_at_setup() -> None:
    from types import SimpleNamespace

    from lightning_merak.parallel.data.buckets import check_sharding

    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    plain = dict(data_parallel_sharding="none", data_parallel=2, pipeline_parallel=1, tensor_parallel=1)
    for split in ({"pipeline_parallel": 2}, {"tensor_parallel": 2}):
        layout = SimpleNamespace(**{**plain, **split})
        with pytest.raises(ValueError, match=f"{next(iter(split))}=2 cannot train with a loss-scaling.*bf16-mixed"):
            check_sharding(layout, [], scaled)
        check_sharding(layout, [], MixedPrecision("bf16-mixed", "cpu"))
    with pytest.raises(ValueError, match="data_parallel_sharding='full' with a loss-scaling.*bf16-mixed"):
        check_sharding(SimpleNamespace(**{**plain, "data_parallel_sharding": "full"}), [], scaled)
    check_sharding(SimpleNamespace(**plain), [], scaled)


def test_fp16_loss_scaling_at_a_fixed_split_layout_is_refused_before_launch() -> None:
    from lightning_merak.strategies.merak3d import Merak3DStrategy

    with pytest.raises(ValueError, match="pipeline_parallel=2 cannot train with a loss-scaling.*bf16-mixed"):
        Merak3DStrategy(data_parallel=1, pipeline_parallel=2).validate_precision_before_launch("16-mixed", 2)
    with pytest.raises(ValueError, match="data_parallel_sharding='full' with a loss-scaling"):
        Merak3DStrategy(data_parallel=2, data_parallel_sharding="full").validate_precision_before_launch("16-mixed", 2)
    Merak3DStrategy(data_parallel=1, pipeline_parallel=2).validate_precision_before_launch("bf16-mixed", 2)
    Merak3DStrategy(data_parallel=2).validate_precision_before_launch("16-mixed", 2)
