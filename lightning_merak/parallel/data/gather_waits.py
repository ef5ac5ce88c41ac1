"""Where ZeRO-1's parameter gather, overlapped with the next forward, is waited for.

:class:`~lightning_merak.parallel.data.buckets.DataParallelGradients` waits for each bucket of updated parameters in
a forward pre-hook of the first module that uses it (:func:`first_users`). A module whose parameters are read by
something other than its forward (the split vocabulary's rows, read by their exchanges before the pipeline schedule
or in its serving threads) would be read before that hook; it is a :class:`ReadsOutsideForward`, whose readers call
:meth:`ReadsOutsideForward.before_reads` first, and the gather registers its wait there (:func:`outside_readers`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Optional

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ReadsOutsideForward", "first_users", "outside_readers"]


class ReadsOutsideForward(nn.Module):
    """A module whose parameters (its submodules' included) are read outside its forward: whoever reads them calls
    :meth:`before_reads` first, which runs the waits registered with :meth:`register_read_wait`."""

    def register_read_wait(self, wait: Callable[[], None]) -> RemovableHandle:
        """Run ``wait`` before every read of this module's parameters (until the handle is removed)."""
        waits = self.__dict__.setdefault("_read_waits", OrderedDict())
        handle = RemovableHandle(waits)
        waits[handle.id] = wait
        return handle

    def before_reads(self) -> None:
        """About to read the parameters: run the registered waits (a gather still in flight finishes here)."""
        for wait in list(self.__dict__.get("_read_waits", {}).values()):
            wait()


def first_users(root: nn.Module, bucket_of: Callable[[nn.Parameter], Optional[int]]) -> dict[nn.Module, set[int]]:
    """The buckets (``bucket_of`` a parameter, None: not bucketed) each module's forward must find gathered: its own
    parameters', and those of containers it reads without calling them (a ``ParameterDict`` of adapter factors)."""
    parent = {child: module for module in root.modules() for child in module.children()}
    users: dict[nn.Module, set[int]] = {}
    for owner in root.modules():
        indices = {bucket_of(param) for param in owner._parameters.values() if param is not None} - {None}
        if not indices:
            continue
        caller = owner
        while type(caller).forward is nn.Module.forward and caller in parent:  # never called: a container
            caller = parent[caller]
        users.setdefault(caller, set()).update(indices)  # type: ignore[arg-type]
    return users


def outside_readers(root: nn.Module, bucket_of: Callable[[nn.Parameter], Optional[int]]
                    ) -> dict[ReadsOutsideForward, set[int]]:
    """The buckets each :class:`ReadsOutsideForward` module under ``root`` must find gathered before its reads."""
    readers: dict[ReadsOutsideForward, set[int]] = {}
    for module in root.modules():
        if isinstance(module, ReadsOutsideForward):
            indices = {bucket_of(param) for param in module.parameters()} - {None}
            if indices:
                readers[module] = indices  # type: ignore[assignment]
    return readers
