"""A malformed-input corpus for every route of the server, kept as data (test_malformed_corpus.py sends it).

Each `Case` is one request to one of the shared servers ("text": a tiny LM + TTS; "images": tiny
Qwen-Image; "videos": tiny Wan) and the answer it must get: a 4xx `status` whose OpenAI-style error
names `param` (None where no field is at fault: the body as a whole, an unknown route). Bodies are
`json` (sent with json.dumps, so a lone surrogate travels as the escape `\\ud800`, as a client's
would), or `raw` bytes with their `content_type`. The cases cover what the hardening issue listed
(lone surrogates in every text field, deep nesting, numbers of thousands of digits, non-finite
floats, out-of-range token ids, unknown roles, string booleans, blank prompts, wrong content types,
`seconds` refused as `seconds`, template kwargs) plus the wrong types and ranges of every field.
"""

from dataclasses import dataclass
from typing import Any, Optional

LONE = "a\ud800b"                               # a lone surrogate: valid JSON, not encodable text
DEEP = b"[" * 100_000 + b"]" * 100_000           # 100k-deep JSON array
DIGITS = "7" * 5000                             # a number of 5000 digits
MAX_MODEL_LEN = 512                             # of the tiny LM (MAX_CHARS_PER_TOKEN * this chars fit at most)


@dataclass
class Case:
    server: str                                 # "text" | "images" | "videos"
    path: str
    json: Any = None                            # body, sent as JSON
    raw: Optional[bytes] = None                 # or this body as it is
    content_type: str = "application/json"
    method: str = "POST"
    status: int = 400
    param: Optional[str] = None                 # the field the error must name

    @property
    def id(self) -> str:
        return f"{self.server}:{self.method} {self.path} {str(self.json if self.raw is None else self.raw)[:60]}"


