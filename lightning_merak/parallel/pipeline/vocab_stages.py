"""The LM head split by vocabulary rows over the pipeline ranks (``strategy.vocab_stages``).

With a large vocabulary the head alone outweighs several stages of blocks (a 32k head at width 128 is
2.5 stages of an 8-block Llama at pp=4), and no cut can balance that. Following Yeung et al., *Balancing
Pipeline Parallelism with Vocabulary Parallelism* (arXiv 2411.05288), every pipeline rank holds rows
``[r·c, min((r+1)·c, V))``, ``c = ⌈V/pp⌉``, of the head (:class:`VocabularySlice`) and, per micro-batch:

* the last stage runs the head's steps up to the head itself (the final norm) and broadcasts that hidden state
  to every pipeline rank;
* each rank computes its rows' logits and the softmax cross-entropy pieces: its maximum, its sum of
  exponentials and the target's logit where the target lies in its rows; two all-reduces give the exact loss;
* in training each rank then computes its rows' part of the hidden state's gradient (softmax − one-hot times
  its rows), summed onto the last stage by a reduce, which hands it to the schedule's backward, and its rows'
  weight gradient, kept locally.

Under context parallelism each context rank's pipeline ranks run this on its shard of the sequence (the targets
shifted on the whole sequence), and the last stage sums the loss over the context ranks.

These collectives run on a process group of their own. The last stage runs them inside the schedule, where
it scores the micro-batch; the other ranks serve them from a thread started with the step, beside their own
stages' forward and backward. They are not placed in the schedule's idle slots as in the paper: a rank's
thread competes with its stage for the cores, and the last stage waits for every rank's share of each
micro-batch before its backward.

The weight is a DTensor sharded ``Shard(0)`` over the pipeline mesh with the head's real shape, so a sharded
checkpoint holds the unsplit head under its own name and any layout resumes it. The loss is next-token
cross-entropy (``CausalLMModule.loss_from_logits``), computed here. The input embedding splits alike
(:mod:`.embedding_stages`); a tied head and embedding are one weight split once. LoRA on the head splits with it
(:mod:`.head_adapters`): its projection by ``A`` travels with the hidden state, its gradient with the hidden state's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_merak.parallel.context.model import IGNORE_INDEX
from lightning_merak.parallel.context.stages import sequence_shard, shard_next_token_labels
from lightning_merak.parallel.data.gather_waits import ReadsOutsideForward
from lightning_merak.parallel.pipeline.embedding_stages import embedding_split_problem
from lightning_merak.parallel.pipeline.head_adapters import (
    HeadLoRA,
    LoRAHeadRows,
    head_adapter_problem,
    head_lora,
    head_lora_layout_problem,
)
from lightning_merak.parallel.pipeline.recording import ModelTrace
from lightning_merak.parallel.pipeline.row_scatter import add_rows_gradient, rows_dtensor, scatter_rows
from lightning_merak.util.row_shards import row_shard_range

__all__ = ["LOGIT_TRANSFORMS", "HeadShape", "VocabularyExchange", "VocabularySlice", "check_vocab_stage_rows",
           "head_step_index", "split_head_over_stages", "tied_to_head", "vocab_stage_rows_problem",
           "vocab_stages_config_problem", "vocab_stages_problem"]

@dataclass(frozen=True)
class HeadShape:
    """What every rank needs of the head before the last stage sends its weights: path, sizes, bias, dtype, whether
    it trains (a frozen head, as under adapters, stays frozen), and the input embedding's path when it shares the
    head's weight."""

    path: str
    vocab_size: int
    width: int
    bias: bool
    dtype: torch.dtype
    trainable: bool = True
    tied_embedding: Optional[str] = None
    lora: Optional[HeadLoRA] = None
    """The head's LoRA (:mod:`.head_adapters`), None for a plain ``nn.Linear``."""


def head_step_index(trace: ModelTrace, head_path: str) -> Optional[int]:
    """Position of the head's call among the recorded head steps, or None when it is not called there."""
    return next((index for index, step in enumerate(trace.head) if step.module == head_path), None)


