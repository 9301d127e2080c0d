"""Qwen2.5-Omni streaming speech on one GPU: time to first audio packet and real-time factor.

Builds once (under --work, default /tmp/omnibench) a folder with Qwen2.5-Omni-7B's config, tokenizer and
voices but no weights: ours serves it with `load_format="dummy"` and transformers' reference builds its
model from the config on the GPU -- random bf16 weights, which time exactly like real ones:
  thinker  Qwen2-7B text decoder: hidden 3584, 28 layers, 28 heads, 4 KV heads, MLP 18944, vocab 152064
  talker   the 7B checkpoint's talker_config: hidden 896, 24 layers, 12 heads, 4 KV heads, head_dim 128,
           MLP 18944, codec vocab 8448, input width (embedding_size) 3584
  token2wav transformers' defaults (DiT 22 layers x 1024, BigVGAN 1536 channels); the DiT's codec
           table covers all 8448 talker ids (real: 8194) so random codes always decode (same speed)
  encoders tiny (the prompts are text), the tiny tokenizer / processor (ids below 800), two voices.
Then, through `AsyncOmni` (thinker, talker, code2wav on one GPU), for each stage layout -- `shared`
(every stage in the orchestrator's process, each on a CUDA stream of its own, the thinker and talker
on high-priority streams; pipeline/shared.py) and `process` (each stage in its own stage process, the
pipeline's default on a GPU) -- N concurrent requests (N = 1, 8, 16, 32), each: a chat prompt,
THINKER_TOKENS text tokens (EOS ignored), TALKER_CODES codec ids (stop codes banned) = TALKER_CODES /
50 s of audio, measured per request from the times its audio pieces reach the caller:
  TTFA      request arrival -> the first audio samples reach the caller (mean, p90)
  RTF       (last audio samples - arrival) / seconds of audio; below 1 = faster than real time (mean, max)
  underruns a listener that starts playing at the first piece runs dry: a piece arrives after the audio
            before it has played out (count, and seconds of silence, over all requests)
and transformers' `Qwen2_5OmniForConditionalGeneration.generate` on the same weights for 1
request (not streaming: its first audio is its whole answer), and the floor: the RTF if every
thinker token and talker code cost only reading the decoder weights once at the measured copy
bandwidth (requests decoded together share those reads, so the floor holds at every concurrency;
code2wav's compute is left out, so the true floor is higher). Prints a markdown table last.

    python benchmarks/omni_bench.py [--work /tmp/omnibench] [--out results.json] [--layouts shared,process]
    python benchmarks/omni_bench.py --tiny           # tiny checkpoint, CPU, seconds (a test runs it; = --smoke)

`--stage-devices thinker=cuda:0,talker=cuda:1,code2wav=cuda:1` puts the stages on two GPUs (with
`--layouts process`: each stage in its own process on its GPU).

`--code2wav-growth off` measures Qwen2.5-Omni's code2wav without its chunk ramp (every chunk after the
first has chunk_codes; an integer sets `chunk_growth`); `--code2wav-first N` sets its `first_chunk_codes`;
`--code2wav-first-load arrival` sizes first chunks from the load at arrival (default "schedule": the load of each step until decoded, so requests arriving together count).

`--model qwen3-omni` runs the same measurement on Qwen3-Omni-30B-A3B's shape (`qwen3_omni_bench.py`:
a folder of config + tokenizer only under --work, served with `load_format="dummy"` -- random weights
drawn on the GPU, no checkpoint written -- and the request settings; levels 1, 8, 32; frames at 12.5
per second of audio; no transformers reference or floor row); with `--tiny` (= --smoke) on the tiny one.

Per layout and level it also prints where the first audio's time goes (mean seconds from arrival, from
the orchestrator's stamps, `RequestMetrics.stage_first_output` / `edge_first_input`): each stage's
first output (thinker: first token; talker: first frame; code2wav: first chunk), each edge's first
piece handed over (e.g. the first thinker rows given to the talker), and the first audio at the
caller. `--warm-each-level` runs a short untimed round at each level's concurrency first, so the
difference to a run without it is what first-use shapes (compiles, library plans) cost; `--no-warm-round`
drops even the one 2-stream round after start-up (the first level is then the first requests the stages see;
`OMNISTAGE_AR_WARMUP=0` also skips the AR stages' start-up warm-up, `ar/warmup.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the sibling benchmark modules
from first_output import breakdown_table, first_output_breakdown, mean_breakdown  # noqa: E402

STAGE_NAMES = ("thinker", "talker", "code2wav")    # the pipeline's stages (both omni models)
CODEC_STOPS = (8292, 8293, 8294)                # pad, bos, eos: banned so every answer has the same length
SAMPLE_RATE = 24000


def omni_7b_config(ids: dict[str, int]):
    """`Qwen2_5OmniConfig` of the 7B's shape (see the module docstring); `ids`: tiny tokenizer ids."""
    from transformers import Qwen2_5OmniConfig

    mrope = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}
    marks = dict(audio_token_index=ids["audio_token"], image_token_index=ids["image_token"],
                 video_token_index=ids["video_token"], audio_start_token_id=ids["audio_bos_token"],
                 audio_end_token_id=ids["audio_eos_token"], vision_start_token_id=ids["vision_bos_token"],
                 vision_end_token_id=ids["vision_eos_token"])
    text = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                rope_parameters=mrope, tie_word_embeddings=False, eos_token_id=ids["im_end"],
                pad_token_id=ids["endoftext"])
    audio = dict(num_mel_bins=128, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                 output_dim=3584, max_source_positions=1500, n_window=100)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=112, out_hidden_size=3584, fullatt_block_indexes=[0])
    talker = dict(vocab_size=8448, embedding_size=3584, hidden_size=896, intermediate_size=18944,
                  num_hidden_layers=24, num_attention_heads=12, num_key_value_heads=4, head_dim=128,
                  max_position_embeddings=32768, rms_norm_eps=1e-6, rope_parameters=mrope, **marks)
    return Qwen2_5OmniConfig(
        thinker_config=dict(text_config=text, audio_config=audio, vision_config=vision, **marks),
        talker_config=talker, token2wav_config={"dit_config": {"num_embeds": 8447}, "bigvgan_config": {}})


