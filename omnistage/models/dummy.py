"""`load_format="dummy"`: random weights of a checkpoint's shapes, no weight file read (any process that loads weights).

In: a model folder with its config files (config.json, tokenizer, processor; the safetensors may be
absent), marked dummy in this process by `use_dummy_weights(folder)` (pipeline/build.py does it in the
orchestrator's process and in every stage's, from `EngineConfig.load_format`).
Out, for a marked folder:
  * `init_dummy_(module)`: a native module's parameters drawn in place on their device and dtype
    (the AR decoders: thinker, talker, plain LLMs -- the bulk of the bytes never crosses the host);
  * `checkpoint_shapes(folder)`: checkpoint tensor name -> (shape, dtype), from transformers' class of
    the folder (config.json `architectures[0]`) built on the meta device, names as `save_pretrained`
    writes them (transformers' own reverse conversion), so every reader of checkpoint names (encoders,
    code predictor, code2wav, edge adapters, the memory planner) finds what a real folder holds;
  * `draw(name, shape)`: the float32 CPU tensor of one checkpoint name (the same at every draw).
How values are drawn (as transformers' `_init_weights` does, so activations stay in range): biases and
norm shifts 0, norm scales 1, everything else (routers included) normal with std 0.02; each tensor
from its own generator seeded by `DUMMY_SEED` and its name (the same weights at every start).
"""

from __future__ import annotations

import functools
import os
import zlib

import torch

DUMMY_SEED = 0                                  # fixed: a dummy model is the same at every start
DUMMY_STD = 0.02                                # transformers' `initializer_range` default
_DUMMY_FOLDERS: set[str] = set()                # real paths of folders whose weights are drawn (this process)


def use_dummy_weights(model_dir: str) -> None:
    """Mark `model_dir`'s weights as drawn, not read, in this process."""
    _DUMMY_FOLDERS.add(os.path.realpath(model_dir))


def is_dummy(model_dir: str) -> bool:
    return os.path.realpath(model_dir) in _DUMMY_FOLDERS


def marked_loader(loader, model_dir: str, *args):
    """An AR loader (`ar.engine.ModelLoader`) that marks `model_dir` first: wrapped with functools.partial,
    it carries the mark into the processes of tensor-parallel ranks, which call the loader themselves."""
    use_dummy_weights(model_dir)
    return loader(model_dir, *args)


def _kind(name: str, ndim: int) -> str:
    """"zeros" | "ones" | "normal": what a tensor of this name and rank starts as."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("bias", "running_mean", "num_batches_tracked"):
        return "zeros"
    normed = any(part in name.lower() for part in ("norm", "ln_", "layernorm"))
    if leaf == "running_var" or (ndim == 1 and normed and leaf == "weight"):
        return "ones"
    return "normal"


def _seed(name: str) -> int:
    return (DUMMY_SEED * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF


def _fill_(t: torch.Tensor, name: str) -> torch.Tensor:
    kind = _kind(name, t.ndim)
    if kind == "zeros" or not t.is_floating_point():
        return t.zero_()
    if kind == "ones":
        return t.fill_(1.0)
    gen = torch.Generator(device=t.device).manual_seed(_seed(name))
    return t.normal_(0.0, DUMMY_STD, generator=gen)


@torch.no_grad()
def init_dummy_(module: torch.nn.Module) -> torch.nn.Module:
    """Every parameter of `module` drawn in place (see the module docstring); buffers are left as built."""
    for name, p in module.named_parameters():
        _fill_(p.data, name)
    return module


def draw(name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dummy tensor of checkpoint name `name` (float32 for floating dtypes), on the CPU."""
    out = torch.empty(shape, dtype=torch.float32 if dtype.is_floating_point else dtype)
    return _fill_(out, name)


@functools.lru_cache(maxsize=4)
def checkpoint_shapes(model_dir: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Checkpoint name -> (shape, stored dtype) of the folder's transformers model (see the module docstring)."""
    import transformers
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion

    config = AutoConfig.from_pretrained(model_dir)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise ValueError(f"load_format='dummy' needs transformers' class of {model_dir} (config.json "
                         f"architectures[0] = {arch!r}) to know the checkpoint's shapes")
    with torch.device("meta"):
        model = cls._from_config(config)
    state = revert_weight_conversion(model, model.state_dict())
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return {name: (tuple(t.shape), dtype if t.is_floating_point() else t.dtype) for name, t in state.items()}
