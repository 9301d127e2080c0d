"""Tiny Qwen3-TTS folders (built once per session, the same builder and seed as the fixtures) and
the qwen-tts reference cases in fixtures/ (see fixtures/README.md)."""

from __future__ import annotations

import json
import os

import pytest

from tts_testutil import FIXTURES, talker_engine


@pytest.fixture(scope="session")
def tts_folders(tmp_path_factory) -> dict[str, str]:
    from omnistage.testing.qwen3_tts import make_tiny_qwen3_tts

    root = tmp_path_factory.mktemp("qwen3_tts")
    return {v: make_tiny_qwen3_tts(str(root / v), v) for v in ("custom_voice", "voice_design", "base")}


@pytest.fixture(scope="session")
def cases() -> dict[str, dict]:
    with open(os.path.join(FIXTURES, "cases.json"), encoding="utf-8") as f:
        return {name: dict(case, name=name) for name, case in json.load(f).items()}


@pytest.fixture(scope="session")
def talkers(tts_folders) -> dict:
    return {v: talker_engine(folder) for v, folder in tts_folders.items()}
