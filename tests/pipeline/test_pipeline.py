"""Pipelines as data, adapters and the orchestrator: hand-made inputs, then a real two-stage cascade
(a tiny random LM streaming sentences into the Piper TTS stage) on CPU."""

import numpy as np
import pytest

from omnistage.codec.speech import TTSInput, TTSParams, clean_for_speech, split_sentences
from omnistage.config import EngineConfig
from omnistage.outputs import CompletionOutput, RequestOutput
from omnistage.codec.speech import text_to_tts
from omnistage.models.registry import adapter_target
from omnistage.pipeline.deploy_config import apply_deploy_config
from omnistage.pipeline.orchestrator import Orchestrator
from omnistage.spec import EdgeSpec, PipelineSpec, StageSpec
from omnistage.stage import StageOutput


def _lm_out(text: str, finished: bool, rid: str = "r") -> StageOutput:
    comp = CompletionOutput(0, text, finish_reason="stop" if finished else None)
    return StageOutput(rid, RequestOutput(rid, outputs=[comp], finished=finished), finished)


# ---- adapters -----------------------------------------------------------------------------------
def test_split_sentences_waits_for_whitespace_and_keeps_abbreviations():
    assert split_sentences("Hello there. How are", final=False) == (["Hello there."], " How are")
    assert split_sentences("It costs 3.5 dollars", final=False) == ([], "It costs 3.5 dollars")
    assert split_sentences("Dr. Smith is here. Yes!", final=False) == (["Dr. Smith is here."], " Yes!")
    assert split_sentences("Dr. Smith is here. Yes!", final=True) == (["Dr. Smith is here.", "Yes!"], "")
    assert split_sentences("Wait...", final=False) == ([], "Wait...")
    assert split_sentences("**Bold** claim!\n\n- item one\n- item two", final=True) == (
        ["Bold claim!", "item one", "item two"], "")
    assert clean_for_speech("  # Title\n`code`  ") == "Title code"
    long = "word, " * 80                        # a run-on without a sentence end is cut at a clause
    pieces, rest = split_sentences(long, final=False)
    assert pieces and all(len(p) <= 300 for p in pieces) and len(rest) <= 300


def test_text_to_tts_emits_whole_sentences_as_the_text_grows():
    text = "The capital of France is Paris. It is large! Is it old? Yes"
    seen = []
    for n in range(1, len(text) + 1):
        x = text_to_tts(_lm_out(text[:n], finished=False))
        assert isinstance(x, TTSInput) and not x.finished
        assert x.sentences[:len(seen)] == seen  # never rewrites what was already emitted
        seen = x.sentences
    assert seen == ["The capital of France is Paris.", "It is large!", "Is it old?"]
    final = text_to_tts(_lm_out(text, finished=True))
    assert final.finished and final.sentences == seen + ["Yes"]
    assert final.slice(1, 3, False) == TTSInput(["It is large!", "Is it old?"], False)
    assert adapter_target("text_to_tts") is text_to_tts
    with pytest.raises(ValueError, match="adapter must be one of"):
        adapter_target("nope")


# ---- specs and deploy configs -------------------------------------------------------------------
def _cascade_spec() -> PipelineSpec:
    return PipelineSpec(
        [StageSpec("llm", "ar", "/m", EngineConfig(), final_output="text"),
         StageSpec("tts", "codec", "", EngineConfig(device="cpu"), final_output="audio", backend="piper")],
        [EdgeSpec("llm", "tts", "text_to_tts", chunk_size=1)])


def test_routes_run_only_the_stages_a_request_needs():
    spec = _cascade_spec()
    assert spec.route("llm", None) == ["llm"]
    assert spec.route("llm", ["text", "audio"]) == ["llm", "tts"]
    assert spec.route("llm", ["audio"]) == ["llm", "tts"]
    assert spec.route("tts", None) == ["tts"]
    with pytest.raises(ValueError, match=r"modalities must be a non-empty subset of \['audio'\]"):
        spec.route("tts", ["text"])
    with pytest.raises(ValueError, match="kind must be one of"):
        StageSpec("x", "gan", "")
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        EdgeSpec("a", "b", "text_to_tts", chunk_size=0)