def build_checkpoint(path: str, weights: bool = False) -> str:
    """The 7B-shape folder (kept across runs): config, generation config, tokenizer / processor and voices;
    without `weights` nothing else: ours serves it with `load_format="dummy"` and transformers' reference
    builds its model from the config on the GPU (`bench_hf`), random weights either way, no 16 GB write.
    With `weights` also a random bf16 checkpoint (omni_stream_check.py compares decodes of real files)."""
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    from omnistage.testing import qwen2_5_omni as tiny

    if os.path.exists(os.path.join(path, "spk_dict.pt")):
        return path
    tokenizer = tiny.make_omni_tokenizer()
    ids = tiny._token_ids(tokenizer)
    config = omni_7b_config(ids)
    os.makedirs(path, exist_ok=True)
    config.architectures = ["Qwen2_5OmniForConditionalGeneration"]   # what save_pretrained of the model writes
    config.save_pretrained(path)
    GenerationConfig(eos_token_id=[ids["im_end"], ids["endoftext"]], pad_token_id=ids["endoftext"]).save_pretrained(path)
    tiny.make_processor(tokenizer).save_pretrained(path)
    if weights:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen2_5OmniForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
        model.generation_config = GenerationConfig.from_pretrained(path)
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
    # the voices last: their file marks a finished folder
    torch.save(tiny.make_speakers(config, torch.Generator().manual_seed(1)), os.path.join(path, "spk_dict.pt"))
    return path


MESSAGES = [{"role": "system", "content": "You are a helpful voice assistant. Answer in a few sentences."},
            {"role": "user", "content": "Tell me about the harbour town where you grew up, and the market there."}]


