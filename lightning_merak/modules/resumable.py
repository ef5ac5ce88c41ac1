"""The training loader every data module here shares: it resumes a restored pass where the interrupted run stopped
(see :class:`ResumableDataLoader`)."""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, DistributedSampler

from lightning_merak.modules.config import DataError

__all__ = ["ResumableDataLoader", "check_batch_shape"]


class ResumableDataLoader(DataLoader):
    """A training loader that resumes in the middle of a pass where the interrupted run stopped.

    Each pass over the data is numbered, and its shuffle order depends only on ``shuffle_seed``
    and that number: the loader's generator is reseeded, and a distributed sampler or the dataset
    (when it has ``set_epoch``, as a stream does) gets the number as its epoch. Lightning saves the
    loader's ``state_dict`` in checkpoints: the pass, how many of its batches the loop has
    trained (``trained_batches()``) and what they held (shares, batch size, pass length, a
    distributed sampler's order). On restore the run continues that pass (or starts the next one
    if it was done) and reads and drops the batches already trained.

    Passes follow the trainer's epoch (``epoch()``), shifted by what a restore found: Lightning
    counts an epoch as done when ``max_steps`` stops it half-way, and it may open the loader
    more than once for one epoch, so neither its epoch nor the number of passes opened alone
    names the pass. Without a trainer (``epoch()`` is None) every opening is a new pass.
    ``closes_finished_epoch`` is asked, when a restored pass is finished, whether the trainer first closes that
    pass's epoch (the loader then resumes the pass at its end, yielding nothing) rather than beginning the next one
    (see :meth:`~lightning_merak.modules.data.TokenDataModule.align_loops_after_finished_pass`).
    """

    def __init__(self, *args: Any, epoch: Callable[[], Optional[int]], trained_batches: Callable[[], int],
                 shuffle_seed: int, closes_finished_epoch: Optional[Callable[[], bool]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch, self.trained_batches, self.shuffle_seed = epoch, trained_batches, shuffle_seed
        self.closes_finished_epoch = closes_finished_epoch
        self._openings, self._current_pass = 0, 0
        self._resume: Optional[tuple[int, int]] = None
        self._epoch_shift: Optional[int] = None

    def state_dict(self) -> dict[str, Any]:
        return {"pass": self._current_pass, "batches": self.trained_batches(), **self._batch_shape(),
                "pass_length": len(self) if _has_length(self) else None, "order": self._order()}

    def _batch_shape(self) -> dict[str, Any]:
        """What a trained batch count means in samples: the ranks a distributed sampler (or a stream split by rank,
        its ``shares``) splits each pass over, and each rank's batch size (None: a batch sampler's own batches)."""
        replicas = getattr(self.sampler, "num_replicas", None)
        return {"replicas": replicas if replicas is not None else getattr(self.dataset, "shares", 1),
                "batch_size": self.batch_size}

    def _order(self) -> Optional[list[Any]]:
        """How a distributed sampler orders each pass: ``["randperm", seed]`` (``torch.randperm`` seeded by ``seed``
        plus the pass) or ``["sequential"]``; None for another sampler (a one-device loader's shuffle draws from its
        generator after the iterator does) or a stream. Step ``s`` of every rank reads positions ``s x global batch``
        to ``(s + 1) x global batch`` of that order, so runs of one order and global batch read the same samples a
        step however many ranks split them."""
        if not isinstance(self.sampler, DistributedSampler):
            return None
        return ["randperm", self.sampler.seed] if self.sampler.shuffle else ["sequential"]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # an endless stream never finishes a pass; older checkpoints hold no pass length
        pass_length = state.get("pass_length", len(self) if _has_length(self) else None)
        finished = pass_length is not None and state["batches"] >= pass_length
        if not finished:  # a finished pass skips nothing, so the next one may split its samples otherwise
            check_batch_shape(state, **self._batch_shape(), order=self._order())
        next_pass = finished and not (self.closes_finished_epoch is not None and self.closes_finished_epoch())
        self._resume = (state["pass"] + 1, 0) if next_pass else (state["pass"], state["batches"])
        self._epoch_shift, self._openings = None, 0

    def _pass_now(self) -> int:
        epoch = self.epoch()
        if epoch is None:
            return self._resume[0] + self._openings if self._resume is not None else self._openings
        if self._epoch_shift is None:
            self._epoch_shift = self._resume[0] - epoch if self._resume is not None else 0
        return epoch + self._epoch_shift

    def __iter__(self) -> Iterator[Any]:
        current = self._pass_now()
        self._openings += 1
        self._current_pass = current
        if self.generator is not None:
            self.generator.manual_seed(self.shuffle_seed + current)
        for ordered in (self.sampler, self.dataset):
            if hasattr(ordered, "set_epoch"):
                ordered.set_epoch(current)
        batches = super().__iter__()
        if self._resume is not None and self._resume[0] == current:
            deque(islice(batches, self._resume[1]), maxlen=0)  # drop the trained batches (all, at a pass's end)
        return batches


def check_batch_shape(state: dict[str, Any], replicas: int, batch_size: Optional[int],
                      order: Optional[list[Any]]) -> None:
    """Refuse to resume a loader's ``state`` part-way through its pass at ``replicas`` data-parallel shares of
    ``batch_size`` in ``order`` (:meth:`ResumableDataLoader.state_dict`'s terms) where its trained batches meant other
    samples: another split, unless the global batch and a distributed sampler's order are the checkpoint's (its steps
    then read this run's samples). Pure, so a launcher can check a checkpoint before it starts any rank."""
    saved = {key: state[key] for key in ("replicas", "batch_size") if key in state}  # older checkpoints: none
    now = {"replicas": replicas, "batch_size": batch_size}
    if all(saved[key] == now[key] for key in saved):
        return
    global_batch = saved["replicas"] * saved["batch_size"] if None not in saved.values() else None
    if state.get("order") is not None and state.get("order") == order and global_batch == replicas * (batch_size or 0):
        return
    raise DataError(
        f"the checkpoint's run read {saved.get('replicas', '?')} data-parallel shares of "
        f"{saved.get('batch_size', '?')} samples a step, this run reads {replicas} of "
        f"{batch_size}: skipping its {state['batches']} trained batches would skip other samples than "
        "it trained, so some would be trained twice and others never. Resume with the same data-parallel "
        f"degree and data.batch_size, or on data-parallel ranks that keep its global batch of "
        f"{global_batch or '?'} samples a step (data-parallel degree x data.batch_size, 2 ranks or more) with "
        "the same trainer.seed, or resume a checkpoint written at the end of a pass, or start a new run from its "
        "weights (merak-export, then model.path)")


def _has_length(loader: DataLoader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True
