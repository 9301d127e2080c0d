"""Noise schedules and denoising solvers as pure functions (runs in the diffusion stage's process).

In: a diffusers scheduler config (the dict in `scheduler/scheduler_config.json`), a step count and,
for resolution-dependent shifting, `mu`; per step: the current sample, the model output, the task's
sigma table, its step index and its solver state. Out: a `Schedule` (sigmas with a trailing 0 and the
timesteps the model sees) and, per step, the next sample plus the next solver state.

Nothing here keeps state between calls: a task owns its `Schedule`, `step_index` and `solver_state`,
so one forward can serve tasks at different timesteps. The arithmetic follows diffusers'
`FlowMatchEulerDiscreteScheduler` and `UniPCMultistepScheduler` (flow prediction) operation by
operation, so a task reproduces the diffusers pipeline's latents for the same seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

FLOW_EULER = "FlowMatchEulerDiscreteScheduler"
UNIPC = "UniPCMultistepScheduler"
SUPPORTED_SCHEDULERS = (FLOW_EULER, UNIPC)


@dataclass
class Schedule:
    kind: str                                   # scheduler class name: FLOW_EULER or UNIPC
    sigmas: torch.Tensor                        # float32 [num_steps + 1], noise level per step, last is terminal
    timesteps: torch.Tensor                     # [num_steps], the value passed to the model (float32, int64 for UniPC)
    config: dict                                # the scheduler config the schedule was built from

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])


def calculate_shift(image_seq_len: int, base_seq_len: int = 256, max_seq_len: int = 4096,
                    base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """`mu` of the dynamic shift: linear in the number of image tokens (FLUX, Qwen-Image, Z-Image)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


def mu_for(config: dict, image_seq_len: int) -> float:
    return calculate_shift(image_seq_len, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", 1.15))


def _time_shift(config: dict, mu: float, t):
    if config.get("time_shift_type", "exponential") == "linear":
        return mu / (mu + (1 / t - 1) ** 1.0)
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)


def _stretch_to_terminal(t, terminal: float):
    one_minus_z = 1 - t
    scale = one_minus_z[-1] / (1 - terminal)
    return 1 - (one_minus_z / scale)


def _check_plain(config: dict) -> None:
    for name in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "stochastic_sampling",
                 "invert_sigmas"):
        if config.get(name):
            raise ValueError(f"scheduler option {name}=True is not supported by omnistage's solvers")


def flow_match_schedule(config: dict, num_steps: int, mu: Optional[float] = None,
                        sigmas: Optional[list[float]] = None) -> Schedule:
    """FlowMatchEulerDiscreteScheduler.set_timesteps: optional base `sigmas`, then static or dynamic shift."""
    _check_plain(config)
    n_train = config.get("num_train_timesteps", 1000)
    shift = config.get("shift", 1.0)
    dynamic = config.get("use_dynamic_shifting", False)
    if dynamic and mu is None:
        raise ValueError("this model's scheduler shifts by resolution: mu is required")
    if sigmas is None:
        # The init-time table (already shifted when the shift is static) gives the end points.
        train = torch.from_numpy(np.linspace(1, n_train, n_train, dtype=np.float32)[::-1].copy()) / n_train
        if not dynamic:
            train = shift * train / (1 + (shift - 1) * train)
        base = np.linspace(train[0].item() * n_train, train[-1].item() * n_train, num_steps) / n_train
    else:
        base = np.array(sigmas).astype(np.float32)
    if dynamic:
        base = _time_shift(config, mu, base)
    else:
        base = shift * base / (1 + (shift - 1) * base)
    if config.get("shift_terminal"):
        base = _stretch_to_terminal(base, config["shift_terminal"])
    sig = torch.from_numpy(np.asarray(base)).to(torch.float32)
    timesteps = sig * n_train
    return Schedule(FLOW_EULER, torch.cat([sig, torch.zeros(1)]), timesteps, dict(config))


def flow_match_euler_step(x: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float) -> torch.Tensor:
    """x_{next} = x + (sigma_next - sigma) * v, in float32, returned in v's dtype (diffusers' order of ops)."""
    dt = sigma_next - sigma
    return (x.to(torch.float32) + dt * v).to(v.dtype)


def unipc_schedule(config: dict, num_steps: int, mu: Optional[float] = None) -> Schedule:
    """UniPCMultistepScheduler.set_timesteps with `use_flow_sigmas` (Wan's default)."""
    if not config.get("use_flow_sigmas") or config.get("prediction_type") != "flow_prediction":
        raise ValueError("UniPCMultistepScheduler is supported with use_flow_sigmas and flow_prediction only")
    _check_plain(config)
    n_train = config.get("num_train_timesteps", 1000)
    base = np.linspace(1, 1 / n_train, num_steps + 1)[:-1]
    if config.get("use_dynamic_shifting"):
        if mu is None:
            raise ValueError("this model's scheduler shifts by resolution: mu is required")
        base = _time_shift(config, mu, base)
    else:
        fs = config.get("flow_shift", 1.0)
        base = fs * base / (1 + (fs - 1) * base)
    if config.get("shift_terminal"):
        base = _stretch_to_terminal(base, config["shift_terminal"])
    if np.fabs(base[0] - 1) < 1e-6:
        base[0] -= 1e-6
    timesteps = (base * n_train).copy()
    last = base[-1] if config.get("final_sigmas_type", "zero") == "sigma_min" else 0
    sig = np.concatenate([base, [last]]).astype(np.float32)
    return Schedule(UNIPC, torch.from_numpy(sig), torch.from_numpy(timesteps).to(torch.int64), dict(config))


