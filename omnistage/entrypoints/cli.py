"""The `omnistage` command: `serve`, `generate`, `bench`, `make-tiny` (runs in the user's process).

`omnistage serve [MODEL]` starts the OpenAI-compatible server (no MODEL: the embedded SmolLM2; its
API key from `--api-key-file PATH`, `$OMNISTAGE_API_KEY` or `--api-key`, the first two kept out of `ps`),
`omnistage generate [MODEL] --prompt ...` runs one prompt offline and prints or writes the result
(no MODEL: the embedded SmolLM2; a model with a chat template gets the prompt as a user message
unless `--no-chat`; image / video models: `--output FILE.png|FILE.mp4`, checked before any work,
`--size WxH`, `--steps`, `--num-frames`), `omnistage bench` load-tests an OpenAI-compatible server (or, `--offline`, the
in-process engine; `entrypoints/bench/`), `omnistage make-tiny DIR --kind KIND` (KIND: one of
`testing.TINY_KINDS`) writes tiny random checkpoints in real formats. Bad options end in one line
naming the option (`--device cuda` without a GPU, a busy `--port`: checked before the model loads).
Heavy imports (torch, transformers) happen inside the subcommands, so `--help` is instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Optional, Sequence

from omnistage.config import CACHE_BACKENDS, COMPILE_MODES, EXECUTOR_BACKENDS, LOAD_FORMATS, cache_config_problem

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _json_object(option: str):
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{option}: not valid JSON ({e}); pass a JSON object") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{option} must be a JSON object, got {text!r}")
        return value

    return parse


class _WholeWordsHelp(argparse.HelpFormatter):
    """Help text wrapped at spaces only, so names with hyphens (flux-schnell) stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (default: auto: the first GPU, "
                                                    "else the CPU)")
    p.add_argument("--dtype", default="auto", choices=_DTYPES, help="weights and activations (default: auto)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per engine step at most")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output tokens at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per engine step at most")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache pool size in blocks")
    p.add_argument("--seed", type=int, default=None, help="seed of unseeded sampled requests")
    p.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                   help="AR stages: split the model over N ranks (processes; one GPU each, or CPU over gloo); "
                        "N must divide the attention heads (default: 1)")
    p.add_argument("--load-format", default=None, choices=LOAD_FORMATS,
                   help="auto: read the folder's safetensors; dummy: random weights of the checkpoint's shapes, "
                        "no weight file read (benchmarks; a folder with config + tokenizer is enough) (default: auto)")
    p.add_argument("--deploy-config", default=None, metavar="FILE.yaml",
                   help="pipeline overrides: per-stage devices, engine sizes, chunking (see pipeline/deploy_config.py)")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens): "
                        "auto = the model's generation_config.json, vllm = none, or another folder's (default: auto)")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   type=_json_object("--override-generation-config"),
                   help="defaults over the model's, e.g. '{\"temperature\": 0.7, \"max_new_tokens\": 512}' "
                        "(max_new_tokens: the answer cap of requests that give no max_tokens)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error", "critical"),
                   help="server / engine log level (default: info; generate: warning)")
    # -- diffusion step cache and VAE (vLLM-Omni's flags) --
    p.add_argument("--cache-backend", default=None, choices=tuple(CACHE_BACKENDS),
                   help="diffusion step cache (default: none)")
    p.add_argument("--cache-config", default=None, type=_json_object("--cache-config"), metavar="JSON",
                   help='settings of the cache backend, e.g. \'{"rel_l1_thresh": 0.2}\' (see README)')
    p.add_argument("--vae-use-tiling", action="store_true", default=None,
                   help="decode images / videos with the VAE's tiled decode (less memory)")
    # -- diffusion speed (EngineConfig's block of the same names; checked there) --
    p.add_argument("--attention-backend", default=None, metavar="NAME|ROLE=NAME,...",
                   help="diffusion attention: auto, TORCH_SDPA, FLASH_ATTN, EFFICIENT_ATTN, CUDNN_ATTN, MATH_ATTN, "
                        "FLEX_ATTN, SAGE_ATTN (lossy 8-bit); per role: dit=...,text_encoder=... (default: auto)")
    p.add_argument("--quantization", default=None,
                   help="fp8: online FP8 weights of the DiT blocks' / AR decoder layers' linear layers")
    p.add_argument("--ignored-layers", default=None, metavar="NAME,...",
                   help="module-name parts --quantization leaves unquantized (e.g. img_mlp, o_proj, layers.0.)")
    p.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no regional torch.compile of the DiT blocks and no step graphs (both on by default on CUDA)")
    p.add_argument("--diffusion-compile-mode", default=None, choices=COMPILE_MODES,
                   help="torch.compile mode of the DiT blocks (default: default)")
    p.add_argument("--diffusion-compile-dynamic", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the DiT blocks over symbolic shapes, one compile for every resolution (default: on)")
    p.add_argument("--enable-cpu-offload", action="store_true", default=None,
                   help="model-level offload: text encoders and DiT take turns on the GPU")
    p.add_argument("--enable-layerwise-offload", action="store_true", default=None,
                   help="layerwise offload: DiT blocks stream from pinned host memory, the next one prefetched")
    # -- scale-out: replicas and Ray placement (EngineConfig's fields of the same names) --
    p.add_argument("--num-replicas", type=int, default=None, metavar="N",
                   help="copies of every stage, each its own process; requests go to the least-loaded one "
                        "(per stage: num_replicas in --deploy-config)")
    p.add_argument("--distributed-executor-backend", default=None, choices=EXECUTOR_BACKENDS,
                   help="mp: stage processes on this host; ray: Ray actors on an existing Ray cluster, placed by "
                        "the deploy config's per-stage `ray:` (needs omnistage[ray]) (default: mp)")
    p.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                   help="the Ray cluster to join with --distributed-executor-backend ray (default: auto)")
    # -- diffusion parallelism (vLLM-Omni's DiffusionParallelConfig; world size = the product of the sizes,
    # with --tensor-parallel-size meaning DiT tensor parallel on a diffusion stage) --
    p.add_argument("--ulysses-degree", "--usp", type=int, default=None, metavar="N",
                   help="diffusion: Ulysses sequence parallel over N ranks (all-to-all around attention)")
    p.add_argument("--ring-degree", "--ring", type=int, default=None, metavar="N",
                   help="diffusion: Ring attention over N ranks (K/V blocks passed around)")
    p.add_argument("--cfg-parallel-size", type=int, default=None, choices=(1, 2),
                   help="diffusion: 2 = the CFG branches (prompt, negative prompt) on two ranks")


