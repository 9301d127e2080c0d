"""Pure solvers against diffusers' stateful schedulers: same sigma tables, same trajectories."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from omnistage.diffusion.solvers import make_schedule, mu_for, solver_step

FLOW_CONFIGS = [
    dict(shift=3.0),                                                        # SD3: static shift
    dict(shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),  # FLUX-dev: dynamic
    dict(shift=1.0, use_dynamic_shifting=True, time_shift_type="linear", shift_terminal=0.05),
]


def _trajectory(step_fn, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, generator=g)
    for i in range(steps):
        v = torch.sin(x * (i + 1)) + 0.1 * torch.randn(x.shape, generator=g)
        x = step_fn(i, x, v)
    return x


@pytest.mark.parametrize("cfg", FLOW_CONFIGS)
@pytest.mark.parametrize("with_sigmas", [False, True])
def test_flow_match_euler_matches_diffusers(cfg, with_sigmas):
    ref = FlowMatchEulerDiscreteScheduler(**cfg)
    n, seq = 5, 1024
    mu = mu_for(ref.config, seq) if cfg.get("use_dynamic_shifting") else None
    base = [1.0 - i / n for i in range(n)] if with_sigmas else None
    ref.set_timesteps(n, sigmas=base, mu=mu)
    ours = make_schedule(dict(ref.config, _class_name="FlowMatchEulerDiscreteScheduler"), n, mu=mu, sigmas=base)
    assert torch.equal(ours.sigmas, ref.sigmas) and torch.equal(ours.timesteps, ref.timesteps)
    a = _trajectory(lambda i, x, v: ref.step(v, ref.timesteps[i], x, return_dict=False)[0], n)
    b = _trajectory(lambda i, x, v: solver_step(x, v, ours, i, None)[0], n)
    assert torch.equal(a, b)


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_unipc_flow_matches_diffusers(steps):
    ref = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    ref.set_timesteps(steps)
    ours = make_schedule(dict(ref.config, _class_name="UniPCMultistepScheduler"), steps)
    assert torch.equal(ours.timesteps, ref.timesteps) and torch.allclose(ours.sigmas, ref.sigmas)
    state = {}

    def step(i, x, v):
        x_next, state["s"] = solver_step(x, v, ours, i, state.get("s"))
        return x_next

    a = _trajectory(lambda i, x, v: ref.step(v, ref.timesteps[i], x, return_dict=False)[0], steps)
    b = _trajectory(step, steps)
    assert torch.allclose(a, b, atol=1e-6)


def test_unsupported_scheduler_is_named():
    with pytest.raises(ValueError, match="DDIMScheduler"):
        make_schedule({"_class_name": "DDIMScheduler"}, 4)
