"""The shared layout (`stage_layout: shared`, pipeline/shared.py): every stage of the tiny Qwen2.5-Omni
in the orchestrator's process, driven by its one step loop (CPU, fp32: no CUDA streams here, so this
checks what the layout computes and how it fails; the GPU timing is benchmarks/omni_bench.py's).
Thinker ids, talker codes and waveforms equal the inline layout's, which equal the process-per-stage
layout's (tests/models/qwen2_5_omni/test_pipeline_omni.py::test_every_stage_in_its_own_process_gives_the_
same_text_codes_and_audio; three stage processes take minutes to start on a loaded CI machine, so this
file does not start them again); a stage whose step raises fails only the requests it holds, and
serves on."""

import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from omnistage.params import SamplingParams  # noqa: E402

TALKER_LEN = {"params": {"max_tokens": 40}}
SHARED = {"stage_layout": "shared", "stages": {"talker": TALKER_LEN}}
INLINE = {"stage_layout": "inline", "stages": {"talker": TALKER_LEN}}
MESSAGES = ([{"role": "user", "content": "Tell me a story."}], [{"role": "user", "content": "Sing it again."}])


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def omni_dir(tmp_path_factory) -> str:
    from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

    return make_tiny_qwen2_5_omni(str(tmp_path_factory.mktemp("omni") / "tiny-qwen2_5_omni"))


@pytest.fixture(scope="module")
def shared(omni_dir):
    from omnistage import Omni

    with Omni(omni_dir, device="cpu", dtype="float32", max_num_batched_tokens=16, deploy_config=SHARED) as o:
        yield o


def _requests(omni):
    from omnistage.models.qwen2_5_omni.code2wav import Code2WavParams

    thinker = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    talker = SamplingParams(**{**omni.orchestrator.spec.stage("talker").params, "temperature": 0, "max_tokens": 24})
    prompts = [dict(omni.render_chat(m), modalities=["text", "audio"], voice=v)
               for m, v in zip(MESSAGES, ("Ethan", "Chelsie"))]
    return prompts, thinker, [thinker, talker, Code2WavParams(seed=7)]   # the same initial noise in both runs


def _recording_codes(omni) -> dict:
    """request id -> the talker's codes, as its stage reports them (filled while `omni` generates)."""
    talker, codes = omni.orchestrator.stages["talker"], {}
    step = talker.step

    def record():
        outs = step()
        codes.update({o.request_id: o.output.outputs[0].token_ids for o in outs})
        return outs

    talker.step = record
    return codes


def test_shared_layout_gives_the_same_ids_codes_and_audio(shared, omni_dir):
    from omnistage import Omni
    from omnistage.pipeline.shared import SharedStage

    assert all(isinstance(s, SharedStage) for s in shared.orchestrator.stages.values())
    assert [s.priority for s in shared.orchestrator.spec.stages] == [1, 2, 0]   # talker first, code2wav last
    prompts, thinker, per_stage = _requests(shared)
    codes = _recording_codes(shared)
    try:
        got = shared.generate(prompts, thinker, sampling_params_list=per_stage, use_tqdm=False)
    finally:
        del shared.orchestrator.stages["talker"].step
    with Omni(omni_dir, device="cpu", dtype="float32", max_num_batched_tokens=16, deploy_config=INLINE) as inline:
        assert not any(isinstance(s, SharedStage) for s in inline.orchestrator.stages.values())
        want_codes = _recording_codes(inline)
        want = inline.generate(prompts, thinker, sampling_params_list=per_stage, use_tqdm=False)
    assert codes == want_codes
    assert len(codes) == 2 and all(len(c) > 0 for c in codes.values())
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and len(g.outputs[0].token_ids) == 8
        assert g.audio.samples.shape == w.audio.samples.shape and g.audio.samples.size > 0
        np.testing.assert_allclose(g.audio.samples, w.audio.samples, atol=1e-5)
    # audio length follows the talker's codes (its stop code gives none)
    assert sorted(g.audio.samples.size for g in got) == sorted(
        2 * 240 * len([c for c in cs if c not in shared.orchestrator.spec.stage("talker").params["stop_token_ids"]])
        for cs in codes.values())


