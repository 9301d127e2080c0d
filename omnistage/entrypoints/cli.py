"""The `omnistage` command: `serve`, `generate`, `make-tiny` (runs in the user's process).

`omnistage serve [MODEL]` starts the OpenAI-compatible server (no MODEL: the embedded SmolLM2; its
API key from `--api-key-file PATH`, `$OMNISTAGE_API_KEY` or `--api-key`, the first two kept out of `ps`),
`omnistage generate MODEL --prompt ...` runs one prompt offline and prints or writes the result
(image / video models: `--output FILE.png|FILE.mp4`, `--size WxH`, `--steps`, `--num-frames`),
`omnistage bench` load-tests an OpenAI-compatible server (or, `--offline`, the in-process engine;
`entrypoints/bench/`), `omnistage make-tiny DIR --kind llm|qwen-image|wan|...` writes tiny random
checkpoints in real formats. Heavy imports (torch, transformers) happen inside the subcommands, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional, Sequence

from omnistage.config import CACHE_BACKENDS, cache_config_problem

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto)")
    p.add_argument("--dtype", default="auto", choices=_DTYPES, help="weights and activations (default: auto)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per engine step at most")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step at most")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache pool size in blocks")
    p.add_argument("--seed", type=int, default=None, help="seed of unseeded sampled requests")
    p.add_argument("--deploy-config", default=None, metavar="FILE.yaml",
                   help="pipeline overrides: per-stage devices, engine sizes, chunking (see pipeline/deploy_config.py)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"))
    # -- diffusion step cache and VAE (vLLM-Omni's flags) --
    p.add_argument("--cache-backend", default=None, choices=tuple(CACHE_BACKENDS),
                   help="diffusion step cache (default: none)")
    p.add_argument("--cache-config", default=None, type=_json_object, metavar="JSON",
                   help='settings of the cache backend, e.g. \'{"rel_l1_thresh": 0.2}\' (see README)')
    p.add_argument("--vae-use-tiling", action="store_true", default=None,
                   help="decode images / videos with the VAE's tiled decode (less memory)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}); pass an object such as "
                                         '\'{"rel_l1_thresh": 0.2}\'') from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnistage", description="Serve and run omni-modality models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench,make-tiny}")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None,
                       help="local model folder (transformers or diffusers layout); omit for the embedded SmolLM2")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on /v1 routes (visible in `ps`: prefer "
                            "$OMNISTAGE_API_KEY or --api-key-file)")
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="read the API key from this file (its first line); default: $OMNISTAGE_API_KEY if set")
    serve.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: MODEL's folder name, or MODEL as given)")
    serve.add_argument("--max-body-bytes", type=int, default=None,
                       help="largest request body; larger ones get 413 before they are read (default: 32 MiB)")
    serve.add_argument("--max-image-pixels", type=int, default=None,
                       help="largest width * height of a generated image or video frame (default: 2048*2048)")
    serve.add_argument("--max-video-jobs", type=int, default=None,
                       help="queued + running /v1/videos jobs at most; more get 429 (default: 16)")
    serve.add_argument("--drain-timeout", type=float, default=None, metavar="S",
                       help="on SIGTERM / SIGINT, wait this long for requests in flight, then cut them (default: 30)")
    serve.add_argument("--speaker-samples-dir", default=None, metavar="DIR",
                       help="where uploaded voices (POST /v1/audio/voices) are kept, one file each, restored at "
                            "start (default: $XDG_CACHE_HOME/omnistage/voices, ~/.cache without it)")
    serve.add_argument("--speaker-max-uploaded", type=int, default=None, metavar="N",
                       help="uploaded voices kept at most (default: 1000)")
    serve.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="hosts (and their subdomains) whose http(s) URLs speech `ref_audio` may name; "
                            "default: none, no URL is fetched")
    _add_engine_args(serve)

    gen = sub.add_parser("generate", help="run one prompt offline and print the result")
    gen.add_argument("model", help="local model folder")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message via the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--output", default="-", help="'-' prints text; a file path writes the result there")
    gen.add_argument("--size", default=None, help="image / video models: WIDTHxHEIGHT (default: the model's)")
    gen.add_argument("--steps", type=int, default=None, help="image / video models: denoising steps")
    gen.add_argument("--num-frames", type=int, default=None, help="video models: frames to generate")
    _add_engine_args(gen)
    gen.set_defaults(log_level="warning")

    from omnistage.entrypoints.bench.main import add_bench_args

    bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server (or, --offline, the engine)")
    add_bench_args(bench)
    _add_engine_args(bench)                     # used with --offline
    bench.set_defaults(log_level="warning")

    tiny = sub.add_parser("make-tiny", help="write tiny random checkpoints in real formats")
    tiny.add_argument("dir", help="output folder")
    tiny.add_argument("--kind", default="llm", help="llm | qwen2_5_omni | qwen-image | qwen-image-edit | flux | flux-schnell | sd3 | z-image | wan | wan2.2 | wan-i2v | all")
    return parser


def _check_device(args: argparse.Namespace) -> None:
    if not (args.device in _DEVICES or args.device.startswith("cuda:")):
        raise SystemExit(f"omnistage: --device must be one of {', '.join(_DEVICES)} or cuda:N, got {args.device!r}")


def _check_cache(args: argparse.Namespace) -> None:
    if args.cache_config is None:
        return
    if args.cache_backend is None:
        raise SystemExit(f"omnistage: --cache-config needs --cache-backend (one of {', '.join(CACHE_BACKENDS)})")
    problem = cache_config_problem(args.cache_backend, args.cache_config)
    if problem is not None:
        raise SystemExit(f"omnistage: --cache-config: {problem[1]}")


def cmd_generate(args: argparse.Namespace) -> int:
    from omnistage import SamplingParams
    from omnistage.entrypoints.common import engine_kwargs_from_args
    from omnistage.entrypoints.omni import Omni

    try:
        with Omni(model=args.model, device=args.device, dtype=args.dtype, **engine_kwargs_from_args(args)) as omni:
            if omni.orchestrator.spec.main_stage.kind == "diffusion":
                params = _diffusion_params(args)
            else:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
            if args.chat:
                out = omni.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
            else:
                out = omni.generate(args.prompt, params, use_tqdm=not isinstance(params, SamplingParams))[0]
    except (FileNotFoundError, ValueError) as e:                # bad model folder, prompt or option
        raise SystemExit(f"omnistage: {e}") from e
    if out.video is not None:
        if args.output == "-":
            raise SystemExit("omnistage: this model makes videos; pass --output FILE.mp4")
        from omnistage.io.media import encode_mp4

        with open(args.output, "wb") as f:
            f.write(encode_mp4(out.video.frames, out.video.fps))
    elif out.images:
        if args.output == "-":
            raise SystemExit("omnistage: this model makes images; pass --output FILE.png")
        out.images[0].save(args.output)
    elif out.audio is not None:
        if args.output == "-":
            raise SystemExit("omnistage: this model makes audio; pass --output FILE.wav")
        import soundfile

        soundfile.write(args.output, out.audio.samples, out.audio.sample_rate)
    else:
        text = out.outputs[0].text if out.outputs else ""
        if args.output == "-":
            print(text)
        else:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
    if args.output != "-":
        print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _diffusion_params(args: argparse.Namespace):
    from omnistage import DiffusionParams

    width = height = None
    if args.size:
        try:
            width, height = (int(v) for v in args.size.lower().split("x"))
        except ValueError:
            raise ValueError(f"--size must be WIDTHxHEIGHT, e.g. 512x512; got {args.size!r}") from None
    return DiffusionParams(height=height, width=width, num_inference_steps=args.steps, num_frames=args.num_frames,
                           seed=args.seed)


def cmd_bench(args: argparse.Namespace) -> int:
    from omnistage.entrypoints.bench.main import cmd_bench as run_bench

    return run_bench(args)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from omnistage.testing import make_tiny

    try:
        paths = make_tiny(args.dir, args.kind)
    except ValueError as e:
        raise SystemExit(f"omnistage: {e}") from e
    for path in paths:
        print(path)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from omnistage.entrypoints.openai.api_server import run_server

    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise SystemExit(f"omnistage: --max-body-bytes must be a positive integer, got {args.max_body_bytes}")
    run_server(args)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "log_level"):
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if hasattr(args, "device"):
        _check_device(args)
    if hasattr(args, "cache_backend"):
        _check_cache(args)
    commands = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench, "make-tiny": cmd_make_tiny}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