def stage_params(thinker_tokens: int, talker_codes: int) -> list:
    from omnistage import SamplingParams

    thinker = SamplingParams(max_tokens=thinker_tokens, temperature=0.7, ignore_eos=True, seed=0)
    talker = SamplingParams(max_tokens=talker_codes, temperature=0.9, top_k=40, top_p=0.8, repetition_penalty=1.05,
                            bad_token_ids=list(CODEC_STOPS), seed=0)
    return [thinker, talker, None]


async def one_request(engine, prompt: dict, params: list, voice: str) -> dict[str, float]:
    start = time.perf_counter()
    pieces: list[tuple[float, int]] = []        # (arrival time, samples) of each new piece of audio
    samples = text = 0
    first_audio_wall = metrics = None
    async for out in engine.generate(dict(prompt, modalities=["text", "audio"], voice=voice), params[0],
                                     sampling_params_list=params):
        n = 0 if out.audio is None else out.audio.samples.size
        if n > samples:
            pieces.append((time.perf_counter(), n - samples))
            first_audio_wall = first_audio_wall or time.time()
            samples = n
        text = len(out.outputs[0].token_ids)
        metrics = out.metrics or metrics
    audio_s = samples / SAMPLE_RATE
    last = pieces[-1][0]
    dry, dry_s = underruns(pieces)
    return {"ttfa_s": pieces[0][0] - start, "rtf": (last - start) / audio_s, "audio_s": audio_s,
            "text_tokens": text, "seconds": last - start, "underruns": dry, "underrun_s": dry_s,
            "ttfa_breakdown_s": first_output_breakdown(metrics, first_audio_wall)}


def underruns(pieces: list[tuple[float, int]]) -> tuple[int, float]:
    """(times, seconds) a listener's playback ran dry: it starts at the first piece and plays each
    piece on arrival or right after the one before, whichever is later."""
    count, silent = 0, 0.0
    played_out = pieces[0][0]                   # when the audio received so far has finished playing
    for i, (t, n) in enumerate(pieces):
        if i and t > played_out:
            count, silent = count + 1, silent + t - played_out
        played_out = max(played_out, t) + n / SAMPLE_RATE
    return count, silent


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


BUSY_KEYS = {"thinker_model_s": "step_seconds_total", "thinker_steps": "steps_total",
             "talker_model_s": "talker:step_seconds_total", "talker_steps": "talker:steps_total",
             "code2wav_dit_s": "code2wav:dit_seconds_total", "code2wav_vocoder_s": "code2wav:vocoder_seconds_total",
             "code2wav_batches": "code2wav:dit_batches_total",
             "edge_thinker_talker_s": "edge:thinker->talker:seconds", "edge_talker_code2wav_s": "edge:talker->code2wav:seconds"}


async def concurrent(engine, prompt: dict, n: int, params: list) -> dict[str, Any]:
    voices = [v["id"] for v in engine.voices()]
    before = engine.stats()
    start = time.perf_counter()
    runs = await asyncio.gather(*(one_request(engine, prompt, params, voices[i % len(voices)]) for i in range(n)))
    wall = time.perf_counter() - start
    await asyncio.sleep(0.3)                    # the engine loop refreshes its stats snapshot
    after = engine.stats()
    # where the time went: each stage's busy seconds (and steps) during this level
    busy = {name: round(after.get(key, 0) - before.get(key, 0), 3) for name, key in BUSY_KEYS.items()}
    ttfa = [r["ttfa_s"] for r in runs]
    return {"concurrency": n, "ttfa_mean_s": statistics.mean(ttfa), "ttfa_p90_s": p90(ttfa), "ttfa_max_s": max(ttfa),
            "ttfa_breakdown_mean_s": mean_breakdown([r["ttfa_breakdown_s"] for r in runs]),
            "rtf_mean": statistics.mean(r["rtf"] for r in runs), "rtf_max": max(r["rtf"] for r in runs),
            "underruns": sum(r["underruns"] for r in runs), "underrun_s": sum(r["underrun_s"] for r in runs),
            "audio_s_per_request": runs[0]["audio_s"], "audio_s_per_wall_s": sum(r["audio_s"] for r in runs) / wall,
            "wall_s": wall, "busy": busy}


