"""The context-parallel degree a run will have, where it is known before launch (pure: plain numbers)."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Mapping, Union

__all__ = ["known_context_parallel", "naming_auto_degree"]

_OPTION_NAMES = {"dp": "data_parallel", "pp": "pipeline_parallel", "tp": "tensor_parallel"}


def known_context_parallel(context_parallel: Union[int, str], degrees: Mapping[str, Union[int, str]],
                           world_size: int) -> int:
    """``context_parallel`` when fixed; for ``'auto'`` the only degree the planner can choose when the data-,
    pipeline- and tensor-parallel ``degrees`` are all fixed (its layouts fill the world: ``dp x pp x tp x cp``),
    so that what rules it out is refused before launch; else 1 (the planner decides)."""
    if isinstance(context_parallel, int):
        return context_parallel
    fixed = [degree for degree in degrees.values() if isinstance(degree, int)]
    if len(fixed) < len(degrees) or world_size % math.prod(fixed):
        return 1
    return world_size // math.prod(fixed)


@contextlib.contextmanager
def naming_auto_degree(context_parallel: Union[int, str], known: int,
                       degrees: Mapping[str, Union[int, str]]) -> Iterator[None]:
    """Inside, a refusal of the degree :func:`known_context_parallel` found for ``'auto'`` says where it comes
    from and adds the way out of leaving another degree to the planner (a fixed degree's refusal is unchanged)."""
    try:
        yield
    except ValueError as error:
        if context_parallel != "auto":
            raise
        fixed = ", ".join(f"{_OPTION_NAMES.get(name, name)}={degree}" for name, degree in degrees.items())
        raise ValueError(f"context_parallel='auto' can only be {known} here (the other degrees are fixed: {fixed}), "
                         f"and {error}; or set data_parallel, pipeline_parallel or tensor_parallel to 'auto'"
                         ) from error
