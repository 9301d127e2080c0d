"""`VoiceStore`: uploaded voices as one safetensors file each -- written whole, restored by a new
store on the same folder (a restart), read back sample for sample, capped, damaged files skipped --
and the serve flags that configure it."""

import numpy as np
import pytest

from omnistage.entrypoints import cli
from omnistage.entrypoints.openai.api_server import speech_options_from_args
from omnistage.entrypoints.openai.voice_store import StoredVoice, VoiceStore, default_voice_dir


def _voice(name: str, n: int = 1600) -> StoredVoice:
    samples = np.sin(np.arange(n, dtype=np.float32) / 7) * 0.5
    return StoredVoice(name=name, sample_rate=16000, seconds=n / 16000, consent="yes", ref_text="Hi.", samples=samples)


def test_voices_persist_and_come_back_sample_for_sample(tmp_path):
    store = VoiceStore(str(tmp_path / "voices"), max_voices=2)
    assert store.names() == [] and not (tmp_path / "voices").exists()    # nothing written before an upload
    added = store.add(_voice("alice"))
    assert added.samples is None and len(added.digest) == 64 and added.created_at > 0
    store.add(_voice("bob", 800))
    with pytest.raises(ValueError, match="exists already"):
        store.add(_voice("alice"))
    with pytest.raises(ValueError, match="--speaker-max-uploaded"):
        store.add(_voice("carol"))
    (tmp_path / "voices" / "broken.safetensors").write_bytes(b"not a safetensors file")
    again = VoiceStore(str(tmp_path / "voices"))
    assert again.names() == ["alice", "bob"] and again.get("alice").digest == added.digest
    samples, rate, text = again.reference("alice")
    assert rate == 16000 and text == "Hi." and np.array_equal(samples, _voice("alice").samples)
    assert again.delete("alice") and not again.delete("alice") and again.reference("alice") is None
    assert VoiceStore(str(tmp_path / "voices")).names() == ["bob"]


def test_serve_flags_configure_the_speech_routes(tmp_path, monkeypatch):
    parse = cli.build_parser().parse_args
    options = speech_options_from_args(parse(["serve"]))
    assert options.speaker_samples_dir is None and options.allowed_media_domains == ()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_voice_dir() == str(tmp_path / "omnistage" / "voices")
    options = speech_options_from_args(parse(["serve", "--speaker-samples-dir", "/srv/v", "--speaker-max-uploaded",
                                              "5", "--allowed-media-domains", "example.com", "cdn.example.org"]))
    assert (options.speaker_samples_dir, options.speaker_max_uploaded) == ("/srv/v", 5)
    assert options.allowed_media_domains == ("example.com", "cdn.example.org")
    with pytest.raises(SystemExit, match="--speaker-max-uploaded"):
        speech_options_from_args(parse(["serve", "--speaker-max-uploaded", "-1"]))
