"""The check of ``Merak3DStrategy``'s ``process_group_backend`` when the strategy is made (not at launch)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["backend_problem"]


def backend_problem(backend: Any) -> Optional[str]:
    """Why torch.distributed cannot start ``backend`` (a name such as ``"gloo"``, or per device types
    ``"cpu:gloo,cuda:nccl"``), or None: an unknown name, a device type the backend does not serve, or a backend
    this torch was built without would otherwise fail only once the processes have launched."""
    known = [name for name in dist.Backend.backend_list if name != "undefined"]
    fix = f"choose one of {', '.join(known)}, per device type as 'cpu:gloo,cuda:nccl', or None (from the device)"
    if not isinstance(backend, str) or not backend:
        return f"process_group_backend={backend!r} is not a backend name; {fix}"
    for entry in backend.lower().split(","):
        device_type, _, name = entry.rpartition(":") if ":" in entry else ("", "", entry)
        if name not in known:
            return f"process_group_backend={backend!r}: {name!r} is not a torch.distributed backend; {fix}"
        served = dist.Backend.backend_capability.get(name, [device_type])
        if ":" in entry and device_type not in served:
            return (f"process_group_backend={backend!r}: {name} does not serve {device_type!r} tensors (it serves "
                    f"{', '.join(served)}); {fix}")
        if not dist.is_backend_available(name):
            return (f"process_group_backend={backend!r}: torch {torch.__version__} was built without {name}; "
                    f"{fix}")
    return None
