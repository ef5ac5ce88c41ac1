"""Regional compilation for strategies other than merak3d (DDP, FSDP2, DeepSpeed, single device).

``Trainer(callbacks=[RegionalCompile()])`` compiles each transformer block of the LightningModule's model with
``torch.compile`` (:mod:`lightning_merak.parallel.regional_compile`) once the strategy has wrapped it, before the
first batch; merak3d compiles its own blocks after it cuts and splits them (``Merak3DStrategy(compile=True)``,
``strategy.compile=true``), so the callback refuses that strategy rather than compile blocks about to be replaced.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_merak.parallel.pipeline.trace import TraceError, find_trunk
from lightning_merak.parallel.regional_compile import CompiledForward, compile_blocks

__all__ = ["RegionalCompile"]


def _compile_backends() -> tuple[list[str], list[str]] | None:
    """``torch.compile``'s backend names: every one it accepts, and those it lists for use (debug ones left out);
    ``None`` where this torch has no ``torch._dynamo.list_backends`` (a private API; ``torch.compile`` then refuses
    an unknown name itself, at the first compiled block)."""
    list_backends = getattr(getattr(torch, "_dynamo", None), "list_backends", None)
    if list_backends is None:
        return None
    return list_backends(exclude_tags=()), list_backends()


class RegionalCompile(pl.Callback):
    """Compile each block of the model's trunk (its ``nn.ModuleList`` of same-class blocks) in place.

    Args:
        backend: the ``torch.compile`` backend (``"inductor"``; ``"aot_eager"`` to debug a difference).
    """

    def __init__(self, backend: str = "inductor") -> None:
        backends = _compile_backends()
        if not isinstance(backend, str) or (backends is not None and backend not in backends[0]):
            listed = f" ({', '.join(backends[1])}, or a debug one)" if backends is not None else ""
            raise ValueError(f"RegionalCompile(backend={backend!r}) is not a torch.compile backend; choose one "
                             f"torch knows{listed}, e.g. 'inductor', or 'aot_eager' to debug a difference")
        self.backend = backend
        self.compiled: list[CompiledForward] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if getattr(trainer.strategy, "strategy_name", None) == "merak3d":
            raise ValueError("RegionalCompile compiles blocks merak3d replaces when it cuts and splits the model; "
                             "use Merak3DStrategy(compile=True) (strategy.compile=true) and drop the callback")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._compile(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._compile(pl_module)

    def _compile(self, pl_module: pl.LightningModule) -> None:
        if self.compiled:
            return
        try:
            path, trunk = find_trunk(pl_module)
        except TraceError as error:
            raise ValueError(f"RegionalCompile compiles transformer blocks one by one: {error}") from error
        prefix = f"{path}." if path else ""
        self.compiled = compile_blocks(((f"{prefix}{index}", block) for index, block in enumerate(trunk)),
                                       backend=self.backend)