def bench_ours(path: str, device: str, dtype: str, levels: list[int], thinker_tokens: int,
               talker_codes: int, deploy: Optional[dict] = None, params_for=None,
               load_format: str = "auto", warm_each_level: bool = False, warm_round: bool = True) -> list[dict]:
    """`params_for(thinker_tokens, talker_codes)`: the stages' params (default: Qwen2.5-Omni's `stage_params`).
    `warm_each_level`: before each level's timed round, a short round at the same concurrency (the
    level's batch shapes seen once: first-use costs such as kernel compiles or library plans leave the
    timings; without it only a 2-stream round runs first). `warm_round` False: not even that one, so the
    first level's requests are the first after start-up."""
    from omnistage.entrypoints.async_omni import AsyncOmni

    params_for = params_for or stage_params
    layout = (deploy or {}).get("stage_layout", "default")
    start = time.perf_counter()
    engine = AsyncOmni(path, device=device, dtype=dtype, deploy_config=deploy, load_format=load_format)
    from omnistage.layers import pdl              # read after the build: the shared layout may turn it off

    print(f"[{layout} layout] started in {time.perf_counter() - start:.1f} s; programmatic dependent launch in "
          f"this process: {'on' if pdl.ENABLED else 'off'}", flush=True)
    try:
        prompt = engine.render_chat(MESSAGES)
        warm = params_for(8, 48)
        if warm_round:
            asyncio.run(concurrent(engine, prompt, 2, warm))  # compile / allocate outside the timings
        runs = []
        for n in levels:
            if warm_each_level:
                asyncio.run(concurrent(engine, prompt, n, warm))
            runs.append(asyncio.run(concurrent(engine, prompt, n, params_for(thinker_tokens, talker_codes))))
            # each level as it ends: a later failure keeps the earlier ones
            print(f"[{layout} layout, {n} streams] {json.dumps(runs[-1])}", flush=True)
        return runs
    finally:
        engine.close()


def bench_hf(path: str, device: str, dtype: torch.dtype, thinker_tokens: int, talker_codes: int) -> dict:
    """transformers' whole-answer `generate`, 1 request, same lengths (sampled, EOS and stops held back)."""
    from transformers import AutoConfig, AutoProcessor, GenerationConfig, Qwen2_5OmniForConditionalGeneration

    if any(name.endswith(".safetensors") for name in os.listdir(path)):
        model = Qwen2_5OmniForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
    else:                                       # the bench's config-only folder: random weights drawn on the GPU
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2_5OmniForConditionalGeneration._from_config(AutoConfig.from_pretrained(path), dtype=dtype)
        model.eval().load_speakers(os.path.join(path, "spk_dict.pt"))
        model.generation_config = GenerationConfig.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, return_tensors="pt").to(device)
    timings = []
    for tokens, codes in ((4, 24), (thinker_tokens, talker_codes)):   # the first call warms up
        torch.manual_seed(0)
        start = time.perf_counter()
        _, wav = model.generate(**inputs, speaker="Chelsie", thinker_max_new_tokens=tokens,
                                thinker_min_new_tokens=tokens, talker_max_new_tokens=codes,
                                talker_min_new_tokens=codes)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - start, wav.numel() / SAMPLE_RATE))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    seconds, audio_s = timings[-1]
    return {"concurrency": 1, "ttfa_mean_s": seconds, "ttfa_p90_s": seconds, "ttfa_max_s": seconds,
            "rtf_mean": seconds / audio_s, "rtf_max": seconds / audio_s, "underruns": 0, "underrun_s": 0.0,
            "audio_s_per_request": audio_s, "audio_s_per_wall_s": audio_s / seconds, "wall_s": seconds}