def test_deploy_config_overrides_devices_sizes_and_chunking(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("stages:\n  llm: {device: cpu, max_num_seqs: 4, params: {temperature: 0.5}}\n"
                    "  tts: {options: {max_batch_sentences: 2}}\n"
                    "edges:\n  - {src: llm, dst: tts, chunk_size: 3, first_chunk_size: 1}\n")
    spec = apply_deploy_config(_cascade_spec(), str(path))
    llm, tts = spec.stages
    assert llm.engine.device == "cpu" and llm.engine.max_num_seqs == 4 and llm.params == {"temperature": 0.5}
    assert tts.options == {"max_batch_sentences": 2}
    assert (spec.edges[0].chunk_size, spec.edges[0].first_chunk_size) == (3, 1)
    assert [e.piece_size(n) for e, n in ((spec.edges[0], 0), (spec.edges[0], 1))] == [1, 3]
    assert len(apply_deploy_config(_cascade_spec(), {"stages": {"tts": {"enabled": False}}}).stages) == 1
    with pytest.raises(ValueError, match=r"stage must be one of \['llm', 'tts'\]"):
        apply_deploy_config(_cascade_spec(), {"stages": {"talker": {"device": "cpu"}}})
    with pytest.raises(ValueError, match="unknown keys"):
        apply_deploy_config(_cascade_spec(), {"stages": {"llm": {"gpu": 1}}})
    with pytest.raises(ValueError, match="device must be"):
        apply_deploy_config(_cascade_spec(), {"stages": {"llm": {"device": "tpu"}}})


# ---- the orchestrator's streaming edges, with a recording stage -----------------------------------
class _Recorder:
    """A downstream stage that records the pieces it receives and finishes on the last one."""

    params_type = TTSParams

    def __init__(self):
        self.pieces, self.params, self.aborted, self._done = [], {}, [], []

    def add_request(self, rid, inputs, params, arrival_time=None):
        self.params[rid] = params
        self.add_input(rid, inputs)

    def add_input(self, rid, piece):
        self.pieces.append((rid, list(piece.sentences), piece.finished))
        if piece.finished:
            self._done.append(rid)

    def step(self):
        done, self._done = self._done, []
        return [StageOutput(r, RequestOutput(r, finished=True), True) for r in done]

    def abort(self, rid):
        self.aborted.append(rid)

    def has_unfinished(self):
        return bool(self._done)

    def stats(self):
        return {}


class _Script:
    """An upstream stage that replays given texts, one per step."""

    def __init__(self, texts):
        self.texts, self.active, self.aborted = texts, {}, []

    def add_request(self, rid, inputs, params, arrival_time=None):
        self.active[rid] = 0

    def step(self):
        outs = []
        for rid, i in list(self.active.items()):
            last = i == len(self.texts) - 1
            outs.append(_lm_out(self.texts[i], last, rid))
            self.active[rid] = i + 1
            if last:
                del self.active[rid]
        return outs

    def abort(self, rid):
        self.aborted.append(rid)
        self.active.pop(rid, None)

    def has_unfinished(self):
        return bool(self.active)

    def stats(self):
        return {"num_running": len(self.active)}


def test_orchestrator_streams_pieces_with_a_smaller_first_chunk():
    words = ["One.", "Two.", "Three.", "Four.", "Five.", "Six.", "Seven.", "Eight."]
    texts = [" ".join(words[:n])[:-1] for n in (2, 5, 7, 8)]     # the last word still growing
    spec = _cascade_spec()
    spec.edges[0] = EdgeSpec("llm", "tts", "text_to_tts", chunk_size=2, first_chunk_size=1)
    rec = _Recorder()
    orch = Orchestrator(spec, stages={"llm": _Script(texts), "tts": rec})
    orch.add_request("r", {"prompt": "x", "modalities": ["text", "audio"], "voice": "joe"})
    outs = []
    while orch.has_unfinished():
        outs += orch.step()
    assert rec.params["r"].voice == "joe"
    assert rec.pieces == [("r", ["One."], False), ("r", ["Two.", "Three."], False),
                          ("r", ["Four.", "Five."], False), ("r", ["Six.", "Seven.", "Eight"], True)]
    assert [o.finished for o in outs] == [False] * 3 + [True]
    assert all(c.finish_reason is None for o in outs[:-1] for c in o.outputs)   # held back until the end
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].text == texts[-1]


