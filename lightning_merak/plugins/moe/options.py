"""What the MoE layer adds to DeepSpeed's: its options, declared and checked once, and the checks of DeepSpeed's
own layer arguments, made before anything is built.

Plain Python (no torch, no DeepSpeed): ``merak-train``'s ``moe`` options derive their schema
from :class:`MoEOptions`'s fields, so composing a configuration stays light. A refusal names an option as its
caller spelled it: the Python argument, or inside :func:`option_keys` the key ``merak-train``'s user typed
(``moe.capacity_factor``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_merak.util.fields import option
from lightning_merak.util.values import is_finite_number

__all__ = ["DispatchPath", "MoEOptions", "NOISY_GATE_POLICIES", "PlacementPolicy", "PlanFrom", "check_count",
           "check_flag", "check_layer_arguments", "check_number", "option_key", "option_keys"]

DispatchPath = Literal["capacity", "dropless"]
PlacementPolicy = Literal["none", "pro_prophet", "shadowing", "auto"]
PlanFrom = Literal["auto", "current", "previous"]
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
"""What DeepSpeed's ``TopKGate`` takes as ``noisy_gate_policy`` (``None`` and ``"None"``: no noise)."""
_REPLICATING_PLACEMENTS = ("pro_prophet", "auto")
_TYPED_KEYS: ContextVar[Optional[Mapping[str, str]]] = ContextVar("moe_typed_keys", default=None)
"""The keys :func:`option_key` names options by (none outside :func:`option_keys`)."""


@contextlib.contextmanager
def option_keys(keys: Mapping[str, str]) -> Iterator[None]:
    """Meanwhile refusals name each option in ``keys`` by its key there: an entry point whose users type keys wraps
    its checks in this (``merak-train``: ``{"capacity_factor": "moe.capacity_factor", "k":
    "model.config.num_experts_per_tok"}``), so the message names what they typed."""
    token = _TYPED_KEYS.set(dict(keys))
    try:
        yield
    finally:
        _TYPED_KEYS.reset(token)


def option_key(name: str) -> str:
    """How a refusal names option ``name``: its typed key inside :func:`option_keys`, else the Python argument."""
    keys = _TYPED_KEYS.get()
    return name if keys is None else keys.get(name, name)


def check_count(name: str, value: Any, lowest: int | None, fix: str) -> None:
    """Refuse ``value`` unless it is an integer >= ``lowest`` (None: any integer; a bool is an int to Python, but
    ``True`` as a count is a slip, not a 1)."""
    if not isinstance(value, int) or isinstance(value, bool) or (lowest is not None and value < lowest):
        raise ValueError(f"{option_key(name)}={value!r} must be an integer{'' if lowest is None else f' >= {lowest}'}; "
                         f"{fix}")


def check_number(name: str, value: Any, fix: str, *, above: float | None = None, at_least: float | None = None) -> None:
    """Refuse ``value`` unless it is a finite number (not a bool) > ``above`` or >= ``at_least``: NaN passes no
    comparison, so an unchecked one silently turns its rule off."""
    if (not is_finite_number(value) or (above is not None and value <= above)
            or (at_least is not None and value < at_least)):
        bound = f" > {above}" if above is not None else f" >= {at_least}" if at_least is not None else ""
        raise ValueError(f"{option_key(name)}={value!r} must be a finite number{bound}; {fix}")


def check_flag(name: str, value: Any) -> None:
    """Refuse ``value`` unless it is a bool: ``"false"`` would count as true."""
    if not isinstance(value, bool):
        raise ValueError(f"{option_key(name)}={value!r} must be True or False; pass a bool (a string or number here "
                         "is a slip)")