def _copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, measured as ar_bench.py measures it."""
    from ar_bench import copy_bandwidth

    return copy_bandwidth()


def floor(path: str, thinker_tokens: int, talker_codes: int, bandwidth: float) -> dict:
    from omnistage.pipeline.memory import weight_bytes   # from the safetensors headers (bf16 checkpoint)

    # a decode step reads every layer and the output head; of the embedding table only its rows
    thinker = weight_bytes(path, ("thinker.model.layers.", "thinker.model.norm.", "thinker.lm_head."))
    talker = weight_bytes(path, ("talker.model.layers.", "talker.model.norm.", "talker.codec_head."))
    seconds = (thinker * thinker_tokens + talker * talker_codes) / bandwidth
    return {"thinker_bytes": thinker, "talker_bytes": talker, "bandwidth_Bps": bandwidth,
            "rtf": seconds / (talker_codes / 50)}


def table(res: dict) -> str:
    rows = [f"| engine, stage layout, streams ({res['shape']}, {res['device']}) | TTFA mean s | TTFA p90 s | "
            "RTF mean | RTF max | underruns (s dry) | audio s per wall s |", "|---|---|---|---|---|---|---|"]

    def row(name: str, r: dict) -> str:
        return (f"| {name}, {r['concurrency']} | {r['ttfa_mean_s']:.3f} | {r['ttfa_p90_s']:.3f} | {r['rtf_mean']:.3f} | "
                f"{r['rtf_max']:.3f} | {r['underruns']} ({r['underrun_s']:.2f}) | {r['audio_s_per_wall_s']:.2f} |")

    for layout, runs in res["layouts"].items():
        rows += [row(f"omnistage AsyncOmni streaming, {layout}", r) for r in runs]
    rows += [row("transformers generate, whole answer", r) for r in res["hf"]]
    if res.get("floor"):
        f = res["floor"]
        rows.append(f"| floor: decoder weights read once per token ({f['thinker_bytes'] / 1e9:.1f} + "
                    f"{f['talker_bytes'] / 1e9:.1f} GB at {f['bandwidth_Bps'] / 1e9:.0f} GB/s) | - | - | "
                    f"{f['rtf']:.3f} | - | - | - |")
    return "\n".join(rows)


def layouts_breakdown_table(res: dict) -> str:
    """Mean seconds from arrival to each stage's first output, edge's first piece and the caller's first audio."""
    return breakdown_table(res["shape"], [(f"{layout}, {r['concurrency']} streams", r.get("ttfa_breakdown_mean_s") or {})
                                          for layout, rs in res["layouts"].items() for r in rs])


