"""Checkpoint conversion with Hugging Face (Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5, GPT-2; the mixtures of experts
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-MoE), proven by logits parity.

Each family is a table (`mjax/convert/llama.py`, `gpt2.py`, `moe.py`) read by one mechanism (`spec.py`) in both
directions.
"""

from mjax.convert.spec import ConversionError, InputError

__all__ = ["ConversionError", "InputError", "hf_to_mjax", "load_pretrained", "mjax_to_hf"]


def __getattr__(name):  # heavy modules load on first use
    if name == "load_pretrained":
        from mjax.convert.pretrained import load_pretrained  # noqa: PLC0415

        return load_pretrained
    if name in ("hf_to_mjax", "mjax_to_hf"):
        from mjax.convert import hf  # noqa: PLC0415

        return getattr(hf, name)
    raise AttributeError(f"module 'mjax.convert' has no attribute {name!r}")
