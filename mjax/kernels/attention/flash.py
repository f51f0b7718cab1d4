"""mjax's flash attention: Pallas kernels (Triton lowering) for forward and backward, behind a custom_vjp.

    out = flash_attention(q, k, v, causal=True, sliding_window=None, segment_ids=None, scale=None,
                          return_lse=False, offset=None)

Layout BTNH: q [B, T, N, H], k/v [B, S, K, H] with N % K == 0 (GQA/MQA; K/V are never repeated). Masks: causal
(query i sits at key position i + S - T, as in `reference_attention`), a left sliding window, and segment ids
for packed documents: one [B, T] array (T == S), or a pair (q_segment_ids [B, T], kv_segment_ids [B, S]) as
ring attention needs. Inputs bf16/fp16 (fp32 works too, at full fp32 matmul precision); accumulation is fp32.
`return_lse=True` also returns the log-sum-exp [B, N, T] fp32 (natural log; -inf for a row that sees no key,
whose output is 0); its gradient is supported. `offset` places query i at key position i + offset (default S - T;
a traced int32 scalar or [B] array is a kernel operand: context parallelism's blocks), and
`flash_attention_backward` is the blockwise backward that ring attention runs against its merged output. Under a
mesh the forward and the backward kernel each run per shard of the batch and heads (sharded.py).

Two kernel families share this wrapper (`kernel=`): "pallas", Triton lowering, which runs interpreted on CPU (the
tests) and on any GPU; "mosaic", Hopper's Mosaic GPU kernels (mosaic.py: TMA, wgmma, warp specialisation), on
CPU under jax >= 0.12's Mosaic GPU interpreter (the tests). Sequence lengths that are not block multiples are
zero-padded here and the padding is masked in the kernels; head dims are zero-padded up to what the kernels tile
(a power of two; 64/128/256 for mosaic).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.attention.errors import AttentionUnsupported
from mjax.kernels.options import ATTN_CORE
from mjax.kernels.attention.flash_common import MaskSpec, default_block_sizes, default_interpret, pow2_at_least
from mjax.kernels.attention.sharded import sharded_backward, sharded_forward

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_HEAD_DIM = 256


def check_supported(q_shape, k_shape, v_shape, dtype, *, sliding_window=None, segment_ids=None, kernel="pallas"):
    """Raises AttentionUnsupported, naming what to change, for anything this kernel cannot do."""
    name = f"attention_impl={kernel}"
    if len(q_shape) != 4 or len(k_shape) != 4 or tuple(k_shape) != tuple(v_shape):
        raise AttentionUnsupported(
            f"{name} expects q [B,T,N,H] and k, v [B,S,K,H] of one shape; got q{tuple(q_shape)} "
            f"k{tuple(k_shape)} v{tuple(v_shape)}")
    b, t, n, h = q_shape
    if k_shape[0] != b or k_shape[3] != h:
        raise AttentionUnsupported(f"{name} needs q and k/v with the same batch and head dim; got "
                                   f"q{tuple(q_shape)} k{tuple(k_shape)}")
    if n % k_shape[2]:
        raise AttentionUnsupported(f"query heads {n} are not a multiple of KV heads {k_shape[2]}")
    dtypes = DTYPES[:2] if kernel == "mosaic" else DTYPES
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in dtypes]:
        raise AttentionUnsupported(f"{name} takes {', '.join(jnp.dtype(d).name for d in dtypes)} inputs, not "
                                   f"{dtype}; set the compute dtype to bfloat16")
    if h > MAX_HEAD_DIM or h % 8:
        raise AttentionUnsupported(f"{name} supports head dims that are multiples of 8 up to "
                                   f"{MAX_HEAD_DIM}, not {h}; use --attention_impl=xla")
    if sliding_window is not None and sliding_window < 1:
        raise AttentionUnsupported(f"sliding_window must be >= 1, got {sliding_window}")
    if segment_ids is not None and not isinstance(segment_ids, (tuple, list)) and t != k_shape[1]:
        raise AttentionUnsupported(f"one segment_ids array needs equal query and key lengths (got {t} and "
                                   f"{k_shape[1]}); pass (q_segment_ids, kv_segment_ids)")


def flash_attention(q, k, v, *, causal=True, sliding_window=None, segment_ids=None, scale=None, return_lse=False,
                    offset=None, block_sizes=None, interpret: bool | None = None, kernel: str = "pallas"):
    """Flash attention with the reference's semantics; see the module docstring. Returns out (and lse).
    kernel: "pallas" (Triton lowering, BlockSizes) or "mosaic" (Hopper, mosaic.MosaicBlocks)."""
    call = _prepare(q, k, v, causal, sliding_window, segment_ids, scale, offset, block_sizes, interpret, kernel)
    out, lse = _flash(*call.operands, call.kernel, call.spec, call.blocks, call.scale, call.interpret)
    out, lse = call.unpad(out), lse[:, :, :q.shape[1]]
    return (out, lse) if return_lse else out


def flash_attention_backward(q, k, v, out, lse, do, *, causal=True, sliding_window=None, segment_ids=None,
                             scale=None, offset=None, block_sizes=None, interpret: bool | None = None,
                             kernel: str = "pallas"):
    """(dq, dk, dv) of this block of attention, given the output `out` [B,T,N,H] and log-sum-exp `lse` [B,N,T] of
    a larger attention it is part of (its other key blocks merged in) and that output's cotangent `do`: the
    blockwise backward of ring attention, P recomputed against the merged lse."""
    call = _prepare(q, k, v, causal, sliding_window, segment_ids, scale, offset, block_sizes, interpret, kernel)
    t, tp = q.shape[1], call.operands[0].shape[1]
    lse = jnp.pad(lse.astype(jnp.float32), ((0, 0), (0, 0), (0, tp - t)), constant_values=-jnp.inf)  # P = 0 there
    dq, dk, dv = sharded_backward(*call.operands, call.pad_q(out), lse, call.pad_q(do.astype(q.dtype)),
                                  jnp.zeros_like(lse), kernel=call.kernel, spec=call.spec, blocks=call.blocks, scale=call.scale,
                                  interpret=call.interpret)
    return call.unpad(dq), dk[:, :k.shape[1], :, :k.shape[3]], dv[:, :k.shape[1], :, :k.shape[3]]


class _Call(NamedTuple):
    operands: tuple  # padded q, k, v, segment ids (or None), offset (or None)
    kernel: str
    spec: MaskSpec
    blocks: object  # BlockSizes (pallas) or MosaicBlocks (mosaic)
    scale: float
    interpret: bool
    t: int
    h: int
    tp: int
    hp: int

    def pad_q(self, x):  # [B, T, N, H] -> [B, Tp, N, Hp]
        return _pad_axis(_pad_axis(x, 1, self.tp), 3, self.hp)

    def unpad(self, x):  # [B, Tp, N, Hp] -> [B, T, N, H]
        return x[:, :self.t, :, :self.h]


def _prepare(q, k, v, causal, sliding_window, segment_ids, scale, offset, block_sizes, interpret, kernel) -> _Call:
    if kernel not in ("pallas", "mosaic"):
        raise AttentionUnsupported(f"flash_attention kernel={kernel!r} is not pallas or mosaic")
    check_supported(q.shape, k.shape, v.shape, q.dtype, sliding_window=sliding_window, segment_ids=segment_ids,
                    kernel=kernel)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise AttentionUnsupported(f"attention_impl={kernel} needs q, k, v of one dtype; got {q.dtype}, {k.dtype}, "
                                   f"{v.dtype}")
    b, t, n, h = q.shape
    s = k.shape[1]
    scale = float(h**-0.5 if scale is None else scale)
    interpret = default_interpret() if interpret is None else bool(interpret)

    if kernel == "mosaic":
        from mjax.kernels.attention.mosaic import default_mosaic_blocks, padded_head_dim  # noqa: PLC0415

        hp = padded_head_dim(h)  # wgmma tiles of 64 columns
        blocks = (block_sizes or default_mosaic_blocks(hp)).clamp(t, s)
    else:
        hp = pow2_at_least(h)  # Triton tiles are powers of two
        blocks = (block_sizes or default_block_sizes(hp)).clamp(t, s)
    tp = -(-t // blocks.q_multiple) * blocks.q_multiple
    sp = -(-s // blocks.k_multiple) * blocks.k_multiple

    q_seg = kv_seg = None
    if segment_ids is not None:
        q_seg, kv_seg = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids, segment_ids)
        # Edge padding keeps the per-block segment spans tight; padded keys are masked by position anyway, and
        # padded queries (sliced off, zero cotangent) may attend whatever they like.
        q_seg = _pad_axis(q_seg.astype(jnp.int32), 1, tp, mode="edge")
        kv_seg = _pad_axis(kv_seg.astype(jnp.int32), 1, sp, mode="edge")
    dynamic = offset is not None and not isinstance(offset, int)
    if dynamic:  # a traced offset (context-parallel blocks): one per batch row, a kernel operand
        offset = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (b,))
    spec = MaskSpec(causal=bool(causal), window=None if sliding_window is None else int(sliding_window),
                    offset=0 if dynamic else (s - t if offset is None else offset), kv_len=s, kv_len_padded=sp,
                    q_len_padded=tp, segments=segment_ids is not None, dynamic_offset=dynamic)
    kp = _pad_axis(_pad_axis(k, 1, sp), 3, hp)
    vp = _pad_axis(_pad_axis(v, 1, sp), 3, hp)
    call = _Call((), kernel, spec, blocks, scale, interpret, t, h, tp, hp)
    return call._replace(operands=(call.pad_q(q), kp, vp, q_seg, kv_seg, offset if dynamic else None))


def _pad_axis(x, axis, size, mode="constant"):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, mode=mode)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _flash(q, k, v, q_seg, kv_seg, offset, kernel, spec, blocks, scale, interpret):
    out, lse = sharded_forward(q, k, v, q_seg, kv_seg, offset, kernel=kernel, spec=spec, blocks=blocks, scale=scale,
                               interpret=interpret)
    return out, lse  # a tuple, as _flash_fwd's: a kernel may return a list


def _flash_fwd(q, k, v, q_seg, kv_seg, offset, kernel, spec, blocks, scale, interpret):
    out, lse = sharded_forward(q, k, v, q_seg, kv_seg, offset, kernel=kernel, spec=spec, blocks=blocks,
                               scale=scale, interpret=interpret)
    # Named so that a remat policy can keep the kernel's results and skip rerunning it (remat name attn_core).
    out, lse = checkpoint_name(out, ATTN_CORE), checkpoint_name(lse, ATTN_CORE)
    return (out, lse), (q, k, v, q_seg, kv_seg, offset, out, lse)


def _flash_bwd(kernel, spec, blocks, scale, interpret, residuals, cotangents):
    q, k, v, q_seg, kv_seg, offset, out, lse = residuals
    do, dlse = cotangents
    dq, dk, dv = sharded_backward(q, k, v, q_seg, kv_seg, offset, out, lse, do.astype(q.dtype),
                                  dlse.astype(jnp.float32), kernel=kernel, spec=spec, blocks=blocks, scale=scale,
                                  interpret=interpret)
    return dq, dk, dv, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