def tied_to_head(embedding: Optional[nn.Module], head: Optional[nn.Module]) -> bool:
    """Whether the input ``embedding`` and the LM ``head`` share one weight (tied word embeddings)."""
    weight = getattr(embedding, "weight", None)
    return weight is not None and weight is getattr(head, "weight", None)


def vocab_stages_problem(model: nn.Module, trace: ModelTrace, *, schedule: str) -> Optional[str]:
    """Why the head of ``model`` cannot be split over the pipeline ranks in this layout, or None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    problem = head_adapter_problem(head)
    if problem is not None:
        return problem
    problem = _tied_embedding_problem(model, head, schedule)
    if problem is not None:
        return problem
    path = next(name for name, module in model.named_modules() if module is head)
    index = head_step_index(trace, path)
    if index is None:
        return f"the LM head {path} is not called after the last block; set vocab_stages='off'"
    after = [step.module or getattr(step.function, "__name__", "?") for step in trace.head[index + 1:]]
    return _transformed_logits(after) if after else None


LOGIT_TRANSFORMS = ("logits_scaling", "logit_scale", "final_logit_softcapping")
"""Config keys whose value transformers applies to the head's logits (Granite divides, Cohere multiplies, Gemma 2/3
soft-cap; None: not applied)."""


def _transformed_logits(what: object) -> str:
    return (f"vocab_stages scores the head's logits as they are, but the model transforms them ({what}: logit "
            "scaling or soft-capping); set vocab_stages='off' (or 'auto', which keeps the head on the last stage)")


def vocab_stages_config_problem(model: nn.Module, schedule: str, tensor_parallel: Optional[int] = None
                                ) -> Optional[str]:
    """What :func:`vocab_stages_problem` would find at the build that the unsplit ``model``'s config and modules show
    without a trace, so ``vocab_stages='on'`` is refused before launch: an adapter on the head that cannot split
    (:func:`~.head_adapters.head_adapter_problem`; with ``tensor_parallel`` known, LoRA dropout there too), logits
    its config transforms (:data:`LOGIT_TRANSFORMS`), a head tied to an input embedding that cannot be split
    (Gemma's scaled one)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    problem = head_adapter_problem(head)
    if problem is None and tensor_parallel is not None:
        problem = head_lora_layout_problem(head_lora(head), tensor_parallel)
    if problem is None:
        problem = _tied_embedding_problem(model, head, schedule)
    if problem is not None:
        return problem
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    transforms = [f"{key}={value}" for key in LOGIT_TRANSFORMS
                  if (value := getattr(text_config, key, None)) is not None]
    return _transformed_logits(transforms) if transforms else None


def _tied_embedding_problem(model: nn.Module, head: Optional[nn.Module], schedule: str) -> Optional[str]:
    """Why the input embedding tied to ``head`` cannot be split over the stages with it, or None (untied, or it
    can: the split table serves both)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    problem = embedding_split_problem(embedding, schedule) if tied_to_head(embedding, head) else None
    return None if problem is None else (
        f"the LM head is tied to the input embedding, which cannot be split with it: {problem}; untie them "
        "(tie_word_embeddings=False) or set vocab_stages='off'")


def vocab_stage_rows_problem(vocab_size: int, parts: int) -> Optional[str]:
    """Why a vocabulary is too small for ``vocab_stages`` to give each of the ``parts`` (pipeline × tensor-parallel)
    ranks rows of it, naming the fix; None where every rank gets rows."""
    if row_shard_range(vocab_size, parts, parts - 1)[0] >= vocab_size:
        return (f"a vocabulary of {vocab_size} rows split over {parts} pipeline × tensor-parallel ranks leaves the "
                "last rank without rows; set vocab_stages='off'")
    return None


def check_vocab_stage_rows(vocab_size: int, parts: int) -> None:
    """Refuse what :func:`vocab_stage_rows_problem` finds."""
    problem = vocab_stage_rows_problem(vocab_size, parts)
    if problem is not None:
        raise ValueError(problem)


class VocabularySlice(ReadsOutsideForward):
    """The LM head rows ``[start, end)`` of this pipeline rank: ``weight`` (and ``bias``) are DTensors sharded by
    rows over the pipeline mesh with the head's whole shape, whose local part is this rank's rows (read by its
    :class:`VocabularyExchange`, never by a forward)."""

    def __init__(self, weight_rows: torch.Tensor, bias_rows: Optional[torch.Tensor], vocab_size: int,
                 mesh: DeviceMesh, trainable: bool = True) -> None:
        super().__init__()
        self.vocab_size, self.width = vocab_size, weight_rows.shape[1]
        self.start, self.end = row_shard_range(vocab_size, mesh.size(), mesh.get_local_rank())
        self.weight = nn.Parameter(rows_dtensor(weight_rows, vocab_size, mesh), trainable)
        self.bias = (nn.Parameter(rows_dtensor(bias_rows, vocab_size, mesh), trainable) if bias_rows is not None
                     else None)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the logits of ``hidden``."""
        bias = self.bias.to_local() if self.bias is not None else None
        return F.linear(hidden, self.weight.to_local(), bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the pipeline scores the split LM head through its VocabularyExchange, not by calling it")


class _SplitHeadLoss(torch.autograd.Function):
    """The exchange's loss on the last stage; its backward hands the hidden state's gradient summed over the ranks
    (computed with the loss) to the schedule's backward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, exchange: "VocabularyExchange", targets: torch.Tensor) -> torch.Tensor:
        loss, grad = exchange.score(hidden.detach(), targets, backward=True)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None


class VocabularyExchange:
    """The split head's per-micro-batch collectives over ``group`` (this replica's pipeline ranks) and the loss.

    ``source`` is the global rank of the last stage. :meth:`begin` and :meth:`end` bracket a step: on the other
    ranks they start and join the thread serving the step's micro-batches; on every rank :meth:`end` sets the
    rows' gradients summed over the micro-batches. On the last stage :meth:`loss` is the schedule's loss function.
    """

    def __init__(self, head: VocabularySlice, group: dist.ProcessGroup, source: int, is_last: bool,
                 device: torch.device, last_ranks: int = 1, lora: Optional[LoRAHeadRows] = None,
                 context: Optional[dist.ProcessGroup] = None) -> None:
        self.head, self.group, self.source, self.is_last, self.device = head, group, source, is_last, device
        self.lora = lora
        """The head's LoRA rows (:mod:`.head_adapters`), which hold ``head`` as their base layer, or None."""
        self.context = context
        """The context-parallel group (None without): each micro-batch's hidden state is this rank's load-balanced
        shard of the sequence, scored against the targets shifted on the whole sequence, and the last stage's loss
        is summed over the group (:func:`~lightning_merak.parallel.context.stages.context_parallel_stage_loss`'s
        convention)."""
        self.last_ranks = last_ranks
        """Ranks running the last stage (its tensor-parallel ranks): each needs the hidden state's gradient."""
        self.inferring: Callable[[], bool] = lambda: False
        """Whether the schedule is inferring its stages' shapes (a loss outside the step's micro-batches)."""
        self.active = True
        """Off while a prediction runs the schedule: the loss it computes is discarded, so nothing is exchanged."""
        self.shifted = False
        """Whether the targets are already each position's next token (micro-batching's labels): every position is
        scored against its own, instead of the targets shifted by one here."""
        self.token_weight: Optional[float] = None
        """Each scored token's weight in the loss (micro-batching's global-batch weighting); None: the mean over
        the micro-batch's scored tokens."""
        self._backward = False
        self._grads: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    # A step ------------------------------------------------------------------------------------

    def begin(self, targets: Union[torch.Tensor, list[torch.Tensor]], micro_batches: int, backward: bool) -> None:
        """Start a step of ``micro_batches`` micro-batches of ``targets`` (one tensor split evenly, or each
        micro-batch's own), with their backward when ``backward``."""
        self._backward, self._grads, self._error = backward, {}, None
        self._before_reads()
        if self.is_last:
            return
        chunks = list(targets) if isinstance(targets, list) else list(torch.tensor_split(targets, micro_batches))
        self._thread = threading.Thread(target=self._serve, args=(chunks,), name="vocab-stages", daemon=True)
        self._thread.start()

    def end(self) -> None:
        """Wait for this rank's share of the step; the rows' gradients go to their parameters' ``grad``."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the split LM head's exchange failed on this rank") from error
        lora_a = self.lora.factor_a if self.lora is not None else None
        for param, grad in self._grads.values():
            if param is lora_a:  # whole on the last stage
                param.grad = grad if param.grad is None else param.grad.add_(grad)
            else:
                add_rows_gradient(param, grad)
        self._grads = {}

    def _before_reads(self) -> None:
        """Finish what must precede reading the rows (a ZeRO-1 gather in flight), on the step's thread."""
        self.head.before_reads()
        if self.lora is not None:
            self.lora.before_reads()

    def _serve(self, chunks: list[torch.Tensor]) -> None:
        try:
            cp = 1 if self.context is None else dist.get_world_size(self.context)
            for targets in chunks:
                hidden = torch.empty((targets.shape[0], targets.shape[1] // cp, self._sent_width()),
                                     dtype=self.head.weight.dtype, device=self.device)
                self.score(hidden, targets.to(self.device), self._backward)
        except BaseException as error:  # re-raised by end(), on the step's thread
            self._error = error

    # The last stage's loss ---------------------------------------------------------------------

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the micro-batch whose last hidden state (after the final norm) is
        ``hidden``, over the whole vocabulary: the schedule's loss function on the last stage."""
        if self.inferring() or not self.active:
            return (hidden * 0).float().sum()  # shapes only: the other ranks are not scoring this one
        if self._backward and torch.is_grad_enabled() and hidden.requires_grad:
            return _SplitHeadLoss.apply(hidden, self, targets)
        return self.score(hidden.detach(), targets, backward=False)[0]

    def _scored(self, targets: torch.Tensor) -> tuple[slice, torch.Tensor, torch.Tensor, int]:
        """``(positions of the hidden state scored, their next tokens flat, the micro-batch's scored tokens, the
        factor its gradients carry)``: without context parallelism every position but the last against the next
        token; with it, every position of this rank's shard against the next token on the whole sequence, the
        count over the whole sequence and the gradients times the group size (summed over the group's ranks when
        the data-parallel reduction averages over ``dp x cp``)."""
        if self.shifted:  # each position's own target; under context parallelism this rank's rows of them
            count = (targets != IGNORE_INDEX).sum().to(self.device)
            if self.context is None:
                return slice(None), targets.reshape(-1).to(self.device), count, 1
            local = sequence_shard(targets, self.context)
            return slice(None), local.reshape(-1).to(self.device), count, dist.get_world_size(self.context)
        if self.context is None:
            labels = targets[:, 1:].reshape(-1).to(self.device)
            return slice(None, -1), labels, (labels != IGNORE_INDEX).sum(), 1
        local, count = shard_next_token_labels(targets, self.context)
        return slice(None), local.reshape(-1).to(self.device), count.to(self.device), dist.get_world_size(self.context)

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits of ``hidden`` (the same on every rank; a collective over the ranks)."""
        self._before_reads()
        hidden = hidden.to(self.head.weight.dtype)
        local = self.head.logits(hidden)
        if self.lora is not None:  # the last stage projects by A, the ranks add their rows of s·B u
            projected = (F.linear(hidden, self.lora.factor_a) if self.is_last
                         else hidden.new_empty((*hidden.shape[:-1], self.lora.lora.rank))).contiguous()
            dist.broadcast(projected, src=self.source, group=self.group)
            local = local + self._lora_logits(projected)
        parts = dist.get_world_size(self.group)
        width = -(-self.head.vocab_size // parts)
        padded = F.pad(local, (0, width - local.shape[-1])) if local.shape[-1] < width else local
        gathered = [torch.empty_like(padded) for _ in range(parts)]
        dist.all_gather(gathered, padded.contiguous(), group=self.group)
        return torch.cat(gathered, dim=-1)[..., :self.head.vocab_size]

    # One micro-batch on every rank -------------------------------------------------------------

    def score(self, hidden: torch.Tensor, targets: torch.Tensor,
              backward: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(loss, gradient of hidden)`` of one micro-batch; ``hidden`` is the last stage's (received elsewhere).

        The gradient, summed over the ranks, is returned on the last stage (None without ``backward``). Autocast is
        off: the serving threads run without the step's, so every rank computes in the head's dtype alike."""
        with torch.no_grad(), torch.autocast(self.device.type, enabled=False):
            dtype = hidden.dtype
            hidden = hidden.to(self.head.weight.dtype).contiguous()
            projection = None
            if self.lora is not None and self.is_last:  # u = A x' travels with the hidden state
                projection = self.lora.project(hidden)
                hidden = torch.cat([hidden, projection[0]], dim=-1)
            dist.broadcast(hidden, src=self.source, group=self.group)
            positions, y, count, factor = self._scored(targets)
            x = hidden[:, positions, :self.head.width].reshape(-1, self.head.width)
            logits = self.head.logits(x)
            if self.lora is not None:
                u = hidden[:, positions, self.head.width:].reshape(-1, self.lora.lora.rank)
                logits = logits + self._lora_logits(u)
            logits = logits.float()
            maximum = logits.max(dim=-1).values
            dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=self.group)
            exponentials = torch.exp(logits - maximum[:, None])
            inside = (y >= self.head.start) & (y < self.head.end)
            local_y = (y - self.head.start).clamp(0, logits.shape[-1] - 1)
            target_logit = logits.gather(1, local_y[:, None]).squeeze(1) * inside
            sums = torch.stack([exponentials.sum(dim=-1), target_logit])
            dist.all_reduce(sums, group=self.group)
            valid = (y != IGNORE_INDEX).float()
            token_losses = ((torch.log(sums[0]) + maximum - sums[1]) * valid).sum()
            loss = token_losses / count if self.token_weight is None else token_losses * self.token_weight
            if self.context is not None and self.is_last:  # the whole micro-batch's, on each context rank
                dist.all_reduce(loss, group=self.context)
            if not backward:
                return loss, None
            grad_logits = exponentials / sums[0][:, None]
            grad_logits.scatter_add_(1, local_y[:, None], -inside.float()[:, None])
            weights = valid * factor / count if self.token_weight is None else valid * (factor * self.token_weight)
            grad_logits = (grad_logits * weights[:, None]).to(x.dtype)
            if self.head.weight.requires_grad:
                self._accumulate(self.head.weight, grad_logits.t() @ x)
                if self.head.bias is not None:
                    self._accumulate(self.head.bias, grad_logits.sum(dim=0))
            grad_hidden = torch.zeros_like(hidden)  # with LoRA: ∂u beside ∂x
            grad_rows = grad_logits @ self.head.weight.to_local()
            if self.lora is not None:
                scaled = grad_logits * self.lora.lora.scaling
                if self.lora.factor_b.requires_grad:
                    self._accumulate(self.lora.factor_b, scaled.t() @ u)
                grad_rows = torch.cat([grad_rows, scaled @ self.lora.factor_b.to_local()], dim=-1)
            grad_hidden[:, positions] = grad_rows.view(*hidden.shape[:1], -1, hidden.shape[-1])
            if self.last_ranks > 1:
                dist.all_reduce(grad_hidden, group=self.group)
            else:
                dist.reduce(grad_hidden, dst=self.source, group=self.group)
            if not self.is_last:
                return loss, None
            if projection is not None:  # ∂A and the LoRA path's term of ∂x, from ∂u summed over the ranks
                grad_a, grad_x = self.lora.project_backward(grad_hidden[..., self.head.width:], *projection[1:])
                if self.lora.factor_a.requires_grad:
                    self._accumulate(self.lora.factor_a, grad_a)
                grad_hidden = grad_hidden[..., :self.head.width] + grad_x
            return loss, grad_hidden.to(dtype)

    def _sent_width(self) -> int:
        """Columns of the tensor the last stage broadcasts: the hidden state, and with LoRA its projection by A."""
        return self.head.width + (self.lora.lora.rank if self.lora is not None else 0)

    def _lora_logits(self, projected: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``s · B u`` given the projection ``u = A x'``."""
        assert self.lora is not None
        return F.linear(projected, self.lora.factor_b.to_local()) * self.lora.lora.scaling

    def _accumulate(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` to the step's gradient of ``param`` (set on it by :meth:`end`)."""
        held = self._grads.get(id(param))
        self._grads[id(param)] = (param, grad.to(param.dtype) if held is None else held[1].add_(grad))


def split_head_over_stages(stages: nn.ModuleList, shape: HeadShape, trace: ModelTrace, mesh: DeviceMesh,
                           group: dist.ProcessGroup, device: torch.device, tensor_parallel: int = 1,
                           context: Optional[dist.ProcessGroup] = None, allocate: bool = False) -> VocabularyExchange:
    """Put this rank's :class:`VocabularySlice` in place of the head (in its last stage's model, with several
    stages per rank: the one that has the head on the last rank) and return the exchange.

    ``mesh`` is the replica's pipeline ranks, or with ``tensor_parallel`` > 1 its pipeline × tensor-parallel ranks
    flattened (stage-major): the rows split over all of them. The last stage's first tensor-parallel rank sends
    every rank its rows of the head (a scatter over ``mesh``'s group, at build: no other rank holds the whole
    head) and broadcasts each micro-batch's hidden state (the same on every tensor-parallel rank of the last
    stage, which all get its gradient). The last stage's forward then ends before the head.

    ``allocate``: each rank allocates its rows instead, for a pretrained loader to fill (no rank holds the whole head;
    the head on meta). Not with LoRA on the head, whose factors the last stage's adapter holds.
    """
    stage = next((part for part in stages if part.is_last), stages[-1])
    parts = mesh.size()
    check_vocab_stage_rows(shape.vocab_size, parts)
    holder = parts - tensor_parallel  # the last stage's first tensor-parallel rank
    source = dist.get_global_rank(mesh.get_group(), holder)
    head = stage.net.get_submodule(shape.path) if mesh.get_local_rank() == holder and not allocate else None
    if allocate:
        if shape.lora is not None:
            raise ValueError("the split LM head's rows are allocated for a loader only without LoRA on the head")
        start, end = row_shard_range(shape.vocab_size, parts, mesh.get_local_rank())
        weight = torch.empty((end - start, shape.width), dtype=shape.dtype, device=device)
        bias = torch.empty((end - start,), dtype=shape.dtype, device=device) if shape.bias else None
    else:
        weight = scatter_rows(None if head is None else head.weight.detach(), shape.vocab_size, (shape.width,),
                              shape.dtype, device, mesh.get_group(), holder)
        bias = (scatter_rows(None if head is None else head.bias.detach(), shape.vocab_size, (), shape.dtype,
                             device, mesh.get_group(), holder) if shape.bias else None)
    rows = VocabularySlice(weight, bias, shape.vocab_size, mesh, shape.trainable)
    placed: nn.Module = rows
    if shape.lora is not None:  # B's rows split as W's; A and the dropout stay on the last stage
        adapter = shape.lora.adapter
        factor_b = scatter_rows(None if head is None else head.lora_B[adapter].weight.detach(), shape.vocab_size,
                                (shape.lora.rank,), shape.dtype, device, mesh.get_group(), holder)
        last_head = stage.net.get_submodule(shape.path) if stage.is_last else None
        placed = LoRAHeadRows(rows, shape.lora, nn.Parameter(rows_dtensor(factor_b, shape.vocab_size, mesh),
                                                             shape.lora.trainable),
                              None if last_head is None else last_head.lora_A[adapter].weight,
                              None if last_head is None else last_head.lora_dropout[adapter])
        del last_head
    del head
    stage.net.set_submodule(shape.path, placed)
    stage.head_stop = head_step_index(trace, shape.path)
    return VocabularyExchange(rows, group, source, stage.is_last, device, last_ranks=tensor_parallel,
                              lora=placed if isinstance(placed, LoRAHeadRows) else None, context=context)
