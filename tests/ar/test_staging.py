"""ar/staging.py: uploads through a ring of staging memory give what `torch.tensor` gives (values,
dtype, shape) across segment changes and laps of the ring. On the CPU the ring is not pinned and
each upload is cloned out of it, so a later write into the ring cannot change an earlier result;
on CUDA the same offsets are copied from pinned memory (benchmarks/tts_check_cuda.py runs there)."""

import numpy as np
import torch

from omnistage.ar.staging import PinnedRing, host_array


def test_dtype_inference_equals_torch_tensor():
    for values in ([True, False], [1, 2, 3], [0.5, 1.0], [], [[1, 2], [3, 4]], [1, 2.5]):
        arr, dtype = host_array(values, None)
        assert dtype == torch.tensor(values).dtype and arr.shape == torch.tensor(values).shape, values
    assert host_array([1, 2], torch.bfloat16)[0].dtype == np.float32   # no numpy bf16: cast on the device


def test_ring_uploads_equal_their_values_across_laps():
    ring = PinnedRing(torch.device("cpu"), segment_bytes=256, segments=2)
    g = np.random.default_rng(0)
    got, want, offsets = [], [], set()
    for i in range(60):                         # ~10 laps of the 512-byte ring
        n = int(g.integers(1, 30))
        values = g.integers(-5, 5, n).tolist() if i % 3 else (g.random(n) < 0.5).tolist()
        dtype = (torch.long, None, torch.float32)[i % 3]
        got.append(ring.upload(*host_array(values, dtype)))
        want.append(torch.tensor(values, dtype=dtype))
        offsets.add(ring.head)
    assert ring.segment in (0, 1) and len(offsets) > 4
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    big = ring.upload(*host_array(list(range(100)), torch.long))   # larger than a segment: on its own
    assert torch.equal(big, torch.arange(100))
