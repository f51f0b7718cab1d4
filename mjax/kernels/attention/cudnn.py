"""cuDNN's fused attention through `jax.nn.dot_product_attention` (and its primitives, which remat finds by identity)."""

import functools

import jax


@functools.cache
def cudnn_forward_primitives() -> tuple:
    """cuDNN's fused attention forward primitives, whose results `attn_core` keeps (the Pallas kernel names its
    own). Taken from JAX's private module, so a rename there fails loudly instead of silently recomputing; imported
    only by a remat policy that can meet cuDNN attention."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415

    return cudnn._dot_product_attention_fwd_p, cudnn._dot_product_attention_fwd_p_wrapper


def cudnn_attention(q, k, v, *, causal, sliding_window, segment_ids, scale, return_lse):
    del segment_ids, return_lse  # None / False: the capability table (why_unsupported) sends those calls elsewhere
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, local_window_size=window,
                                        implementation="cudnn")