def check_layer_arguments(hidden_size: Any, num_experts: Any, ep_size: Any, k: Any, capacity_factor: Any,
                          eval_capacity_factor: Any, min_capacity: Any, noisy_gate_policy: Any,
                          **flags: Any) -> None:
    """Refuse DeepSpeed ``MoE`` arguments that fail at the first forward (``num_experts=0``) or change what it
    computes without a word (a capacity of 0 or NaN drops tokens, ``k`` above ``num_experts`` routes to experts
    that do not exist, ``noisy_gate_policy='RSample'`` is ignored by top-2 gating). ``flags``: the boolean switches
    by name; ``use_tutel`` and ``enable_expert_tensor_parallelism`` must be False."""
    check_count("hidden_size", hidden_size, 1, "pass the model's hidden size (the experts' input and output width)")
    check_count("num_experts", num_experts, 1, "pass the number of experts of the layer")
    check_count("ep_size", ep_size, 1, "pass the ranks the experts are spread over (1: no expert parallelism)")
    if num_experts % ep_size:
        raise ValueError(f"{option_key('ep_size')}={ep_size} does not divide "
                         f"{option_key('num_experts')}={num_experts}; pick a divisor")
    if not isinstance(k, int) or isinstance(k, bool) or k not in (1, 2):
        raise ValueError(f"{option_key('k')}={k!r}: only top-1 and top-2 gating are supported (DeepSpeed's TopKGate "
                         "paths); pass 1 or 2, or for a transformers MoE model use moe.experts=merak_ep, which keeps "
                         "the model's own router and runs any top-k")
    if k > num_experts:
        raise ValueError(f"{option_key('k')}={k} exceeds {option_key('num_experts')}={num_experts}: a token cannot go "
                         f"to {k} different experts; pass {option_key('k')} <= {num_experts} or more experts")
    capacity_fix = "pass e.g. 1.0 (DeepSpeed's default: an expert takes up to factor x tokens / num_experts)"
    check_number("capacity_factor", capacity_factor, capacity_fix, above=0)
    check_number("eval_capacity_factor", eval_capacity_factor, capacity_fix, above=0)
    check_count("min_capacity", min_capacity, 0, "pass the fewest tokens an expert always takes (0: no floor)")
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"{option_key('noisy_gate_policy')}={noisy_gate_policy!r}: choose None, 'Jitter' or 'RSample'")
    if noisy_gate_policy == "RSample" and k != 1:
        raise ValueError(f"{option_key('noisy_gate_policy')}='RSample' samples top-1 gating only, top-2 would ignore "
                         f"it; pass {option_key('k')}=1, or 'Jitter' or None")
    for name, value in flags.items():
        check_flag(name, value)
    unsupported = [name for name in ("use_tutel", "enable_expert_tensor_parallelism") if flags.get(name)]
    if unsupported:
        raise ValueError(f"{' and '.join(map(option_key, unsupported))} {'is' if len(unsupported) == 1 else 'are'} "
                         "not supported; pass False")


