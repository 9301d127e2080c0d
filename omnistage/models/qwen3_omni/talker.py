"""Qwen3-Omni's talker and its MTP code predictor as one AR-stage component (the talker stage's process).

Registered as component "qwen3_omni.talker" (`models/registry.py`); `load_talker(model_dir, device,
dtype, max_positions)` follows the AR loader contract and returns `(Qwen3OmniTalker, text config,
None, {codec eos})`:

  * the decoder (`talker.model.*`): the thinker's Qwen3-MoE decoder (`thinker.Qwen3MoeForCausalLM`)
    with a sparse MoE block in every layer -- routed experts (`norm_topk_prob` off) plus a
    sigmoid-gated shared expert (`layers.moe.SparseMoeBlock`) -- over codebook 0, with `embed_tokens` = the codec embedding and
    `lm_head` = `codec_head`, so the AR engine gives it paged KV, continuous batching and CUDA graphs.
    Its rope is the talker config's interleaved multimodal rope (`mrope_section`): the adapter gives
    a prompt with an image or a video transformers' 3-D positions (`ARPrompt.mrope_positions` and
    the delta generated positions continue with); a text or audio conversation gives equal
    positions in all three rows, which the engine runs as 1-D positions;
  * `frame_head`: the code predictor (`code_predictor.*`, the same network and contract as
    Qwen3-TTS' `CodePredictor`, reused from there): run by the AR runner right after each step's
    sampling for every sampled row at once, it predicts codebooks 1..G-1 from the row's last
    hidden state and its code 0 (G-1 small AR steps over a KV cache made for that frame alone) and
    returns the row the token's own position adds (the sum of their embeddings), as transformers'
    `Qwen3OmniMoeTalkerForConditionalGeneration.prepare_inputs_for_generation` does;
  * `compute_logits` masks the ids transformers' talker never samples (vocab - 1024 up, but codec eos),
    and each layer's shared-expert gate | up and shared gate run as one GEMM (`merge_moe_inputs`).

The talker's prompt rows and its streamed text rows come from the thinker through the
`qwen3_omni.thinker_to_talker` adapter (`adapters.py`), which owns the text / hidden projections.
"""

from __future__ import annotations

from typing import Optional

import torch

from omnistage.layers.merged_linear import merge_linears
from omnistage.models import dummy
from omnistage.models.qwen3_omni.thinker import (MoeDecoderLayer, Qwen3MoeForCausalLM, interleaved_mrope, omni_config,
                                                 read_tensors)
from omnistage.models.qwen3_tts.predictor import FramePredictor
from omnistage.models.qwen3_tts.talker import CodePredictor

TALKER = "qwen3_omni.talker"


def talker_text_config(model_dir: str):
    """The talker decoder's config (a private copy) with its interleaved multimodal rope."""
    config = interleaved_mrope(omni_config(model_dir).talker_config.text_config)
    config.tie_word_embeddings = False
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def predictor_config(talker) -> dict:
    """Qwen3-TTS `CodePredictor`'s config dict from a Qwen3-Omni `code_predictor_config`."""
    cfg = talker.code_predictor_config.to_dict()
    cfg["rope_theta"] = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    cfg["num_code_groups"] = talker.num_code_groups
    return cfg


class Qwen3OmniTalker(Qwen3MoeForCausalLM):
    """The talker decoder: the thinker's Qwen3-MoE structure with a shared expert in every layer
    (transformers' talker makes every layer sparse, whatever `decoder_sparse_step` says)."""

    def __init__(self, config, max_positions: int):
        super().__init__(config, max_positions)
        shared = int(config.shared_expert_intermediate_size)
        for i in range(config.num_hidden_layers):
            self.layers[i] = MoeDecoderLayer(config, shared)
        self.frame_head: Optional[FramePredictor] = None
        self.suppressed: Optional[torch.Tensor] = None   # [V] bool: ids never sampled (`suppress`)

    def suppress(self, eos: int) -> None:
        """The ids from vocab - 1024 up but codec eos are never sampled (transformers' talker `generate`
        suppresses them): masked in `compute_logits`, once per step on the device (inside the decode
        graphs), rather than as 1023 `bad_token_ids` of every row that the sampler uploads each step."""
        vocab = self.config.vocab_size
        mask = torch.zeros(vocab, dtype=torch.bool, device=self.embed_tokens.weight.device)
        mask[max(0, vocab - 1024):] = True
        mask[eos] = False
        self.suppressed = mask

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits if self.suppressed is None else logits.masked_fill(self.suppressed, float("-inf"))

    def merge_moe_inputs(self) -> None:
        """Each layer's shared-expert gate | up and its sigmoid gate read the same rows: one GEMM
        (`layers.merged_linear`; under fp8 that GEMM stays in the model dtype)."""
        for layer in self.layers:
            merge_linears(layer.mlp, ("shared_expert.gate_up_proj", "shared_expert_gate"))


def load_talker(model_dir: str, device: torch.device, dtype: torch.dtype, max_positions: Optional[int]):
    talker = omni_config(model_dir).talker_config
    config = talker_text_config(model_dir)
    most = min(max_positions or config.max_position_embeddings, config.max_position_embeddings)
    drawn = dummy.is_dummy(model_dir)           # load_format="dummy": the decoder is drawn in place
    prefixes = ("talker.code_predictor.",) if drawn else ("talker.",)
    tensors = {name[len("talker."):]: t for name, t in read_tensors(model_dir, prefixes)}
    with torch.device("meta"):
        model = Qwen3OmniTalker(config, most)
    model = model.to_empty(device=device).to(dtype=dtype)
    if drawn:
        dummy.init_dummy_(model)
    else:
        decoder = [("model.embed_tokens.weight", tensors["model.codec_embedding.weight"]),
                   ("lm_head.weight", tensors["codec_head.weight"])]
        decoder += [(k, v) for k, v in tensors.items() if k.startswith(("model.layers.", "model.norm."))]
        model.load_weights(decoder)
    model.merge_moe_inputs()
    model.suppress(int(talker.codec_eos_token_id))
    model.rotary.build(device)
    predictor = CodePredictor(predictor_config(talker), config.hidden_size)
    predictor.load({k[len("code_predictor."):]: v for k, v in tensors.items() if k.startswith("code_predictor.")})
    predictor = predictor.to(device=device, dtype=dtype).eval()
    predictor.sampling = {"top_k": 50, "top_p": 0.8}   # what transformers' talker samples its code predictor with
    model.frame_head = FramePredictor(predictor, model.embed_tokens)
    return model.eval(), config, None, frozenset({int(talker.codec_eos_token_id)})
