"""Host -> device uploads of small per-step arrays through persistent pinned memory (stage process).

In: a host list or numpy array (a step's ids, positions, slots, per-row sampling values) and the
device it goes to. Out: a tensor on that device, its copy queued without waiting (`non_blocking`).

A copy from pageable memory makes the host wait for the device's queued work, and
`torch.tensor(values, pin_memory=True)` pays a pinned allocation per call (~0.2 ms on an H200 host:
a talker step made 12 of them). Here each thread owns, per CUDA device and stream, one pinned ring allocated once
(`PinnedRing`): the values are written into it with numpy and copied from there. The ring is cut into
segments; leaving a segment records a CUDA event after its last queued copy, and a segment is written
again only once the event of its previous lap is done, so a copy never reads bytes the host has
rewritten. A lap takes many steps (a step uploads a few KB), so that wait is almost never a real one.
On the CPU the values become a tensor directly, as before (nothing to pin).
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np
import torch

SEGMENT_BYTES = 1 << 18                         # one ring segment (256 KiB); a larger upload is pinned on its own
SEGMENTS = 4                                    # segments per ring
ALIGN = 64                                      # every upload starts at a multiple of this many bytes

_NUMPY = {torch.long: np.int64, torch.int32: np.int32, torch.bool: np.bool_, torch.float32: np.float32,
          torch.float64: np.float64, torch.float16: np.float16, torch.uint8: np.uint8}


def host_array(values, dtype: Optional[torch.dtype]) -> tuple[np.ndarray, torch.dtype]:
    """(`values` as a numpy array, the torch dtype the device tensor gets). Without `dtype`, the dtype
    `torch.tensor(values)` would infer: bool, int64, or the default float dtype for floats."""
    if dtype is None:
        arr = np.asarray(values)
        if arr.dtype.kind == "b":
            dtype = torch.bool
        elif arr.dtype.kind in "iu":
            dtype = torch.long
        else:
            dtype = torch.get_default_dtype()
    np_dtype = _NUMPY.get(dtype, np.float32)    # others (bfloat16) go up as float32 and are cast on the device
    return np.ascontiguousarray(np.asarray(values, dtype=np_dtype)), dtype


class PinnedRing:
    """One thread's pinned staging memory for one device (see the module docstring)."""

    def __init__(self, device: torch.device, segment_bytes: int = SEGMENT_BYTES, segments: int = SEGMENTS):
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.empty(segment_bytes * segments, dtype=torch.uint8, pin_memory=self.pinned)
        self.bytes = self.host.numpy()
        self.segment_bytes = segment_bytes
        self.events: list = [None] * segments   # per segment: recorded after its last copy of the last lap
        self.segment = 0                        # the segment being written
        self.head = 0                           # next free byte (inside `segment`)

    def _take(self, nbytes: int) -> int:
        """The offset of `nbytes` free bytes, moving to the next segment when this one is full."""
        end = (self.segment + 1) * self.segment_bytes
        if self.head + nbytes > end:
            if self.pinned:
                self.events[self.segment] = torch.cuda.Event()
                self.events[self.segment].record()
            self.segment = (self.segment + 1) % len(self.events)
            self.head = self.segment * self.segment_bytes
            event = self.events[self.segment]
            if event is not None:
                event.synchronize()             # its copies of the last lap are done (long ago, as a rule)
                self.events[self.segment] = None
        at = self.head
        self.head += -(-nbytes // ALIGN) * ALIGN
        return at

    def buffer(self, count: int, np_dtype) -> tuple[np.ndarray, torch.Tensor]:
        """`count` elements of ring memory as (a numpy view to fill, the torch view to copy from);
        valid for copies queued before the ring's next lap. None when too big for a segment."""
        nbytes = count * np.dtype(np_dtype).itemsize
        if nbytes > self.segment_bytes:
            return None
        at = self._take(max(nbytes, 1))
        arr = self.bytes[at:at + nbytes].view(np_dtype)
        return arr, self.host[at:at + nbytes].view(torch.from_numpy(arr[:0]).dtype)

    def upload(self, arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """`arr` on the ring's device as `dtype`, copied from the ring without waiting."""
        staged = self.buffer(arr.size, arr.dtype)
        if staged is None:                      # rare: too big for a segment
            host = torch.from_numpy(arr)
            host = host.pin_memory() if self.pinned else host.clone()
            return host.to(self.device, non_blocking=True).to(dtype)
        flat, host = staged
        flat[:] = arr.reshape(-1)
        host = host.view(arr.shape)
        if not self.pinned:                     # a CPU "device": the caller gets its own memory
            return host.clone().to(dtype)
        return host.to(self.device, non_blocking=True).to(dtype)


_local = threading.local()


def ring_for(device: torch.device) -> PinnedRing:
    """The calling thread's ring for `device` and its current stream (made on first use): a ring's
    events are recorded on the stream its copies are queued on (the shared layout runs stages of one
    thread on streams of their own)."""
    rings = getattr(_local, "rings", None)
    if rings is None:
        rings = _local.rings = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    ring = rings.get(key)
    if ring is None:
        ring = rings[key] = PinnedRing(torch.device("cuda", index))
    return ring


def staged(device: torch.device, count: int, np_dtype) -> tuple[np.ndarray, torch.Tensor]:
    """`count` elements of host memory to fill (numpy view) and copy from (torch view): the thread's ring on
    CUDA (no copy waits for queued steps; a pinned allocation when too big for a segment), plain memory on
    a CPU device."""
    if device.type != "cuda":
        arr = np.empty(count, dtype=np_dtype)
        return arr, torch.from_numpy(arr)
    got = ring_for(device).buffer(count, np_dtype)
    if got is not None:
        return got
    host = torch.empty(count, dtype=torch.from_numpy(np.zeros(0, np_dtype)).dtype, pin_memory=True)
    return host.numpy(), host


def upload(values, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """`values` (a list, nested lists of one shape, or a numpy array) as a tensor on `device`."""
    if device.type != "cuda":
        if isinstance(values, np.ndarray):
            host = torch.from_numpy(values)
            return host if dtype is None else host.to(dtype)
        return torch.tensor(values, dtype=dtype)
    arr, dtype = host_array(values, dtype)
    return ring_for(device).upload(arr, dtype)
