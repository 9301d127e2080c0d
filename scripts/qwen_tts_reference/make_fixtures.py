"""Reference outputs of `qwen-tts` 0.1.1 on the tiny Qwen3-TTS folders (run in the reference venv).

In: the folders `omnistage make-tiny --kind qwen3_tts` writes (one per variant, given as
--custom-voice / --voice-design / --base). Out: one .npz per case under --out (the test fixtures,
tests/models/qwen3_tts/fixtures/): the text token ids the reference fed its talker (`input_ids`,
`instruct_ids`, `ref_ids`), the talker's codes of every codebook (`codes`, [frames, groups], before
the eos frame), the waveform its wrapper returns (`wav`, float32 at 24 kHz), and for Base the
reference audio (`ref_audio`, at the case's `ref_rate`, default 24 kHz), its codes (`ref_code`) and
speaker embedding (`spk_embedding`).
Greedy cases pass do_sample=False and subtalker_dosample=False; sampled ones seed torch's global
RNG with `seed` right before the call. Everything runs on the CPU in float32 with eager attention.

Runs only beside qwen-tts' own pins (transformers 4.57.3): see make_venv.sh and run.sh.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

MAX_NEW_TOKENS = 12
TEXT = "The harbour town woke slowly."
TEXT_2 = "Boats came in before the sun was high, and the market filled with voices."
INSTRUCT = "Speak calmly, in a low voice."
REF_TEXT = "The old engineer kept a notebook."


def ref_audio(rate: int = 24000) -> np.ndarray:
    """1.2 s of a two-tone chirp at `rate` Hz (deterministic; at 16 kHz another voice: lower, with a third tone)."""
    t = np.arange(int(1.2 * rate)) / rate
    wav = 0.3 * np.sin(2 * np.pi * (180 + 90 * t) * t) + 0.1 * np.sin(2 * np.pi * 1300 * t)
    if rate != 24000:
        wav = 0.3 * np.sin(2 * np.pi * (110 + 60 * t) * t) + 0.15 * np.sin(2 * np.pi * 2100 * t) + 0.05 * np.sin(
            2 * np.pi * 600 * t)
    return wav.astype(np.float32)


def cases() -> list[dict]:
    greedy = {"do_sample": False, "subtalker_dosample": False}
    sampled = {"do_sample": True, "subtalker_dosample": True, "seed": 1234}
    return [
        dict(name="custom_voice_greedy", variant="custom_voice", text=TEXT, speaker="vivian", language="English",
             gen=greedy),
        dict(name="custom_voice_instruct_streaming_text", variant="custom_voice", text=TEXT_2, speaker="ryan",
             language="Auto", instruct=INSTRUCT, non_streaming_mode=False, gen=greedy),
        dict(name="custom_voice_sampled", variant="custom_voice", text=TEXT, speaker="vivian", language="English",
             gen=sampled),
        dict(name="voice_design_greedy", variant="voice_design", text=TEXT, language="Auto", instruct=INSTRUCT,
             gen=greedy),
        dict(name="voice_design_sampled", variant="voice_design", text=TEXT_2, language="Chinese",
             instruct=INSTRUCT, gen=sampled),
        dict(name="base_icl_greedy", variant="base", text=TEXT, language="English", ref_text=REF_TEXT,
             x_vector_only_mode=False, gen=greedy),
        dict(name="base_xvector_greedy", variant="base", text=TEXT_2, language="English",
             x_vector_only_mode=True, gen=greedy),
        dict(name="base_icl_sampled", variant="base", text=TEXT, language="English", ref_text=REF_TEXT,
             x_vector_only_mode=False, gen=sampled),
        dict(name="base_xvector_sampled", variant="base", text=TEXT, language="Auto", x_vector_only_mode=True,
             gen=sampled),
        dict(name="base_icl_16k_greedy", variant="base", text=TEXT_2, language="English", ref_text=TEXT,
             x_vector_only_mode=False, ref_rate=16000, gen=greedy),
        dict(name="base_icl_non_streaming_greedy", variant="base", text=TEXT_2, language="Auto", ref_text=REF_TEXT,
             x_vector_only_mode=False, non_streaming_mode=True, gen=greedy),
    ]


def run_case(tts, case: dict) -> dict[str, np.ndarray]:
    captured: dict = {}
    inner = tts.model.generate

    def recording_generate(**kwargs):           # records what the talker got and produced
        for key in ("input_ids", "instruct_ids", "ref_ids"):
            ids = kwargs.get(key)
            if ids and ids[0] is not None:
                captured[key] = ids[0][0].numpy()
        codes, hidden = inner(**kwargs)
        captured["codes"] = codes[0].numpy()
        return codes, hidden

    tts.model.generate = recording_generate
    gen = dict(case["gen"])
    seed = gen.pop("seed", None)
    gen["max_new_tokens"] = MAX_NEW_TOKENS
    try:
        if seed is not None:
            torch.manual_seed(seed)
        variant = case["variant"]
        if variant == "custom_voice":
            wavs, sr = tts.generate_custom_voice(case["text"], speaker=case["speaker"], language=case["language"],
                                                 instruct=case.get("instruct"),
                                                 non_streaming_mode=case.get("non_streaming_mode", True), **gen)
        elif variant == "voice_design":
            wavs, sr = tts.generate_voice_design(case["text"], instruct=case["instruct"], language=case["language"],
                                                 non_streaming_mode=case.get("non_streaming_mode", True), **gen)
        else:
            rate = case.get("ref_rate", 24000)
            audio = ref_audio(rate)
            items = tts.create_voice_clone_prompt((audio, rate), ref_text=case.get("ref_text"),
                                                  x_vector_only_mode=case["x_vector_only_mode"])
            captured["ref_audio"] = audio
            captured["spk_embedding"] = items[0].ref_spk_embedding.float().numpy()
            if items[0].ref_code is not None:
                captured["ref_code"] = items[0].ref_code.numpy()
            if seed is not None:
                torch.manual_seed(seed)
            wavs, sr = tts.generate_voice_clone(case["text"], language=case["language"], voice_clone_prompt=items,
                                                non_streaming_mode=case.get("non_streaming_mode", False), **gen)
    finally:
        tts.model.generate = inner
    assert sr == 24000, sr
    captured["wav"] = np.asarray(wavs[0], np.float32)
    return captured


def main() -> None:
    from qwen_tts import Qwen3TTSModel

    ap = argparse.ArgumentParser()
    ap.add_argument("--custom-voice", required=True)
    ap.add_argument("--voice-design", required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", help="make these cases only (cases.json keeps the others)")
    args = ap.parse_args()
    folders = {"custom_voice": args.custom_voice, "voice_design": args.voice_design, "base": args.base}
    os.makedirs(args.out, exist_ok=True)
    models = {}
    index = {}
    listed = os.path.join(args.out, "cases.json")
    if args.only and os.path.exists(listed):
        with open(listed, encoding="utf-8") as f:
            index = json.load(f)
    for case in cases():
        if args.only and case["name"] not in args.only:
            continue
        variant = case["variant"]
        if variant not in models:
            models[variant] = Qwen3TTSModel.from_pretrained(folders[variant], dtype=torch.float32,
                                                            attn_implementation="eager")
        out = run_case(models[variant], case)
        np.savez_compressed(os.path.join(args.out, f"{case['name']}.npz"), **out)
        meta = {k: v for k, v in case.items() if k != "name"}
        meta["max_new_tokens"] = MAX_NEW_TOKENS
        index[case["name"]] = meta
        print(case["name"], "codes", out["codes"].shape, "wav", out["wav"].shape)
    with open(listed, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)


if __name__ == "__main__":
    main()
