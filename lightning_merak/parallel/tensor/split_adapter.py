"""What every adapter split by tensor parallelism with its base shares: the base class of the split LoRA layers
(:mod:`~lightning_merak.parallel.tensor.adapters`) and the split Q-BaRA / QA-HiRA ones
(:mod:`~lightning_merak.parallel.tensor.pooled_adapters`), and the refusals common to both."""

from __future__ import annotations

from typing import Optional, Sized

import torch
from torch import nn

__all__ = ["SPLIT_FIX", "SplitAdapter", "reordered_rows_refusal", "shared_split_problem"]

SPLIT_FIX = "use tensor_parallel=1 (pipeline_parallel / data_parallel split adapter models)"


def reordered_rows_refusal(method_name: str, layer_name: str, lambda_out: int) -> str:
    """Why a pooled adapter with ``lambda_out > 1`` cannot split with a column layer whose ranks hold reordered or
    shared rows: its groups of output rows would cross the ranks."""
    return (f"{method_name}: the ranks of the column layer {layer_name} hold reordered or shared rows (fused "
            f"projections, shared key/value heads), which groups of lambda_out={lambda_out} would cross; use "
            f"lambda_out=1 for it, or {SPLIT_FIX}")


def shared_split_problem(layer: nn.Module, adapters: Sized) -> Optional[str]:
    """Why no adapter on tuner ``layer`` (holding ``adapters``) splits with its base, or None: a base other than a
    float ``nn.Linear`` (or a subclass computing the same product), several adapters, a merged one."""
    from transformers.pytorch_utils import Conv1D  # lazy: a tuner layer means PEFT, hence transformers, is loaded

    base = layer.get_base_layer()
    if isinstance(base, Conv1D):  # not a quantised base: building the adapter model on meta changes nothing
        return ("its base is a transformers Conv1D (GPT-2's layers, weight stored (in, out)), which is not split "
                "under an adapter however the adapter model was built (on the meta device too): put the "
                "adapters on other layers (adapter.target_modules) to keep tensor parallelism")
    if not _plain_product(base):
        problem = (f"its base is a {type(base).__module__}.{type(base).__qualname__}, a layer class whose forward the "
                   "split does not reproduce (it splits float nn.Linear layers and subclasses computing the same "
                   "x @ W.T + b, such as Falcon's FalconLinear)")
        weight = getattr(base, "weight", None)
        if isinstance(weight, torch.Tensor) and not weight.is_floating_point():
            problem += ("; a base quantised before the split is not split: build the adapter model on the meta device "
                        "(adapter=... under merak3d, or lightning_merak.adapters.meta.attach_on_meta) so that each "
                        "rank quantises its shard after the split")
        return problem
    if len(adapters) != 1:
        return f"it holds {len(adapters)} adapters; one adapter per layer is split"
    if layer.merged:
        return "its adapter is merged into the base; unmerge it first"
    return None


def _plain_product(base: nn.Module) -> bool:
    """Whether ``base`` is a float ``nn.Linear`` whose forward is ``x @ W.T + b``, which the split layers compute
    from its weight and bias: ``nn.Linear`` itself, a subclass keeping its forward, or FalconLinear (it only adds
    the bias after the product)."""
    from transformers.models.falcon.modeling_falcon import FalconLinear  # lazy: as Conv1D above

    if not isinstance(base, nn.Linear) or not base.weight.is_floating_point():
        return False
    return type(base).forward is nn.Linear.forward or type(base) is FalconLinear


class SplitAdapter(nn.Module):
    """An adapter split with its base layer (``base_layer``, a column or row layer); :meth:`partial_parameters`
    are its whole parameters whose gradient each rank forms from its part only (summed over the group)."""

    base_layer: nn.Module

    def __init__(self, layer: nn.Module, problem: Optional[str]) -> None:
        """Refuse ``layer`` where it cannot split (``problem``: why; the adapter checks before launch name the
        same reasons first)."""
        super().__init__()
        if problem is not None:
            raise ValueError(f"the adapter cannot be split: {problem}; {SPLIT_FIX}")
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def partial_parameters(self) -> list[nn.Parameter]:
        raise NotImplementedError
