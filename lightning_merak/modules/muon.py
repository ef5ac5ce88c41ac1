"""Muon on the hidden matrices and AdamW on the rest, as one optimizer, divided over data-parallel ranks.

Muon's Newton–Schulz step needs each matrix whole. Replicated data parallelism gives each matrix one owner rank
(:meth:`MuonWithAdamW.spread_over`); ZeRO-1/2 leave flat slices of the matrices on the ranks, which
:meth:`MuonWithAdamW.assemble_pieces` turns into whole matrices on one owner each
(:class:`~lightning_merak.parallel.data.whole_matrices.MatrixPieces`): each rank keeps the momentum of its slices
(an elementwise update), sends its slices of the Nesterov update to the matrices' owners, the owners
orthogonalise, and each rank applies its slices of the result. The arithmetic is torch's own
(``torch.optim._muon``), so a sharded step equals ``torch.optim.Muon`` on the same gradients, bit for bit. Its
Newton–Schulz iteration runs in bfloat16, fast on GPUs and on CPUs that multiply bfloat16 natively (AVX512-BF16,
AMX) and some 50× slower than float32 on those that do not (AVX2 only): there ``newton_schulz_dtype="float32"``
runs the same iteration (:func:`newton_schulz`) in float32, and a bfloat16 run warns once, naming it. Fused
expert tensors (``[experts, rows, cols]``, transformers' MoE layers) are stacks of matrices: each expert's matrix is
orthogonalised on its own, as if it were its own parameter; expert-parallel ranks step the experts they hold, and so
do FSDP2's ranks (``data_parallel_sharding="full"`` shards a stack along its experts); a shard splitting the
matrices themselves is gathered for the step (:func:`_each_local_matrix`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from lightning_merak.modules.config import NEWTON_SCHULZ_DTYPES
from lightning_merak.parallel.data.owners import OwnedMatrices
from lightning_merak.parallel.data.whole_matrices import MatrixPieces
from lightning_merak.util.cpu_features import cpu_multiplies_bfloat16
from lightning_merak.util.timing import median_call_time
from lightning_merak.util.values import is_finite_number

__all__ = ["NEWTON_SCHULZ_DTYPES", "MatrixMuon", "MuonWithAdamW", "newton_schulz", "newton_schulz_seconds",
           "not_linear_maps"]


def newton_schulz(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.optim.Muon``'s quintic Newton–Schulz iteration on ``matrix`` (2-D) in ``dtype``: the same operations
    in the same order as its bfloat16 kernel, so in bfloat16 the two agree bit for bit."""
    a, b, c = coefficients
    tall = matrix.size(0) > matrix.size(1)
    ortho = matrix.to(dtype)
    if tall:
        ortho = ortho.T
    ortho = ortho / ortho.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = ortho @ ortho.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, gram_update, ortho, beta=a)
    return ortho.T if tall else ortho


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def not_linear_maps(model: nn.Module) -> set[int]:
    """Ids of ``model``'s parameters of two or three dimensions that :class:`MatrixMuon` would take for a matrix or a
    stack of matrices but are neither, which Muon leaves to AdamW: a convolution's kernel (a depthwise
    ``(channels, 1, k)`` kernel would be stepped as ``channels`` separate ``1 x k`` matrices), a stack of biases
    (``down_proj_bias``: one bias per expert) and a bilinear form. What stays with Muon, as the Muon recipe's rule of
    every hidden tensor of two or more dimensions: linear maps' weights (``nn.Linear``, transformers' ``Conv1D``, a
    router, an adapter's factors), other 2-D tensors (Mamba's ``A_log``) and the 3-D tensors of other modules, stacks
    of per-expert matrices (``gate_up_proj``). Pass it with the embeddings as :class:`MuonWithAdamW`'s
    ``adamw_only``."""
    found: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.ndim in (2, 3) and (isinstance(module, (*_CONVOLUTIONS, nn.Bilinear)) or "bias" in name):
                found.add(id(param))
    return found