def build_parser() -> argparse.ArgumentParser:
    from omnistage import __version__
    from omnistage.testing import TINY_KINDS

    parser = argparse.ArgumentParser(prog="omnistage", description="Serve and run omni-modality models.")
    parser.add_argument("--version", action="version", version=f"omnistage {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench,make-tiny}")

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None,
                       help="local model folder (transformers or diffusers layout); omit for the embedded SmolLM2")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0: all)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port; checked before the model loads (default: 8000)")
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
    gen.add_argument("model", nargs="?", default=None,
                     help="local model folder (transformers or diffusers layout); omit for the embedded SmolLM2")
    gen.add_argument("--prompt", required=True, help="the text prompt (image / video models: what to draw)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="send the prompt as a user message through the model's chat template (default: yes when "
                          "the model has one; --no-chat sends the raw text)")
    gen.add_argument("--max-tokens", type=int, default=64, help="text models: new tokens at most (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="text models: 0 = greedy (default: 0)")
    gen.add_argument("--output", default="-", help="'-' prints text; a file path writes the result there "
                                                   "(image models: FILE.png, video models: FILE.mp4, speech: FILE.wav)")
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

    tiny = sub.add_parser("make-tiny", help="write tiny random checkpoints in real formats",
                          formatter_class=_WholeWordsHelp)
    tiny.add_argument("dir", help="output folder")
    tiny.add_argument("--kind", default="llm", metavar="KIND", help=f"{' | '.join(TINY_KINDS)} (default: llm)")
    return parser


def _check_device(args: argparse.Namespace) -> None:
    """One line naming --device when it is malformed or names a GPU this machine does not have."""
    device = args.device
    if not (device in _DEVICES or device.startswith("cuda:")):
        raise SystemExit(f"omnistage: --device must be one of {', '.join(_DEVICES)} or cuda:N, got {device!r}")
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if device == "cuda" else device.split(":", 1)[1]
    if not str(index).isdigit() or int(index) >= count:
        have = f"cuda:0..cuda:{count - 1}, cpu" if count else "cpu only (no CUDA device is visible to torch " \
            f"{torch.__version__})"
        raise SystemExit(f"omnistage: --device {device}: no such GPU; available: {have}")


# what each kind of output is written as; `--output -` (print) suits text only
_OUTPUT_SUFFIX = {"image": ".png", "video": ".mp4", "audio": ".wav"}


def _check_output(args: argparse.Namespace, kind: str) -> None:
    """Before any work: a model that makes `kind` ("image", "video", "audio") needs --output FILE."""
    if kind in _OUTPUT_SUFFIX and args.output == "-":
        raise SystemExit(f"omnistage: this model makes {kind}s; pass --output FILE{_OUTPUT_SUFFIX[kind]}")


def _check_cache(args: argparse.Namespace) -> None:
    if args.cache_config is None:
        return
    if args.cache_backend is None:
        raise SystemExit(f"omnistage: --cache-config needs --cache-backend (one of {', '.join(CACHE_BACKENDS)})")
    problem = cache_config_problem(args.cache_backend, args.cache_config)
    if problem is not None:
        raise SystemExit(f"omnistage: --cache-config: {problem[1]}")


def _check_engine_options(args: argparse.Namespace) -> None:
    """Bad engine options (an unknown attention backend, offload modes together, ...) end the command
    at once with EngineConfig's message, which names the option and the allowed values."""
    from omnistage.config import EngineConfig
    from omnistage.entrypoints.common import engine_kwargs_from_args

    fields = {f.name for f in dataclasses.fields(EngineConfig)}      # not deploy_config, generation_config
    kwargs = {k: v for k, v in engine_kwargs_from_args(args).items() if k in fields}
    try:
        EngineConfig(**kwargs)
    except ValueError as e:
        raise SystemExit(f"omnistage: {e}") from e
    if kwargs.get("distributed_executor_backend") == "ray":
        from omnistage.parallel.ray_ranks import import_ray

        try:
            import_ray()
        except RuntimeError as e:               # names the extra to install
            raise SystemExit(f"omnistage: --distributed-executor-backend ray: {e}") from e


def cmd_generate(args: argparse.Namespace) -> int:
    from omnistage import SamplingParams
    from omnistage.entrypoints.common import engine_kwargs_from_args
    from omnistage.entrypoints.omni import Omni

    try:
        with Omni(model=args.model, device=args.device, dtype=args.dtype, **engine_kwargs_from_args(args)) as omni:
            main = omni.orchestrator.spec.main_stage
            if main.kind == "diffusion":
                _check_output(args, getattr(omni.orchestrator.stages[main.name], "output_kind", "image"))
                params = _diffusion_params(args)
            else:
                params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
            chat = args.chat
            if chat is None:                    # instruct models answer a user turn, not raw text
                chat = main.kind == "ar" and bool(getattr(omni.tokenizer, "chat_template", None))
            if chat:
                out = omni.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
            else:
                out = omni.generate(args.prompt, params, use_tqdm=not isinstance(params, SamplingParams))[0]
    except (FileNotFoundError, ValueError) as e:                # bad model folder, prompt or option
        raise SystemExit(f"omnistage: {e}") from e
    if out.video is not None:
        _check_output(args, "video")
        from omnistage.io.media import encode_mp4

        with open(args.output, "wb") as f:
            f.write(encode_mp4(out.video.frames, out.video.fps))
    elif out.images:
        _check_output(args, "image")
        out.images[0].save(args.output)
    elif out.audio is not None:
        _check_output(args, "audio")
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
    if hasattr(args, "cache_backend"):
        _check_cache(args)                      # first: its messages name the --cache-* flags
    if hasattr(args, "device"):
        _check_device(args)
        _check_engine_options(args)
    commands = {"serve": cmd_serve, "generate": cmd_generate, "bench": cmd_bench, "make-tiny": cmd_make_tiny}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
