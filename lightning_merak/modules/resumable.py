"""The training loader every data module here shares: it resumes a restored pass where the interrupted run stopped
(see :class:`ResumableDataLoader`)."""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Any, Callable, Iterator, Optional

from torch.utils.data import DataLoader, DistributedSampler

from lightning_merak.modules.config import DataError

__all__ = ["ResumableDataLoader", "check_batch_shape", "check_resumed_batch_shape"]


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
    ``next_pass_epoch`` is asked, when a restored pass is finished under a trainer, the epoch in which the trainer
    begins the next pass (a checkpoint of the last batch's end is restored before the loop counts that batch's
    epoch done), or None where it first closes the finished pass's epoch (the loader then resumes the pass at its
    end, yielding nothing; see :meth:`~lightning_merak.modules.data.TokenDataModule.align_loops_after_finished_pass`).
    ``batches_per_pass`` gives the batches the fit loop trains of each pass (``trainer.num_training_batches``, fewer
    than the loader holds under ``limit_train_batches``, the count of an endless stream's epoch), None where it is
    unknown: a pass ends there, so a checkpoint of a limited epoch's end resumes on the next pass.
    """

    def __init__(self, *args: Any, epoch: Callable[[], Optional[int]], trained_batches: Callable[[], int],
                 shuffle_seed: int, next_pass_epoch: Optional[Callable[[], Optional[int]]] = None,
                 batches_per_pass: Optional[Callable[[], Optional[int]]] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch, self.trained_batches, self.shuffle_seed = epoch, trained_batches, shuffle_seed
        self.next_pass_epoch, self.batches_per_pass = next_pass_epoch, batches_per_pass
        self._openings, self._current_pass = 0, 0
        self._resume: Optional[tuple[int, Optional[int]]] = None  # (pass, batches to skip; None: all of them)
        self._epoch_shift: Optional[int] = None

    def state_dict(self) -> dict[str, Any]:
        return {"pass": self._current_pass, "batches": self.trained_batches(), **self._batch_shape(),
                "pass_length": self._pass_length(), "order": self._order()}

    def _pass_length(self) -> Optional[int]:
        """Batches the fit loop trains of a pass: ``batches_per_pass()``, else the whole loader; None for an endless
        stream, which never finishes one."""
        trained = None if self.batches_per_pass is None else self.batches_per_pass()
        if trained is not None:
            return trained
        return len(self) if _has_length(self) else None

    def _known_pass_length(self) -> Optional[int]:
        """:meth:`_pass_length` where it is known now: not under a trainer restoring the loader before it counts the
        pass (``batches_per_pass()`` None; a launcher checks the run's count)."""
        if self.batches_per_pass is not None and self.batches_per_pass() is None:
            return None
        return self._pass_length()

    def _batch_shape(self) -> dict[str, Any]:
        """What a trained batch count means in samples: the ranks a distributed sampler (or a stream split by rank,
        its ``shares``) splits each pass over, and each rank's batch size: the loader's, else that of a dataset that
        yields whole batches itself (global batches of variable lengths, read whole by every rank); None: a batch
        sampler's own batches."""
        replicas = getattr(self.sampler, "num_replicas", None)
        batch_size = self.batch_size if self.batch_size is not None else getattr(self.dataset, "batch_size", None)
        return {"replicas": replicas if replicas is not None else getattr(self.dataset, "shares", 1),
                "batch_size": batch_size}

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
        # older checkpoints hold no pass length
        pass_length = state["pass_length"] if "pass_length" in state else self._pass_length()
        finished = _pass_finished(state["batches"], pass_length)
        if not finished:  # a finished pass skips nothing, so the next one may split its samples otherwise
            check_batch_shape(state, **self._batch_shape(), order=self._order(), pass_length=self._known_pass_length())
        self._resume, self._epoch_shift, self._openings = (state["pass"], state["batches"]), None, 0
        if finished:
            self._resume = (state["pass"] + 1, 0)
            if self.next_pass_epoch is not None and self.epoch() is not None:
                next_epoch = self.next_pass_epoch()
                if next_epoch is None:  # the trainer closes the finished pass's epoch first
                    self._resume = (state["pass"], None)
                else:  # where the first opening's epoch may not be the pass's
                    self._epoch_shift = state["pass"] + 1 - next_epoch

    def _pass_now(self) -> int:
        epoch = self.epoch()
        if epoch is None:
            return self._resume[0] + self._openings if self._resume is not None else self._openings
        if self._epoch_shift is None:
            self._epoch_shift = self._resume[0] - epoch if self._resume is not None else 0
        if self._resume is not None and self._openings == 0:
            return self._resume[0]  # the restored pass, opened before the loop may have begun its epoch
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
        skip = self._resume[1] if self._resume is not None and self._resume[0] == current else 0
        if skip is None:  # the finished pass of the epoch the trainer closes: nothing, though limit_train_batches
            return iter(())  # may have left batches of it untrained
        batches = super().__iter__()
        deque(islice(batches, skip), maxlen=0)  # drop the trained batches
        return batches


def check_batch_shape(state: dict[str, Any], replicas: int, batch_size: Optional[int],
                      order: Optional[list[Any]], pass_length: Optional[int] = None) -> None:
    """Refuse to resume a loader's ``state`` part-way through its pass at ``replicas`` data-parallel shares of
    ``batch_size`` in ``order``, ``pass_length`` batches a pass (:meth:`ResumableDataLoader.state_dict`'s terms; None:
    not known) where its trained batches meant other samples: another split, unless the global batch and a
    distributed sampler's order are the checkpoint's (its steps then read this run's samples); another order (the
    sampler's seed) or pass length (the data's size), whose pass holds other samples at the same steps. Pure, so a
    launcher can check a checkpoint before it starts any rank."""
    # older checkpoints: none, or no batch size for global batches of variable lengths (their loader's is None)
    saved = {key: state[key] for key in ("replicas", "batch_size") if state.get(key) is not None}
    now = {"replicas": replicas, "batch_size": batch_size}
    if all(saved[key] == now[key] for key in saved):
        if len(saved) == 2:  # an older checkpoint's pass may have been of another shape: let through, as before
            _check_same_pass(state, order, pass_length)
        return
    global_batch = saved["replicas"] * saved["batch_size"] if len(saved) == 2 else None
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


def check_resumed_batch_shape(state: dict[str, Any], replicas: int, batch_size: Optional[int],
                              sampler_seed: Optional[int] = None, pass_length: Optional[int] = None) -> None:
    """:func:`check_batch_shape` as the ranks will make it restoring ``state``, for a launcher that knows the run's
    ``replicas`` and ``batch_size``, and where known the seed a distributed sampler shuffles by (``sampler_seed``, the
    trainer's) and the batches of a pass (``pass_length``), else takes the checkpoint's; a pass that is finished, or
    whose length only the ranks know (older checkpoints), is let through."""
    if "batches" not in state or "pass_length" not in state:  # another loader's state, or an older checkpoint's
        return
    order = state.get("order")
    if sampler_seed is not None and order is not None and order[0] == "randperm":
        order = ["randperm", sampler_seed]
    if not _pass_finished(state["batches"], state["pass_length"]):
        check_batch_shape(state, replicas, batch_size, order, pass_length)


def _check_same_pass(state: dict[str, Any], order: Optional[list[Any]], pass_length: Optional[int]) -> None:
    """Refuse to continue a pass in another order or of another length than the checkpoint's: the batches it skips
    would not be the ones trained, some samples trained twice and others never."""
    changes = []
    if state.get("order") is not None and order is not None and list(state["order"]) != list(order):
        changes.append(f"its distributed sampler ordered the pass {list(state['order'])}, this run's orders it "
                       f"{list(order)} (another trainer.seed, or shuffling turned on or off)")
    if state.get("pass_length") is not None and pass_length is not None and state["pass_length"] != pass_length:
        changes.append(f"its pass was {state['pass_length']} batches, this run's is {pass_length} (another data "
                       "size: data.num_sequences, the corpus, data.val_fraction; or trainer.limit_train_batches)")
    if changes:
        raise DataError(
            f"the checkpoint stopped {state['batches']} batches into a pass, and {'; '.join(changes)}: skipping its "
            "trained batches would skip other samples than it trained, so some would be trained twice and others "
            "never. Resume with the settings it was trained with, or resume a checkpoint written at the end of a "
            "pass, or start a new run from its weights (merak-export, then model.path)")


def _pass_finished(batches: int, pass_length: Optional[int]) -> bool:
    """Whether ``batches`` trained finish a pass of ``pass_length`` (None: an endless stream's, never finished)."""
    return pass_length is not None and batches >= pass_length


def _has_length(loader: DataLoader) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True
