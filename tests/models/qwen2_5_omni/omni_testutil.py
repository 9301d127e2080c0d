"""Helpers shared by the Qwen2.5-Omni tests (imported by name: pytest puts this folder on sys.path)."""

import contextlib

import torch


@contextlib.contextmanager
def single_thread():
    """Runs torch single-threaded inside the block and restores the thread count afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
