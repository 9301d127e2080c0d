"""CPU offload of a diffusion stage's weights (stage process; device-generic, knows no model names).

In: modules and the compute device. Weights are inference-only, so each parameter / buffer keeps
one host copy (pinned when the device is CUDA) for its lifetime: putting a module on the device is
one copy per tensor (`tensor.data = host.to(device)`), taking it off is dropping the device copy
(`tensor.data = host`), never a copy back. The tensors keep their identity, so hooks, compiled
blocks and optimisers that hold them see the same objects. On a CPU device both moves are no-ops
that still run (the tests' path); outputs equal resident ones exactly either way.

  ModelOffload (`enable_cpu_offload`)      whole components by role; `use(roles)` puts those roles
      on the device and every other offloaded role off (the engine calls it before each phase:
      encode -> text encoders, denoise -> DiT). The VAE, small beside either, stays resident, so
      that decoding a finished request does not push the DiT out while others still denoise.
  LayerwiseOffload (`enable_layerwise_offload`)   a DiT's repeated blocks stay on the host; a
      forward pre-hook makes block i resident (waiting for its prefetch) and starts copying block
      i + 1 (the last one prefetches the first) on a side CUDA stream, a forward hook drops block i
      after it ran: at most two blocks of each DiT on the device. The DiT's other weights stay resident.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn


class _HostCopy:
    """One module's tensors with their host copies; `load` / `drop` move them (see module doc)."""

    def __init__(self, module: nn.Module, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in list(module.parameters(recurse=True)) + list(module.buffers(recurse=True)):
            host = t.data.to("cpu")
            if pin and not host.is_pinned():
                host = host.pin_memory()
            t.data = host
            self.tensors.append((t, host))
        self.ready: Optional[torch.cuda.Event] = None     # set while a prefetch is in flight
        self.resident = False                              # device copies in place (or being copied)

    def load(self, stream: Optional["torch.cuda.Stream"] = None) -> None:
        """Device copies of every tensor (on `stream` when given: call `wait` before use)."""
        self.resident = True
        if stream is None:
            for t, host in self.tensors:
                t.data = host.to(self.device, non_blocking=True)
            return
        with torch.cuda.stream(stream):
            for t, host in self.tensors:
                t.data = host.to(self.device, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def wait(self) -> None:
        """Make the compute stream wait for a prefetch, and tell the allocator who uses its memory."""
        if self.ready is None:
            return
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.ready)
        for t, _ in self.tensors:
            t.data.record_stream(current)
        self.ready = None

    def drop(self) -> None:
        for t, host in self.tensors:
            t.data = host
        self.resident = False


class ModelOffload:
    """Components by role take turns on the device."""

    def __init__(self, roles: dict[str, list[nn.Module]], device: torch.device):
        self.copies = {role: [_HostCopy(m, device) for m in mods] for role, mods in roles.items()}
        self.on: set[str] = set()              # roles on the device now
        self.moves = 0                         # components put on the device so far (tests count them)

    def use(self, roles: Iterable[str]) -> None:
        want = {r for r in roles if r in self.copies}
        if not want:                           # a resident role's phase (the VAE): nothing moves
            return
        for role in self.on - want:
            for c in self.copies[role]:
                c.drop()
        for role in want - self.on:
            for c in self.copies[role]:
                c.load()
                self.moves += 1
        self.on = want


class LayerwiseOffload:
    """Blocks of one or more DiTs stream through the device, one ahead (see module doc)."""

    def __init__(self, groups: list[list[nn.Module]], device: torch.device):
        """`groups`: the repeated blocks of each DiT in forward order (each DiT is its own ring)."""
        self.device = device
        self.copies: list[_HostCopy] = []
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.loads = 0                         # block loads so far (tests count them)
        self.peak_resident = 0                 # most blocks on the device at once
        self.rings = len(groups)               # DiTs streamed (each holds at most two blocks)
        for blocks in groups:
            first = len(self.copies)
            self.copies += [_HostCopy(b, device) for b in blocks]
            for j, block in enumerate(blocks):
                block.register_forward_pre_hook(self._pre_hook(first + j, first + (j + 1) % len(blocks)))
                block.register_forward_hook(self._post_hook(first + j))

    def _pre_hook(self, i: int, nxt: int):
        def hook(module, args):
            copy = self.copies[i]
            if copy.ready is None and not copy.resident:     # not prefetched (first block of a forward)
                copy.load()
                self.loads += 1
            copy.wait()
            if nxt != i and not self.copies[nxt].resident and self.copies[nxt].ready is None:
                self.copies[nxt].load(self.stream)
                self.loads += 1
            self.peak_resident = max(self.peak_resident, sum(c.resident for c in self.copies))
        return hook

    def _post_hook(self, i: int):
        def hook(module, args, output):
            self.copies[i].drop()
        return hook
