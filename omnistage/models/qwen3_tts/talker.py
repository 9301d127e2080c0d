"""Qwen3-TTS' talker and code predictor as one AR-stage component (the talker stage's process).

Registered as component "qwen3_tts.talker" (`models/registry.py`); `load_talker(model_dir, device,
dtype, max_positions)` follows the AR loader contract and returns `(Qwen3TTSTalker, config, None,
{codec eos})`:

  * the talker: a Qwen3 decoder (`talker.model.*`) over codec group 0 -- our native
    `Qwen3ForCausalLM` with `embed_tokens` = the codec embedding and `lm_head` = `codec_head`, so
    the AR engine gives it paged KV, continuous batching and CUDA graphs. Its multimodal rope gets
    equal positions in all three sections for speech, which is plain 1-D rope;
  * `frame_head`: the code predictor (`CodePredictor`'s weights run by `predictor.FramePredictor`),
    run by the AR runner right after each step's sampling for every sampled row at once: from the
    row's last hidden state and its group-0 code it predicts codebooks 1..G-1 (G-1 small AR steps
    over a KV buffer made fresh for that frame, so nothing is kept or shared between requests or
    frames; one CUDA graph per batch bucket on the GPU) and returns the row its next position adds
    (the sum of their embeddings);
  * `compute_logits`: the codec head's logits with the top 1024 ids but eos masked (the
    reference's suppressed tokens);
  * `make_request`: text + `TTSParams` -> the AR request (`prompt.py`, with the talker's text
    embedding and projection, which live here, on the talker's device); for Base the reference
    voice is encoded here too (`reference.py`: speech-tokenizer encoder + speaker encoder).
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

from omnistage.codec.speech import TTSParams, TTSInput
from omnistage.models.llama import Qwen3ForCausalLM
from omnistage.models.loader import safetensors_files
from omnistage.models.qwen3_tts.predictor import FramePredictor
from omnistage.models.qwen3_tts.prompt import PromptBuilder, TTSConfig
from omnistage.models.qwen3_tts.reference import ReferenceEncoder

TALKER = "qwen3_tts.talker"


def read_tensors(model_dir: str, prefix: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors under `prefix`, the prefix dropped."""
    from safetensors import safe_open

    out = {}
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    out[name[len(prefix):]] = f.get_tensor(name)
    return out


def qwen3_config(cfg: dict, vocab_size: int, max_positions: int):
    """A transformers `Qwen3Config` of a Qwen3-TTS sub-config (talker or code predictor), 1-D rope."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=vocab_size, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                       num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
                       num_key_value_heads=cfg["num_key_value_heads"],
                       head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
                       rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=max_positions,
                       rope_parameters={"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000))},
                       tie_word_embeddings=False, hidden_act=cfg.get("hidden_act", "silu"),
                       architectures=["Qwen3ForCausalLM"])


class CodePredictor(nn.Module):
    """The code predictor's weights (checkpoint layout); `predictor.FramePredictor` runs them."""

    def __init__(self, cfg: dict, talker_hidden: int):
        from transformers import Qwen3Model

        super().__init__()
        groups = cfg["num_code_groups"]
        config = qwen3_config(cfg, 1, groups + 1)
        config._attn_implementation = "sdpa"
        self.model = Qwen3Model(config)         # its 1-row embed_tokens is unused: inputs are embeddings
        self.project = (nn.Linear(talker_hidden, cfg["hidden_size"]) if cfg["hidden_size"] != talker_hidden
                        else nn.Identity())
        self.embeds = nn.ModuleList(nn.Embedding(cfg["vocab_size"], talker_hidden) for _ in range(groups - 1))
        self.heads = nn.ModuleList(nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
                                   for _ in range(groups - 1))
        self.sampling: dict = {}                # generation_config.json's subtalker_{temperature,top_k,top_p} (by name)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        state = {}
        for name, tensor in tensors.items():
            if name.startswith("model.codec_embedding."):
                state["embeds." + name[len("model.codec_embedding."):]] = tensor
            elif name.startswith("lm_head."):
                state["heads." + name[len("lm_head."):]] = tensor
            elif name.startswith("small_to_mtp_projection."):
                state["project." + name[len("small_to_mtp_projection."):]] = tensor
            else:
                state[name] = tensor
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if m != "model.embed_tokens.weight"]
        if missing or unexpected:
            raise ValueError(f"code predictor weights: missing {missing[:5]}, unexpected {unexpected[:5]}")


