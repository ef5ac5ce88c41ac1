"""A meta model's embedding and LM head split over the vocabulary before they are materialised.

At ``tensor_parallel>1`` each rank keeps rows ``[start, end)`` of the input embedding and the LM head
(:mod:`~lightning_merak.parallel.tensor.vocab`). Materialising them whole and then keeping 1/tp
(what a model built on real tensors does) allocates, and with a pretrained checkpoint reads,
152k × 4096 rows per rank for a Qwen-sized vocabulary. :class:`VocabularyRows` splits them on the
meta device instead: each rank allocates only its rows (a stand-in of the module's class holding
them, initialised by the model's own init so buffers such as Gemma's ``embed_scale`` are real), and
the weight loader, which reads a DTensor's local box, reads only those rows from the file.

Rows the loader did not write (a module without pretrained weights keeps its random init) are then
initialised as a single process initialises them: the part's vocabulary modules are materialised
whole once, in the order the build materialises a part, their rows copied in and the rest freed.
Random draws for a slice cannot equal the same rows of a table drawn whole (the generator's stream
runs through the earlier rows first, and a tied head re-draws the shared weight after the
embedding), and the layout-equality tests compare every shard with the single-process model, so
random init keeps that one whole materialisation; a pretrained build never makes it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_merak.parallel.pipeline.meta_trace import row_stand_in
from lightning_merak.parallel.tensor.vocab import split_vocabulary, vocab_shard_range, vocabulary_modules

__all__ = ["VocabularyRows"]

Materialize = Callable[..., None]
"""``(module, unsplit name, recurse=True) -> None``: a Materializer's ``materialize``."""


@dataclass
class _Held:
    """One row-split tensor this rank holds: rows ``[start, end)`` of ``attribute`` of ``sources[source]``."""

    parameter: nn.Parameter
    source: int
    attribute: str
    start: int
    end: int
    version: int = -1


@dataclass
class _Part:
    """A part's vocabulary modules as they were on meta (in materialisation order), their paths and shards."""

    sources: list[nn.Module]
    paths: list[str]
    held: list[_Held]


class VocabularyRows:
    """Splits the embedding and head of each of ``parts`` (on meta) over ``mesh``, materialising only this rank's
    rows; :meth:`load` then fills them.

    ``materialize_with(copy)`` returns the function materialising modules of a copy of the model, as the
    build initialises them.
    """

    def __init__(self, parts: Sequence[nn.Module], mesh: DeviceMesh, sequence_parallel: bool,
                 materialize_with: Callable[[nn.Module], Materialize]) -> None:
        self._materialize_with = materialize_with
        self._parts: list[_Part] = []
        for part in parts:
            model = getattr(part, "net", part)
            embedding_path, head_path, _ = vocabulary_modules(model)
            paths = [path for _, path in sorted((index, name) for index, (name, _) in enumerate(model.named_modules())
                                                if name in (embedding_path, head_path))]
            sources = [model.get_submodule(path) for path in paths]
            replaced = split_vocabulary([part], mesh, sequence_parallel, self._stand_in_rows)
            held = []
            for index, source in enumerate(sources):
                for attribute in ("weight", "bias"):
                    old = getattr(source, attribute, None)
                    if old is not None and id(old) in replaced and all(h.parameter is not replaced[id(old)]
                                                                       for h in held):
                        start, end = vocab_shard_range(old.shape[0], mesh.size(), mesh.get_local_rank())
                        held.append(_Held(replaced[id(old)], index, attribute, start, end))
            self._parts.append(_Part(sources, paths, held))

    def _stand_in_rows(self, module: nn.Module, path: str, start: int, end: int) -> nn.Module:
        stand_in = row_stand_in(module, torch.arange(start, end))
        self._materialize_with(stand_in)(stand_in, path)
        return stand_in

    def load(self, load_weights: Callable[[], Any]) -> None:
        """Run ``load_weights`` (this rank's weight loader, on its local tensors), then give every row-split
        tensor it did not write the single-process initialisation of its rows.

        A tensor's version counter counts the in-place writes to it: one the loader left unchanged was not
        loaded (a module without pretrained weights), whatever values it holds.
        """
        for part in self._parts:
            for held in part.held:
                held.version = held.parameter.to_local()._version
        load_weights()
        for part in self._parts:
            unwritten = [held for held in part.held if held.parameter.to_local()._version == held.version]
            if unwritten:
                self._initialise(part, unwritten)

    def _initialise(self, part: _Part, unwritten: list[_Held]) -> None:
        whole = copy.deepcopy(part.sources)  # meta, ties between them kept
        materialize = self._materialize_with(nn.ModuleList(whole))
        for module, path in zip(whole, part.paths):
            materialize(module, path)
        with torch.no_grad():
            for held in unwritten:
                held.parameter.to_local().copy_(getattr(whole[held.source], held.attribute)[held.start:held.end])