def main(argv: Optional[list[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/omnibench", help="where the random checkpoint is kept")
    ap.add_argument("--model", choices=("qwen2.5-omni", "qwen3-omni"), default="qwen2.5-omni",
                    help="which omni model's shape (default qwen2.5-omni)")
    ap.add_argument("--tiny", "--smoke", dest="smoke", action="store_true",
                    help="tiny checkpoint on CPU with short answers")
    ap.add_argument("--levels", default=None, help="comma-separated concurrency levels (default 1,8,16,32; tiny 1,2)")
    ap.add_argument("--layouts", default="shared,process",
                    help="comma-separated stage layouts to measure, each a deploy `stage_layout`: shared, process "
                         "or inline (default shared,process)")
    ap.add_argument("--thinker-tokens", type=int, default=None, help="text tokens per answer (default 64; smoke 8)")
    ap.add_argument("--talker-codes", type=int, default=None, help="codec ids per answer, 50/s (default 500; smoke 30)")
    ap.add_argument("--code2wav-chunk", type=int, default=None, help="codes per code2wav chunk (default: the pipeline's)")
    ap.add_argument("--code2wav-first", type=int, default=None,
                    help="Qwen2.5-Omni code2wav's first_chunk_codes (the load rule starts there; default: the pipeline's)")
    ap.add_argument("--code2wav-growth", default=None,
                    help="Qwen2.5-Omni code2wav's chunk_growth: an integer, or off (no ramp; default: the stage's)")
    ap.add_argument("--code2wav-first-load", choices=("arrival", "schedule"), default=None,
                    help="Qwen2.5-Omni code2wav's first_chunk_load: size first chunks by the load at arrival or at "
                         "each step until decoded (default: the stage's)")
    ap.add_argument("--code2wav-batch", type=int, default=None,
                    help="most requests per code2wav decode (max_batch_requests; default: the pipeline's)")
    ap.add_argument("--code2wav-runner", choices=("inline", "shared", "process"), default=None,
                    help="code2wav's runner in every layout measured (default: the layout's)")
    ap.add_argument("--no-code2wav-graphs", action="store_true", help="code2wav's ODE without CUDA graphs")
    ap.add_argument("--code2wav-dit-dtype", choices=("float32", "bfloat16"), default=None,
                    help="Qwen2.5-Omni code2wav's dit_dtype (default: the stage's, bfloat16 on CUDA)")
    ap.add_argument("--ar-runner", choices=("inline", "shared", "process"), default=None,
                    help="thinker's and talker's runner in every layout measured (default: the layout's)")
    ap.add_argument("--warm-each-level", action="store_true",
                    help="a short untimed round at each level's concurrency before its timed one")
    ap.add_argument("--no-warm-round", action="store_true",
                    help="no untimed 2-stream round after start-up: the first level's requests are the first ones")
    ap.add_argument("--stage-devices", default=None, metavar="STAGE=DEVICE,...",
                    help="place stages on devices, e.g. thinker=cuda:0,talker=cuda:1,code2wav=cuda:1 (two GPUs; "
                         "default: every stage on the one device)")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers reference")
    ap.add_argument("--hf-only", action="store_true",
                    help="only transformers' reference (and the floor): in a process of its own, since the shared "
                         "layout's stages keep their GPU memory until the process ends")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    params_for, load_format = None, "auto"
    if args.model == "qwen3-omni":
        import qwen3_omni_bench as q3

        if args.smoke:
            path = q3.tiny_checkpoint(os.path.join(args.work, "tiny-qwen3_omni"))
            device, dtype, shape, levels, tokens, codes = "cpu", "float32", "tiny Qwen3-Omni, fp32", [1, 2], 8, 12
        else:
            path = q3.config_folder(os.path.join(args.work, "qwen3_omni_30b_a3b_config"))
            device, dtype, shape = "cuda", "bfloat16", "Qwen3-Omni-30B-A3B shape, bf16, load_format=dummy"
            load_format = "dummy"
            levels, tokens, codes = [1, 8, 32], 64, 125

        def params_for(t, c):
            return q3.stage_params(path, t, c)

        args.skip_hf = True                     # transformers' 30B-A3B generate is not run here
    elif args.smoke:
        from omnistage.testing.qwen2_5_omni import make_tiny_qwen2_5_omni

        path = os.path.join(args.work, "tiny-qwen2_5_omni")
        if not os.path.exists(os.path.join(path, "spk_dict.pt")):
            make_tiny_qwen2_5_omni(path)
        device, dtype, shape = "cpu", "float32", "tiny Qwen2.5-Omni, fp32"
        levels, tokens, codes = [1, 2], 8, 30
    else:
        path = build_checkpoint(os.path.join(args.work, "qwen2_5_omni_7b_config"))
        device, dtype, shape = "cuda", "bfloat16", "Qwen2.5-Omni-7B shape, bf16, random weights drawn on the GPU"
        load_format = "dummy"
        levels, tokens, codes = [1, 8, 16, 32], 64, 500
    levels = [int(x) for x in args.levels.split(",")] if args.levels else levels
    tokens, codes = args.thinker_tokens or tokens, args.talker_codes or codes
    code2wav: dict[str, Any] = {}
    options = {("chunk_frames" if args.model == "qwen3-omni" else "chunk_codes"): args.code2wav_chunk,
               "max_batch_requests": args.code2wav_batch, "dit_dtype": args.code2wav_dit_dtype,
               "first_chunk_codes": args.code2wav_first, "first_chunk_load": args.code2wav_first_load}
    options = {k: v for k, v in options.items() if v}
    if args.code2wav_first_load and args.model == "qwen3-omni":
        ap.error("--code2wav-first-load is a Qwen2.5-Omni code2wav option")
    if args.code2wav_first and args.model == "qwen3-omni":
        ap.error("--code2wav-first is a Qwen2.5-Omni code2wav option (Qwen3-Omni's: first_chunk_frames)")
    if args.code2wav_growth is not None:        # off: null, every chunk after the first has chunk_codes
        if args.model == "qwen3-omni" or not (args.code2wav_growth == "off" or args.code2wav_growth.isdigit()):
            ap.error(f"--code2wav-growth (Qwen2.5-Omni only) must be an integer or off, got {args.code2wav_growth!r}")
        options["chunk_growth"] = None if args.code2wav_growth == "off" else int(args.code2wav_growth)
    if options:
        code2wav["options"] = options
    if args.code2wav_runner:
        code2wav["runner"] = args.code2wav_runner
    if args.no_code2wav_graphs:
        code2wav["cuda_graphs"] = False
    stages = {"code2wav": code2wav} if code2wav else {}
    if args.ar_runner:
        for name in ("thinker", "talker"):
            stages.setdefault(name, {})["runner"] = args.ar_runner
    for item in filter(None, (args.stage_devices or "").split(",")):
        name, _, dev = item.partition("=")
        if name not in STAGE_NAMES or not dev:
            ap.error(f"--stage-devices takes STAGE=DEVICE pairs, STAGE one of {', '.join(STAGE_NAMES)}; got {item!r}")
        stages.setdefault(name, {})["device"] = dev
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in ("shared", "process", "inline")]
    if bad or not layouts:
        ap.error(f"--layouts must list shared, process or inline; got {args.layouts!r}")
    if args.hf_only and args.skip_hf:
        ap.error("--hf-only and --skip-hf leave nothing to measure")
    if args.hf_only:
        layouts = []
    deploys = {layout: {"stage_layout": layout, "stages": stages} for layout in layouts}
    measured = {layout: bench_ours(path, device, dtype, levels, tokens, codes, deploy, params_for, load_format,
                                   args.warm_each_level, not args.no_warm_round)
                for layout, deploy in deploys.items()}
    hf = [] if args.skip_hf else [bench_hf(path, device, getattr(torch, dtype), tokens, codes)]
    if hf:
        print(f"[transformers generate, 1 stream] {json.dumps(hf[0])}", flush=True)
    if load_format == "dummy":                  # the floor counts a config-only folder's bytes from its shapes
        from omnistage.models.dummy import use_dummy_weights

        use_dummy_weights(path)
    res = {"shape": shape, "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
           "thinker_tokens": tokens, "talker_codes": codes, "deploy_configs": deploys, "layouts": measured,
           "warm_each_level": args.warm_each_level, "warm_round": not args.no_warm_round,
           "ours": measured[layouts[0]] if layouts else [],
           "hf": hf,
           "floor": (floor(path, tokens, codes, _copy_bandwidth())
                     if device == "cuda" and args.model == "qwen2.5-omni" else None)}
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    rate = 12.5 if args.model == "qwen3-omni" else 50
    print(f"\nEach request: a chat prompt, {tokens} text tokens, {codes} codec ids = {codes / rate:.1f} s of audio.\n")
    print(table(res))
    print()
    if res["layouts"]:
        print(layouts_breakdown_table(res))
    return res


if __name__ == "__main__":
    main()
