"""Where a batch-1 decode step's wall time goes beyond its kernels: measurements over an engine's captured
decode graph and a torch.profiler run of its steps (the benchmark's process, CUDA only; used by
q3_thinker_bench.py, any `AREngine` with CUDA graphs would do).

In: the engine's `CudaGraphs` (ar/cuda_graphs.py), a finished `torch.profiler.profile` over N engine
steps, and the engine's decode wall per step from a timed run. Out: a dict of milliseconds and a small
markdown table:
  (a) back-to-back `replay()` of the bs1 graph, no host work between (ar_bench.graph_step_ms);
  (b) the profiler's device activity per step: the sum of kernel durations and their count; the GPU's idle
      time between device events (kernels and copies) in gaps shorter than `SHORT_GAP_US` (kernel
      boundaries) and in longer ones (waits for the host);
  (c) the engine's wall per decode step (prefill excluded), measured by the caller;
  (d) host wall and CPU time of one `replay()` call with the GPU idle and with the same graph in flight;
  (e) self CPU time per step of the CUDA runtime calls that wait or launch (`SYNC_APIS`), from the
      profiler's CPU events.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ar_bench import graph_step_ms  # noqa: E402

SHORT_GAP_US = 10.0          # device gaps below this count as kernel boundaries, the rest as waits for the host
SYNC_APIS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaGraphLaunch")


def replay_host_ms(graphs, batch: int = 1, calls: int = 20) -> dict:
    """(a) and (d) for the `batch` graph at context 192 (graph_step_ms sets the static inputs and leaves them
    so: the KV it writes goes to the scratch slot). Host times are medians over `calls` launches."""
    out = {"replay_back_to_back_ms": graph_step_ms(graphs, [batch])[batch]}
    g = graphs.graphs[batch]
    for state in ("idle", "in_flight"):
        walls, cpus = [], []
        for _ in range(calls):
            torch.cuda.synchronize()
            if state == "in_flight":
                g.replay()                        # the same graph queued and running while the next is launched
            t, c = time.perf_counter(), time.thread_time()
            g.replay()
            walls.append(time.perf_counter() - t)
            cpus.append(time.thread_time() - c)
        torch.cuda.synchronize()
        out[f"replay_call_{state}_wall_ms"] = 1e3 * sorted(walls)[calls // 2]
        out[f"replay_call_{state}_cpu_ms"] = 1e3 * sorted(cpus)[calls // 2]
    return out


def profile_gap(prof, steps: int) -> dict:
    """(b) and (e) from a profile of `steps` engine steps (device events: kernels, memcpy, memset)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    kernels = [end - start for start, end, name in spans if not name.startswith(("Memcpy", "Memset"))]
    short = long = 0.0
    waits = 0
    reach = spans[0][1] if spans else 0.0
    for start, end, _ in spans[1:]:
        gap = start - reach
        if gap > 0:
            if gap < SHORT_GAP_US:
                short += gap
            else:
                long += gap
                waits += 1
        reach = max(reach, end)
    out = {"kernel_ms": sum(kernels) / 1e3 / steps, "kernels": len(kernels) / steps, "device_events": len(spans) / steps,
           "gap_short_ms": short / 1e3 / steps, "gap_long_ms": long / 1e3 / steps, "gap_long_count": waits / steps}
    averages = prof.key_averages()
    for api in SYNC_APIS:          # runtime names may carry a version suffix (cudaGraphLaunch_v10000)
        rows = [e for e in averages if e.key.startswith(api)]
        out[f"{api}_self_cpu_ms"] = sum(e.self_cpu_time_total for e in rows) / 1e3 / steps
        out[f"{api}_calls"] = sum(e.count for e in rows) / steps
    return out


def print_gap_table(gap: dict, steps: int) -> None:
    """The table, then the rule to read it by."""
    def ms(key: str) -> str:
        return f"{gap[key]:.3f}" if key in gap else "-"

    print(f"\nbs1 gap (served engine, batch 1; profile over {steps} steps)")
    print("| what | ms per step |")
    print("|---|---|")
    print(f"| (a) back-to-back replay() of the bs1 graph, wall | {ms('replay_back_to_back_ms')} |")
    print(f"| (b) profiler: sum of kernel durations ({gap.get('kernels', 0):.0f} kernels; "
          f"{gap.get('device_events', 0):.0f} device events with copies) | {ms('kernel_ms')} |")
    print(f"| (b) profiler: GPU idle in gaps < {SHORT_GAP_US:.0f} us (kernel boundaries) | {ms('gap_short_ms')} |")
    print(f"| (b) profiler: GPU idle in gaps >= {SHORT_GAP_US:.0f} us ({gap.get('gap_long_count', 0):.1f} per step) "
          f"| {ms('gap_long_ms')} |")
    print(f"| (c) engine wall per decode step, timed run (prefill excluded) | {ms('engine_decode_step_ms')} |")
    for state in ("idle", "in_flight"):
        print(f"| (d) one replay() call, GPU {state.replace('_', ' ')}: host wall / CPU time "
              f"| {ms(f'replay_call_{state}_wall_ms')} / {ms(f'replay_call_{state}_cpu_ms')} |")
    for api in SYNC_APIS:
        print(f"| (e) profiler: {api} self CPU ({gap.get(f'{api}_calls', 0):.2f} calls per step) "
              f"| {ms(f'{api}_self_cpu_ms')} |")
    print("Reading: (a) ~= (c): the gap is inside the graph (kernel boundaries); (c) >> (a): host-bound "
          "(then (d) and (e) say where the host waits).")
