"""What crosses a stage-process boundary: msgspec msgpack for control data, shared memory for arrays.

`encode(obj) -> bytes` / `decode(bytes) -> obj` carry plain data (str, int, float, bool, None, bytes,
lists, tuples as lists, str-keyed dicts), omnistage dataclasses (`SamplingParams`, `TTSInput`,
`RequestOutput`, `StageOutput`, the messages of `pipeline.stage_messages`, ...; rebuilt by class
path, only from the `omnistage` package; a field still at its plain or empty-list / dict default
is left out and made again by the class's `__init__`), numpy arrays, torch tensors and PIL images (a diffusion
stage's input and output images; video frames are arrays). Runs in both the orchestrator's and the
stage's process.

* An array (or CPU tensor) of at least `SHM_MIN_BYTES` goes through a POSIX shared-memory segment:
  the sender creates it and hands over ownership, the receiver copies it out and unlinks it;
  smaller ones travel inline in the message.
* A CUDA tensor of at least `CUDA_IPC_MIN_BYTES` goes by CUDA IPC (torch's handle, ref counter and
  event): the receiver maps the sender's memory, copies it into its own allocation on the same
  device and drops the mapping, so the sender's block is free again as soon as the copy is done.
* A smaller CUDA tensor (a hidden-state row per token: kilobytes, where opening an IPC handle costs
  more than the copy) is staged through pinned host memory -- all of a message's with one
  synchronisation -- and put back on its device by the receiver.

* `encode(obj, inline=True)` (a stage process on another host: `pipeline/launch.py`) carries every
  array inline in the message and stages CUDA tensors through host memory: no shared memory and no
  CUDA IPC, which do not cross hosts. A stage process started that way makes it its default
  (`set_inline_default`).

* A PIL image travels as its mode, size, raw pixel bytes (an array, so shared memory when large)
  and palette, and is rebuilt with `Image.frombytes`: the same pixels in the same mode.

A tensor arrives with the dtype, shape and device it left with (bfloat16 included).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any, Optional

import msgspec
import numpy as np

SHM_MIN_BYTES = 64 * 1024                       # arrays this large go through shared memory
CUDA_IPC_MIN_BYTES = 1 << 20                    # CUDA tensors this large go by CUDA IPC
_TYPE, _ARRAY, _SHM, _TENSOR, _CUDA_IPC = "__os_type__", "__os_array__", "__os_shm__", "__os_tensor__", "__os_ipc__"
_IMAGE = "__os_image__"
_PLAIN = frozenset({int, float, str, bool, bytes, type(None)})   # exact types msgpack encodes unchanged

_inline_default = False                         # `encode`'s `inline` when not given (`set_inline_default`)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def _array_to_wire(arr: np.ndarray, inline: bool = False) -> dict:
    arr = np.ascontiguousarray(arr)
    meta = {"dtype": arr.dtype.str, "shape": list(arr.shape)}
    if arr.nbytes < SHM_MIN_BYTES or inline:
        return {_ARRAY: arr.tobytes(), **meta}
    from multiprocessing import resource_tracker, shared_memory

    shm = shared_memory.SharedMemory(create=True, size=arr.nbytes)
    np.ndarray(arr.shape, arr.dtype, buffer=shm.buf)[...] = arr
    resource_tracker.unregister(shm._name, "shared_memory")   # the receiver unlinks it
    name = shm.name
    shm.close()
    return {_SHM: name, **meta}


def _torch():
    import torch

    return torch


def _host_bytes(t) -> np.ndarray:
    """A CPU tensor's bytes as a uint8 array (any dtype, bfloat16 included)."""
    return t.contiguous().reshape(-1).view(_torch().uint8).numpy()


def _tensor_to_wire(t, pending: list, inline: bool) -> dict:
    t = t.detach()
    meta = {_TENSOR: str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "device": str(t.device)}
    if t.device.type == "cuda" and t.numel() * t.element_size() >= CUDA_IPC_MIN_BYTES and not inline:
        from torch.multiprocessing.reductions import reduce_tensor

        t = t.contiguous()
        (_, size, stride, offset, _, _, device, handle, storage_bytes, storage_offset, _, ref_handle,
         ref_offset, event, event_sync) = reduce_tensor(t)[1]
        return {**meta, _CUDA_IPC: [list(stride), offset, device, handle, storage_bytes, storage_offset,
                                    ref_handle, ref_offset, event, event_sync]}
    if t.device.type == "cuda":               # copied after every copy of the message is queued
        host = t.contiguous().to("cpu", non_blocking=True)
        pending.append((meta, host))
        return meta
    return {**meta, "data": _array_to_wire(_host_bytes(t.cpu()), inline)}


def _image_to_wire(image, inline: bool) -> dict:
    """A PIL image as its mode, size, raw pixel bytes (a uint8 array: shared memory when large),
    palette and transparency; `Image.frombytes` rebuilds it exactly in every mode."""
    palette = None
    if image.mode in ("P", "PA") and image.palette is not None:
        palette = [image.palette.mode, bytes(image.getpalette(rawmode=image.palette.mode) or b"")]
    transparency = image.info.get("transparency")
    return {_IMAGE: image.mode, "size": list(image.size), "palette": palette,
            "transparency": transparency if isinstance(transparency, (int, bytes, tuple)) else None,
            "data": _array_to_wire(np.frombuffer(image.tobytes(), dtype=np.uint8), inline)}


def _image_from_wire(obj: dict):
    from PIL import Image

    image = Image.frombytes(obj[_IMAGE], tuple(obj["size"]), _from_wire(obj["data"]).tobytes())
    if obj.get("palette"):
        mode, palette = obj["palette"]
        image.putpalette(palette, rawmode=mode)
    if obj.get("transparency") is not None:
        value = obj["transparency"]
        image.info["transparency"] = tuple(value) if isinstance(value, list) else value
    return image


