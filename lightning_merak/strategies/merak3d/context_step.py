"""merak3d's step with a context-parallel degree per sample (``context_parallel_degree='per_micro_batch'``).

Each global batch of variable-length samples (:class:`~lightning_merak.parallel.micro_batching.VariableBatch`) is
planned into rounds (:func:`~lightning_merak.parallel.context.variable.plan_context_degrees`, the same on every
rank), which :class:`~lightning_merak.parallel.context.rounds.RoundRunner` runs with one backward each. Installed
as the module's ``compute_loss``, in the strategy's pipeline-step slot: like a pipelined step it runs its
backward passes inside the training step and hands the gradients back in ``backward``, where the data-parallel
reduction averages them over ``dp x cp`` ranks; each round's loss is weighted so that this average is the
gradient of the token mean over the whole global batch.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_merak.modules.causal_lm import scores_next_token
from lightning_merak.parallel.context.model import ContextParallelForward, attention_model
from lightning_merak.parallel.context.rounds import RoundRunner, context_subgroups, measure_degree_cost
from lightning_merak.parallel.context.variable import ContextPlan, DegreeCost, plan_context_degrees
from lightning_merak.parallel.layout import LayoutGroups
from lightning_merak.parallel.micro_batching.options import DEFAULT_TOKENS, MicroBatching
from lightning_merak.parallel.micro_batching.plan import CostModel
from lightning_merak.parallel.micro_batching.samples import VariableBatch, target_count
from lightning_merak.parallel.pipeline.stage import RankStages
from lightning_merak.strategies.merak3d.network import ModuleView
from lightning_merak.strategies.merak3d.pipeline_step import HeldGradients, hold_gradients, restore_gradients
from lightning_merak.strategies.merak3d.variable_step import PipelineSteps, install_pipeline_step

__all__ = ["ContextRoundsStep", "check_context_rounds_model", "install_context_rounds", "install_step"]


class _NoClock:
    """The pipeline-step slot's busy clock: no stage here, so no measured bubble."""

    last: Optional[tuple[float, float]] = None


