"""Tiny checkpoints in real Hugging Face formats, built in code for tests and demos.

Contract:
  * ``make_tokenizer(save_dir=None) -> PreTrainedTokenizerFast``: a byte-level BPE trained on the
    built-in ``_CORPUS`` (English plus multi-byte UTF-8), Qwen-style special tokens
    (``<|endoftext|>`` = pad, ``<|im_start|>``, ``<|im_end|>`` = eos) and a ChatML chat template.
    The same call always yields the same vocabulary; a fresh object is returned each call.
  * ``make_tiny_lm(save_dir, arch, ...) -> save_dir``: a randomly initialised Llama / Qwen2 / Qwen3
    causal LM (float32, GQA) written with ``save_pretrained`` (safetensors, optionally sharded),
    together with the tokenizer and a generation config, so the real loading path runs on it.

Runs in whichever process calls it (tests, CLI); needs only CPU, takes a few seconds.
"""

from __future__ import annotations

import functools
import os

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
VOCAB_SIZE = 768
# Qwen2's pre-tokenizer split (contractions, letter runs, single digits, punctuation, whitespace).
# transformers' AutoTokenizer rebuilds a model_type="qwen2" folder's pipeline as NFC + this split +
# byte-level, so the tiny tokenizer uses exactly that pipeline: every loading path gives the same ids.
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML as Qwen uses it. Content may be a string or a list of OpenAI-style parts, of which only
# the text parts are rendered (tiny models have no other modality). Tools as Qwen2.5 shows them:
# a system turn listing the functions, assistant calls as <tool_call> JSON, tool results in a
# user turn inside <tool_response>.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nCall a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>"
    "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' -}}"
    "{{- call['function']['arguments'] | tojson -}}{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = """\
The harbour town woke slowly. Fishing boats came in before the sun was high, and the market filled
with voices, crates of silver fish, baskets of bread, and the smell of coffee from the small cafe on
the corner. Children ran between the stalls while their parents argued about prices, the weather,
and whether the new bridge would ever be finished. Nobody was in a hurry; the tide would turn when
it wanted to, and the gulls would follow the last boat home.

A language model reads text as a sequence of tokens. Each token is a small piece of a word, a whole
word, or a single byte. The model predicts the next token from the ones before it, one step at a
time, and a serving engine schedules many such requests together so that the processor stays busy.
Batching, caching the keys and values of earlier tokens, and streaming partial results back to the
user are the ordinary tools of the trade. What is the capital of France? The capital of France is
Paris. What is two plus two? Two plus two is four. Please answer briefly and politely.

In the workshop, the old engineer kept a notebook of every machine she had repaired: pumps, clocks,
radios, a printing press, and once a mechanical organ that played only in the key of D. She wrote
the date, the fault, and the fix, and at the end of each page a short note about what she would do
differently next time. Her apprentices laughed at the notebook until the day the same pump failed
again, and the answer was already written there in neat blue ink.

Images are grids of pixels, audio is a stream of samples, and video is a sequence of images with
sound beside it. A model that understands all of them must turn each into vectors of the same size,
mix them with the text, and then decide what to say or what to draw. Diffusion models start from
noise and remove it step by step; speech models turn tokens into waveforms at twenty-four thousand
samples per second. The numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear too, as do symbols like
+ - * / = < > ( ) [ ] { } # @ & % $ and punctuation: commas, full stops; colons! questions?

Multi-byte text keeps the byte-level rules honest: a naïve café owner in Zürich served crème brûlée
and smörgåsbord; señor Muñoz said "¡olé!" and Ελληνικά, русский язык, 日本語のテキスト, 中文文本,
한국어 문장 and emoji like 🙂 🚀 🎉 👩‍💻 all appeared on the same menu, priced in € and £ and ¥.
"""


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Trains the BPE once per process and returns its serialised form (immutable, safe to cache)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok.to_str()


def make_tokenizer(save_dir: str | None = None) -> PreTrainedTokenizerFast:
    """Returns a fresh tiny tokenizer (see module docstring); also saves it when ``save_dir`` is set."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


def _config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
            num_kv_heads: int, tie: bool, max_position_embeddings: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        # Large init makes random logits peaky but varied, so greedy text is not one repeated token.
        initializer_range=0.5,
        tie_word_embeddings=tie,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    if arch == "llama":
        # A scaled rope covers the non-default rotary path that real Llama 3 checkpoints use.
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": max_position_embeddings // 4}
        return LlamaConfig(**common, rope_parameters=rope)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    # Qwen3: head_dim deliberately differs from hidden_size // num_heads (as in real Qwen3
    # checkpoints) so code that derives head_dim from hidden_size fails loudly.
    return Qwen3Config(**common, head_dim=2 * hidden_size // num_heads,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DEFAULT_TIE = {"llama": False, "qwen2": True, "qwen3": True}


def make_tiny_lm(
    save_dir: str,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool | None = None,
    max_position_embeddings: int = 512,
    shard_size: int | str | None = None,
) -> str:
    """Writes a random tiny causal LM of ``arch`` ("llama", "qwen2", "qwen3") to ``save_dir``.

    ``tie_word_embeddings=None`` picks the per-arch default (Llama untied, Qwen2/Qwen3 tied).
    ``shard_size`` (bytes or a string like "100KB") produces the sharded safetensors + index layout.
    The weights depend only on the arguments: the global torch RNG is restored afterwards.
    """
    import transformers

    if arch not in _LM_CLASSES:
        raise ValueError(f"arch={arch!r} is not supported; allowed: {sorted(_LM_CLASSES)}")
    tokenizer = make_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    tie = _DEFAULT_TIE[arch] if tie_word_embeddings is None else tie_word_embeddings
    config = _config(arch, len(tokenizer), hidden_size, num_layers, num_heads, num_kv_heads, tie,
                     max_position_embeddings, eos_id, pad_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, _LM_CLASSES[arch])(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False)
    os.makedirs(save_dir, exist_ok=True)
    save_kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
    model.save_pretrained(save_dir, safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(save_dir)
    return save_dir


def draw_norms_and_biases(model: torch.nn.Module, norm_range: tuple[float, float], bias_std: float) -> None:
    """Draws, in place from the global torch RNG, `model`'s norm weights from U(norm_range) and its
    other 1-D parameters (biases) from N(0, bias_std): a fresh model's ones and zeros would hide a
    path that applies them wrong (the fused decode kernels' tests and benchmarks)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(*norm_range)
            elif p.dim() == 1:
                p.normal_(0, bias_std)