def test_orchestrator_text_only_requests_skip_tts_and_abort_reaches_every_stage():
    rec, script = _Recorder(), _Script(["One. Two. Three", "One. Two. Three. Four"])
    orch = Orchestrator(_cascade_spec(), stages={"llm": script, "tts": rec})
    orch.add_request("t", "plain text prompt")
    outs = orch.step() + orch.step()
    assert [o.finished for o in outs] == [False, True] and rec.pieces == []
    orch.add_request("a", {"prompt": "x", "modalities": ["text", "audio"]})
    orch.step()
    assert rec.pieces == [("a", ["One.", "Two."], False)]
    orch.abort("a")
    assert script.aborted == ["a"] and rec.aborted == ["a"]
    with pytest.raises(ValueError, match="modalities must be"):
        orch.add_request("b", {"prompt": "x", "modalities": ["image"]})


class _BatchRecorder(_Recorder):
    """A `_Recorder` that takes a step's streamed pieces in one call (`add_inputs`) and refuses those
    of request "bad"."""

    def __init__(self):
        super().__init__()
        self.calls = []                         # request ids of each add_inputs call

    def add_inputs(self, items):
        self.calls.append([rid for rid, _ in items])
        errors = []
        for rid, piece in items:
            if rid == "bad":
                errors.append(ValueError("this piece is refused"))
                continue
            self.add_input(rid, piece)
            errors.append(None)
        return errors


def test_orchestrator_hands_a_steps_pieces_over_in_one_call_and_a_refused_one_fails_alone():
    script = _Script(["One. Two", "One. Two. Three", "One. Two. Three. Four"])
    rec = _BatchRecorder()
    spec = _cascade_spec()
    spec.edges[0] = EdgeSpec("llm", "tts", "text_to_tts", chunk_size=1)
    orch = Orchestrator(spec, stages={"llm": script, "tts": rec})
    for rid in ("good", "bad"):
        orch.add_request(rid, {"prompt": "x", "modalities": ["text", "audio"]})
    finals = {}
    while orch.has_unfinished():
        finals.update((o.request_id, o) for o in orch.step() if o.finished)
    # first pieces start the requests (add_request); the next step's pieces of both come in one call
    assert rec.calls == [["good", "bad"], ["good"]]
    assert [p for p in rec.pieces if p[0] == "good"] == [("good", ["One."], False), ("good", ["Two."], False),
                                                         ("good", ["Three.", "Four"], True)]
    [(rid, error)] = orch.pop_errors()
    assert rid == "bad" and isinstance(error, ValueError) and "refused" in str(error)
    assert list(finals) == ["good"] and "bad" in script.aborted and "bad" in rec.aborted
    assert orch.stats()["edge:llm->tts:pieces"] == 5


# ---- a real cascade: tiny LM -> Piper -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_cascade(tiny_models):
    pytest.importorskip("piper")
    from omnistage import Omni

    omni = Omni(tiny_models["llama"], device="cpu", dtype="float32")
    assert [s.name for s in omni.orchestrator.spec.stages] == ["llm", "tts"]
    return omni


def test_tiny_lm_cascade_audio_starts_before_the_text_is_finished(tiny_cascade):
    from omnistage import SamplingParams

    omni, orch = tiny_cascade, tiny_cascade.orchestrator
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    # A prompt whose greedy text completes a sentence well before its last token.
    texts = omni.generate(["Hello", "The harbour town woke", "What is the capital of France?", "Please answer"],
                          params, use_tqdm=False)
    prompt = next((o.prompt for o in texts if split_sentences(o.outputs[0].text[:-30], False)[0]), None)
    assert prompt is not None, "no candidate prompt produced a sentence end"
    assert not orch.stages["tts"].has_unfinished()           # the text-only requests never reached it
    orch.add_request("c", {"prompt": prompt, "modalities": ["text", "audio"], "voice": "joe"}, params)
    events = []
    while orch.has_unfinished():
        for out in orch.step():
            events.append(("audio" if out.audio is not None and len(out.audio.samples) else "text",
                           out.num_generated_tokens, out.finished))
    first_audio = next(i for i, e in enumerate(events) if e[0] == "audio")
    assert events[first_audio][1] < 48 and events[-1][2]      # audio began while the LM was still writing
    final = out
    assert final.outputs[0].text == next(o for o in texts if o.prompt == prompt).outputs[0].text
    assert final.audio.sample_rate == 22050 and final.audio.samples.dtype == np.float32
    assert np.isfinite(final.audio.samples).all() and len(final.audio.samples) > 22050 * 0.3


