"""The dispatch point every attention layer calls: the capability table behind `--attention_impl`.

Layout is [batch, seq, heads, head_dim] (BTNH). K/V may have fewer heads than Q (GQA/MQA); they are never
materialised repeated. Masks: causal, a left sliding window, and segment ids for packed documents.
"""

import functools
import logging

import jax
import jax.numpy as jnp

from mjax.kernels.attention.cudnn import cudnn_attention
from mjax.kernels.attention.errors import AttentionUnsupported
from mjax.kernels.attention.reference import reference_attention, reference_attention_backward
from mjax.kernels.device import is_hopper
from mjax.kernels.options import ATTENTION_IMPLS, CUDNN_NOT_DETERMINISTIC
from mjax.xla_flags import deterministic_ops_in_xla_flags

log = logging.getLogger(__name__)

IMPLS = ATTENTION_IMPLS


def _flash_kernel(kernel: str):
    """mjax's flash kernels: Triton ("pallas") or Hopper ("mosaic"), per shard under a mesh (sharded.py)."""
    def attend(q, k, v, **kwargs):
        from mjax.kernels.attention import flash, sharded  # noqa: PLC0415  (import only when chosen)

        sharded.check_whole_sequences(q.shape[1], k.shape[1])
        return flash.flash_attention(q, k, v, kernel=kernel, **kwargs)

    return attend


_IMPL_FNS = {"xla": reference_attention, "cudnn": cudnn_attention, "mosaic": _flash_kernel("mosaic"),
             "pallas": _flash_kernel("pallas")}


HALF_DTYPES = (jnp.bfloat16, jnp.float16)


def why_unsupported(impl: str, *, backend: str, dtype, head_dim: int, segment_ids: bool, return_lse: bool,
                    causal: bool = True, sliding_window=None, q_len=None, kv_len=None,
                    offset: bool = False, hopper: bool = False, deterministic: bool = False) -> str | None:
    """The capability table: None if `impl` can do this call, else the reason in words. deterministic: the
    program is compiled with XLA's deterministic ops (--deterministic_mode)."""
    dtype = jnp.dtype(dtype)
    if impl == "xla":
        return None
    if impl == "cudnn":
        if backend != "gpu":
            return f"cudnn needs a GPU (backend is {backend})"
        if dtype not in [jnp.dtype(d) for d in HALF_DTYPES]:
            return f"cudnn takes bfloat16/float16, not {dtype}"
        if head_dim > 256 or head_dim % 8:
            return f"cudnn needs a head dim that is a multiple of 8 up to 256, not {head_dim}"
        if segment_ids:
            return "cudnn cannot mask packed documents (segment ids)"
        if return_lse:
            return "cudnn does not return the log-sum-exp"
        if offset:
            return "cudnn takes no query position offset"
        if sliding_window is not None and not causal:
            return "cudnn has only a causal sliding window"
        if causal and q_len is not None and kv_len is not None and q_len != kv_len:
            return "cudnn aligns the causal mask differently when query and key lengths differ"
        if deterministic:
            return CUDNN_NOT_DETERMINISTIC
        return None
    if impl == "mosaic":
        from mjax.kernels.attention.flash import MAX_HEAD_DIM  # noqa: PLC0415

        if backend != "gpu" or not hopper:
            return ("mosaic needs a Hopper GPU (compute capability 9.0: wgmma, TMA), "
                    f"not {'a GPU of another generation' if backend == 'gpu' else backend}")
        if dtype not in [jnp.dtype(d) for d in HALF_DTYPES]:
            return f"mosaic takes bfloat16/float16, not {dtype}"
        if head_dim > MAX_HEAD_DIM or head_dim % 8:
            return f"mosaic needs a head dim that is a multiple of 8 up to {MAX_HEAD_DIM}, not {head_dim}"
        return None
    if impl == "pallas":
        from mjax.kernels.attention.flash import DTYPES, MAX_HEAD_DIM  # noqa: PLC0415

        if backend not in ("gpu", "cpu"):
            return f"the pallas kernel runs on GPU (or interpreted on CPU), not {backend}"
        if dtype not in [jnp.dtype(d) for d in DTYPES]:
            return f"pallas takes bfloat16/float16/float32, not {dtype}"
        if head_dim > MAX_HEAD_DIM or head_dim % 8:
            return f"pallas needs a head dim that is a multiple of 8 up to {MAX_HEAD_DIM}, not {head_dim}"
        return None
    raise AttentionUnsupported(f"--attention_impl={impl!r} is not one of {', '.join(IMPLS)}")


