"""Collectives in callbacks run on every rank or on none.

A collective that only some ranks reach (``trainer.log_dir`` broadcasts from rank 0; DeltaMemory's
plan exchange gathers from all ranks) leaves the others waiting in the next collective they meet:
a deadlock until gloo's timeout, or a "collective mismatch" abort.

``merak-train memory=delta``, where rank 0 used to broadcast ``trainer.log_dir`` alone in
``on_train_end`` while rank 1 waited in the final checkpoint's collective, is the README's command:
tests/test_readme.py runs it (2 processes) and fails at its timeout if it hangs.
"""

from __future__ import annotations

import warnings

import torch

from lightning_merak.callbacks.delta.blocks import discover_blocks
from lightning_merak.callbacks.delta.budget import parse_budget
from lightning_merak.callbacks.delta.runtime import ManagerOptions, MemoryManager
from lightning_merak.testing.delta_models import tiny_gpt2


def _count_shares(budget: str) -> tuple[int, bool]:
    """How often a manager calls ``share`` in four steps of one input size, and whether its plan fits."""
    model = tiny_gpt2()
    model.train()
    calls = []

    def share(payload):
        calls.append(payload)
        return payload

    options = ManagerOptions(budget=parse_budget(budget), swap_tier="host", warmup_steps=1)
    manager = MemoryManager(discover_blocks(model), options, log=lambda message: None, share=share)
    manager.start(model, torch.device("cpu"))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    try:
        for _ in range(4):
            manager.begin_step("ids", ids.numel())
            loss = model(input_ids=ids, labels=ids).loss
            manager.end_forward()
            loss.backward()
            manager.end_backward()
        return len(calls), manager.plan.fits
    finally:
        manager.close()


def test_plan_exchange_does_not_depend_on_whether_this_ranks_plan_fits():
    """Pipeline stages plan apart: a stage whose plan cannot fit must still join the re-plan exchange."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny budget cannot be met: that is the point
        unfitting, unfitting_fits = _count_shares("1KiB")
    fitting, fitting_fits = _count_shares("1GiB")
    assert (unfitting_fits, fitting_fits) == (False, True)
    assert unfitting == fitting == 2, "one exchange for the plan, one for the re-plan check of the input size"


def test_ranks_meeting_new_input_sizes_at_different_steps_exchange_plans_equally_often():
    """Variable-length data: one rank meets a new input size while its peer does not; both must still take part
    in the same number of plan exchanges (a collective), or the peer is left waiting in it."""
    import threading

    barrier = threading.Barrier(2, timeout=60)  # a rank left alone in an exchange breaks it
    votes: dict[int, list[bool]] = {0: [], 1: []}
    shares = {0: 0, 1: 0}

    def run(rank: int, lengths: list[int]) -> None:
        def any_rank(flag: bool) -> bool:  # what the all-reduce does across two ranks
            votes[rank].append(flag)
            barrier.wait()
            return votes[0][-1] or votes[1][-1]

        def share(payload):
            shares[rank] += 1
            barrier.wait()
            return payload

        torch.manual_seed(rank)
        model = tiny_gpt2()
        model.train()
        options = ManagerOptions(budget=parse_budget("1GiB"), swap_tier="host", warmup_steps=1)
        manager = MemoryManager(discover_blocks(model), options, log=lambda message: None, share=share,
                                any_rank=any_rank)
        manager.start(model, torch.device("cpu"))
        try:
            for length in lengths:
                ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
                manager.begin_step(("ids", length), ids.numel())
                loss = model(input_ids=ids, labels=ids).loss
                manager.end_forward()
                loss.backward()
                manager.end_backward()
        finally:
            manager.close()

    threads = [threading.Thread(target=run, args=(0, [16, 16, 16, 32, 32]), daemon=True),
               threading.Thread(target=run, args=(1, [16, 16, 16, 16, 16]), daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a rank is still waiting in an exchange"
    assert shares[0] == shares[1] == 3, "the plan, the re-plan check of 16 tokens, and that of rank 0's 32 tokens"
