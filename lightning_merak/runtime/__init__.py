"""The shared runtime that strategies (:mod:`lightning_merak.strategies`) and plugins
(:mod:`lightning_merak.plugins`) both build on; it imports neither.

- :mod:`~lightning_merak.runtime.turns`: turn-taking between sub-batch threads, meetings of
  all sub-batches (:func:`~lightning_merak.runtime.turns.meet_in_turn`).
- :mod:`~lightning_merak.runtime.sub_batches`: a forward (and its backward) run as overlapped
  sub-batches (:func:`~lightning_merak.runtime.sub_batches.run_sub_batches`).
- :mod:`~lightning_merak.runtime.collectives`: collectives that hand the turn on while in flight,
  replayed rather than repeated on recomputation, and their trace.
- :mod:`~lightning_merak.runtime.weight_gradients`: weight gradients computed while the input
  gradient's collective is in flight.
- :mod:`~lightning_merak.runtime.random_state`: snapshots of the random generators;
  :mod:`~lightning_merak.runtime.rank_streams`: a random stream of each rank's own in a region.
- :mod:`~lightning_merak.runtime.gradient_norm`: the arithmetic of clipping by the total norm, and
  gradients split over a group's ranks (:class:`~lightning_merak.runtime.gradient_norm.ShardedGradients`).
- :mod:`~lightning_merak.runtime.gradient_buffer`: gradients as views of one flat tensor per dtype,
  for collectives on it in place; :mod:`~lightning_merak.runtime.host_memory`: freed host memory
  returned to the system at once.
- :mod:`~lightning_merak.runtime.dtensors`: a rank's part of a tensor the layout split.
- :mod:`~lightning_merak.runtime.watchdog`: a hang or a lost rank ends every rank, naming it.
- :mod:`~lightning_merak.runtime.checkpoint_files`: checkpoints written atomically, the newest complete one;
  :mod:`~lightning_merak.runtime.resume`: what ``resume=auto`` continues from;
  :mod:`~lightning_merak.runtime.elastic`: restarted attempts of an elastic run kept apart;
  :mod:`~lightning_merak.runtime.safe_load`: checkpoints and exports read without unpickling code.
- :mod:`~lightning_merak.runtime.layout_aware`: the protocol through which callbacks and plugins
  see a parallel strategy, and the marker of a block the strategy recomputes.
"""
