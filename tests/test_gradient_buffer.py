"""GradientBuffer: gradients live in one flat tensor per dtype and keep autograd's values."""

import torch
from torch import nn

from lightning_merak.distributed.gradient_buffer import GradientBuffer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3), nn.Linear(3, 2, bias=False))


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return model(torch.randn(4, 6)).square().sum()


def _inside(flat: torch.Tensor, tensor: torch.Tensor) -> bool:
    start = flat.data_ptr()
    return start <= tensor.data_ptr() < start + flat.numel() * flat.element_size()


def test_accumulated_gradients_are_views_of_the_buffer_with_autograds_values() -> None:
    reference, model = _model(), _model()
    buffer = GradientBuffer(list(model.parameters()))
    for seed in (1, 2):  # the second backward accumulates into the slices in place
        _loss(reference, seed).backward()
        _loss(model, seed).backward()
    (flat,) = buffer.flats
    assert flat.numel() == sum(p.numel() for p in model.parameters())
    for expected, param in zip(reference.parameters(), model.parameters()):
        assert _inside(flat, param.grad)
        torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=0)


def test_assigned_gradients_are_gathered_and_absent_ones_stay_absent() -> None:
    model = _model()
    buffer = GradientBuffer(list(model.parameters()))
    _loss(model, 1).backward()
    first, last = model[0].weight, model[3].weight
    assigned = torch.full_like(first, 7.0)
    first.grad = assigned
    last.grad = None
    buffer.gather()
    assert _inside(buffer.flats[0], first.grad) and torch.equal(first.grad, assigned)
    assert last.grad is None
    (flat,) = buffer.flats
    assert float(flat.abs().sum()) > 0
    buffer.flats[0].zero_()
    assert float(first.grad.abs().sum()) == 0


def test_one_flat_per_dtype_and_frozen_or_repeated_parameters_left_out() -> None:
    model = _model()
    model[2].to(torch.float64)
    model[3].weight.requires_grad_(False)
    params = list(model.parameters())
    buffer = GradientBuffer(params + params)
    assert len(buffer.flats) == 2 and {flat.dtype for flat in buffer.flats} == {torch.float32, torch.float64}
    assert sum(flat.numel() for flat in buffer.flats) == sum(p.numel() for p in params if p.requires_grad)
    assert all(p.requires_grad for p in buffer.params)
    buffer.remove()
    model[2].to(torch.float32)
    _loss(model, 1).backward()
    assert not any(_inside(flat, model[0].weight.grad) for flat in buffer.flats)


def test_tail_first_sizes_keep_the_last_buckets_small_and_double_up_to_the_bucket_size() -> None:
    from lightning_merak.distributed.gradient_buffer import tail_first_sizes

    assert tail_first_sizes([4] * 10, 16, 4) == [3, 4, 2, 1]
    assert tail_first_sizes([4] * 10, 16, None) == [2, 4, 4]
    assert tail_first_sizes([4] * 10, 16, 64) == [2, 4, 4]  # a tail above the bucket size is the bucket size
    assert tail_first_sizes([1, 1, 40], 16, 4) == [2, 1]  # a large last item closes its bucket alone
    assert tail_first_sizes([4] * 3, None, 4) == [3]
    assert tail_first_sizes([], 16, 4) == []


class _UsedOutOfOrder(nn.Module):
    """Registers ``last`` before ``first`` but uses ``first`` first, like a decoder layer's norms."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.last, self.middle, self.first = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.middle(self.first(x)))


def test_buckets_in_the_order_a_backward_finished_them_start_without_memory_and_adopt_autograds_values() -> None:
    model, reference = _UsedOutOfOrder(), _UsedOutOfOrder()
    params = list(model.parameters())
    guessed = GradientBuffer(params, bucket_bytes=40)
    assert guessed.params == list(reversed(params))  # the guess puts ``first`` last and ``last`` first...
    model(torch.randn(3, 6)).sum().backward()
    order = guessed.finish_order()
    finished = [model.last.bias, model.last.weight, model.middle.bias, model.middle.weight, model.first.bias,
                model.first.weight]
    assert {id(p) for p in order} == {id(p) for p in params}
    assert [id(p) for p in order[-2:]] == [id(p) for p in finished[-2:]]  # ...which the backward finished last
    guessed.remove()
    for param in params:
        param.grad = None
    buffer = GradientBuffer(params, bucket_bytes=40, ready_order=order, released=True)
    assert [id(p) for p in buffer.params] == [id(p) for p in order]
    assert all(bucket.released for bucket in buffer.buckets)
    assert [id(p) for p in buffer.buckets[-1].params] == [id(model.first.weight)]  # alone: 96 bytes, over 40
    for seed in (1, 2):
        torch.manual_seed(seed)
        inputs = torch.randn(3, 6)
        reference(inputs).sum().backward()
        model(inputs).sum().backward()
    for expected, param in zip(reference.parameters(), params):
        assert _inside(buffer.bucket_of(param).flat, param.grad)
        torch.testing.assert_close(param.grad, expected.grad, rtol=0, atol=0)
