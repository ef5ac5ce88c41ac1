"""DeepSpeed's communication wrapper over the process group torch already has, without its CPU build step.

On a CPU accelerator, DeepSpeed's ``TorchBackend`` compiles a shared-memory all-reduce kernel the first time
it starts (``deepspeed_shm_comm``: g++ and ninja, 60–90 s on two cores), and every rank that finds the build
lock of a build killed halfway waits on it forever. The kernel serves only ``inference_all_reduce``; training
(ZeRO, MoE exchanges, gradient reduction) uses torch's collectives, so nothing here calls it. Marking the op
incompatible before DeepSpeed's backend starts skips the build, with the same results.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["SHARED_MEMORY_OP", "init_deepspeed_comm", "skip_shared_memory_kernel"]

SHARED_MEMORY_OP = "deepspeed_shm_comm"
"""The name DeepSpeed's ``ShareMemCommBuilder`` registers in ``deepspeed.ops.__compatible_ops__``."""


def skip_shared_memory_kernel() -> None:
    """Keep DeepSpeed from compiling (and initialising) its CPU shared-memory all-reduce kernel."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):  # absent in a DeepSpeed without op builders: nothing is built then
        compatible[SHARED_MEMORY_OP] = False


def init_deepspeed_comm(backend: Optional[str] = None) -> None:
    """Start DeepSpeed's comm wrapper once, over torch's default group (gloo or NCCL), without the CPU kernel
    build; ``backend`` defaults to that group's."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed import comm

    if comm.is_initialized():
        return
    skip_shared_memory_kernel()
    deepspeed.init_distributed(dist_backend=backend or dist.get_backend(), auto_mpi_discovery=False)