def _iteration_in(dtype: str, zeropower: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The Newton–Schulz iteration run in ``dtype`` (:data:`NEWTON_SCHULZ_DTYPES`): :func:`newton_schulz` in float32,
    torch's kernel ``zeropower`` in bfloat16; both take ``(matrix, coefficients, steps, eps)``."""
    return newton_schulz if dtype == "float32" else zeropower


def _warn_slow_bfloat16(params: list[torch.Tensor]) -> None:
    """Warn (on rank 0, once: one call site) where bfloat16 Newton–Schulz would run on a CPU without native bfloat16
    products."""
    if not any(param.device.type == "cpu" for param in params) or cpu_multiplies_bfloat16():
        return
    rank_zero_warn(f"Muon's Newton–Schulz iteration runs in bfloat16 (torch.optim.Muon's), which this CPU "
                   f"({torch.backends.cpu.get_cpu_capability()}, no AVX512-BF16 or AMX) multiplies some 50x slower "
                   "than float32; set optim.newton_schulz_dtype=float32 for the same iteration in float32",
                   stacklevel=3)


def _muon_kernels() -> tuple[Callable[..., torch.Tensor], Callable[..., float]]:
    """torch's Newton–Schulz iteration and learning-rate adjustment (private functions of ``torch.optim._muon``,
    looked up when the optimizer is built, so a torch without them fails there, with the fix, not mid-step)."""
    kernels = importlib.import_module("torch.optim._muon")
    zeropower = getattr(kernels, "_zeropower_via_newtonschulz", None)
    adjust_lr = getattr(kernels, "_adjust_lr", None)
    if zeropower is None or adjust_lr is None:
        raise RuntimeError(f"optim=muon needs torch.optim._muon's Newton–Schulz functions, which torch "
                           f"{torch.__version__} does not have; use a torch that has them, or optim=adamw")
    return zeropower, adjust_lr


def _checked_muon_settings(settings: dict[str, Any], known: Iterable[str]) -> dict[str, Any]:
    """``settings`` of ``torch.optim.Muon``, refused (naming each bad one and its range) where torch would refuse
    them or would step with them into non-finite or unorthogonalised weights: NaN passes no range, a momentum of 1
    or more grows without bound, and ``ns_steps < 1`` skips the orthogonalisation."""
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise TypeError(f"Muon has no setting {', '.join(unknown)}; its settings are {', '.join(sorted(known))}")

    def number(name: str) -> Optional[float]:
        value = settings.get(name)
        return float(value) if is_finite_number(value) else None

    bounds = {"lr": (lambda v: v >= 0, ">= 0"), "weight_decay": (lambda v: v >= 0, ">= 0"),
              "momentum": (lambda v: 0 <= v < 1, "in [0, 1)"), "eps": (lambda v: v > 0, "> 0")}
    problems = [f"{name}={settings[name]!r} must be a finite number {bound}" for name, (test, bound) in bounds.items()
                if name in settings and ((value := number(name)) is None or not test(value))]
    steps = settings.get("ns_steps")
    if "ns_steps" in settings and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        problems.append(f"ns_steps={steps!r} must be an integer >= 1 (Newton–Schulz iterations)")
    if settings.get("adjust_lr_fn") not in (None, "original", "match_rms_adamw"):
        problems.append(f"adjust_lr_fn={settings['adjust_lr_fn']!r} must be None, 'original' or 'match_rms_adamw'")
    if not isinstance(settings.get("nesterov", True), bool):
        problems.append(f"nesterov={settings['nesterov']!r} must be True or False")
    if problems:
        raise ValueError("Muon: " + "; ".join(problems))
    return settings


def _refuse_shared_storage(params: Iterable[torch.Tensor]) -> None:
    """Refuse two parameters over one storage (a tie made by copying ``.data``, not by sharing the Parameter):
    each would be stepped, the shared weights moved twice."""
    seen: dict[tuple[int, tuple[int, ...]], int] = {}
    for index, param in enumerate(params):
        if type(param.data) is not torch.Tensor or param.is_meta or param.numel() == 0:
            continue  # DTensor shards and meta tensors have no storage of their own to compare
        key = (param.data_ptr(), tuple(param.shape))
        if key in seen:
            raise ValueError(f"parameters {seen[key]} and {index} (shape {tuple(param.shape)}) share one storage, so "
                             "the optimizer would step those weights twice; tie them as one nn.Parameter (as "
                             "transformers' tie_weights does) or pass one of them")
        seen[key] = index


def _each_local_matrix(stack: DTensor, step: Callable[[torch.Tensor], torch.Tensor]) -> DTensor:
    """``step`` on this rank's whole matrices of a sharded stack (``[..., rows, cols]``, such as FSDP2's fused
    experts): a shard of the stack dimensions holds whole matrices, stepped where they lie; one splitting a matrix's
    rows or columns is first gathered along them (and cut again after), since Newton–Schulz needs each matrix whole."""
    mesh, placements = stack.device_mesh, tuple(stack.placements)
    matrix_dims = {stack.ndim - 2, stack.ndim - 1}
    whole_matrices = tuple(  # a shard-like placement (Shard, FSDP2 with TP's strided shard) has a dim
        placement if getattr(placement, "dim", None) is not None and placement.dim % stack.ndim not in matrix_dims
        else Replicate() for placement in placements)
    gathered = stack if whole_matrices == placements else stack.redistribute(mesh, whole_matrices)
    stepped = DTensor.from_local(step(gathered.to_local()), mesh, whole_matrices, run_check=False,
                                 shape=gathered.shape, stride=gathered.stride())
    return stepped if whole_matrices == placements else stepped.redistribute(mesh, placements)


class MatrixMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update (its defaults, Newton–Schulz iteration and learning-rate adjustment) on
    matrices and on stacks of matrices: a fused expert tensor ``[experts, rows, cols]`` is stepped as if each
    expert's matrix were its own parameter. With :attr:`pieces` set (:meth:`MuonWithAdamW.assemble_pieces`), the
    slices ZeRO-1/2 put in its groups are stepped by putting each matrix together on its owner (module docstring).
    A slice without a gradient is left as it is, as torch leaves a parameter without one, and counts as zeros in
    its matrix: so a step whose gradients every rank dropped (``NonFiniteGuard``'s skip) changes nothing, with the
    ranks still exchanging the same pieces (none waits for one that skipped).
    """

    def __init__(self, params: Any, lr: float, momentum: float, newton_schulz_dtype: str = "bfloat16",
                 **defaults: Any) -> None:
        if newton_schulz_dtype not in NEWTON_SCHULZ_DTYPES:
            raise ValueError(f"newton_schulz_dtype={newton_schulz_dtype!r}; choose one of "
                             f"{', '.join(NEWTON_SCHULZ_DTYPES)}")
        signature = inspect.signature(torch.optim.Muon.__init__).parameters
        settings = {name: parameter.default for name, parameter in signature.items()
                    if parameter.default is not inspect.Parameter.empty}
        super().__init__(params, _checked_muon_settings({**settings, **defaults, "lr": lr, "momentum": momentum},
                                                        settings))
        _refuse_shared_storage([param for group in self.param_groups for param in group["params"]])
        self._zeropower, self._adjust_lr = _muon_kernels()
        for group in self.param_groups:
            for param in group["params"]:
                if param.ndim not in (2, 3):
                    raise ValueError(f"Muon steps matrices and stacks of matrices; a parameter of shape "
                                     f"{tuple(param.shape)} belongs with AdamW")
        self.newton_schulz_dtype = newton_schulz_dtype
        """The dtype of the Newton–Schulz iteration (:data:`NEWTON_SCHULZ_DTYPES`), a setting of the run."""
        if newton_schulz_dtype == "bfloat16":
            _warn_slow_bfloat16([param for group in self.param_groups for param in group["params"]])
        self.pieces: Optional[MatrixPieces] = None
        self._group_of: dict[int, dict[str, Any]] = {}

    def assemble(self, pieces: MatrixPieces) -> None:
        """Step the matrices of ``pieces`` from now on by putting their slices together (collective-free)."""
        self.pieces = pieces
        self._group_of = {pieces.index[id(param)]: group for group in self.param_groups
                          for param in group["params"] if id(param) in pieces.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, which replaces the group dicts by new ones, with each assembled matrix's group found
        again among the new (by position), so its Newton–Schulz settings are read from the groups in use."""
        positions = {index: next(position for position, held in enumerate(self.param_groups) if held is group)
                     for index, group in self._group_of.items()}
        super().load_state_dict(state_dict)
        self._group_of = {index: self.param_groups[position] for index, position in positions.items()}

    def _sliced(self) -> bool:
        """Whether data-parallel sharding has replaced the assembled matrices by this rank's slices (of none, on a
        rank whose part of the buckets holds none)."""
        return self.pieces is not None and bool(self.pieces.matrices) and not any(
            id(param) in self.pieces.index for group in self.param_groups for param in group["params"])

    def _orthogonalised(self, update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """torch's Newton–Schulz iteration on a matrix, or on each matrix of a stack (``[..., rows, cols]``), in
        :attr:`newton_schulz_dtype`."""
        iteration = _iteration_in(self.newton_schulz_dtype, self._zeropower)

        def one(matrix: torch.Tensor) -> torch.Tensor:
            return iteration(matrix, group["ns_coefficients"], group["ns_steps"], group["eps"])

        if update.ndim == 2:
            return one(update)
        if isinstance(update, DTensor):
            return _each_local_matrix(update, lambda local: self._orthogonalised(local, group))
        return torch.stack([one(matrix) for matrix in update.reshape(-1, *update.shape[-2:]).unbind(0)]).view(
            update.shape)

    def _nesterov_update(self, param: nn.Parameter, group: dict[str, Any]) -> torch.Tensor:
        """The momentum step of ``param`` (a matrix or a slice of one: elementwise) and its Nesterov update."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)
        buffer = state["momentum_buffer"]
        buffer.lerp_(param.grad, 1 - group["momentum"])
        return param.grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    def _apply(self, param: nn.Parameter, group: dict[str, Any], shape: torch.Size, orthogonal: torch.Tensor) -> None:
        """Weight decay, then the orthogonalised update scaled for a matrix of ``shape``."""
        lr = float(group["lr"])
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(orthogonal.view_as(param), alpha=-self._adjust_lr(lr, group["adjust_lr_fn"], shape[-2:]))

    @torch.no_grad()
    def step_matrices(self, params: list[nn.Parameter]) -> None:
        """The step of ``params`` alone (whole matrices of this optimizer; those without a gradient are skipped)."""
        wanted = {id(param) for param in params}
        for group in self.param_groups:
            for param in group["params"]:
                if id(param) in wanted and param.grad is not None:
                    update = self._nesterov_update(param, group)
                    self._apply(param, group, param.shape, self._orthogonalised(update, group))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held: dict[int, torch.Tensor] = {}
        steps: list[tuple[nn.Parameter, dict[str, Any], torch.Tensor, Any]] = []
        for group in self.param_groups:
            for param in group["params"]:
                whole = getattr(param, "sharded_from", param)
                index: Optional[int] = None
                if whole is not param:
                    assert self.pieces is not None, "sharded Muon slices without MuonWithAdamW.assemble_pieces()"
                    index = self.pieces.index[id(whole)]
                if param.grad is None:
                    if index is not None:  # sent as zeros: the ranks put the matrices together every step
                        held[index] = torch.zeros_like(param)
                    continue
                update = self._nesterov_update(param, group)
                if index is None:
                    steps.append((param, group, whole, self._orthogonalised(update, group)))
                else:
                    held[index] = update
                    steps.append((param, group, whole, index))
        results = (self.pieces.map_whole(
            lambda index, matrix: self._orthogonalised(matrix, self._group_of[index]), held)
            if self._sliced() and self.pieces is not None else {})
        for param, group, whole, result in steps:
            self._apply(param, group, whole.shape, results[result] if isinstance(result, int) else result)
        return loss


class _PartsState(MutableMapping):
    """Per-parameter optimizer state kept by the part that steps the parameter, read and written as one mapping."""

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self._parts = parts

    def _part(self, param: Any) -> torch.optim.Optimizer:
        """The part whose groups hold ``param`` now (data-parallel sharding replaces the groups' parameters)."""
        for part in self._parts:
            if any(held is param for group in part.param_groups for held in group["params"]):
                return part
        raise KeyError(param)

    def __getitem__(self, param: Any) -> dict[str, Any]:
        return self._part(param).state[param]

    def __setitem__(self, param: Any, value: dict[str, Any]) -> None:
        self._part(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._part(param).state[param]

    def __contains__(self, param: object) -> bool:
        return any(param in part.state for part in self._parts)

    def __iter__(self) -> Iterator[Any]:
        return (param for part in self._parts for param in part.state)

    def __len__(self) -> int:
        return sum(len(part.state) for part in self._parts)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon (:class:`MatrixMuon`: ``torch.optim.Muon``'s update) on the hidden matrices of ``groups`` and on fused
    expert tensors (each expert's matrix on its own), AdamW on every other parameter (norms, biases, and the
    embeddings and head, whose ids ``adamw_only`` holds, as the Muon recipe prescribes), as one optimizer. A tensor of
    two or three dimensions that is no matrix (a convolution's kernel, a stack of biases) goes to AdamW only through
    ``adamw_only``: a caller holding the model passes :func:`not_linear_maps` there.

    Why one: Lightning's automatic optimization steps one optimizer per module, and Muon orthogonalises
    matrices only (norms and biases need another rule). Muon scales its step to match
    AdamW's update size (``adjust_lr_fn="match_rms_adamw"``), so both share the learning rate and weight decay.
    Its groups are the two optimizers' own (named ``muon/<group>`` and ``adamw/<group>``), so a learning-rate
    schedule moves both.

    Under replicated data parallelism, :meth:`spread_over` gives each matrix one owner rank
    (:class:`~lightning_merak.parallel.data.owners.OwnedMatrices`): the owner alone keeps its momentum and
    orthogonalises it, and broadcasts the new value, so the Newton–Schulz work and the momentum divide over the
    replicas instead of repeating on each; the result is the same. merak3d does this by itself at
    ``data_parallel_sharding="none"``; ``state_dict`` still holds every matrix's momentum. Under ZeRO-1/2 merak3d
    calls :meth:`assemble_pieces` and the parts step this rank's slices (module docstring).
    """

    def __init__(self, groups: list[dict[str, Any]], lr: float, momentum: float,
                 adamw_only: frozenset[int] | set[int] = frozenset(), newton_schulz_dtype: str = "bfloat16") -> None:
        # torch's bookkeeping, before the parts exist (add_param_group); the groups are then the parts'
        super().__init__([param for group in groups for param in group["params"]], {"lr": lr})
        self.adamw_only = frozenset(adamw_only)
        """Ids of the matrices left to AdamW (embeddings and head), in later groups (:meth:`add_param_group`) too."""
        split = [self._split_group(group) for group in groups]
        # every group in both parts, empty or not: a pipeline stage holding no hidden matrix (only the embedding)
        # has the same groups as the others, so a learning-rate schedule's state fits every stage
        self.muon = MatrixMuon([muon for muon, _ in split], lr=lr, momentum=momentum,
                               newton_schulz_dtype=newton_schulz_dtype, adjust_lr_fn="match_rms_adamw")
        self.parts: list[torch.optim.Optimizer] = [self.muon, torch.optim.AdamW([adamw for _, adamw in split], lr=lr)]
        self._take_parts_groups()
        self.state = _PartsState(self.parts)  # what checkpointers read and write per parameter: the parts' own
        self.owners: Optional[OwnedMatrices] = None

    def _split_group(self, group: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``group`` cut into Muon's part (the hidden matrices and expert stacks) and AdamW's (the rest)."""
        params = list(group["params"])
        hidden = [param for param in params if param.ndim in (2, 3) and id(param) not in self.adamw_only]
        hidden_ids = {id(param) for param in hidden}
        name = group.get("name", "params")
        rest = [param for param in params if id(param) not in hidden_ids]
        return {**group, "params": hidden, "name": f"muon/{name}"}, {**group, "params": rest, "name": f"adamw/{name}"}

    def _take_parts_groups(self) -> None:
        """Make :attr:`param_groups` the parts' group dicts themselves, so a learning-rate schedule setting them
        sets the parts' (after each change of the parts' groups: torch's load replaces the dicts)."""
        self.param_groups = [group for part in self.parts for group in part.param_groups]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add ``param_group`` (as Lightning's ``BaseFinetuning`` does when it unfreezes layers) to the parts by the
        constructor's rule, each filling in its own defaults; torch's own call from the constructor records it."""
        if "parts" not in vars(self):
            super().add_param_group(param_group)
            return
        params = param_group["params"]
        param_group = {**param_group, "params": [params] if isinstance(params, torch.Tensor) else list(params)}
        held = {id(param) for group in self.param_groups for param in group["params"]}
        if any(id(param) in held for param in param_group["params"]):
            raise ValueError("some parameters of the new group are already in this optimizer's groups; add each "
                             "parameter once")
        muon_group, adamw_group = self._split_group(param_group)
        for part, group in zip(self.parts, (muon_group, adamw_group)):
            part.add_param_group(group)
        self._take_parts_groups()

    @property
    def matrices(self) -> list[nn.Parameter]:
        """The parameters Muon steps."""
        return [param for group in self.muon.param_groups for param in group["params"]]

    def spread_over(self, group: Any, replicated: Optional[set[int]] = None) -> None:
        """Step each Muon matrix on one rank of ``group`` and broadcast it; ``replicated``: ids of the matrices
        every rank of ``group`` holds with equal values and gradients (default: all; others, such as
        expert-parallel weights, step on their own rank). A collective-free call every rank of ``group`` makes."""
        matrices = [param for param in self.matrices if replicated is None or id(param) in replicated]
        self.owners = OwnedMatrices(matrices, group)
        self.owners.drop_state(self.muon.state)

    def assemble_pieces(self, plan: Callable[[list[nn.Parameter]], MatrixPieces]) -> None:
        """Before data-parallel sharding puts slices of the matrices in the groups: ``plan(matrices)`` says which
        rank holds which slice of each sharded matrix and who owns it; each step then puts every matrix together
        on its owner for the Newton–Schulz iteration. Collective-free."""
        self.muon.assemble(plan(self.matrices))

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.owners is None:  # alone, or on data-parallel slices (MatrixMuon puts them together)
            self.muon.step()
        else:  # each owner steps its matrices and sends the new values; matrices not shared step here
            shared = {id(param) for param in self.owners.params}
            self.muon.step_matrices([param for param in self.matrices if id(param) not in shared])
            self.owners.step_and_share(self.muon.step_matrices)
        for part in self.parts[1:]:
            part.step()
        return loss

    def _split(self, flat: dict[str, Any]) -> list[dict[str, Any]]:
        """torch's state dict over all the parts' groups, cut into one per part (indices made the part's own)."""
        parts, first_group, first_index = [], 0, 0
        for part in self.parts:
            groups = flat["param_groups"][first_group:first_group + len(part.param_groups)]
            count = sum(len(group["params"]) for group in part.param_groups)
            state = {index - first_index: value for index, value in flat["state"].items()
                     if first_index <= index < first_index + count}
            parts.append({"state": state, "param_groups": [
                {**group, "params": [index - first_index for index in group["params"]]} for group in groups]})
            first_group, first_index = first_group + len(part.param_groups), first_index + count
        return parts

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Every part's state; spread over replicas, every matrix's momentum gathered from its owner (a collective
        then: every rank of the group calls it)."""
        received = [] if self.owners is None else self.owners.gather_state(self.muon.state, "momentum_buffer")
        try:
            return {"parts": [part.state_dict() for part in self.parts]}
        finally:
            if self.owners is not None:
                self.owners.drop_state(self.muon.state, received)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this optimizer's own format, or torch's over :attr:`param_groups` (the parts' groups in order, as a
        checkpointer writing ``state[param]`` per parameter builds it)."""
        parts = state_dict["parts"] if "parts" in state_dict else self._split(state_dict)
        for part, state in zip(self.parts, parts):
            part.load_state_dict(state)
        self._take_parts_groups()
        if self.owners is not None:
            self.owners.drop_state(self.muon.state)


def newton_schulz_seconds(optimizers: Iterable[Any], device: torch.device, repeats: int = 3) -> dict[int, float]:
    """Seconds of the Newton–Schulz iterations a step runs for each parameter (by ``id``) of ``optimizers``:
    :class:`MuonWithAdamW`'s and :class:`MatrixMuon`'s matrices in their dtype (a stack of experts' matrices:
    each one's), ``torch.optim.Muon``'s in bfloat16 (its kernel); none for other optimizers. Timed on ``device``
    once per distinct matrix shape and setting, on random matrices (a parameter on meta is timed by its shape),
    so AutoPipe can price each stage's optimizer step."""
    torch_muon = getattr(torch.optim, "Muon", None)
    timed: dict[tuple[Any, ...], float] = {}
    seconds: dict[int, float] = {}
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer
        optimizer = optimizer.muon if isinstance(optimizer, MuonWithAdamW) else optimizer
        if isinstance(optimizer, MatrixMuon):
            dtype = optimizer.newton_schulz_dtype
        elif torch_muon is not None and isinstance(optimizer, torch_muon):
            dtype = "bfloat16"
        else:
            continue
        for group in optimizer.param_groups:
            settings = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"], dtype)
            for param in group["params"]:
                shape = tuple(param.shape[-2:])
                if (shape, settings) not in timed:
                    timed[(shape, settings)] = _time_newton_schulz(shape, *settings, device, repeats)
                seconds[id(param)] = timed[(shape, settings)] * (param.numel() // max(shape[0] * shape[1], 1))
    return seconds


def _time_newton_schulz(shape: tuple[int, ...], coefficients: tuple[float, float, float], steps: int, eps: float,
                        dtype: str, device: torch.device, repeats: int) -> float:
    matrix, iteration = torch.randn(shape, device=device), _iteration_in(dtype, _muon_kernels()[0])
    return median_call_time(lambda: iteration(matrix, coefficients, steps, eps), repeats, device)
