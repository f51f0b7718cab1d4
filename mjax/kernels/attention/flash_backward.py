"""Flash-attention backward kernels (Pallas, Triton lowering): dq, and dk/dv, recomputing P from the saved LSE.

With z = scale * q.k, P = exp(z - lse), dP = dO V^T and delta = rowsum(dO * O) - dLSE:
    dS = P * (dP - delta),  dq = scale * dS K,  dk = scale * dS^T Q,  dv = P^T dO.
(Subtracting the LSE cotangent from delta is the whole gradient of the optional LSE output.)

dq: grid (query blocks, batch, q heads), walking key blocks like the forward.
dk/dv: grid (key blocks, batch, KV heads), walking the query blocks of every q head in the KV head's group, so
GQA gradients are summed in registers and K/V are never repeated. Both run in the transposed orientation where
that avoids transposing P and dS.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from mjax.kernels.attention.flash_common import (LOG2E, BlockSizes, MaskSpec, compiler_params, dot, kernel_refs,
                                                 offset_input, pl, query_block_segment_inputs, run_blocks,
                                                 segment_block_bounds)


def _dq_kernel(*refs, spec: MaskSpec, bq: int, bk: int, scale: float, n_q_blocks: int):
    inputs, spec, (qseg_ref, kseg_ref, lo_ref, hi_ref), (dq_ref,) = kernel_refs(refs, spec, 6, 1)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    seg_bounds = (lo_ref[...], hi_ref[...]) if spec.segments else None
    qi = n_q_blocks - 1 - pl.program_id(0)
    q = q_ref[...]  # [bq, H]
    do = do_ref[...]
    lse = lse_ref[...]  # [bq], log2 domain, +inf on rows that saw nothing
    delta = delta_ref[...]
    q_rows = qi * bq + jnp.arange(bq, dtype=jnp.int32)
    q_seg = qseg_ref[...] if spec.segments else None
    qk_scale = scale * LOG2E

    def body(j, dq, masked):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s = dot(q, k, trans_b=True) * qk_scale  # [bq, bk]
        s, _ = spec.apply(s, q_rows, start + jnp.arange(bk, dtype=jnp.int32), masked=masked, row_seg=q_seg,
                          col_seg=kseg_ref[pl.ds(start, bk)] if spec.segments else None)
        p = jnp.exp2(s - lse[:, None])
        dp = dot(do, v, trans_b=True)  # [bq, bk]
        ds = p * (dp - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k)

    dq = jnp.zeros(q.shape, jnp.float32)
    dq = run_blocks(spec.kv_block_ranges(qi, bq, bk, seg_bounds), body, dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, spec: MaskSpec, bq: int, bk: int, scale: float, groups: int):
    inputs, spec, (qseg_ref, kseg_ref, lo_ref, hi_ref), (dk_ref, dv_ref) = kernel_refs(refs, spec, 6, 2)
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = inputs
    seg_bounds = (lo_ref[...], hi_ref[...]) if spec.segments else None
    kj = pl.program_id(0)
    k = k_ref[...]  # [bk, H]
    v = v_ref[...]
    k_cols = kj * bk + jnp.arange(bk, dtype=jnp.int32)
    k_seg = kseg_ref[...] if spec.segments else None
    qk_scale = scale * LOG2E
    ranges = spec.q_block_ranges(kj, bq, bk, seg_bounds)

    def group_body(g, carry):
        def body(i, carry, masked):
            dk, dv = carry
            start = pl.multiple_of(i * bq, bq)
            q = q_ref[pl.ds(start, bq), g, :]  # [bq, H]
            do = do_ref[pl.ds(start, bq), g, :]
            lse = lse_ref[g, pl.ds(start, bq)]
            delta = delta_ref[g, pl.ds(start, bq)]
            st = dot(k, q, trans_b=True) * qk_scale  # [bk, bq] = S^T
            q_rows = start + jnp.arange(bq, dtype=jnp.int32)
            st, _ = spec.apply(st, q_rows, k_cols, masked=masked, row_seg=k_seg, transposed=True,
                               col_seg=qseg_ref[pl.ds(start, bq)] if spec.segments else None)  # [bk, bq]
            pt = jnp.exp2(st - lse[None, :])  # [bk, bq]
            dv = dv + dot(pt.astype(do.dtype), do)
            dpt = dot(v, do, trans_b=True)  # [bk, bq]
            dst = pt * (dpt - delta[None, :])
            dk = dk + dot(dst.astype(q.dtype), q)
            return dk, dv

        return run_blocks(ranges, body, carry)

    h = k.shape[-1]
    zeros = jnp.zeros((bk, h), jnp.float32)
    if groups == 1:
        dk, dv = group_body(0, (zeros, zeros))
    else:
        dk, dv = lax.fori_loop(0, groups, group_body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


@functools.partial(jax.jit, static_argnames=("spec", "blocks", "scale", "interpret"))
def flash_backward(q, k, v, q_seg, kv_seg, out, lse, do, dlse, offset=None, *, spec: MaskSpec, blocks: BlockSizes,
                   scale: float, interpret: bool):
    """Padded inputs as flash_forward; lse [B,N,Tp] natural log; dlse its cotangent. Returns dq, dk, dv."""
    b, tp, n, h = q.shape
    sp, kh = k.shape[1], k.shape[2]
    groups = n // kh
    # Per-row terms in fp32, [B, N, Tp]: delta = rowsum(dO * O) - dLSE, and lse in base 2 with empty rows at +inf
    # so that their P is exactly 0.
    delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse
    lse2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E)

    # ---- dq ----
    bq, bk = blocks.block_q_dq, blocks.block_k_dq
    nq = tp // bq

    def qmap(i, bi, hi):
        return bi, nq - 1 - i, hi, 0

    def rowmap(i, bi, hi):
        return bi, hi, nq - 1 - i

    def kvmap(i, bi, hi):
        return bi, 0, hi // groups, 0

    in_specs = [pl.BlockSpec((None, bq, None, h), qmap),
                pl.BlockSpec((None, sp, None, h), kvmap),
                pl.BlockSpec((None, sp, None, h), kvmap),
                pl.BlockSpec((None, bq, None, h), qmap),
                pl.BlockSpec((None, None, bq), rowmap),
                pl.BlockSpec((None, None, bq), rowmap)]
    args = [q, k, v, do, lse2, delta]
    if spec.dynamic_offset:
        offset_spec, offset = offset_input(offset)
        in_specs.append(offset_spec)
        args.append(offset)
    if spec.segments:
        seg_specs, seg_args = query_block_segment_inputs(q_seg, kv_seg, bq, bk, sp, nq)
        in_specs += seg_specs
        args += seg_args
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec, bq=bq, bk=bk, scale=scale, n_q_blocks=nq),
        grid=(nq, b, n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, None, h), qmap),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(blocks.num_warps_dq, blocks.num_stages_dq),
        interpret=interpret,
        name="mjax_flash_bwd_dq",
    )(*args)

    # ---- dk, dv ----
    bq, bk = blocks.block_q_dkv, blocks.block_k_dkv
    nk = sp // bk
    q5 = q.reshape(b, tp, kh, groups, h)  # free: heads are contiguous per KV group
    do5 = do.reshape(b, tp, kh, groups, h)
    lse4 = lse2.reshape(b, kh, groups, tp)
    delta4 = delta.reshape(b, kh, groups, tp)

    def kmap(j, bi, hi):
        return bi, j, hi, 0

    def grpmap(j, bi, hi):
        return bi, 0, hi, 0, 0

    def grprowmap(j, bi, hi):
        return bi, hi, 0, 0

    in_specs = [pl.BlockSpec((None, tp, None, groups, h), grpmap),
                pl.BlockSpec((None, bk, None, h), kmap),
                pl.BlockSpec((None, bk, None, h), kmap),
                pl.BlockSpec((None, tp, None, groups, h), grpmap),
                pl.BlockSpec((None, None, groups, tp), grprowmap),
                pl.BlockSpec((None, None, groups, tp), grprowmap)]
    args = [q5, k, v, do5, lse4, delta4]
    if spec.dynamic_offset:
        in_specs.append(offset_input(offset)[0])
        args.append(offset)
    if spec.segments:
        _, _, q_lo, q_hi = segment_block_bounds(q_seg, kv_seg, bq, bk)
        in_specs += [pl.BlockSpec((None, tp), lambda j, bi, hi: (bi, 0)),
                     pl.BlockSpec((None, bk), lambda j, bi, hi: (bi, j)),
                     pl.BlockSpec((None, None), lambda j, bi, hi: (bi, j)),
                     pl.BlockSpec((None, None), lambda j, bi, hi: (bi, j))]
        args += [q_seg, kv_seg, q_lo, q_hi]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, spec=spec, bq=bq, bk=bk, scale=scale, groups=groups),
        grid=(nk, b, kh),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bk, None, h), kmap), pl.BlockSpec((None, bk, None, h), kmap)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=compiler_params(blocks.num_warps_dkv, blocks.num_stages_dkv),
        interpret=interpret,
        name="mjax_flash_bwd_dkv",
    )(*args)
    return dq, dk, dv
