"""Which forward pass runs which architecture (``general.architecture``)."""

from __future__ import annotations

from .config import ModelConfig
from .gemma3 import Gemma3Model
from .llama import LlamaModel
from .phi3 import Phi3Model

# llama, qwen2 and qwen3 share one block (qwen2's biases, qwen3's Q/K norms and NeoX
# rope come from the layout table and the config); Gemma 3's block differs in most steps
MODEL_CLASSES: dict[str, type[LlamaModel]] = {
    "llama": LlamaModel,
    "qwen2": LlamaModel,
    "qwen3": LlamaModel,
    "gemma2": Gemma3Model,  # Gemma 3's pass without Q/K norms, with soft-capping
    "gemma3": Gemma3Model,
    "phi3": Phi3Model,
}


def model_class(cfg: ModelConfig) -> type[LlamaModel]:
    return MODEL_CLASSES[cfg.arch]
