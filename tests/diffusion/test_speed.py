"""Diffusion speed features on tiny fp32 checkpoints (diffusion/speed.py, attention.py, offload.py).

Lossless options (SDPA kernels, FlexAttention, regional compile, both offload modes) keep every family
equal to diffusers' `pipe()` for the same seed; the compile path runs once (FLUX) with the "eager"
backend, which exercises the dynamo tracing of the blocks without inductor's C++ build. Offload
equals resident output exactly and really streams blocks. The lossy paths (8-bit attention, FP8
linear layers) run in their reference form and stay within the stated tolerances.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffusion_testutil import frames_uint8, max_pixel_diff, reference_pipe
from omnistage.config import EngineConfig
from omnistage.diffusion import attention
from omnistage.diffusion.attention import AttentionRouter
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.speed import DiffusionSpeed
from omnistage.layers import fp8_linear, linear_gelu, merged_linear, quant_attention
from omnistage.models.registry import diffusion_family
from omnistage.params import DiffusionParams

CFG = EngineConfig(device="cpu", dtype="float32")
IMAGE = dict(height=32, width=32)
VIDEO = dict(height=32, width=32, num_frames=5)
# kind -> (pipe() kwargs, DiffusionParams kwargs, size, lossless speed options)
CASES = {
    "flux": (dict(guidance_scale=4.5), dict(guidance_scale=4.5), IMAGE,
             DiffusionSpeed(attention={"dit": "FLEX_ATTN", "text_encoder": "MATH_ATTN"}, compile=True,
                            compile_backend="eager", offload="layerwise", merge_projections=True,
                            step_constants=True, fuse_gelu=True)),
    "qwen-image": (dict(true_cfg_scale=3.0, negative_prompt="blurry"), dict(true_cfg_scale=3.0), IMAGE,
                   DiffusionSpeed(attention={"dit": "FLEX_ATTN", "text_encoder": "MATH_ATTN"}, offload="model",
                                  merge_projections=True)),
    "sd3": (dict(guidance_scale=5.0, negative_prompt="blurry"), dict(guidance_scale=5.0), IMAGE,
            DiffusionSpeed(attention={"dit": "MATH_ATTN", "text_encoder": "EFFICIENT_ATTN"}, offload="layerwise",
                           merge_projections=True)),
    "z-image": (dict(guidance_scale=4.0, negative_prompt="blurry"), dict(guidance_scale=4.0), IMAGE,
                DiffusionSpeed(attention={"dit": "FLEX_ATTN", "text_encoder": "MATH_ATTN"}, offload="layerwise",
                               merge_projections=True)),
    "wan2.2": (dict(guidance_scale=4.0, negative_prompt="blurry", output_type="np"), dict(guidance_scale=4.0), VIDEO,
               DiffusionSpeed(attention={"dit": "FLEX_ATTN", "text_encoder": "MATH_ATTN"}, offload="layerwise",
                              merge_projections=True, step_constants=True, fuse_gelu=True)),
}


def _pixels(out):
    return out.video.frames if out.video is not None else out.images[0]


def _run(tiny_dir, kind: str, speed: DiffusionSpeed, seed: int = 11, steps: int = 3):
    _, params_kw, size, _ = CASES[kind]
    eng = DiffusionEngine(tiny_dir(kind), diffusion_family(tiny_dir(kind)), CFG, speed=speed)
    inputs = {"prompt": "a red cube on a table", "negative_prompt": "blurry"}
    out = eng.generate({"r": (inputs, DiffusionParams(seed=seed, num_inference_steps=steps, **size, **params_kw))})["r"]
    assert out.error is None, out.error
    return eng, out


@pytest.mark.parametrize("kind", list(CASES))
def test_lossless_options_match_diffusers(tiny_dir, kind):
    pipe_kw, _, size, speed = CASES[kind]
    pipe = reference_pipe(tiny_dir(kind))
    ref = pipe(prompt="a red cube on a table", num_inference_steps=3,
               generator=torch.Generator("cpu").manual_seed(11), **size, **pipe_kw)
    ref = frames_uint8(ref.frames[0]) if "num_frames" in size else ref.images[0]
    eng, out = _run(tiny_dir, kind, speed)
    assert max_pixel_diff(_pixels(out), ref) <= 2
    shape = eng.family.attention_probe_shape()     # what "auto" attention would be measured on (CUDA)
    assert len(shape) == 4 and all(isinstance(n, int) and n > 0 for n in shape), shape
    acc = eng.accel
    parts = [m for d in eng.family.denoisers() for m in d.modules() if isinstance(m, merged_linear.LinearPart)]
    assert acc.merged_groups > 0 and len(parts) >= 2 * acc.merged_groups   # every declared group merged ...
    assert all(p.group._left == 0 and p.group._output is None for p in parts)   # ... and keeps nothing after
    if not speed.compile:                      # each group's members shared one GEMM per forward of its DiT
        per_dit = [{m.group.gemms for m in d.modules() if isinstance(m, merged_linear.LinearPart)}
                   for d in eng.family.denoisers()]          # (Wan2.2: each step runs one of two experts)
        assert all(len(g) == 1 for g in per_dit) and sum(g.pop() for g in per_dit) == eng.runner.num_forwards
    if speed.step_constants:                   # rotary tables: computed at the first step, reused after
        assert acc.constants.hits == eng.runner.num_forwards - len(acc.constants.outputs) > 0
    if speed.compile:
        assert acc.compiled_blocks == sum(len(getattr(acc_m, a)) for acc_m in [eng.family.transformer]
                                          for a in eng.family.repeated_blocks)
        assert acc.first_denoise_s is not None
    if speed.offload == "layerwise":           # blocks streamed through, at most two per DiT on the device
        assert acc.layerwise.loads >= len(acc.layerwise.copies) and acc.layerwise.peak_resident <= 2 * acc.layerwise.rings
    if speed.offload == "model":               # encoders and DiT took turns
        assert acc.model_offload.moves >= 2 and acc.model_offload.on == {"dit"}


@pytest.mark.parametrize("kind", ["flux", "wan2.2"])
def test_linear_gelu_equals_separate_ops_exactly(tiny_dir, kind):
    """fuse_gelu on the CPU runs the reference form of the one-GEMM op: the same ops as diffusers'
    modules, so the output is bit-identical; every tanh-GELU feed-forward is fused (FLUX's single-block
    MLP projection stays in its merged group), and the compiled path traces the custom op."""
    base = DiffusionSpeed(merge_projections=True)
    _, plain = _run(tiny_dir, kind, base, steps=2)
    speed = DiffusionSpeed(merge_projections=True, fuse_gelu=True, compile=kind == "flux", compile_backend="eager")
    eng, fused = _run(tiny_dir, kind, speed, steps=2)
    assert max_pixel_diff(_pixels(fused), _pixels(plain)) == 0
    mods = [m for d in eng.family.denoisers() for m in d.modules() if isinstance(m, linear_gelu.LinearGELU)]
    assert eng.accel.fused_gelus == len(mods) > 0
    if kind == "flux":
        double = eng.family.transformer.transformer_blocks[0]
        assert isinstance(double.ff.net[0], linear_gelu.LinearGELU) and "ff.net.0.proj.weight" in double.state_dict()
        assert len(eng.family.transformer.single_transformer_blocks[0].attn.to_q.group.bounds) == 4   # q|k|v|mlp
        assert eng.accel.compiled_blocks > 0


def test_step_graph_inputs_are_tensors_and_the_flag_is_cuda_only(tiny_dir):
    """FLUX declares its denoiser call as a function of tensors (what a CUDA graph replays,
    diffusion/step_graphs.py): `graph_inputs` holds only tensors and `denoise` is `denoise_inputs` of
    them; on the CPU `step_graphs` builds no graphs and the output stays the plain one."""
    base = DiffusionSpeed(merge_projections=True)
    _, plain = _run(tiny_dir, "flux", base, steps=2)
    eng, out = _run(tiny_dir, "flux", DiffusionSpeed(merge_projections=True, step_graphs=True), steps=2)
    assert eng.accel.graphs is None and eng.runner.graphs is None and eng.speed_info["step_graphs"] is False
    assert max_pixel_diff(_pixels(out), _pixels(plain)) == 0
    fam = eng.family
    task = fam.new_task("g", {"prompt": "a cube"}, DiffusionParams(seed=1, num_inference_steps=2, **IMAGE,
                                                                   guidance_scale=4.5))
    fam.encode([task])
    fam.prepare(task)
    x, t = fam.model_input(task), fam.model_timestep(task).reshape(1)
    inputs = fam.graph_inputs(x, t, [task.cond], [task])
    assert all(isinstance(v, torch.Tensor) for v in inputs.values()) and {"x", "t", "text", "pooled"} <= set(inputs)
    with torch.no_grad():
        assert torch.equal(fam.denoise_inputs(fam.key(task), inputs), fam.denoise(fam.key(task), x, t, [task.cond],
                                                                                  [task]))


def test_linear_gelu_op():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 8), torch.randn(12, 8), torch.randn(12)
    out = linear_gelu.linear_gelu_tanh(x, w, b)
    assert torch.equal(out, F.gelu(F.linear(x, w, b), approximate="tanh"))
    assert linear_gelu.linear_gelu_tanh(x.to("meta"), w.to("meta"), None).shape == (2, 5, 12)
    lin = torch.nn.Linear(8, 12)                # trainable weights, grad on: the differentiable ops
    y = linear_gelu.LinearGELU(lin)(x)
    assert torch.equal(y, F.gelu(lin(x), approximate="tanh")) and y.requires_grad
    with torch.no_grad():                       # inference: the one-GEMM op, compiled over symbolic shapes too
        compiled = torch.compile(linear_gelu.LinearGELU(lin), dynamic=True, backend="aot_eager")
        assert torch.equal(compiled(x), F.gelu(lin(x), approximate="tanh"))
    fp8 = linear_gelu.LinearGELU(fp8_linear.Fp8Linear.from_linear(torch.nn.Linear(8, 12)))   # FP8: layer, then GELU
    assert fp8(x.reshape(-1, 8).repeat(4, 1)).shape == (40, 12)
    assert not linear_gelu.epilogue_supports(x.reshape(-1, 8), w, b)        # CPU: the reference


_RESIDENT: dict = {}


def _resident(tiny_dir):
    """FLUX with no speed feature (seed 4, 2 steps), run once for the comparisons below."""
    if not _RESIDENT:
        _RESIDENT["out"] = _run(tiny_dir, "flux", DiffusionSpeed(), seed=4, steps=2)[1]
    return _RESIDENT["out"]


@pytest.mark.parametrize("offload", ["model", "layerwise"])
def test_offload_equals_resident_exactly(tiny_dir, offload):
    resident = _resident(tiny_dir)
    eng, out = _run(tiny_dir, "flux", DiffusionSpeed(offload=offload), seed=4, steps=2)
    assert max_pixel_diff(_pixels(out), _pixels(resident)) == 0
    if offload == "layerwise":                 # every block's weights live on the host between uses
        assert all(not c.resident for c in eng.accel.layerwise.copies[1:])


def test_sage_reference_close_to_sdpa():
    """8-bit attention vs exact SDPA on random heads: relative error (Frobenius) under 3 % in float32
    and bfloat16 (measured ~1 %); the router sends mask-free SDPA calls to it and masked ones past it."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 3, 150, 64, dtype=dtype) for _ in range(3))
        k = k + 2.0                            # an offset the smoothing of k removes
        exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        approx = quant_attention.reference(q, k, v)
        assert approx.dtype == dtype
        assert ((approx.float() - exact).norm() / exact.norm()).item() < 0.03
    q8, sq, k8, sk = quant_attention.quantize(q, k)
    assert q8.dtype == torch.int8 and sq.shape == (2, 3, 2) and sk.shape == (2, 3, 3)   # 128- and 64-token blocks
    with AttentionRouter("SAGE_ATTN", torch.device("cpu")):
        routed = F.scaled_dot_product_attention(q, k, v)
        mask = torch.ones(150, 150, dtype=torch.bool)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(routed, quant_attention.reference(q, k, v))
    assert torch.equal(masked, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_fp8_reference_path(tiny_dir):
    """FP8 W8A8 (reference form on CPU): a linear layer within 5 % relative error of float32, and the
    FLUX family with its DiT blocks quantized (projections merged first, so a merged group is one FP8
    GEMM; a group with an ignored member stays unmerged and bf16) within 8 pixel levels of the float32
    image (measured <= 2)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(5, 7, 64)
    q = fp8_linear.Fp8Linear.from_linear(linear)
    assert q.weight_fp8.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (48, 1)
    exact = linear(x)
    assert ((q(x) - exact).norm() / exact.norm()).item() < 0.05
    x8, xs = fp8_linear.quantize_rows(x.reshape(-1, 64).bfloat16())     # the CUDA path's scaled matmul
    qb = fp8_linear.Fp8Linear.from_linear(linear.bfloat16())
    fast = qb.scaled_mm(x8, xs, torch.bfloat16).float()
    ref = fp8_linear.reference(x8, xs, qb.weight_fp8, qb.weight_scale, qb.bias, torch.bfloat16).float()
    assert ((fast - ref).norm() / ref.norm()).item() < 1e-2
    full = _resident(tiny_dir)
    ignored = ("ff_context", "single_transformer_blocks.0.")      # a part of a name, or a whole block
    eng, out = _run(tiny_dir, "flux", DiffusionSpeed(quantization="fp8", ignored_layers=ignored, merge_projections=True),
                    seed=4, steps=2)
    blocks = [b for a in eng.family.repeated_blocks for b in getattr(eng.family.transformer, a)]
    names = [n for b in blocks for n, m in b.named_modules() if isinstance(m, fp8_linear.Fp8Linear)]
    assert eng.accel.fp8_layers == len(names) > 0 and not any("ff_context" in n for n in names)
    assert not any(isinstance(m, fp8_linear.Fp8Linear) for m in eng.family.transformer.single_transformer_blocks[0].modules())
    assert isinstance(eng.family.transformer.proj_out, torch.nn.Linear)      # outside the blocks: untouched
    dit = eng.family.transformer
    assert isinstance(dit.transformer_blocks[0].attn.to_k.group.proj, fp8_linear.Fp8Linear)   # q|k|v: one FP8 GEMM
    assert type(dit.single_transformer_blocks[0].proj_mlp) is torch.nn.Linear   # ignored: neither merged nor FP8
    assert max_pixel_diff(_pixels(out), _pixels(full)) <= 8


def test_speed_from_config():
    speed = DiffusionSpeed.from_config(EngineConfig(device="cpu", attention_backend="dit=sage", quantization="fp8",
                                                    ignored_layers="img_mlp,txt_mlp", enable_layerwise_offload=True))
    assert speed.attention == {"dit": "SAGE_ATTN", "text_encoder": "auto"}
    assert speed.ignored_layers == ("img_mlp", "txt_mlp") and speed.offload == "layerwise"
    assert speed.compile is False              # compile is a CUDA fast path
    assert speed.merge_projections is True     # lossless, on wherever the DiT runs in one process
    parallel = EngineConfig(device="cpu", parallel_config={"ulysses_degree": 2})
    assert DiffusionSpeed.from_config(parallel).merge_projections is False   # the plans name separate layers
    cuda = dict(device="cuda")                 # config only: nothing runs on the device
    assert DiffusionSpeed.from_config(EngineConfig(**cuda)).probe_attention is True
    assert DiffusionSpeed.from_config(EngineConfig(**cuda, parallel_config={"ulysses_degree": 2})).probe_attention \
        is False                               # a parallel DiT's ranks all keep the same kernel
    # step graphs: on for a CUDA DiT in one process, off eager, parallel or on the CPU
    assert DiffusionSpeed.from_config(EngineConfig(**cuda)).step_graphs is True
    assert DiffusionSpeed.from_config(EngineConfig(**cuda, enforce_eager=True)).step_graphs is False
    assert DiffusionSpeed.from_config(EngineConfig(**cuda, parallel_config={"ulysses_degree": 2})).step_graphs is False
    assert speed.step_graphs is False
    assert AttentionRouter("auto", torch.device("cpu")).name == "TORCH_SDPA"
    assert AttentionRouter("auto", torch.device("cuda")).name == "CUDNN_ATTN"


@pytest.mark.parametrize("kwargs, words", [
    (dict(attention_backend="fastest"), ["attention_backend", "SAGE_ATTN", "fastest"]),
    (dict(attention_backend="vae=sdpa"), ["attention_backend", "dit, text_encoder"]),
    (dict(quantization="int4"), ["quantization", "fp8"]),
    (dict(ignored_layers=("img_mlp",)), ["ignored_layers", "quantization"]),
    (dict(enable_cpu_offload=True, enable_layerwise_offload=True), ["enable_cpu_offload", "enable_layerwise_offload"]),
    (dict(diffusion_compile_mode="reduce-overhead"), ["diffusion_compile_mode", "max-autotune-no-cudagraphs"]),
])
def test_bad_speed_options_name_the_option(kwargs, words):
    with pytest.raises(ValueError) as err:
        EngineConfig(**kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_cli_flags_reach_the_engine_options():
    from omnistage.entrypoints.cli import build_parser
    from omnistage.entrypoints.common import engine_kwargs_from_args

    args = build_parser().parse_args(["serve", "m", "--attention-backend", "FLASH_ATTN", "--quantization", "fp8",
                                      "--ignored-layers", "img_mlp", "--enforce-eager", "--enable-cpu-offload"])
    kw = engine_kwargs_from_args(args)
    want = dict(attention_backend="FLASH_ATTN", quantization="fp8", ignored_layers="img_mlp",
                enforce_eager=True, enable_cpu_offload=True)
    assert {k: kw.get(k) for k in kw if k not in ("generation_config",)} == want   # generation_config has a default of its own ("auto")
    assert EngineConfig(**want).ignored_layers == ("img_mlp",)
    assert "enable_layerwise_offload" not in engine_kwargs_from_args(build_parser().parse_args(["serve", "m"]))


def test_compile_options_reach_the_speed_features():
    from omnistage.entrypoints.cli import build_parser
    from omnistage.entrypoints.common import engine_kwargs_from_args

    args = build_parser().parse_args(["serve", "m", "--diffusion-compile-mode", "max-autotune-no-cudagraphs",
                                      "--no-diffusion-compile-dynamic"])
    kw = {k: v for k, v in engine_kwargs_from_args(args).items() if k.startswith("diffusion_compile")}
    assert len(kw) == 2
    speed = DiffusionSpeed.from_config(EngineConfig(device="cpu", **kw))
    assert (speed.compile_mode, speed.compile_dynamic, speed.probe_attention) == ("max-autotune-no-cudagraphs",
                                                                                  False, False)   # probe: CUDA only


def test_attention_probe_choice():
    """The probe keeps the fastest backend that runs the shape (ties: PROBE_BACKENDS order), skips
    those that raise, and measures each shape once per process; on this CPU with the real timer, the
    SDPA kernels CPU torch lacks (cuDNN, efficient) are skipped and the choice is one that ran."""
    table = {"CUDNN_ATTN": None, "FLASH_ATTN": 3e-3, "EFFICIENT_ATTN": 1e-3, "FLEX_ATTN": 1e-3}
    calls = []

    def timer(name, q, k, v):
        calls.append(name)
        if table[name] is None:
            raise RuntimeError("no kernel for this shape")
        return table[name]
    shape = (1, 2, 40, 16)
    got = attention.probe(shape, torch.float32, torch.device("cpu"), attention.PROBE_BACKENDS, timer=timer)
    assert got.choice == "EFFICIENT_ATTN" and set(got.skipped) == {"CUDNN_ATTN"} and len(calls) == 4
    again = attention.probe(shape, torch.float32, torch.device("cpu"), attention.PROBE_BACKENDS, timer=timer)
    assert again is got and len(calls) == 4
    real = attention.probe((1, 2, 24, 16), torch.float32, torch.device("cpu"))
    assert {"CUDNN_ATTN", "EFFICIENT_ATTN"} <= set(real.skipped) and "FLASH_ATTN" in real.seconds
    assert "FLEX_ATTN" not in real.seconds                 # compiled on CUDA only: not a CPU candidate
    assert real.choice == min(real.seconds, key=real.seconds.get)


def test_attention_probe_at_load_is_lossless(tiny_dir):
    """probe_attention (on by default on CUDA) measures the DiT's shape at load, routes "auto" DiT
    attention to the winner, reports it in the stage's info, and the output stays the resident one."""
    eng, out = _run(tiny_dir, "flux", DiffusionSpeed(probe_attention=True), seed=4, steps=2)
    fam, probe = eng.family, eng.accel.attention_probe
    cfg, lim = fam.transformer.config, fam.limits()
    tokens = (lim.default_height // fam.multiple) * (lim.default_width // fam.multiple) + fam.joint_text_tokens
    assert probe.shape == (1, cfg.num_attention_heads, tokens, cfg.attention_head_dim)
    assert eng.accel.routers["dit"].name == probe.choice == eng.speed_info["attention"]["dit"]
    assert eng.speed_info["attention_probe"]["choice"] == probe.choice
    assert eng.accel.routers["text_encoder"].name == "TORCH_SDPA"      # encoders keep the device default
    assert max_pixel_diff(_pixels(out), _pixels(_resident(tiny_dir))) <= 2


def test_memory_plan_counts_what_offload_keeps_on_the_device(tiny_dir):
    import os

    from omnistage.pipeline.memory import offloaded_weight_bytes, weight_bytes
    from omnistage.spec import StageSpec

    path = tiny_dir("flux")
    size = {k: weight_bytes(os.path.join(path, k), None, torch.float32)
            for k in ("text_encoder", "text_encoder_2", "vae", "transformer")}

    def est(**kw):
        return offloaded_weight_bytes(StageSpec("dit", "diffusion", path, EngineConfig(device="cpu", **kw)),
                                      torch.float32)
    assert est(enable_cpu_offload=True) == size["vae"] + max(size["text_encoder"] + size["text_encoder_2"],
                                                             size["transformer"])
    layerwise = est(enable_layerwise_offload=True)
    assert size["vae"] + size["text_encoder"] + size["text_encoder_2"] < layerwise < sum(size.values()) + size["transformer"]


def test_options_flow_through_omni_and_the_deploy_config(tiny_dir):
    from omnistage.entrypoints.omni import Omni

    deploy = {"stages": {"dit": {"attention_backend": "dit=flex", "enforce_eager": True}}}
    with Omni(tiny_dir("flux"), device="cpu", dtype="float32", enable_layerwise_offload=True,
              deploy_config=deploy) as omni:
        accel = omni.orchestrator.stages["dit"].accel
        assert accel.layerwise is not None and accel.routers["dit"].name == "FLEX_ATTN"
        out = omni.generate({"prompt": "a red cube on a table", "negative_prompt": "blurry"},
                            DiffusionParams(seed=4, num_inference_steps=2, guidance_scale=4.5, **IMAGE),
                            use_tqdm=False)[0]
    assert max_pixel_diff(out.images[0], _pixels(_resident(tiny_dir))) <= 2
    with pytest.raises(ValueError, match="quantization must be one of"):
        Omni(tiny_dir("flux"), device="cpu", quantization="int3")


def test_step_batching_with_speed_features_on(tiny_dir):
    """Requests at different steps still share forwards with FP8, flex attention and layerwise offload
    on, and each equals its own run alone."""
    speed = DiffusionSpeed(attention={"dit": "FLEX_ATTN", "text_encoder": "auto"}, quantization="fp8",
                           offload="layerwise")
    eng = DiffusionEngine(tiny_dir("flux"), diffusion_family(tiny_dir("flux")), CFG, speed=speed)
    reqs = {rid: ({"prompt": p}, DiffusionParams(seed=s, num_inference_steps=n, guidance_scale=4.5, **IMAGE))
            for rid, p, s, n in [("a", "a red cube", 1, 2), ("b", "two green spheres", 2, 3)]}
    alone = {rid: eng.generate({rid: r})[rid] for rid, r in reqs.items()}
    eng.runner.max_batch_tasks = 0
    together = eng.generate(reqs)
    assert eng.runner.max_batch_tasks == 2
    for rid in reqs:
        assert max_pixel_diff(_pixels(together[rid]), _pixels(alone[rid])) <= 2, rid