class ContextRoundsStep:
    """The rounds of each global batch on this rank; :meth:`loss` returns the global batch's token-mean loss."""

    def __init__(self, module: Any, model: nn.Module, groups: LayoutGroups, options: MicroBatching,
                 degree: Any = "per_micro_batch") -> None:
        forward = attention_model(model).forward  # a PEFT model's base model runs the split forward
        if not isinstance(forward, ContextParallelForward):
            raise TypeError("context_parallel_degree='per_micro_batch' runs on a model with context parallelism "
                            "installed (install_context_parallel)")
        check_context_rounds_model(module, model)
        config = getattr(model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        if options.cost is None and not vocab:
            raise ValueError("context_parallel_degree='per_micro_batch' measures its cost model on samples of the "
                             "model's vocabulary, but its config names no vocab_size; set strategy.micro_batching_cost")
        self.cost: Optional[DegreeCost] = DegreeCost(CostModel(*options.cost)) if options.cost is not None else None
        """The per-sample planner's cost model: ``micro_batching_cost``, else measured here on the first global
        batch (:func:`~lightning_merak.parallel.context.rounds.measure_degree_cost`)."""
        self._vocab = vocab
        self._module, self._model, self._groups, self._options, self._degree = module, model, groups, options, degree
        self._runner = RoundRunner(forward, context_subgroups(groups))
        self._planned: Optional[tuple[VariableBatch, ContextPlan]] = None
        self._pending: HeldGradients = []
        self.scaled_later: frozenset[int] = frozenset()
        """As :attr:`~.pipeline_step.PipelineStep.scaled_later`: gradients the reduction divides by the rounds."""
        self.clock = _NoClock()
        self.last_plan: Optional[ContextPlan] = None

    def token_cap(self, lengths: list[int]) -> int:
        """Tokens one rank may hold: ``micro_batch_tokens`` (default 4096), never below the longest sample's share
        at the whole group's degree."""
        size = self._groups.layout.context_parallel
        return max(self._options.tokens or DEFAULT_TOKENS, -(-max(lengths) // size) + 2 * size)

    def plan(self, batch: Any) -> ContextPlan:
        if not isinstance(batch, VariableBatch):
            raise TypeError(f"context_parallel_degree='per_micro_batch' needs variable-length global batches "
                            f"(VariableBatch, data.lengths=variable), got {type(batch).__name__}; for fixed-length "
                            "blocks set context_parallel_degree='fixed'")
        if self._planned is None or self._planned[0] is not batch:
            lengths = [int(length) for length in batch.lengths]
            layout = self._groups.layout
            cap = self.token_cap(lengths)
            if self.cost is None:  # every rank plans its first global batch at once: measure here, together
                self.cost = measure_degree_cost(self._runner, self._model, layout.context_parallel, cap, self._vocab,
                                                batch.tokens.device, longest_sample(self._model, lengths))
                rank_zero_info(f"merak3d: per-sample context-parallel degrees planned on a cost measured here: "
                               f"{self.cost} (strategy.micro_batching_cost fixes one)")
            self._planned = (batch, plan_context_degrees(lengths, layout.batch_replicas, layout.context_parallel,
                                                         self.cost, cap, self._degree))
        return self._planned[1]

    def backward_passes(self, batch: Any) -> int:
        """Rounds every rank runs for ``batch`` (one backward each; what the data-parallel reduction is armed with)."""
        return len(self.plan(batch).replicas[0])

    def loss(self, batch: Any) -> Tensor:
        plan = self.plan(batch)
        self.last_plan = plan
        rounds = plan.replicas[self._groups.batch_rank]
        lengths = [int(length) for length in batch.lengths]
        targets = target_count(lengths)
        replicated = self._groups.layout.data_parallel  # ranks the reduction averages over: dp x cp
        training = self._module.training and torch.is_grad_enabled()
        parameters = [p for p in self._model.parameters() if p.requires_grad]

        def backward(loss: Tensor, degree: int) -> None:  # a split loss's backward already scales by its degree
            (loss * (replicated * len(rounds) / degree)).backward()

        if not training:
            with torch.no_grad():
                share = self._runner.run(rounds, batch.tokens, lengths, targets, None)
        else:
            for param in parameters:
                param.grad = None
            share = self._runner.run(rounds, batch.tokens, lengths, targets, backward)
            self._pending = hold_gradients(parameters, len(rounds), self.scaled_later)
        dist.all_reduce(share, group=self._groups.data_parallel_group)
        return share

    def restore_gradients(self) -> None:
        """Put back the gradients the last training step computed (Lightning zeroes them before ``backward``)."""
        restore_gradients(self._pending)
        self._pending = []

    def forward(self, inputs: Tensor) -> Tensor:
        raise RuntimeError("with context_parallel_degree='per_micro_batch' the module only trains and validates; "
                           "predict with context_parallel_degree='fixed'")


def longest_sample(model: nn.Module, lengths: list[int]) -> int:
    """The longest sample a cost measurement may run: the batch's longest, within the model's position table
    (``max_position_embeddings``, GPT-2's ``n_positions``), which longer samples would index past."""
    config = getattr(model, "config", None)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return min(max(lengths), limit) if isinstance(limit, int) and limit > 0 else max(lengths)


def check_context_rounds_model(module: Any, model: nn.Module) -> None:
    """Refuse a ``module`` (training ``model``) whose loss the rounds cannot compute: one of its own (they score
    next-token cross-entropy themselves) or a MoE router aux loss (they have none over the whole batch). Before
    launch (:meth:`~.arguments.Merak3DArguments.validate_model`) and again where the rounds are installed."""
    if not scores_next_token(module) or not hasattr(module, "compute_loss"):
        raise ValueError(f"context_parallel_degree='per_micro_batch' computes next-token cross-entropy itself, but "
                         f"{type(module).__name__} brings its own loss; keep CausalLMModule's loss_from_logits or "
                         "set context_parallel_degree='fixed'")
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ValueError("context_parallel_degree='per_micro_batch' has no router aux loss over the whole batch "
                         "yet; set output_router_logits=False or context_parallel_degree='fixed'")


def install_context_rounds(module: Any, model: nn.Module, groups: LayoutGroups, options: MicroBatching,
                           degree: Any = "per_micro_batch") -> ContextRoundsStep:
    """Run ``module``'s loss (CausalLMModule's next-token cross-entropy) as rounds of per-sample degrees."""
    step = ContextRoundsStep(module, model, groups, options, degree)
    module.compute_loss = step.loss
    module.forward = step.forward
    return step


def install_step(degree: str, options: MicroBatching, view: ModuleView, stages: Optional[RankStages],
                 groups: LayoutGroups, device: torch.device) -> Optional[Union[PipelineSteps, ContextRoundsStep]]:
    """The step that runs backward passes inside the training step, if any: the rounds of per-sample degrees
    (``context_parallel_degree='per_micro_batch'``), the pipeline's schedule (``stages``), else none."""
    if degree == "per_micro_batch":
        return install_context_rounds(view.module, view.network, groups, options)
    return None if stages is None else install_pipeline_step(options, view, stages, groups, device)
