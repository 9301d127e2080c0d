"""`load_format="dummy"` on Qwen2.5-Omni: the tiny folder without its weight files (config, tokenizer,
processor, spk_dict.pt) runs thinker -> talker -> token2wav offline, text and audio out."""

import os
import shutil


def test_qwen2_5_omni_runs_without_weight_files(omni_dir, tmp_path):
    from omnistage import Omni
    from omnistage.params import SamplingParams

    path = str(tmp_path / "config-only")
    shutil.copytree(omni_dir, path, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    assert not [f for f in os.listdir(path) if "safetensors" in f]
    with Omni(path, device="cpu", dtype="float32", load_format="dummy") as omni:
        spec = omni.orchestrator.spec
        assert [s.name for s in spec.stages] == ["thinker", "talker", "code2wav"]
        prompt = dict(omni.render_chat([{"role": "user", "content": "hi"}]), modalities=["text", "audio"])
        thinker = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        talker = SamplingParams(**{**spec.stage("talker").params, "max_tokens": 30})
        out = omni.generate(prompt, thinker, sampling_params_list=[thinker, talker, None], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert out.audio is not None and out.audio.samples.size > 0