@dataclass
class MoEOptions:
    """What this layer adds to DeepSpeed's: dispatch path, placement policy, overlap, and the online check of
    the placement planner (:mod:`.core.plan_check`). The defaults are plain DeepSpeed-MoE's behaviour. Layers
    sharing a scheduler share the check (the first one's settings); block-scope Lancet's sub-batches run the
    model's choice unchecked."""

    dispatch: DispatchPath = option(
        "capacity", "`capacity` (DeepSpeed's: an expert takes at most its capacity of tokens, the rest are dropped) "
        "or `dropless` (every routed token reaches its expert; needs `drop_tokens=False`).")
    placement: PlacementPolicy = option(
        "none", "`none` (experts stay where DeepSpeed puts them), `pro_prophet` (Pro-Prophet's replica sets against "
        "no replication), `shadowing` (the FasterMoE baseline: hot experts to every rank, from this step's "
        "counts) or `auto` (one planner picks, per call, between no replication, dropless dispatch, shadowing and "
        "Pro-Prophet sets by predicted cost).")
    lancet_chunks: Union[int, str] = option(
        1, "Chunks each call's exchange is split into, so that one chunk's all-to-all overlaps another's expert "
        "compute (Lancet); `auto` simulates 1, 2, 4 and 8 and keeps the fastest; 1: no overlap. Digits in a config "
        "file become an integer.")
    lancet_backward: bool = option(
        True, "With chunks, compute the experts' weight gradients after their input gradient, while that chunk's "
        "input-gradient all-to-all is in flight.")
    overlap_transfer: bool = option(
        True, "Move replicated experts' parameters in the background (under the dispatch all-to-all, or prefetched "
        "under the previous layer) rather than before the exchange.")
    replan_every: int = option(1, "Make a new placement plan every this many calls of the layer (1: every call).")
    replan_threshold: Optional[float] = option(
        None, "Also re-plan sooner when the routed counts drifted from those of the last plan by more than this "
        "fraction of its tokens (`null`: only every `replan_every` calls).")
    exclude_fewest: int = option(
        0, "Pro-Prophet: leave out this many ranks, those sending an expert the fewest tokens, when choosing where to "
        "replicate it (the paper's n).")
    slots_per_rank: Optional[int] = option(None, "Pro-Prophet: the most replicas one rank may hold (`null`: no cap).")
    alpha: float = option(
        0.25, "Pro-Prophet's balance rule: loads count as balanced when max − min < alpha × tokens / experts (the "
        "paper's α = 3 never replicated anything at Zipf 1.2 in our measurements, hence 0.25).")
    plan_from: PlanFrom = option(
        "auto", "`current` plans from this call's counts (transfers overlap the dispatch), `previous` from the "
        "previous call's (Pro-Prophet's prediction, transfers prefetched under the previous layer), `auto` "
        "prefetches only while the cost model says the prediction pays.")
    online_check: bool = option(
        True, "With `auto` and `pro_prophet`: correct the planner's predictions per plan kind, timing and chunking "
        "by the layer time measured when each ran; each such arm runs once to be measured.")
    explore_every: int = option(
        16, "With the online check: about every this many calls, an arm whose measurements say it could still be "
        "the fastest runs instead, if its corrected prediction is within `explore_regret` of the best (0: never).")
    explore_regret: float = option(0.25, "How far (relative) above the best an arm's prediction may be to explore it.")
    explore_seed: int = option(0, "Seed of the exploration's random schedule.")
    balance_tolerance: float = option(
        0.05, "Arms measured within this fraction of the fastest run the one whose plan balances the load best "
        "(0: speed alone).")

    def __post_init__(self) -> None:
        if isinstance(self.lancet_chunks, str) and self.lancet_chunks.isdigit():
            self.lancet_chunks = int(self.lancet_chunks)

    def validate(self, drop_tokens: bool, ep_size: int | None = None) -> None:
        """Refuse every field out of range, and options that cannot act with ``drop_tokens`` or ``ep_size``."""
        if self.dispatch not in ("capacity", "dropless"):
            raise ValueError(f"{option_key('dispatch')}={self.dispatch!r}: choose 'capacity' or 'dropless'")
        if self.placement not in ("none", "pro_prophet", "shadowing", "auto"):
            raise ValueError(f"{option_key('placement')}={self.placement!r}: choose 'none', 'pro_prophet', 'shadowing' "
                             "or 'auto'")
        if self.plan_from not in ("auto", "current", "previous"):
            raise ValueError(f"{option_key('plan_from')}={self.plan_from!r}: choose 'auto', 'current' or 'previous'")
        if self.dispatch == "dropless" and drop_tokens:
            raise ValueError(f"{option_key('dispatch')}='dropless' never drops tokens; pass "
                             f"{option_key('drop_tokens')}=False")
        chunks = self.lancet_chunks
        if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
            raise ValueError(f"{option_key('lancet_chunks')}={chunks!r}: use 'auto' or an integer >= 1")
        for flag in ("lancet_backward", "overlap_transfer", "online_check"):
            check_flag(flag, getattr(self, flag))
        check_count("replan_every", self.replan_every, 1, "pass the calls between plans (1: every call)")
        if self.replan_threshold is not None:
            check_number("replan_threshold", self.replan_threshold,
                         "pass the drift (fraction of the plan's tokens) that re-plans early, or None", at_least=0)
        check_count("exclude_fewest", self.exclude_fewest, 0, "pass the lightest senders left out (0: none)")
        if self.slots_per_rank is not None:
            check_count("slots_per_rank", self.slots_per_rank, 1, "pass the most replicas a rank holds, or None")
        check_number("alpha", self.alpha, "pass the balance threshold as a fraction of tokens / experts "
                     "(0: any imbalance replicates; 0.25 by default)", at_least=0)
        check_count("explore_every", self.explore_every, 0, "pass the calls between explorations (0: never)")
        check_number("explore_regret", self.explore_regret,
                     "pass how far (relative) above the best an explored arm may be", at_least=0)
        check_count("explore_seed", self.explore_seed, None, "pass any integer seed")
        check_number("balance_tolerance", self.balance_tolerance, "pass a fraction in [0, 1) (0: speed alone)",
                     at_least=0)
        if self.balance_tolerance >= 1.0:
            raise ValueError(f"{option_key('balance_tolerance')}={self.balance_tolerance} must lie in [0, 1) "
                             "(0: choose on speed alone)")
        if ep_size is not None:
            self._validate_for(ep_size)

    def _validate_for(self, ep_size: int) -> None:
        """Options that would silently do nothing on ``ep_size`` ranks."""
        if self.placement != "none" and ep_size == 1:
            raise ValueError(f"{option_key('placement')}={self.placement!r} needs {option_key('ep_size')} > 1 (nothing "
                             "to replicate to)")
        if self.placement in _REPLICATING_PLACEMENTS and ep_size > 1 and self.exclude_fewest > ep_size - 2:
            raise ValueError(
                f"{option_key('exclude_fewest')}={self.exclude_fewest} leaves Pro-Prophet no rank to replicate to: at "
                f"most {ep_size - 1} other ranks send an expert tokens with {option_key('ep_size')}={ep_size}; pass at "
                f"most {ep_size - 2}")
