"""What crosses a stage-process boundary: msgspec msgpack for control data, shared memory for arrays.

`encode(obj) -> bytes` / `decode(bytes) -> obj` carry plain data (str, int, float, bool, None, bytes,
lists, tuples as lists, str-keyed dicts), omnistage dataclasses (`SamplingParams`, `TTSInput`,
`RequestOutput`, `StageOutput`, ...; rebuilt by class path, only from the `omnistage` package) and
numpy arrays. An array of at least `SHM_MIN_BYTES` goes through a POSIX shared-memory segment: the
sender creates it and hands over ownership, the receiver copies it out and unlinks it; smaller
arrays travel inline. Runs in both the orchestrator's and the stage's process.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import msgspec
import numpy as np

SHM_MIN_BYTES = 64 * 1024                       # arrays this large go through shared memory
_TYPE, _ARRAY, _SHM = "__os_type__", "__os_array__", "__os_shm__"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def _to_wire(obj: Any) -> Any:
    if obj is None or isinstance(obj, (str, int, float, bool, bytes)):
        return obj
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        meta = {"dtype": arr.dtype.str, "shape": list(arr.shape)}
        if arr.nbytes < SHM_MIN_BYTES:
            return {_ARRAY: arr.tobytes(), **meta}
        from multiprocessing import resource_tracker, shared_memory

        shm = shared_memory.SharedMemory(create=True, size=arr.nbytes)
        np.ndarray(arr.shape, arr.dtype, buffer=shm.buf)[...] = arr
        resource_tracker.unregister(shm._name, "shared_memory")   # the receiver unlinks it
        name = shm.name
        shm.close()
        return {_SHM: name, **meta}
    if isinstance(obj, np.generic):
        return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        fields = {f.name: _to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {_TYPE: f"{cls.__module__}:{cls.__qualname__}", **fields}
    if isinstance(obj, dict):
        return {str(k): _to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_to_wire(v) for v in obj]
    raise TypeError(f"{type(obj).__name__} cannot cross a stage-process boundary")


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_from_wire(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _ARRAY in obj:
        return np.frombuffer(obj[_ARRAY], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"]).copy()
    if _SHM in obj:
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(name=obj[_SHM])
        try:
            return np.ndarray(obj["shape"], np.dtype(obj["dtype"]), buffer=shm.buf).copy()
        finally:
            shm.close()
            shm.unlink()
    if _TYPE in obj:
        module, name = obj[_TYPE].split(":")
        if module != "omnistage" and not module.startswith("omnistage."):
            raise ValueError(f"refusing to build {obj[_TYPE]} from a stage message")
        cls = getattr(importlib.import_module(module), name)
        fields = {k: _from_wire(v) for k, v in obj.items() if k != _TYPE}
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        inst = cls(**{k: v for k, v in fields.items() if k in init})
        for k, v in fields.items():
            if k not in init:
                object.__setattr__(inst, k, v)
        return inst
    return {k: _from_wire(v) for k, v in obj.items()}


def encode(obj: Any) -> bytes:
    return _encoder.encode(_to_wire(obj))


def decode(data: bytes) -> Any:
    return _from_wire(_decoder.decode(data))
