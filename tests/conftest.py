"""Shared pytest fixtures: tiny checkpoints built in code, once per session, fully offline."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a minute on the 2-core CPU machine")


@pytest.fixture
def single_thread():
    """torch single-threaded for the test (a module opts in with `pytest.mark.usefixtures`): tiny models issue
    many small kernels, and two OpenMP threads on a loaded 2-core box only wait on each other."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """The in-code byte-level BPE tokenizer (a fresh object; training is cached per process)."""
    from omnistage.testing.llm import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """arch ("llama", "qwen2", "qwen3") -> folder of a tiny random causal LM saved with save_pretrained."""
    from omnistage.testing import make_tiny

    out_dir = tmp_path_factory.mktemp("tiny")
    return {os.path.basename(path).removeprefix("tiny-"): path for path in make_tiny(str(out_dir), kind="llm")}
