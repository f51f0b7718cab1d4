"""Attention: one dispatch point (`dot_product_attention`, `--attention_impl=auto|xla|cudnn|pallas`), the pure-JAX
reference (the test oracle), cuDNN through jax.nn, and mjax's Pallas flash attention, run per shard."""

from mjax.kernels.attention.cudnn import cudnn_forward_primitives
from mjax.kernels.attention.dispatch import (HALF_DTYPES, IMPLS, attention_block_backward, check_call, choose_impl,
                                             dot_product_attention, why_unsupported)
from mjax.kernels.attention.errors import AttentionUnsupported
from mjax.kernels.attention.reference import cached_attention, make_mask, reference_attention
from mjax.kernels.options import ATTN_CORE

__all__ = ["ATTN_CORE", "HALF_DTYPES", "IMPLS", "AttentionUnsupported", "attention_block_backward", "cached_attention",
           "check_call", "choose_impl",
           "cudnn_forward_primitives", "dot_product_attention", "make_mask", "reference_attention",
           "why_unsupported"]
