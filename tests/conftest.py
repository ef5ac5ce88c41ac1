"""Shared pytest set-up: one thread per process, so multi-process tests do not oversubscribe."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread_and_seed():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
