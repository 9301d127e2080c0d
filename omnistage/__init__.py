"""omnistage: an inference and serving engine for omni-modality models."""

from omnistage.outputs import AudioOutput, CompletionOutput, RequestOutput, VideoOutput
from omnistage.params import DiffusionParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name):
    # Entry points import torch and transformers: load them only when asked for.
    if name == "Omni":
        from omnistage.entrypoints.omni import Omni
        return Omni
    if name == "AsyncOmni":
        from omnistage.entrypoints.async_omni import AsyncOmni
        return AsyncOmni
    raise AttributeError(name)


__all__ = ["Omni", "AsyncOmni", "SamplingParams", "StructuredOutputsParams", "DiffusionParams", "RequestOutput", "CompletionOutput",
           "AudioOutput", "VideoOutput"]
