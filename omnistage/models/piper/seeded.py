"""Piper voices with their noise drawn outside the graph, from a seed (runs in the TTS stage's process).

A Piper (VITS) export draws its duration noise (`noise_w`) and its flow noise (`noise_scale`) with
`RandomNormalLike` nodes whose generator lives in the ONNX Runtime kernel, is seeded once per
session and advances with every run: the same sentence gets different durations each time, and
which draws a request gets depends on what ran before it. `seeded_graph` rewrites each such node
into "the first numel(X) values of a new float input `noise_K`, shaped like X"; `synthesize` feeds
those inputs from a NumPy generator seeded by the request's phoneme ids and voice, so a sentence
is spoken the same way whatever else the server is doing (standard normal draws, as before).

In: the voice's .onnx path; per call the phoneme ids, the scales and the speaker id. Out: the
float32 audio array Piper's own `phoneme_ids_to_audio` would return.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional

import numpy as np

NOISE_PER_PHONEME = 4096                        # noise values drawn per phoneme id and noise input to start with;
# the frame noise needs 192 channels x frames (~7 frames per phoneme at speed 1): doubled on a shortfall


def seeded_graph(model_path: str) -> tuple[bytes, list[str]]:
    """The voice's graph with every RandomNormalLike node fed from an input; (serialized model,
    names of the noise inputs). Needs the `onnx` package."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(model_path)
    graph = model.graph
    names, nodes = [], []
    for node in graph.node:
        if node.op_type != "RandomNormalLike":
            nodes.append(node)
            continue
        k = len(names)
        name, shape, count, zero = f"noise_{k}", f"noise_{k}/shape", f"noise_{k}/count", f"noise_{k}/zero"
        names.append(name)
        graph.input.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ["n"]))
        nodes += [helper.make_node("Shape", [node.input[0]], [shape]),
                  helper.make_node("ReduceProd", [shape], [count], keepdims=1),
                  helper.make_node("Constant", [], [zero], value=helper.make_tensor(zero, TensorProto.INT64, [1], [0])),
                  helper.make_node("Slice", [name, zero, count], [f"{name}/flat"]),
                  helper.make_node("Reshape", [f"{name}/flat", shape], [node.output[0]])]
    del graph.node[:]
    graph.node.extend(nodes)
    return model.SerializeToString(), names


class SeededVoice:
    """One voice's ONNX session over `seeded_graph`; `synthesize` is deterministic per input."""

    def __init__(self, model_path: str, providers: list[str]):
        import onnxruntime

        graph, self.noise_inputs = seeded_graph(model_path)
        self.session = onnxruntime.InferenceSession(graph, providers=providers)

    def synthesize(self, ids: list[int], scales: tuple[float, float, float], speaker_id: Optional[int],
                   voice_name: str) -> np.ndarray:
        """Audio of phoneme `ids` with scales (noise_scale, length_scale, noise_w_scale); the noise
        is seeded by (ids, voice_name)."""
        seed = [zlib.crc32(np.asarray(ids, np.int64).tobytes()), zlib.crc32(voice_name.encode())]
        feeds: dict[str, Any] = {"input": np.asarray([ids], np.int64),
                                 "input_lengths": np.asarray([len(ids)], np.int64),
                                 "scales": np.asarray(scales, np.float32)}
        if speaker_id is not None:
            feeds["sid"] = np.asarray([speaker_id], np.int64)
        size = max(1, len(ids)) * NOISE_PER_PHONEME * max(1, int(np.ceil(scales[1])))
        for _ in range(3):                      # a shortfall fails the graph's Reshape: draw more (same prefix)
            try:
                return self._run(feeds, seed, size)
            except Exception:
                size *= 4
        return self._run(feeds, seed, size)

    def _run(self, feeds: dict[str, Any], seed: list[int], size: int) -> np.ndarray:
        for k, name in enumerate(self.noise_inputs):
            feeds[name] = np.random.default_rng([*seed, k]).standard_normal(size, np.float32)
        return np.asarray(self.session.run(None, feeds)[0]).squeeze()