def _drain(orch) -> tuple[dict, dict]:
    finals, errors = {}, {}
    while orch.has_unfinished():
        for out in orch.step():
            if out.finished:
                finals[out.request_id] = out
        errors.update(orch.pop_errors())
    return finals, errors


def test_a_shared_stage_whose_step_raises_fails_only_its_requests(shared):
    orch = shared.orchestrator
    code2wav = orch.stages["code2wav"]
    prompts, thinker, per_stage = _requests(shared)
    step = code2wav.engine.step

    def broken_step():                          # code2wav's step breaks, as a whole, once it holds a request
        del code2wav.engine.step
        raise RuntimeError("forced step failure")

    code2wav.engine.step = broken_step
    orch.add_request("audio", prompts[0], stage_params=per_stage)
    orch.add_request("text", dict(prompts[1], modalities=["text"]), thinker)
    finals, errors = _drain(orch)
    assert set(errors) == {"audio"} and "forced step failure" in str(errors["audio"])
    assert set(finals) == {"text"} and len(finals["text"].outputs[0].token_ids) == 8   # the thinker stepped on
    assert code2wav.engine.step == step and not orch.routes

    orch.add_request("again", prompts[0], stage_params=per_stage)   # the stage serves on
    finals, errors = _drain(orch)
    assert errors == {} and finals["again"].audio.samples.size > 0


def test_bad_layout_options_name_the_option_and_the_allowed_values():
    from omnistage.pipeline.deploy_config import apply_deploy_config
    from omnistage.spec import PipelineSpec, StageSpec

    spec = PipelineSpec([StageSpec("llm", "ar", "")])
    with pytest.raises(ValueError, match="stage_layout must be one of inline, shared, process; got 'gpu'"):
        apply_deploy_config(spec, {"stage_layout": "gpu"})
    with pytest.raises(ValueError, match="priority must be an integer >= 0; got -1"):
        apply_deploy_config(spec, {"stages": {"llm": {"priority": -1}}})
    got = apply_deploy_config(spec, {"stage_layout": "shared"})
    assert got.stages[0].runner == "shared"
    assert apply_deploy_config(spec, {"stage_layout": "shared", "stages": {"llm": {"runner": "process"}}}
                               ).stages[0].runner == "process"      # a stage's own runner wins


def _layout(*stages):
    """A pipeline of AR stages given as (runner, device) pairs, named a, b, c, ..."""
    from omnistage.config import EngineConfig
    from omnistage.spec import PipelineSpec, StageSpec

    return PipelineSpec([StageSpec(chr(ord("a") + i), "ar", "", EngineConfig(device=device), runner=runner)
                         for i, (runner, device) in enumerate(stages)])


def test_pdl_goes_off_only_where_shared_stages_run_beside_another_stage_on_one_gpu(monkeypatch):
    """Programmatic dependent launch hung the shared layout at 32 streams on an H200 (pipeline/shared.py): the
    orchestrator turns it off where a shared stage's GPU runs another stage of its process, and only there."""
    from omnistage.layers import pdl
    from omnistage.pipeline.shared import keep_kernels_apart, side_by_side

    assert side_by_side(_layout(("shared", "cuda:0"), ("shared", "cuda"), ("shared", "cuda:1"))) == ["a", "b"]
    assert side_by_side(_layout(("shared", "cuda:0"), ("inline", "cuda:0"))) == ["a"]   # inline: the default stream
    assert side_by_side(_layout(("shared", "cuda:0"), ("shared", "cuda:1"))) == []      # a GPU each
    assert side_by_side(_layout(("shared", "cuda:0"), ("process", "cuda:0"))) == []     # another process: time-sliced
    assert side_by_side(_layout(("inline", "cuda:0"), ("inline", "cuda:0"))) == []      # one stream
    assert side_by_side(_layout(("shared", "cpu"), ("shared", "cpu"))) == []            # no streams, no PDL
    monkeypatch.setattr(pdl, "ENABLED", True)
    keep_kernels_apart(_layout(("shared", "cuda:0"), ("shared", "cuda:1")))
    assert pdl.ENABLED
    keep_kernels_apart(_layout(("shared", "cuda:0"), ("shared", "cuda:0")))
    assert not pdl.ENABLED