# ---- a stage in its own process -----------------------------------------------------------------
def test_stage_process_death_fails_only_its_requests_and_restarts(tiny_models):
    """The TTS stage of a cascade runs in its own process; killing it mid-request fails that request
    with EngineDeadError (the server's 503) and a fresh process serves the next one."""
    pytest.importorskip("piper")
    import asyncio

    from omnistage.entrypoints.async_omni import AsyncOmni, EngineDeadError

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32",
                       deploy_config={"stages": {"tts": {"runner": "process"}}})
    client = engine.orchestrator.stages["tts"]
    assert engine.voices()[0]["id"] == "joe" and client.params_type is TTSParams

    async def speak(rid, text, kill_after_first=False):
        outs = []
        async for out in engine.generate(text, TTSParams(), rid, entry_stage=engine.speech_stage):
            outs.append(out)
            if kill_after_first:
                client.proc.kill()
        return outs

    async def scenario():
        with pytest.raises(ValueError, match=r"voice must be one of \['joe'\]"):
            async for _ in engine.generate("Hi.", TTSParams(voice="alloy"), "bad", entry_stage="tts"):
                pass
        with pytest.raises(EngineDeadError, match="stage 'tts' process died"):
            await speak("a", "This sentence is spoken again and again. " * 30, kill_after_first=True)
        while True:                             # the new process loads in the background; until then: 503
            try:
                return await speak("b", "Back again.")
            except EngineDeadError as e:
                assert "stage 'tts' is restarting" in str(e)
                await asyncio.sleep(0.1)

    try:
        outs = asyncio.run(scenario())
        assert outs[-1].finished and outs[-1].audio.sample_rate == 22050 and len(outs[-1].audio.samples) > 0
        assert client.restarts == 1
    finally:
        engine.close()


def test_killed_stage_process_gives_503_over_http_and_the_next_request_succeeds(tiny_models):
    pytest.importorskip("piper")
    import threading
    import time

    import httpx
    from live_server import live_server

    from omnistage.entrypoints.async_omni import AsyncOmni
    from omnistage.entrypoints.openai.api_server import build_app

    engine = AsyncOmni(tiny_models["llama"], device="cpu", dtype="float32",
                       deploy_config={"stages": {"tts": {"runner": "process"}}})
    stage = engine.orchestrator.stages["tts"]
    body = {"model": "m", "voice": "joe", "input": "This sentence is spoken again and again. " * 40}
    try:
        with live_server(build_app(engine, "m")) as url:
            result = {}
            thread = threading.Thread(target=lambda: result.update(
                r=httpx.post(url + "/v1/audio/speech", json=body, timeout=120)))
            thread.start()
            deadline = time.time() + 30
            while not stage.has_unfinished():                # the request reached the stage process
                assert time.time() < deadline
                time.sleep(0.01)
            stage.proc.kill()
            thread.join(timeout=60)
            assert result["r"].status_code == 503, result["r"].text
            assert "error" in result["r"].json()
            deadline = time.time() + 60
            while (health := httpx.get(url + "/health")).status_code == 503:   # restarting in the background
                assert health.json()["stages"]["tts"] == "restarting" and time.time() < deadline
                time.sleep(0.1)
            again = httpx.post(url + "/v1/audio/speech", json={**body, "input": "Back again."}, timeout=60)
            assert again.status_code == 200 and again.content[:4] == b"RIFF"
            assert httpx.get(url + "/health").status_code == 200
    finally:
        engine.close()
