"""How merak3d speeds up each transformer block — fp8 linear layers, then regional compilation — in one place.

The build applies it to the blocks that train, and the profilers (AutoPipe's trace, the layout planner) to the
blocks they time, so a partition or a layout is chosen for the blocks as they will run: an fp8 block's compute
time and saved activations, not an eager float block's.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from lightning_merak.parallel.float8 import convert_blocks_to_float8
from lightning_merak.parallel.regional_compile import compile_blocks, profiled_block

__all__ = ["FastBlocks"]


@dataclass(frozen=True)
class FastBlocks:
    """``float8``: the fp8 recipe of the blocks' linear layers (None: none); ``compile``: regional compilation."""

    float8: Optional[str] = None
    compile: bool = False

    def convert_float8(self, blocks: Sequence[tuple[str, nn.Module]]) -> list[str]:
        """Swap each ``(name, block)``'s eligible linear layers for fp8 ones, in place; the converted layers' names."""
        return convert_blocks_to_float8(blocks, self.float8) if self.float8 is not None else []

    def apply(self, blocks: Sequence[tuple[str, nn.Module]]) -> list[str]:
        """fp8 layers, then compilation, on each ``(name, block)`` in place (below recomputation, which wraps the
        compiled forward); the converted layers' names."""
        converted = self.convert_float8(blocks)
        if self.compile:
            compile_blocks(blocks)
        return converted

    def profiled(self, block: nn.Module, name: str) -> tuple[nn.Module, Callable[..., Any]]:
        """What a profiler times for ``block``: the module whose parameters train (an fp8 copy with ``float8``,
        else the block itself) and the callable that runs it as training will (compiled with ``compile``)."""
        if self.float8 is not None:
            block = copy.deepcopy(block)
            self.convert_float8([(name, block)])
        return block, profiled_block(block, name, self.compile)