_EMPTY = object()                               # a field whose default is an empty list / dict (default_factory)
# class -> (its path, per field (name, default or _EMPTY or _NO_DEFAULT)) or None
_SHAPES: dict[type, Optional[tuple[str, tuple[tuple[str, Any], ...]]]] = {}
_NO_DEFAULT = object()                          # a field that is always sent


def _default_of(f: dataclasses.Field) -> Any:
    """What a field may be left out of a message as: its plain default (None, a number, a string,
    a bool), `_EMPTY` for an empty list / dict factory, else `_NO_DEFAULT` (never left out; so are
    fields that `__init__` does not take: the receiver sets only those it gets)."""
    if not f.init:
        return _NO_DEFAULT
    if f.default is not dataclasses.MISSING and type(f.default) in _PLAIN:
        return f.default
    if f.default_factory in (list, dict):
        return _EMPTY
    return _NO_DEFAULT


def _dataclass_shape(cls: type) -> Optional[tuple[str, tuple[tuple[str, Any], ...]]]:
    """A dataclass's class path and fields (looked up once per class: an AR stage sends a few
    dataclasses per request per step); None for other classes."""
    try:
        return _SHAPES[cls]
    except KeyError:
        shape = None
        if dataclasses.is_dataclass(cls):
            shape = (f"{cls.__module__}:{cls.__qualname__}",
                     tuple((f.name, _default_of(f)) for f in dataclasses.fields(cls)))
        _SHAPES[cls] = shape
        return shape


def _to_wire(obj: Any, pending: list, inline: bool = False) -> Any:
    if obj is None or isinstance(obj, (str, int, float, bool, bytes)):
        return obj
    shape = _dataclass_shape(type(obj))
    if shape is not None:
        # fields still at their default are left out: the receiver's `__init__` makes them again
        # (most of an AR stage's per-step output is defaults)
        path, fields = shape
        wire = {_TYPE: path}
        for name, default in fields:
            value = getattr(obj, name)
            kind = type(value)
            if default is not _NO_DEFAULT and (
                    (kind is type(default) and value == default) if default is not _EMPTY
                    else (kind is list or kind is dict) and not value):
                continue
            wire[name] = value if kind in _PLAIN else _to_wire(value, pending, inline)
        return wire
    if isinstance(obj, np.ndarray):
        return _array_to_wire(obj, inline)
    if isinstance(obj, np.generic):
        return obj.item()
    torch = sys.modules.get("torch")            # a tensor exists only once torch is imported
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_to_wire(obj, pending, inline)
    pil = sys.modules.get("PIL.Image")          # likewise a PIL image
    if pil is not None and isinstance(obj, pil.Image):
        return _image_to_wire(obj, inline)
    if isinstance(obj, dict):
        return {str(k): v if type(v) in _PLAIN else _to_wire(v, pending, inline) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        if all(type(v) in _PLAIN for v in obj):     # ids, codes: msgpack takes them as they are
            return obj if isinstance(obj, list) else list(obj)
        if all(type(v) is list and all(type(u) in _PLAIN for u in v) for v in obj):   # frames of codes
            return obj if isinstance(obj, list) else list(obj)
        return [_to_wire(v, pending, inline) for v in obj]
    raise TypeError(f"{type(obj).__name__} cannot cross a stage-process boundary")


def _tensor_from_wire(obj: dict):
    torch = _torch()
    dtype, shape, device = getattr(torch, obj[_TENSOR]), obj["shape"], torch.device(obj["device"])
    if _CUDA_IPC in obj:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        (stride, offset, dev, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event,
         event_sync) = obj[_CUDA_IPC]
        mapped = rebuild_cuda_tensor(torch.Tensor, torch.Size(shape), tuple(stride), offset,
                                     torch.storage.TypedStorage, dtype, dev, handle, storage_bytes,
                                     storage_offset, False, ref_handle, ref_offset, event, event_sync)
        owned = mapped.clone()                  # our own memory; the mapping goes with `mapped`
        torch.cuda.current_stream(owned.device).synchronize()
        return owned
    raw = torch.from_numpy(_from_wire(obj["data"]))
    t = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
    return t.to(device) if device.type != "cpu" else t


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_from_wire(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return _tensor_from_wire(obj)
    if _IMAGE in obj:
        return _image_from_wire(obj)
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


def set_inline_default(inline: bool) -> None:
    """Makes `encode` carry arrays inline unless told otherwise (a stage process on another host)."""
    global _inline_default
    _inline_default = inline


def encode(obj: Any, inline: Optional[bool] = None) -> bytes:
    """`inline`: every array inside the message (None: `set_inline_default`'s choice, else False)."""
    inline = _inline_default if inline is None else inline
    pending: list = []
    wire = _to_wire(obj, pending, inline)
    if pending:                                 # one wait for all of the message's device -> host copies
        torch = _torch()
        for device in {meta["device"] for meta, _ in pending}:
            torch.cuda.current_stream(torch.device(device)).synchronize()
        for meta, host in pending:
            meta["data"] = _array_to_wire(_host_bytes(host), inline)
    return _encoder.encode(wire)


def fingerprint(obj: Any) -> bytes:
    """A digest of `obj`'s encoding with its arrays inline: a cache key that, unlike `encode`,
    creates no shared-memory segment (one nobody receives would never be unlinked)."""
    import hashlib

    return hashlib.sha256(_encoder.encode(_to_wire(obj, [], inline=True))).digest()


def decode(data: bytes) -> Any:
    return _from_wire(_decoder.decode(data))
