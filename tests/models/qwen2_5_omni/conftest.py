"""Fixtures for the Qwen2.5-Omni tests: one tiny checkpoint per session, fully offline.

Torch runs single-threaded inside these tests (restored afterwards): the tiny models issue many
small kernels, and with two OpenMP threads on a busy 2-core machine each one waits on the other
thread (measured: the same token2wav decode took 0.7 s with 1 thread and 21 s with 2).
"""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
from omni_testutil import single_thread  # noqa: E402


@pytest.fixture(autouse=True)
def _single_thread():
    with single_thread():
        yield


@pytest.fixture(scope="session")
def omni_dir(tmp_path_factory) -> str:
    """Folder of the tiny random Qwen2.5-Omni (thinker, talker, token2wav, spk_dict.pt, processor)."""
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    with single_thread():
        return make_tiny_qwen2_5_omni(str(tmp_path_factory.mktemp("omni") / "tiny-qwen2_5_omni"))


@pytest.fixture(scope="session")
def hf_omni(omni_dir):
    """transformers' own Qwen2_5OmniForConditionalGeneration loaded from the tiny folder (fp32, eval)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_dir).eval()


@pytest.fixture(scope="session")
def omni_processor(omni_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(omni_dir)
