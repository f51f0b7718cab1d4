"""Flash-attention forward kernel (Pallas, Triton lowering): online softmax in base 2, fp32 accumulation.

Grid (query blocks, batch, q heads); query blocks run heaviest-first under a causal mask. K/V blocks cover the
whole (padded) key axis of one KV head, picked by q_head // groups in the index map (GQA/MQA without repeating
K/V). Writes the output and the log-sum-exp [B, N, T] in natural log; a row that sees no key gets 0 and -inf.
"""

import functools

import jax
import jax.numpy as jnp

from mjax.kernels.attention.flash_common import (LN2, LOG2E, BlockSizes, MaskSpec, compiler_params, dot, kernel_refs,
                                                 offset_input, pl, query_block_segment_inputs, run_blocks)


def _forward_kernel(*refs, spec: MaskSpec, bq: int, bk: int, scale: float, n_q_blocks: int):
    (q_ref, k_ref, v_ref), spec, (qseg_ref, kseg_ref, lo_ref, hi_ref), (o_ref, lse_ref) = kernel_refs(refs, spec, 3, 2)
    seg_bounds = (lo_ref[...], hi_ref[...]) if spec.segments else None
    qi = n_q_blocks - 1 - pl.program_id(0)
    q = q_ref[...]  # [bq, H]
    q_rows = qi * bq + jnp.arange(bq, dtype=jnp.int32)
    q_seg = qseg_ref[...] if spec.segments else None
    qk_scale = scale * LOG2E

    def body(j, carry, masked):
        acc, m, l = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]  # [bk, H]
        v = v_ref[pl.ds(start, bk), :]
        s = dot(q, k, trans_b=True) * qk_scale  # [bq, bk], log2 domain
        s, any_mask = spec.apply(s, q_rows, start + jnp.arange(bk, dtype=jnp.int32), masked=masked, row_seg=q_seg,
                                 col_seg=kseg_ref[pl.ds(start, bk)] if spec.segments else None)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if any_mask else m_new
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
        return acc, m_new, l

    h = q.shape[-1]
    carry = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, l = run_blocks(spec.kv_block_ranges(qi, bq, bk, seg_bounds), body, carry)
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log2(l)) * LN2  # -inf where the row saw nothing


@functools.partial(jax.jit, static_argnames=("spec", "blocks", "scale", "interpret"))
def flash_forward(q, k, v, q_seg, kv_seg, offset=None, *, spec: MaskSpec, blocks: BlockSizes, scale: float,
                  interpret: bool):
    """q [B,Tp,N,H], k/v [B,Sp,K,H] padded to the block multiples, offset [B] int32 (spec.dynamic_offset) or None;
    returns out [B,Tp,N,H], lse [B,N,Tp] fp32."""
    b, tp, n, h = q.shape
    sp, kh = k.shape[1], k.shape[2]
    groups = n // kh
    bq, bk = blocks.block_q, blocks.block_k
    nq = tp // bq

    def qmap(i, bi, hi):
        return bi, nq - 1 - i, hi, 0

    def kvmap(i, bi, hi):
        return bi, 0, hi // groups, 0

    in_specs = [pl.BlockSpec((None, bq, None, h), qmap),
                pl.BlockSpec((None, sp, None, h), kvmap),
                pl.BlockSpec((None, sp, None, h), kvmap)]
    args = [q, k, v]
    if spec.dynamic_offset:
        offset_spec, offset = offset_input(offset)
        in_specs.append(offset_spec)
        args.append(offset)
    if spec.segments:
        seg_specs, seg_args = query_block_segment_inputs(q_seg, kv_seg, bq, bk, sp, nq)
        in_specs += seg_specs
        args += seg_args
    kernel = functools.partial(_forward_kernel, spec=spec, bq=bq, bk=bk, scale=scale, n_q_blocks=nq)
    return pl.pallas_call(
        kernel,
        grid=(nq, b, n),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, h), qmap),
                   pl.BlockSpec((None, None, bq), lambda i, bi, hi: (bi, hi, nq - 1 - i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, tp), jnp.float32)],
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages),
        interpret=interpret,
        name="mjax_flash_fwd",
    )(*args)
