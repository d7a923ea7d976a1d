"""Model tests run single-threaded: bit-exactness claims need a fixed thread count, and on a shared 2-core
machine one intra-op thread avoids OpenMP barrier stalls that made small matmuls ~100x slower here."""

import pytest
import torch


@pytest.fixture(autouse=True)
def single_intra_op_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