def make_schedule(config: dict, num_steps: int, mu: Optional[float] = None,
                  sigmas: Optional[list[float]] = None) -> Schedule:
    kind = config.get("_class_name", FLOW_EULER)
    if kind == FLOW_EULER:
        return flow_match_schedule(config, num_steps, mu, sigmas)
    if kind == UNIPC:
        return unipc_schedule(config, num_steps, mu)
    raise ValueError(f"scheduler {kind!r} is not supported; supported: {', '.join(SUPPORTED_SCHEDULERS)}")


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    return torch.log(1 - sigma) - torch.log(sigma)


def _unipc_coeffs(hh: torch.Tensor, order: int, rks: torch.Tensor, bh2: bool):
    h_phi_1 = torch.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    B_h = torch.expm1(hh) if bh2 else hh
    R, b, fact = [], [], 1
    for i in range(1, order + 1):
        R.append(torch.pow(rks, i - 1))
        b.append(h_phi_k * fact / B_h)
        fact *= i + 1
        h_phi_k = h_phi_k / hh - 1 / fact
    return h_phi_1, B_h, torch.stack(R), torch.stack(b)


def _unipc_update(x: torch.Tensor, outputs: list, sigmas: torch.Tensor, t_idx: int, s_idx: int, order: int,
                  bh2: bool, model_t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One UniPC predictor (model_t None: from s_idx to t_idx) or corrector (model_t: the new x0 estimate)."""
    sigma_t, sigma_s0 = sigmas[t_idx], sigmas[s_idx]
    alpha_t = 1 - sigma_t
    h = _lambda(sigma_t) - _lambda(sigma_s0)
    m0 = outputs[-1]
    rks, D1s = [], []
    for i in range(1, order):
        si = s_idx - i
        rk = (_lambda(sigmas[si]) - _lambda(sigma_s0)) / h
        rks.append(rk)
        D1s.append((outputs[-(i + 1)] - m0) / rk)
    rks.append(torch.ones(()))
    hh = -h
    h_phi_1, B_h, R, b = _unipc_coeffs(hh, order, torch.stack(rks), bh2)
    D1 = torch.stack(D1s, dim=1) if D1s else None
    x_t_ = sigma_t / sigma_s0 * x - alpha_t * h_phi_1 * m0
    if model_t is None:  # predictor
        if D1 is None:
            return x_t_.to(x.dtype)
        rhos = torch.full((1,), 0.5) if order == 2 else torch.linalg.solve(R[:-1, :-1], b[:-1])
        res = torch.einsum("k,bkc...->bc...", rhos.to(x.device, x.dtype, non_blocking=True), D1)
        return (x_t_ - alpha_t * B_h * res).to(x.dtype)
    # non_blocking: the host -> device copy of the coefficients does not wait for the queued GPU work
    rhos = (torch.full((1,), 0.5) if order == 1 else torch.linalg.solve(R, b)).to(x.device, x.dtype, non_blocking=True)
    corr = torch.einsum("k,bkc...->bc...", rhos[:-1], D1) if D1 is not None else 0
    return (x_t_ - alpha_t * B_h * (corr + rhos[-1] * (model_t - m0))).to(x.dtype)


def unipc_step(x: torch.Tensor, v: torch.Tensor, schedule: Schedule, step_index: int,
               state: Optional[dict]) -> tuple[torch.Tensor, dict]:
    """One UniPC-bh (flow prediction, x0-predicting) step; returns (x_next, new state). `state` is never mutated."""
    cfg = schedule.config
    order_max = cfg.get("solver_order", 2)
    bh2 = cfg.get("solver_type", "bh2") == "bh2"
    if cfg.get("solver_p") or not cfg.get("predict_x0", True) or cfg.get("thresholding"):
        raise ValueError("UniPC with solver_p, predict_x0=False or thresholding is not supported")
    state = state or {"outputs": [None] * order_max, "last_sample": None, "order": 0, "lower_order_nums": 0}
    sigmas = schedule.sigmas
    x0 = x - sigmas[step_index] * v
    use_corrector = (step_index > 0 and (step_index - 1) not in cfg.get("disable_corrector", [])
                     and state["last_sample"] is not None)
    if use_corrector:
        x = _unipc_update(state["last_sample"], state["outputs"], sigmas, step_index, step_index - 1,
                          state["order"], bh2, model_t=x0)
    outputs = state["outputs"][1:] + [x0]
    n = schedule.num_steps
    order = min(order_max, n - step_index) if cfg.get("lower_order_final", True) else order_max
    order = min(order, state["lower_order_nums"] + 1)
    x_next = _unipc_update(x, outputs, sigmas, step_index + 1, step_index, order, bh2)
    new_state = {"outputs": outputs, "last_sample": x, "order": order,
                 "lower_order_nums": min(state["lower_order_nums"] + 1, order_max)}
    return x_next, new_state


def solver_step(x: torch.Tensor, v: torch.Tensor, schedule: Schedule, step_index: int,
                state: Any) -> tuple[torch.Tensor, Any]:
    """Advance one step with the schedule's solver: (x, model output) -> (x_next, next solver state)."""
    if schedule.kind == UNIPC:
        return unipc_step(x, v, schedule, step_index, state)
    s = schedule.sigmas
    return flow_match_euler_step(x, v, s[step_index], s[step_index + 1]), state
