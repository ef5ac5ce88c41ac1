"""The memory manager: block hooks, warm-up profiling, planning and per-step bookkeeping.

Framework-free (plain ``nn.Module`` + a step protocol), so benchmarks and tests can drive
it in a bare training loop and :class:`~lightning_merak.callbacks.delta.DeltaMemory` only
maps Lightning's hooks onto it:

    manager.begin_step(signature, numel)   # before the forward
    manager.end_forward()                  # forward done, backward about to run
    manager.end_backward()                 # after backward

A block may run several times per step (one forward and one backward per micro-batch
inside a pipeline schedule); each run is an *invocation* with its own record and its own
swap owner, so prefetching brings back the micro-batch whose backward is next.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from lightning_merak.callbacks.delta.activation_swap import SwapManager
from lightning_merak.callbacks.delta.budget import AUTO_FRACTION, Budget
from lightning_merak.callbacks.delta.ledger import ResidentLedger, TimelinePoint
from lightning_merak.callbacks.delta.memory_planner import (
    Action,
    Plan,
    PlannerSettings,
    StepProfile,
    calibrate_outside,
    plan_memory,
)
from lightning_merak.callbacks.delta.options import DeltaOptions
from lightning_merak.callbacks.delta.profiler import (
    OUTSIDE,
    BlockRecord,
    DeviceMemory,
    SavedTensorTracker,
    profile_from_records,
)
from lightning_merak.callbacks.delta.recompute_switch import SwitchableForward, install_switch, remove_switch
from lightning_merak.callbacks.delta.swap_tiers import HostTier, make_tier

__all__ = ["ManagerOptions", "MemoryManager", "StepReport", "iter_tensors"]

ShareFn = Callable[[Any], Any]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclass-like outputs."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)
    elif hasattr(obj, "to_tuple"):
        yield from iter_tensors(obj.to_tuple())


@dataclass(kw_only=True)
class ManagerOptions(DeltaOptions):
    """Everything the manager needs besides the model: the callback's settings with the budget parsed,
    the swap tier chosen and the per-block overrides; validated by the callback."""

    budget: Budget
    swap_tier: str
    overrides: Mapping[str, Action] = field(default_factory=dict)


@dataclass(frozen=True)
class StepReport:
    """What one managed step did, for the logger."""

    peak_saved_bytes: int
    budget_bytes: int
    device_peak_bytes: int
    swapped_blocks: int
    recomputed_blocks: int
    planned_release_bytes: int
    exposed_copy_s: float


@dataclass
class _Invocation:
    """One forward (and later backward) of a block within a step: one micro-batch."""

    owner: str
    position: int
    record: BlockRecord
    transient_bytes: int = 0


@dataclass
class _Block:
    name: str
    module: nn.Module
    switch: SwitchableForward
    action: Action = Action.KEEP
    invocations: list[_Invocation] = field(default_factory=list)
    context: Any = None
    handles: list = field(default_factory=list)


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


class MemoryManager:
    """Keeps the resident saved activations of ``blocks`` under a budget.

    Warm-up steps run every block in keep mode and record a profile; then a plan is made
    (shared through ``share`` so data-parallel ranks agree) and blocks switch to their
    actions. A new input size re-plans from the profile scaled by the input's element count.
    ``blocks`` may be empty on a rank whose blocks are all managed by someone else (a
    pipeline stage the strategy recomputes entirely): it still takes part in ``share``.
    """

    def __init__(
        self,
        blocks: Sequence[tuple[str, nn.Module]],
        options: ManagerOptions,
        log: Callable[[str], None] = print,
        share: ShareFn = lambda payload: payload,
        any_rank: Callable[[bool], bool] = lambda flag: flag,
    ) -> None:
        names = [n for n, _ in blocks]
        unknown = sorted(set(options.overrides) - set(names))
        if unknown:
            raise ValueError(f"overrides name unknown blocks {unknown}; managed blocks are {names}")
        if options.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be at least 1, got {options.warmup_steps}")
        self.options = options
        self.log = log
        self.share = share
        self.any_rank = any_rank
        """Whether any rank says so (collective): ranks whose inputs differ in size meet new sizes apart."""
        self.ledger = ResidentLedger()
        self.tracker = SavedTensorTracker(self.ledger)
        self.blocks = [_Block(n, m, install_switch(m)) for n, m in blocks]
        for block in self.blocks:
            block.handles.append(
                block.module.register_forward_pre_hook(functools.partial(self._forward_start, block), with_kwargs=True)
            )
            block.handles.append(
                block.module.register_forward_hook(
                    functools.partial(self._forward_end, block), with_kwargs=True, always_call=True
                )
            )
        self.root: Optional[nn.Module] = None
        self.device_memory: Optional[DeviceMemory] = None
        self.swap: Optional[SwapManager] = None
        self.bandwidth: tuple[float, float] = (1.0, 1.0)
        self._swap_capacity_bytes: Optional[int] = None
        self.budget_bytes: Optional[int] = None
        self.plan: Optional[Plan] = None
        self.profile: Optional[StepProfile] = None
        self.timelines: dict[str, list[TimelinePoint]] = {}
        self.step_reports: list[StepReport] = []
        self._warmup: list[StepProfile] = []
        self._non_activation: list[int] = []
        self._base_numel: Optional[int] = None
        self._plans: dict[Hashable, Plan] = {}
        self._refined: set[Hashable] = set()
        self._signature: Hashable = None
        self._numel = 0
        self._in_step = False
        self._outside_hooks: Any = None
        self._swap_order: list[int] = []
        self._forward_position: dict[str, int] = {}
        self._foreign_hooks_warned = False

    # lifecycle ---------------------------------------------------------------------------

    def start(self, root: nn.Module, device: torch.device) -> None:
        """Create the swap tier on ``device`` and measure its bandwidth (once, before training)."""
        self.root = root
        self.device_memory = DeviceMemory(device)
        pool = self.options.host_pool_bytes
        host_room = _available_host_bytes() // 2
        pool = min(pool, host_room) if pool is not None else host_room
        tier = make_tier(self.options.swap_tier, device, self.options.swap_dir, pool)
        self.swap = SwapManager(tier, self.tracker, self.options.min_offload_bytes, self.options.stash_depth)
        self.bandwidth = tier.measure_bandwidth(device)
        self.log(
            f"DeltaMemory: {len(self.blocks)} blocks managed, swap tier '{tier.name}' "
            f"(copy-out {self.bandwidth[0] / 1e9:.2f} GB/s, copy-in {self.bandwidth[1] / 1e9:.2f} GB/s)"
        )

    @property
    def warming_up(self) -> bool:
        return self.plan is None

    def begin_step(self, signature: Hashable, numel: int) -> None:
        if self.swap is None or self.root is None:
            raise RuntimeError("MemoryManager.start(root, device) must run before the first step")
        if self._in_step:
            self.end_backward()
        self._in_step = True
        self._signature, self._numel = signature, max(1, numel)
        self.tracker.exclude_module_state(self.root)
        self.tracker.start_step()
        if self.plan is not None and self.options.replan_on_shape_change:
            self._apply(self._plan_for(signature))
        self.device_memory.reset_peak()
        self.ledger.start_step()
        for block in self.blocks:
            block.invocations = []
        self._outside_hooks = self.tracker.hooks(OUTSIDE)
        self._outside_hooks.__enter__()

    def end_forward(self) -> None:
        """Forward is over: stop counting saved tensors outside the blocks."""
        if self._outside_hooks is not None:
            self._outside_hooks.__exit__(None, None, None)
            self._outside_hooks = None
        self.ledger.mark("backward")

    def end_backward(self) -> Optional[StepReport]:
        """Backward is over: settle transfers, record the step, plan after warm-up."""
        if not self._in_step:
            return None
        self.end_forward()
        self.swap.end_step()
        for block in self.blocks:
            for invocation in block.invocations:
                self._drop_transient(invocation)
        self._in_step = False
        device_peak = self.device_memory.peak()
        if self.warming_up:
            self._record_warmup(device_peak)
            return None
        report = StepReport(
            peak_saved_bytes=self.ledger.peak_bytes,
            budget_bytes=self.budget_bytes,
            device_peak_bytes=device_peak,
            swapped_blocks=sum(b.action is Action.SWAP for b in self.blocks),
            recomputed_blocks=sum(b.action is Action.RECOMPUTE for b in self.blocks),
            planned_release_bytes=sum(d.released_bytes for d in self.plan.decisions),
            exposed_copy_s=self.swap.take_wait_seconds(),
        )
        self.step_reports.append(report)
        self.timelines["managed"] = list(self.ledger.timeline)
        # share is collective: every rank joins when any rank meets an input size it has not refined
        if self.any_rank(self._signature not in self._refined):
            self._refine(report)
        return report

    def close(self) -> None:
        """Undo everything: hooks, forward switches, swap files; safe after an exception."""
        if self._outside_hooks is not None:
            self._outside_hooks.__exit__(None, None, None)
            self._outside_hooks = None
        for block in self.blocks:
            if block.context is not None:
                block.context.__exit__(None, None, None)
                block.context = None
            for handle in block.handles:
                handle.remove()
            block.handles.clear()
            remove_switch(block.module)
        if self.swap is not None:
            self.swap.close()
        self._in_step = False

    # planning ----------------------------------------------------------------------------

    def _step_records(self) -> list[BlockRecord]:
        return [invocation.record for block in self.blocks for invocation in block.invocations]

    def _record_warmup(self, device_peak: int) -> None:
        profile = profile_from_records(self._step_records(), 0)
        self.timelines["unmanaged"] = list(self.ledger.timeline)
        if self.blocks and not profile.blocks:
            return
        profile = calibrate_outside(profile, {}, self.ledger.peak_bytes)
        if self._base_numel is None:
            self._base_numel = self._numel
        self._warmup.append(profile.scaled(self._base_numel / self._numel))
        self._non_activation.append(max(0, device_peak - self.ledger.peak_bytes))
        if len(self._warmup) >= self.options.warmup_steps:
            self._make_plan()

    def _make_plan(self) -> None:
        local = (
            StepProfile.median(self._warmup),
            int(statistics.median(self._non_activation)),
            self.device_memory.total(),
            self._base_numel,
            self.bandwidth,
            self.swap.tier.capacity_bytes(),
        )
        # Swap bandwidth and capacity are shared too: the director weighs them against forward
        # times, and replicas measuring slightly different copy speeds must not decide differently.
        (self.profile, non_activation, total, self._base_numel, self.bandwidth,
         self._swap_capacity_bytes) = self.share(local)
        self.budget_bytes = self._resolve_budget(non_activation, total)
        self._plans.clear()
        self._apply(self._plan_for(self._signature))

    def _resolve_budget(self, non_activation: int, total: int) -> int:
        budget = self.options.budget
        if budget.nbytes is not None:
            return budget.nbytes
        fraction = AUTO_FRACTION if budget.auto else budget.fraction
        room = int(fraction * total) - non_activation
        if room <= 0:
            warnings.warn(
                f"DeltaMemory: budget {budget} ({fraction * total / 2**30:.2f} GiB) leaves no room for "
                f"activations: the rest of the step already needs {non_activation / 2**30:.2f} GiB; "
                "releasing every block (raise the budget or shrink the batch)",
                stacklevel=2,
            )
            return 0
        return room

    def _settings(self) -> PlannerSettings:
        return PlannerSettings(
            budget_bytes=self.budget_bytes,
            swap_write_bytes_per_s=self.bandwidth[0],
            swap_read_bytes_per_s=self.bandwidth[1],
            swap_capacity_bytes=self._swap_capacity_bytes,
            director=self.options.director,
            prefetch_depth=self.options.prefetch_depth,
            overrides=self.options.overrides,
        )

    def _plan_for(self, signature: Hashable) -> Plan:
        plan = self._plans.get(signature)
        if plan is None:
            factor = self._numel / self._base_numel
            profile = self.profile if factor == 1 else self.profile.scaled(factor)
            plan = plan_memory(profile, self._settings())
            self._plans[signature] = plan
            self.device_memory.release_free()
            self.log(f"DeltaMemory plan for inputs {signature} (x{factor:.2f} of warm-up size):\n{plan.table()}")
            if not plan.fits:
                warnings.warn(
                    f"DeltaMemory: the budget of {plan.budget_bytes / 2**20:.1f} MiB cannot be met; "
                    f"the lowest reachable peak of saved activations is {plan.min_peak_bytes / 2**20:.1f} MiB "
                    "(raise the budget or shrink the batch)",
                    stacklevel=2,
                )
        return plan

    def _refine(self, report: StepReport) -> None:
        """After the first managed step of an input size: re-plan if a plan that fits went over budget.

        Measured saved bytes of keep/swap blocks replace the scaled estimates. Every rank
        takes part in ``share`` once per input size, whatever its own plan, since pipeline
        stages plan apart and one whose plan cannot fit must still join the collective;
        all replicas follow the lowest rank's verdict, so data-parallel ranks keep identical plans.
        """
        new_size = self._signature not in self._refined
        self._refined.add(self._signature)
        scaled = self.profile.scaled(self._numel / self._base_numel)
        over_budget = new_size and self.plan.fits and report.peak_saved_bytes > self.budget_bytes
        refined = self._measured_profile(report, scaled) if over_budget else None
        _, refined, peak_saved_bytes = self.share((scaled, refined, report.peak_saved_bytes))
        if refined is None:
            return
        self.log(
            f"DeltaMemory: saved activations peaked at {peak_saved_bytes / 2**20:.1f} MiB, over the "
            f"budget of {report.budget_bytes / 2**20:.1f} MiB; re-planning from measured sizes"
        )
        del self._plans[self._signature]
        plan = plan_memory(refined, self._settings())
        self._plans[self._signature] = plan
        self.device_memory.release_free()
        self.log(f"DeltaMemory re-plan for inputs {self._signature}:\n{plan.table()}")

    def _measured_profile(self, report: StepReport, scaled: Any) -> Any:
        """The scaled profile with this step's measured sizes, calibrated to its measured peak."""
        current = self._plans[self._signature]
        measured = {b.name: b for b in profile_from_records(self._step_records(), 0).blocks}
        blocks = []
        for profile_block in scaled.blocks:
            found = measured.get(profile_block.name)
            if found is not None and current.action(profile_block.name) is not Action.RECOMPUTE:
                profile_block = dataclasses.replace(
                    profile_block, saved_bytes=found.saved_bytes, boundary_bytes=found.boundary_bytes
                )
            blocks.append(profile_block)
        return calibrate_outside(
            dataclasses.replace(scaled, blocks=tuple(blocks)), current.actions, report.peak_saved_bytes
        )

    def _apply(self, plan: Plan) -> None:
        if plan is self.plan:
            return
        self.plan = plan
        # the stash and prefetches may fill memory only up to the planned peak; the rest of
        # the budget stays free for what the model does not see (a swap-in nobody prefetched)
        self.swap.budget_bytes = min(plan.predicted_peak_bytes, self.budget_bytes) if plan.fits else self.budget_bytes
        actions = plan.actions
        for block in self.blocks:
            block.action = actions.get(block.name, Action.KEEP)
            block.switch.recompute = block.action is Action.RECOMPUTE
        self._forward_position = {d.name: i for i, d in enumerate(plan.decisions)}
        self._swap_order = [i for i, d in enumerate(plan.decisions) if d.action is Action.SWAP]
        if isinstance(self.swap.tier, HostTier):
            self.swap.tier.reserve(sum(d.saved_bytes for d in plan.decisions if d.action is Action.SWAP))

    # block hooks -------------------------------------------------------------------------

    def _now(self) -> float:
        """The time of a block's event. During warm-up on a GPU, after the device has run everything queued
        before it (a synchronisation per block boundary, in the profiled steps only): otherwise a block's
        time would be its kernels' launch, not their run, and recompute would look nearly free."""
        if self.warming_up and self.device_memory.is_cuda:
            torch.cuda.synchronize(self.device_memory.device)
        return time.perf_counter()

    def _forward_start(self, block: _Block, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (self._in_step and torch.is_grad_enabled() and module.training):
            return
        self._warn_foreign_hooks(block)
        invocation = _Invocation(
            owner=f"{block.name}@{len(block.invocations)}",
            position=len(block.invocations),
            record=BlockRecord(block.name, forward_start=self._now()),
        )
        block.invocations.append(invocation)
        inputs = list(iter_tensors((args, kwargs)))
        self.tracker.set_boundary(invocation.owner, inputs)
        needs_grad = [t for t in inputs if t.requires_grad]
        if needs_grad:
            main_input = max(needs_grad, key=lambda t: t.numel())
            main_input.register_hook(functools.partial(self._backward_end, invocation))
        if block.action is Action.SWAP:
            block.context = self.swap.hooks(invocation.owner)
        else:
            block.context = self.tracker.hooks(invocation.owner)
        block.context.__enter__()

    def _forward_end(self, block: _Block, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if block.context is None:
            return
        block.context.__exit__(None, None, None)
        block.context = None
        invocation = block.invocations[-1]
        record = invocation.record
        record.forward_end = self._now()
        record.saved_bytes = self.tracker.saved_bytes(invocation.owner)
        record.boundary_bytes = self.tracker.boundary_bytes(invocation.owner)
        self.ledger.mark(f"fwd {invocation.owner}")
        for tensor in iter_tensors(output):
            if tensor.grad_fn is not None:
                tensor.grad_fn.register_prehook(functools.partial(self._backward_start, block, invocation))
                break

    def _backward_start(self, block: _Block, invocation: _Invocation, grad_outputs: Any) -> None:
        record = invocation.record
        if record.backward_start is not None:
            return
        record.backward_start = self._now()
        if block.action is Action.RECOMPUTE and self.plan is not None:
            decision = self.plan.decisions[self._forward_position[block.name]]
            invocation.transient_bytes = decision.released_bytes
            self.ledger.adjust(invocation.transient_bytes, f"recompute {invocation.owner}")
        position = self._forward_position.get(block.name)
        if self._swap_order and position is not None:
            self.swap.prefetch(self._prefetch_targets(position, invocation.position))

    def _prefetch_targets(self, position: int, micro_batch: int) -> list[tuple[str, int]]:
        """Swapped blocks whose backward comes next (same micro-batch), with the room to keep free.

        Blocks are walked in backward order from ``position``; a recomputed block met on the
        way re-materialises its released bytes before the swapped block's turn.
        """
        targets: list[tuple[str, int]] = []
        headroom = 0
        for decision in reversed(self.plan.decisions[:position]):
            if len(targets) == self.options.prefetch_depth:
                break
            if decision.action is Action.RECOMPUTE:
                headroom = max(headroom, decision.released_bytes)
            elif decision.action is Action.SWAP:
                targets.append((f"{decision.name}@{micro_batch}", headroom))
        current = self.plan.decisions[position]
        if current.action is Action.SWAP:
            targets.insert(0, (f"{current.name}@{micro_batch}", 0))
        return targets[: self.options.prefetch_depth]

    def _backward_end(self, invocation: _Invocation, grad: torch.Tensor) -> None:
        if invocation.record.backward_end is None:
            invocation.record.backward_end = self._now()
            self._drop_transient(invocation)

    def _drop_transient(self, invocation: _Invocation) -> None:
        if invocation.transient_bytes:
            self.ledger.adjust(-invocation.transient_bytes, f"recomputed {invocation.owner} freed")
            invocation.transient_bytes = 0

    def _warn_foreign_hooks(self, block: _Block) -> None:
        if self._foreign_hooks_warned:
            return
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is not None and (self._outside_hooks is None or top[0] is not self._outside_hooks.pack_hook):
            self._foreign_hooks_warned = True
            warnings.warn(
                f"DeltaMemory: other saved_tensors_hooks (save_on_cpu, an offload wrapper, ...) are active "
                f"around block {block.name}; inside managed blocks DeltaMemory's hooks take precedence",
                stacklevel=2,
            )