def _cmpl(param: str, **fields) -> Case:
    return Case("text", "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields}, param=param)


def _chat(param: str, messages: Any = None, **fields) -> Case:
    body = {"messages": [{"role": "user", "content": "hi"}] if messages is None else messages, "max_tokens": 2}
    return Case("text", "/v1/chat/completions", {**body, **fields}, param=param)


def _speech(param: str, **fields) -> Case:
    return Case("text", "/v1/audio/speech", {"input": "Hello.", "voice": "joe", **fields}, param=param)


def _image(param: str, **fields) -> Case:
    return Case("images", "/v1/images/generations",
                {"prompt": "a cube", "size": "32x32", "num_inference_steps": 1, **fields}, param=param)


def _video(param: str, **fields) -> Case:
    return Case("videos", "/v1/videos", {"prompt": "a boat", "size": "48x32", "num_inference_steps": 1, **fields},
                param=param)


def _raw(server: str, path: str, body: bytes, content_type: str = "application/json",
         param: Optional[str] = None) -> Case:
    return Case(server, path, raw=body, content_type=content_type, param=param)


def _every_json_route(body: bytes, content_type: str = "application/json") -> list[Case]:
    routes = [("text", "/v1/completions"), ("text", "/v1/chat/completions"), ("text", "/v1/audio/speech"),
              ("text", "/v1/audio/speech/batch"), ("images", "/v1/images/generations"), ("images", "/v1/images/edits"),
              ("videos", "/v1/videos")]
    return [_raw(server, path, body, content_type) for server, path in routes]


CASES: list[Case] = [
    # ---- bodies no route accepts: not JSON, nested too deep, numbers too long, wrong types ----------------
    *_every_json_route(DEEP),
    *_every_json_route(b'{"prompt": ' + DEEP + b"}"),
    *_every_json_route(b'{"prompt": "x", "n": ' + DIGITS.encode() + b"}"),
    *_every_json_route(b'{"prompt": "x", "max_tokens": ' + b"not json"),
    *_every_json_route(b'{"prompt": "\xff\xfe"}'),                            # not UTF-8
    *_every_json_route(b"[1, 2]"),
    _raw("images", "/v1/images/generations", b'{"prompt": "a cube", "size": "32x32"}', "text/plain"),
    _raw("videos", "/v1/videos", b'{"prompt": "a boat", "size": "48x32"}', "text/plain"),
    _raw("text", "/v1/completions", b'{"prompt": "hi"}', "text/plain"),

    # ---- /v1/completions ------------------------------------------------------------------------------------
    _raw("text", "/v1/completions", b'{"prompt": "\xed\xa0\x80"}', param="prompt"),   # a surrogate in UTF-8 form
    _cmpl("prompt", prompt=LONE),
    _cmpl("prompt", prompt=["fine", LONE]),
    _cmpl("model", model=LONE),
    _cmpl("user", user=LONE),
    _cmpl("stop", stop=[LONE]),
    _raw("text", "/v1/completions", b'{"prompt": "hi", "temperature": Infinity}', param="temperature"),
    _raw("text", "/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', param="temperature"),
    _raw("text", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', param="temperature"),
    _raw("text", "/v1/completions", b'{"prompt": "hi", "top_p": -Infinity}', param="top_p"),
    _cmpl("stop_token_ids", stop_token_ids=[-1]),
    _cmpl("stop_token_ids", stop_token_ids=[10**12], min_tokens=1),
    _cmpl("stop_token_ids", stop_token_ids="7"),
    _cmpl("stream", stream="yes"),
    _cmpl("echo", echo="yes"),
    _cmpl("echo", echo=True),
    _cmpl("suffix", suffix="x"),
    _cmpl("ignore_eos", ignore_eos="no"),
    _cmpl("stream_options", stream=True, stream_options={"include_usage": "yes"}),
    _cmpl("prompt", prompt="ab " * (16 * MAX_MODEL_LEN // 3 + 1)),          # more characters than can fit
    _cmpl("prompt", prompt=[1, 2, 10**9]),                                   # a token id past the vocabulary
    _cmpl("prompt", prompt=[-1]),
    _cmpl("prompt", prompt=[]),
    _cmpl("prompt", prompt=[[]]),
    _cmpl("prompt", prompt=5),
    _cmpl("prompt", prompt={"text": "hi"}),
    Case("text", "/v1/completions", {"max_tokens": 2}, param="prompt"),
    _cmpl("max_tokens", max_tokens=0),
    _cmpl("max_tokens", max_tokens=10**6),
    _cmpl("max_tokens", max_tokens=1.5),
    _cmpl("n", n=0),
    _cmpl("n", n=10**30),
    _cmpl("top_p", top_p=2),
    _cmpl("top_k", top_k=-5),
    _cmpl("min_p", min_p=2),
    _cmpl("presence_penalty", presence_penalty=5),
    _cmpl("frequency_penalty", frequency_penalty=-5),
    _cmpl("repetition_penalty", repetition_penalty=0),
    _cmpl("logprobs", logprobs=21),
    _cmpl("logprobs", logprobs=-1),
    _cmpl("min_tokens", min_tokens=-1),
    _cmpl("min_tokens", min_tokens=5, max_tokens=2),
    _cmpl("stop", stop=[""]),
    _cmpl("stop", stop=5),
    _cmpl("seed", seed=2**70),
    _cmpl("seed", seed="x"),
    Case("text", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, status=404, param="model"),

    # ---- /v1/chat/completions -----------------------------------------------------------------------------
    _raw("text", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
         param="messages"),
    _chat("messages", [{"role": "user", "content": LONE}]),
    _chat("messages", [{"role": LONE, "content": "hi"}]),
    _chat("messages", [{"role": "user", "content": "hi", "name": LONE}]),
    _chat("messages", [{"role": "user", "content": [{"type": "text", "text": LONE}]}]),
    _chat("messages", [{"role": "user", "content": [{"type": LONE}]}]),
    _chat("messages", [{"role": "user", "content": "hi", LONE: "x"}]),
    _chat("model", model=LONE),
    _chat("chat_template_kwargs", chat_template_kwargs={"flag": LONE}),
    _chat("messages", [{"role": "wizard", "content": "hi"}]),
    _chat("messages", [{"content": "hi"}]),
    _chat("messages", [{"role": "user", "content": 5}]),
    _chat("messages", [{"role": "user", "content": [{"type": "hologram"}]}]),
    _chat("messages", [{"role": "user", "content": [{"type": "image_url",
                                                     "image_url": {"url": "data:image/png;base64,AAAA"}}]}]),
    _chat("messages", []),
    _chat("messages", "hi"),
    _chat("messages", [[]]),
    _chat("messages", [{"role": "user", "content": "a" * (16 * MAX_MODEL_LEN + 1)}]),
    Case("text", "/v1/chat/completions", {"max_tokens": 2}, param="messages"),
    _chat("stream", stream="yes"),
    _chat("logprobs", logprobs="yes"),
    _chat("top_logprobs", top_logprobs=2),
    _chat("top_logprobs", logprobs=True, top_logprobs=99),
    _chat("max_completion_tokens", max_completion_tokens=0),
    _chat("max_tokens", max_tokens=10**6),
    _raw("text", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}', param="temperature"),
    _chat("stop_token_ids", stop_token_ids=[-1]),
    _chat("chat_template_kwargs", chat_template_kwargs={"tokenize": True}),
    _chat("chat_template_kwargs", chat_template_kwargs={"conversation": []}),
    _chat("chat_template_kwargs", chat_template_kwargs={"chat_template": "{{ 7 * 7 }}"}),
    _chat("chat_template_kwargs", chat_template_kwargs={"add_generation_prompt": 3}),
    _chat("chat_template_kwargs", chat_template_kwargs={"documents": 5}),
    _chat("chat_template_kwargs", chat_template_kwargs={"not a name": 1}),
    _chat("chat_template_kwargs", chat_template_kwargs="x"),
    _chat("modalities", modalities=["video"]),
    _chat("modalities", modalities="text"),
    _chat("audio.format", modalities=["text", "audio"], audio={"format": "ogg"}),
    _chat("audio.voice", modalities=["text", "audio"], audio={"voice": "nobody"}),
    _chat("audio.voice", modalities=["text", "audio"], audio={"voice": 5}),
    _chat("n", n=2, modalities=["text", "audio"]),
    _chat("n", n=-1),
    Case("text", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
         status=404, param="model"),

    # ---- /v1/audio/speech ---------------------------------------------------------------------------------
    _raw("text", "/v1/audio/speech", b'{"input": "\xed\xa0\x80"}', param="input"),
    _speech("input", input=LONE),
    _speech("input", input="Hello\u0000 world."),
    _speech("input", input=""),
    _speech("input", input="   "),
    _speech("input", input="a" * 4097),
    _speech("input", input=5),
    Case("text", "/v1/audio/speech", {"voice": "joe"}, param="input"),
    _speech("voice", voice=LONE),
    _speech("voice", voice="nobody"),
    _speech("voice", voice={"id": 5}),
    _speech("voice", voice=5),
    _speech("model", model=LONE),
    _speech("instructions", instructions=LONE),
    _speech("speed", speed=0),
    _speech("speed", speed=100),
    _raw("text", "/v1/audio/speech", b'{"input": "Hello.", "speed": Infinity}', param="speed"),
    _speech("response_format", response_format="ogg"),
    _speech("stream_format", stream_format="yes"),
    _speech("stream", stream="yes"),
    _speech("task_type", task_type="Singing"),
    _speech("task_type", task_type="Base"),                      # Piper does not clone
    _speech("language", language=LONE),
    _speech("language", language="xx"),
    _speech("ref_audio", ref_audio="%%%"),
    _speech("ref_audio", ref_audio="file:///etc/passwd"),
    _speech("ref_audio", ref_audio="https://example.com/a.wav"),  # no --allowed-media-domains
    _speech("ref_text", ref_text=LONE),
    _speech("ref_text", ref_text="Hello."),
    _speech("x_vector_only_mode", x_vector_only_mode="yes"),
    _speech("max_new_tokens", max_new_tokens=-1),
    _speech("max_new_tokens", max_new_tokens=DIGITS),
    _speech("initial_codec_chunk_frames", initial_codec_chunk_frames=4),
    Case("text", "/v1/audio/speech/batch", {"items": []}, param="items"),
    Case("text", "/v1/audio/speech/batch", {"items": "Hello."}, param="items"),
    Case("text", "/v1/audio/speech/batch", {"items": [5]}, param="items"),
    Case("text", "/v1/audio/speech/batch", {"items": [{"input": "x"}] * 33}, param="items"),
    Case("text", "/v1/audio/speech/batch", {"model": "nope", "items": [{"input": "x"}]}, status=404, param="model"),
    Case("text", "/v1/audio/voices", {"name": "x", "consent": "yes"}, param="name"),   # JSON: no form fields
    _raw("text", "/v1/audio/voices", b"--x\r\nnot a form", "multipart/form-data; boundary=x"),
    Case("text", "/v1/audio/voices/nobody", method="DELETE", status=404, param="name"),
    Case("text", "/v1/audio/speech", {"model": "nope", "input": "Hello."}, status=404, param="model"),

    # ---- other text-server routes -------------------------------------------------------------------------
    Case("text", "/v1/models", method="DELETE", status=405),
    Case("text", "/v1/nothing-here", {}, status=404),
    Case("text", "/v1/images/generations", {"prompt": "a cube"}, param="model"),   # a text model
    Case("text", "/v1/videos", {"prompt": "a boat"}, param="model"),

    # ---- /v1/images/generations and /v1/images/edits -----------------------------------------------------------
    _raw("images", "/v1/images/generations", b'{"prompt": "\xed\xa0\x80"}', param="prompt"),
    _raw("images", "/v1/images/edits", b'{"prompt": "\xed\xa0\x80"}', param="prompt"),
    _image("prompt", prompt=LONE),
    _image("negative_prompt", negative_prompt=LONE),
    _image("model", model=LONE),
    _image("size", size=LONE),
    _image("user", user=LONE),
    _image("prompt", prompt=""),
    _image("prompt", prompt="  \n "),
    _image("prompt", prompt="a" * 32001),
    _image("negative_prompt", negative_prompt="a" * 32001),
    _image("prompt", prompt=["a", "cube"]),
    Case("images", "/v1/images/generations", {"size": "32x32"}, param="prompt"),
    _image("size", size=DIGITS + "x32"),
    _image("size", size="32x" + DIGITS),
    _image("size", size="0x0"),
    _image("size", size="-32x32"),
    _image("size", size="big"),
    _image("size", size="70x64"),                                            # not a multiple the VAE takes
    _image("size", size="100000x100000"),
    _image("n", n=0),
    _image("n", n=10**30),
    _image("n", n="two"),
    _image("num_inference_steps", num_inference_steps=0),
    _raw("images", "/v1/images/generations", b'{"prompt": "a cube", "num_inference_steps": 1e999}',
         param="num_inference_steps"),
    _raw("images", "/v1/images/generations", b'{"prompt": "a cube", "guidance_scale": Infinity}',
         param="guidance_scale"),
    _raw("images", "/v1/images/generations", b'{"prompt": "a cube", "true_cfg_scale": NaN}', param="true_cfg_scale"),
    _image("seed", seed=2**70),
    _image("response_format", response_format="url"),
    _image("output_format", output_format="gif"),
    Case("images", "/v1/images/generations", {"model": "dall-e-3", "prompt": "a cube"}, status=404, param="model"),
    Case("images", "/v1/images/edits", {"prompt": "redder"}, param="image"),    # Qwen-Image takes no image
    Case("images", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, param="model"),
    Case("images", "/v1/videos", {"prompt": "a boat"}, param="model"),

    # ---- /v1/videos -------------------------------------------------------------------------------------------
    _raw("videos", "/v1/videos", b'{"prompt": "\xed\xa0\x80"}', param="prompt"),
    _video("prompt", prompt=LONE),
    _video("negative_prompt", negative_prompt=LONE),
    _video("model", model=LONE),
    _video("seconds", seconds=LONE),
    _video("input_reference", input_reference={"image_url": LONE}),
    _video("prompt", prompt=""),
    _video("prompt", prompt="a" * 32001),
    _video("seconds", seconds="600"),                                        # 9601 frames: refused as seconds
    _video("seconds", seconds="soon"),
    _video("seconds", seconds=-1),
    _video("seconds", seconds=DIGITS),
    _raw("videos", "/v1/videos", b'{"prompt": "a boat", "seconds": 1e999}', param="seconds"),
    _video("num_frames", num_frames=999),
    _video("num_frames", num_frames=0),
    _video("fps", fps=0),
    _video("fps", fps=10**9),
    _video("size", size=DIGITS + "x32"),
    _video("size", size="50x32"),
    _video("input_reference", input_reference="http://example.com/cat.png"),
    _video("input_reference", input_reference={"file_id": "file_1"}),
    _video("input_reference", input_reference="data:image/png;base64,!!!!"),
    Case("videos", "/v1/videos", {"model": "sora-2", "prompt": "a boat"}, status=404, param="model"),
    Case("videos", "/v1/videos/video_nope", method="GET", status=404, param="video_id"),
    Case("videos", "/v1/videos/video_nope/content", method="GET", status=404, param="video_id"),
    Case("videos", "/v1/videos/video_nope", method="DELETE", status=404, param="video_id"),
    Case("videos", "/v1/videos?limit=0", method="GET", param="limit"),
    Case("videos", "/v1/videos?limit=abc", method="GET", param="limit"),
    Case("videos", "/v1/videos?limit=" + DIGITS, method="GET", param="limit"),
    Case("videos", "/v1/videos?order=sideways", method="GET", param="order"),
    Case("videos", "/v1/videos?after=video_nope", method="GET", param="after"),
    Case("videos", "/v1/images/generations", {"prompt": "a cube"}, param="model"),   # makes videos
]
