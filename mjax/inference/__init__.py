"""Inference: decoding with a KV cache and text generation on the training model's own forward."""

from mjax.inference.decode import forward_with_cache, init_cache
from mjax.inference.generate import PromptError, generate, sample

__all__ = ["PromptError", "forward_with_cache", "generate", "init_cache", "sample"]