def choose_impl(impl: str, *, backend: str, dtype, head_dim: int, segment_ids: bool, return_lse: bool,
                causal: bool = True, sliding_window=None, q_len=None, kv_len=None, offset: bool = False,
                hopper: bool = False, deterministic: bool = False) -> str:
    """The capability table behind `auto`; an explicit choice is checked, never replaced.

    auto, in order of measured training speed (forward + backward, docs/kernels.md): on GPU cuDNN when it can
    (plain causal or windowed attention, not under --deterministic_mode), else on Hopper the Mosaic GPU kernel,
    else the Triton kernel (segment ids, log-sum-exp, fp32, non-causal windows); off GPU, XLA. If nothing fast
    fits on a GPU, auto raises rather than silently materialising the T x S logits: choose --attention_impl=xla
    explicitly for that.
    """
    if impl not in IMPLS:
        raise AttentionUnsupported(f"--attention_impl={impl!r} is not one of {', '.join(IMPLS)}")
    facts = dict(backend=backend, dtype=dtype, head_dim=head_dim, segment_ids=segment_ids, return_lse=return_lse,
                 causal=causal, sliding_window=sliding_window, q_len=q_len, kv_len=kv_len, offset=offset,
                 hopper=hopper, deterministic=deterministic)
    if impl != "auto":
        reason = why_unsupported(impl, **facts)
        if reason:
            raise AttentionUnsupported(f"--attention_impl={impl} cannot do this call: {reason}. "
                                       f"Choose another --attention_impl (auto picks from {', '.join(IMPLS[1:])}).")
        return impl
    if backend != "gpu":
        return "xla"
    reasons = {}
    for candidate in ("cudnn", "mosaic", "pallas"):
        reasons[candidate] = why_unsupported(candidate, **facts)
        if reasons[candidate] is None:
            return candidate
    raise AttentionUnsupported("--attention_impl=auto found no fast attention for this call ("
                               + "; ".join(f"{k}: {v}" for k, v in reasons.items())
                               + "); set --attention_impl=xla to run the unfused reference on purpose")


def check_call(q, k, v, *, sliding_window=None, segment_ids=None) -> None:
    """The rules every implementation shares (so that all of them accept and refuse the same calls)."""
    dtypes = {jnp.dtype(x.dtype) for x in (q, k, v)}
    if any(not jnp.issubdtype(d, jnp.floating) for d in dtypes) or len(dtypes) > 1:
        raise AttentionUnsupported(f"attention takes q, k and v of one floating dtype, got {', '.join(map(str, dtypes))}")
    if q.shape[2] % k.shape[2]:
        raise AttentionUnsupported(f"query heads {q.shape[2]} are not a multiple of KV heads {k.shape[2]}")
    if sliding_window is not None and sliding_window < 1:
        raise AttentionUnsupported(f"sliding_window={sliding_window}: a window holds at least the query's own "
                                   "position (>= 1); None means no window")
    if segment_ids is not None and not isinstance(segment_ids, (tuple, list)) and q.shape[1] != k.shape[1]:
        raise AttentionUnsupported(f"one segment-id array needs equal query and key lengths (got {q.shape[1]} and "
                                   f"{k.shape[1]}); pass a pair (q_segment_ids, kv_segment_ids)")


def _choose(impl, q, k, *, causal, sliding_window, segment_ids, return_lse, offset, deterministic=False) -> str:
    # deterministic ops in XLA_FLAGS reach every caller (generation, user code); --deterministic_mode, a per-compile
    # option, only through `deterministic`
    chosen = choose_impl(impl, backend=jax.default_backend(), dtype=q.dtype, head_dim=q.shape[-1],
                         segment_ids=segment_ids is not None, return_lse=return_lse, causal=causal,
                         sliding_window=sliding_window, q_len=q.shape[1], kv_len=k.shape[1],
                         offset=offset is not None, hopper=is_hopper(),
                         deterministic=deterministic or deterministic_ops_in_xla_flags())
    _log_choice(impl, chosen, q.shape, str(q.dtype))
    return chosen


def dot_product_attention(q, k, v, *, causal=True, sliding_window=None, segment_ids=None, scale=None,
                          impl="auto", return_lse=False, offset=None, deterministic=False):
    """Dispatches to the implementation `impl` names (or `auto` picks); raises AttentionUnsupported otherwise.
    offset: query i sits at key position i + offset (default S - T); a traced value is one block of context
    parallelism's attention. deterministic: compiled with XLA's deterministic ops (--deterministic_mode; those in
    XLA_FLAGS are read here)."""
    check_call(q, k, v, sliding_window=sliding_window, segment_ids=segment_ids)
    chosen = _choose(impl, q, k, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids,
                     return_lse=return_lse, offset=offset, deterministic=deterministic)
    extra = {} if offset is None else {"offset": offset}
    return _IMPL_FNS[chosen](q, k, v, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids,
                             scale=scale, return_lse=return_lse, **extra)


def attention_block_backward(q, k, v, out, lse, do, *, causal=True, sliding_window=None, segment_ids=None,
                             scale=None, impl="auto", offset=None, deterministic=False):
    """(dq, dk, dv) of one block of a larger attention whose merged output `out` and log-sum-exp `lse` are given:
    the backward of ring attention's blocks, by the implementation `impl` names (xla, mosaic or pallas: the ones
    that return the log-sum-exp its forward merges)."""
    check_call(q, k, v, sliding_window=sliding_window, segment_ids=segment_ids)
    chosen = _choose(impl, q, k, causal=causal, sliding_window=sliding_window, segment_ids=segment_ids,
                     return_lse=True, offset=offset, deterministic=deterministic)
    kw = dict(causal=causal, sliding_window=sliding_window, segment_ids=segment_ids, scale=scale, offset=offset)
    if chosen == "xla":
        return reference_attention_backward(q, k, v, out, lse, do, **kw)
    from mjax.kernels.attention.flash import flash_attention_backward  # noqa: PLC0415

    return flash_attention_backward(q, k, v, out, lse, do, kernel=chosen, **kw)


@functools.cache
def _log_choice(requested, chosen, shape, dtype):
    log.info("attention: %s (requested %s) for q%s %s", chosen, requested, shape, dtype)
