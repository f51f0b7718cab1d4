"""Flash-attention forward on Hopper in Pallas Mosaic GPU (FlashAttention-3's structure): per program two compute
warpgroups of block_q query rows each and one memory warpgroup that streams K/V blocks by TMA into a ring of
swizzled shared-memory stages; wgmma for Q K^T and P V; the two compute warpgroups ping-pong on a schedule barrier
so that one's softmax overlaps the other's matmuls.

Persistent: one program per SM works through its share of the (query tile of 2 * block_q rows, head, batch row)
items (persistent.py says in what order). The memory warpgroup keeps the K/V ring streaming from one item into
the next, and the compute warpgroups load the next item's Q into a second buffer (where shared memory has room)
while they work on this one, so an item's prologue (Q load, ring fill) overlaps the previous item's work instead
of idling the SM; the O store's global writes overlap the next item too (only its shared-memory reads are
waited for, as the buffers are reused).

Each warpgroup reads its key-block runs from `ranges` [B, T / block_q, 4] = (lo, full_lo, full_hi, hi) (mosaic.py
computes them from the mask): [lo, full_lo) and [full_hi, hi) are masked (position and segment mask),
[full_lo, full_hi) needs no mask. The memory warpgroup loads the union of the two warpgroups' runs; a warpgroup
steps through the union blocks outside its own runs without computing (it still waits and releases each stage, so
barrier phases stay in step).
Writes out and the log-sum-exp [B, N, T] in natural log (0 and -inf for a row that sees no key).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mjax.kernels.attention.mosaic_common import (LN2, LOG2E, MosaicMask, compute_items, item_buffers, own_runs,
                                                  position_mask, stream_kv, tile_transforms, union_range,
                                                  walk_union)
from mjax.kernels.attention.persistent import deal, persistent_work, persistent_works


def _forward(ranges, offset, q_seg, kv_seg, q, k, v, *, mask: MosaicMask, scale: float, block_q: int,
             block_kv: int, stages: int, num_sms: int, order: str, interpret):
    b, t, n, h = q.shape
    kh = k.shape[2]
    groups = n // kh
    dtype = jnp.dtype(q.dtype)
    n_tiles = t // (2 * block_q)
    ring_bytes = 2 * stages * block_kv * h * dtype.itemsize
    q_bytes = 2 * block_q * h * dtype.itemsize  # both warpgroups' Q (then O) tiles
    q_buffers = item_buffers(ring_bytes, q_bytes)
    qk_scale = scale * LOG2E
    segments = mask.segments

    def kernel(*refs):
        if segments:
            ranges_ref, deal_ref, offset_ref, qseg_ref, kseg_ref, q_ref, k_ref, v_ref, out_ref, lse_ref = refs[:10]
            scratch = refs[10:]
        else:
            ranges_ref, deal_ref, offset_ref, q_ref, k_ref, v_ref, out_ref, lse_ref = refs[:8]
            qseg_ref = kseg_ref = None
            scratch = refs[8:]
        qo_smem4, k_smem, v_smem, lse_smem2, k_bar, v_bar, q_bar, k_free, v_free, sched = scratch
        sm = lax.axis_index("sm")
        wg = lax.axis_index("wg")
        my_works = persistent_works(sm, n_tiles * n * b, num_sms)

        def work(i):
            """(tile, q head, batch row, key blocks [lo_all, hi_all)) of this program's i-th item."""
            tile, q_head, batch = persistent_work(sm, i, num_sms, n, n_tiles, deal_ref)
            return tile, q_head, batch, *union_range(ranges_ref, batch, 2 * tile)

        def schedule_barrier():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        def copy_q(i, buffer):
            tile, q_head, batch = persistent_work(sm, i, num_sms, n, n_tiles, deal_ref)
            row0 = tile * (2 * block_q) + wg * block_q
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(row0, block_q), q_head], qo_smem4.at[buffer, wg],
                                    q_bar.at[2 * buffer + wg])

        def compute_work(i, base):
            """One work item; base: how many K/V blocks this program streamed before it (the ring's position)."""
            tile, q_head, batch, lo_all, hi_all = work(i)
            if q_buffers == 2:
                buffer = lax.rem(i, 2)

                @pl.when(i + 1 < my_works)  # the next item's Q loads while this one runs
                def _():
                    copy_q(i + 1, 1 - buffer)
            else:  # no room for a second buffer (head dim 256): Q loads here
                buffer = 0
                copy_q(i, buffer)
            qo_smem, lse_smem = qo_smem4.at[buffer, wg], lse_smem2.at[wg]
            row0 = tile * (2 * block_q) + wg * block_q
            my_tile = 2 * tile + wg
            q_off = offset_ref[batch]

            q_ids = None
            if segments:  # segment ids are read from global memory straight into registers (L2-cached, small)
                q_ids = plgpu.load(qseg_ref.at[batch, pl.ds(row0, block_q)], layout=plgpu.Layout.WGMMA.reduce(1),
                                   optimized=False)
            plgpu.barrier_wait(q_bar.at[2 * buffer + wg])

            m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((block_q, h), 0, jnp.float32), plgpu.Layout.WGMMA)

            def slot_of(j):
                return lax.rem(base + j - lo_all, jnp.array(stages, jnp.int32))

            def wait_next_k(j):  # K of the next block, waited while this block's P V runs
                @pl.when(j + 1 < hi_all)
                def _():
                    plgpu.barrier_wait(k_bar.at[slot_of(j + 1)])

            def step(j, carry, masked: bool):  # K of block j has been waited for
                acc, m_i, l_i = carry
                slot = slot_of(j)
                k_ids = None
                if masked and segments:  # issued before the QK^T wgmma, so its global-memory latency hides behind it
                    k_ids = plgpu.load(kseg_ref.at[batch, pl.ds(j * block_kv, block_kv)],
                                       layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)

                def qk_scope(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    schedule_barrier()
                    return acc_ref[...]

                qk = pl.run_scoped(qk_scope, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1, layout=plgpu.Layout.WGMMA)
                    keep = position_mask(mask, rows + (row0 + q_off), cols + j * block_kv)
                    if segments:
                        keep = keep & (lax.broadcast_in_dim(q_ids, qk.shape, [0])
                                       == lax.broadcast_in_dim(k_ids, qk.shape, [1]))
                    qk = jnp.where(keep, qk, -jnp.inf)
                m_ij = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
                m_use = jnp.where(m_ij == -jnp.inf, 0.0, m_ij) if masked else m_ij  # rows that saw nothing yet
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_use, qk.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha
                p16 = p.astype(dtype)
                if h <= 128:
                    l_i = l_i + p.sum(axis=1)
                    acc, l_i, m_ij, p16 = lax.optimization_barrier((acc, l_i, m_ij, p16))
                    plgpu.barrier_arrive(sched)
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_wait(sched)
                else:
                    plgpu.barrier_arrive(sched)
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_wait(sched)
                    l_i = l_i + p.sum(axis=1)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next_k(j)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_ij, l_i

            def skip(j, carry):  # a block of the other warpgroup's runs: keep the stages and barriers in step
                slot = slot_of(j)
                plgpu.barrier_arrive(k_free.at[slot])
                schedule_barrier()
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                schedule_barrier()
                wait_next_k(j)
                return carry

            @pl.when(hi_all > lo_all)
            def _():
                plgpu.barrier_wait(k_bar.at[slot_of(lo_all)])

            pl.when(wg == 1)(schedule_barrier)
            acc, m_i, l_i = walk_union(lo_all, hi_all, own_runs(ranges_ref, batch, my_tile), step, skip,
                                       (acc, m_i, l_i))
            pl.when(wg == 0)(schedule_barrier)

            acc = acc / lax.broadcast_in_dim(jnp.where(l_i == 0.0, 1.0, l_i), acc.shape, [0])
            qo_smem[...] = acc.astype(dtype)
            lse_smem[...] = (m_i + jnp.log2(l_i)) * LN2  # -inf where the row saw nothing
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(row0, block_q), q_head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(row0, block_q)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the buffers are written again by the next items
            return base + hi_all - lo_all

        pl.when(wg < 2)(lambda: compute_items(my_works, compute_work, copy_q, q_buffers))

        pl.when(wg == 2)(lambda: stream_kv(my_works, work, groups, block_kv, stages, k_ref, v_ref, k_smem, v_smem,
                                           k_bar, v_bar, k_free, v_free))

    transforms = tile_transforms()
    scratch = [
        plgpu.SMEM((q_buffers, 2, block_q, h), dtype, transforms=transforms),  # [buffer, warpgroup]: Q, then O
        plgpu.SMEM((stages, block_kv, h), dtype, transforms=transforms),
        plgpu.SMEM((stages, block_kv, h), dtype, transforms=transforms),
        plgpu.SMEM((2, block_q), jnp.float32),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=2 * q_buffers),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2),
    ]
    dealt = deal(ranges, n, num_sms, order)  # [B * n_tiles]
    operands = (ranges, dealt, offset, q_seg, kv_seg, q, k, v) if segments else (ranges, dealt, offset, q, k, v)
    return plgpu.kernel(
        kernel,
        out_type=[jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*operands)


@functools.partial(jax.jit,
                   static_argnames=("mask", "scale", "block_q", "block_kv", "stages", "num_sms", "order",
                                    "interpret"))
def mosaic_forward(ranges, offset, q_seg, kv_seg, q, k, v, *, mask: MosaicMask, scale: float, block_q: int,
                   block_kv: int, stages: int, num_sms: int, order: str, interpret=None):
    """out [B,T,N,H], lse [B,N,T] of q [B,T,N,H], k/v [B,S,K,H] (T a multiple of 2 * block_q, S of block_kv), on
    num_sms programs dealing the items in `order` (persistent.py); interpret: the Mosaic GPU interpreter's
    parameters, or None on a GPU."""
    return _forward(ranges, offset, q_seg, kv_seg, q, k, v, mask=mask, scale=scale, block_q=block_q,
                    block_kv=block_kv, stages=stages, num_sms=num_sms, order=order, interpret=interpret)
