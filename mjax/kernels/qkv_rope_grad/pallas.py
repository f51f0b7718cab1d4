"""The backward of splitting the fused QKV projection and rotating Q and K (RoPE), in one Pallas (Triton) pass.

The fused projection's output is grouped per KV head, [B, T, K, G + 2, H] (G query heads, then K, then V, so that
tensor parallelism splits it by KV head). Its gradient assembles dQ and dK, each rotated back, and dV into that
layout. Left to XLA it is a concatenate fusion, which XLA emits one operand at a time, well below the rate of a copy
of the same bytes (docs/performance.md). Here each
program reads a [bt, H] tile of every slot of one KV group once and writes the group's [bt, G + 2, H] output.

RoPE's backward, halves (1, 2) of the head dim: dx1 = dy1 cos + dy2 sin, dx2 = dy2 cos - dy1 sin, in f32 (the
autodiff of `model/rope.py:apply_rope`, which the XLA path runs).

Sharding: `per_shard` with batch, sequence and KV-group dimensions kept as the operands have them.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from mjax.kernels.per_shard import per_shard

TOKENS = 128  # tokens per program


def _kernel(dq_ref, dk_ref, dv_ref, cos_ref, sin_ref, out_ref, *, groups: int, half: int):
    cos, sin = cos_ref[...], sin_ref[...]  # [bt, H/2] f32

    def rotate_back(src, dst):  # src(slice) -> [bt, H/2] values; dst(slice, value) stores
        d1, d2 = src(slice(0, half)).astype(jnp.float32), src(slice(half, 2 * half)).astype(jnp.float32)
        dst(slice(0, half), d1 * cos + d2 * sin)
        dst(slice(half, 2 * half), d2 * cos - d1 * sin)

    def store(slot):
        def dst(hs, value):
            out_ref[:, slot, hs] = value.astype(out_ref.dtype)
        return dst

    for g in range(groups):
        rotate_back(lambda hs, g=g: dq_ref[:, g, hs], store(g))
    rotate_back(lambda hs: dk_ref[:, hs], store(groups))
    out_ref[:, groups + 1, :] = dv_ref[...]


def qkv_rope_grad_local(dq, dk, dv, cos, sin, *, interpret: bool):
    """dq [B, T, K, G, H], dk and dv [B, T, K, H], cos and sin [B, T, H/2] f32 -> [B, T, K, G + 2, H] in dq.dtype."""
    b, t, k, g, h = dq.shape
    bt = TOKENS
    tp = -(-t // bt) * bt
    if tp != t:  # pad the sequence to whole tiles (zeros rotate to zeros)
        pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        dq, dk, dv, cos, sin = map(pad, (dq, dk, dv, cos, sin))
    nt = tp // bt
    tile = lambda i: (i // nt, i % nt)  # noqa: E731  program -> (batch, token tile)
    out = pl.pallas_call(
        functools.partial(_kernel, groups=g, half=h // 2),
        grid=(b * nt, k),
        in_specs=[pl.BlockSpec((None, bt, None, g, h), lambda i, j: (*tile(i), j, 0, 0)),
                  pl.BlockSpec((None, bt, None, h), lambda i, j: (*tile(i), j, 0)),
                  pl.BlockSpec((None, bt, None, h), lambda i, j: (*tile(i), j, 0)),
                  pl.BlockSpec((None, bt, h // 2), lambda i, j: (*tile(i), 0)),
                  pl.BlockSpec((None, bt, h // 2), lambda i, j: (*tile(i), 0))],
        out_specs=pl.BlockSpec((None, bt, None, g + 2, h), lambda i, j: (*tile(i), j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, tp, k, g + 2, h), dq.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="mjax_qkv_rope_grad",
    )(dq, dk, dv, cos, sin)
    return out[:, :t]


@functools.cache
def _per_shard(interpret: bool):
    def local(dq, dk, dv, cos, sin):
        return qkv_rope_grad_local(dq, dk, dv, cos, sin, interpret=interpret)

    return per_shard(local, "b t k g h, b t k h, b t k h, b t c, b t c -> b t k o h",
                     replicated=("g", "h", "c", "o"))


def qkv_rope_grad(dq, dk, dv, cos, sin, *, interpret: bool = False):
    """The gradient of the fused QKV output from dQ [B, T, K*G, H] (rotated), dK [B, T, K, H] (rotated) and dV:
    [B, T, K, G + 2, H]. cos, sin: [B, T, H/2] f32, the angles RoPE rotated by."""
    b, t, n, h = dq.shape
    k = dk.shape[2]
    dq = dq.reshape(b, t, k, n // k, h)  # [B, T, N, H] -> [B, T, K, G, H]
    return _per_shard(bool(interpret))(dq, dk, dv.astype(dq.dtype), cos, sin)