class Qwen3TTSTalker(Qwen3ForCausalLM):
    """The talker decoder plus what the AR engine asks of a TTS talker (see the module docstring)."""

    params_type = TTSParams

    def attach(self, predictor: CodePredictor, prompts: PromptBuilder) -> None:
        self.frame_head = predictor
        self.prompts = prompts
        cfg = prompts.config
        # the top 1024 codec ids but eos are never sampled (the reference's suppress_tokens): masked
        # here, once per step on the device, rather than as 1023 bad_token_ids of every row
        mask = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=self.embed_tokens.weight.device)
        mask[cfg.vocab_size - 1024:] = True
        mask[cfg.eos] = False
        self.suppressed = mask

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden).masked_fill(self.suppressed, float("-inf"))

    def make_request(self, inputs, params: Optional[TTSParams]):
        """Text (a string, a `TTSInput` or {"prompt": text}) + TTSParams -> (ARPrompt, SamplingParams)."""
        if isinstance(inputs, dict):
            inputs = inputs.get("prompt", inputs.get("input"))
        if isinstance(inputs, TTSInput):
            inputs = " ".join(inputs.sentences)
        if not isinstance(inputs, str) or not inputs.strip():
            raise ValueError("a Qwen3-TTS request is the text to speak")
        return self.prompts.build(inputs, params)

    def check_params(self, params: Optional[TTSParams]) -> None:
        self.prompts.config.check(params)

    def voices(self) -> list[dict]:
        cfg = self.prompts.config
        # any_case: speakers are kept lowercase and looked up lowercased, so "Vivian" names "vivian"
        return [{"id": name, "name": name, "sample_rate": 24000, "backend": "qwen3_tts", "any_case": True}
                for name in cfg.speakers]


def load_talker(model_dir: str, device: torch.device, dtype: torch.dtype, max_positions: Optional[int]):
    from transformers import AutoTokenizer

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        talker_cfg = json.load(f)["talker_config"]
    most = min(max_positions or talker_cfg["max_position_embeddings"], talker_cfg["max_position_embeddings"])
    config = qwen3_config(talker_cfg, talker_cfg["vocab_size"], talker_cfg["max_position_embeddings"])
    tensors = read_tensors(model_dir, "talker.")
    with torch.device("meta"):
        model = Qwen3TTSTalker(config, most)
    model = model.to_empty(device=device).to(dtype=dtype)
    decoder = {"model.embed_tokens.weight": tensors["model.codec_embedding.weight"],
               "lm_head.weight": tensors["codec_head.weight"]}
    decoder.update({k: v for k, v in tensors.items() if k.startswith(("model.layers.", "model.norm."))})
    model.load_weights(decoder.items())
    model.rotary.build(device)
    th = talker_cfg["text_hidden_size"]
    text_embedding = nn.Embedding(talker_cfg["text_vocab_size"], th)
    from transformers.activations import ACT2FN

    text_projection = nn.Sequential(nn.Linear(th, th), ACT2FN[talker_cfg.get("hidden_act", "silu")],
                                    nn.Linear(th, talker_cfg["hidden_size"]))
    text_embedding.weight.data.copy_(tensors["model.text_embedding.weight"])
    for i, part in ((0, "linear_fc1"), (2, "linear_fc2")):
        text_projection[i].weight.data.copy_(tensors[f"text_projection.{part}.weight"])
        text_projection[i].bias.data.copy_(tensors[f"text_projection.{part}.bias"])
    predictor = CodePredictor(talker_cfg["code_predictor_config"], talker_cfg["hidden_size"])
    predictor.load({k[len("code_predictor."):]: v for k, v in tensors.items() if k.startswith("code_predictor.")})
    predictor = predictor.to(device=device, dtype=dtype).eval()
    config_tts = TTSConfig.read(model_dir)
    gen = config_tts.generation
    predictor.sampling = {name: kind(gen[f"subtalker_{name}"]) for name, kind in
                          (("temperature", float), ("top_k", int), ("top_p", float)) if f"subtalker_{name}" in gen}
    references = None
    if config_tts.task == "base":
        references = ReferenceEncoder(model_dir, device, dtype, read_tensors(model_dir, "speaker_encoder."))
    prompts = PromptBuilder(config_tts, AutoTokenizer.from_pretrained(model_dir),
                            text_embedding.to(device, dtype).eval(), text_projection.to(device, dtype).eval(),
                            model.embed_tokens, predictor.embeds, references)
    model.attach(FramePredictor(predictor, model.embed_tokens), prompts)
    return model.eval(), config, None, frozenset({prompts.config.eos})
