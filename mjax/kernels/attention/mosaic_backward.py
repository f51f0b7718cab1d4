"""Flash-attention backward on Hopper in Pallas Mosaic GPU: a dq kernel and a dk/dv kernel, each with two compute
warpgroups over their own tiles of rows and one memory warpgroup streaming the other operand's blocks by TMA
(the runs and the union walk of mosaic_common.py).

    dq kernel   persistent over (query tiles, q heads, batch):  S = Q K^T, P = exp2(S c - lse2), dP = dO V^T,
                dS = P (dP - delta), dQ += dS K        (K, V streamed)
    dkv kernel  persistent over (key tiles, KV heads, batch):   S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T,
                dS^T = P^T (dP^T - delta), dK += dS^T Q (Q, dO, lse2, delta streamed for every query head of the
                KV head's group: GQA gradients are summed in registers, K/V never repeated)

lse2 is the forward's log-sum-exp in base 2 (+inf for rows that saw no key, so their P is 0) and delta
= rowsum(O dO) - dlse (the log-sum-exp's own cotangent enters there), both [B, N, T] float32.
`parts` picks which of dk and dv the dkv kernel accumulates: head dim 256 holds only one [64, 256] float32
accumulator per warpgroup in registers, so it runs the kernel twice (("dk",), ("dv",)).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mjax.kernels.attention.mosaic_common import (LOG2E, MosaicMask, compute_items, item_buffers, own_runs,
                                                  position_mask, stream_kv, tile_transforms, union_range,
                                                  walk_union)
from mjax.kernels.attention.persistent import deal, persistent_work, persistent_works

WGMMA = plgpu.Layout.WGMMA
ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)  # a vector along an accumulator's rows / columns


def _segment_ids(ref, batch, start, size, layout):
    return plgpu.load(ref.at[batch, pl.ds(start, size)], layout=layout, optimized=False)


def _dq(ranges, offset, q_seg, kv_seg, q, k, v, do, lse2, delta, *, mask: MosaicMask, scale: float, block_q: int,
        block_kv: int, stages: int, num_sms: int, order: str, interpret):
    """Persistent like the forward (mosaic_forward.py): one program per SM works through its (query tile, head, batch
    row) items in `order`, the K/V ring streaming on from one item into the next and the next item's Q, dO, lse2
    and delta loading into a second buffer (where shared memory has room) while this one runs."""
    b, t, n, h = q.shape
    groups = n // k.shape[2]
    dtype = jnp.dtype(q.dtype)
    n_tiles = t // (2 * block_q)
    qk_scale = scale * LOG2E
    segments = mask.segments
    ring_bytes = 2 * stages * block_kv * h * dtype.itemsize
    item_bytes = 2 * 2 * block_q * h * dtype.itemsize  # both warpgroups' Q and dO tiles
    buffers = item_buffers(ring_bytes, item_bytes)

    def kernel(*refs):
        n_in = 11 if segments else 9
        ins, (dq_ref,), scratch = refs[:n_in], refs[n_in:n_in + 1], refs[n_in + 1:]
        if segments:
            ranges_ref, deal_ref, offset_ref, qseg_ref, kseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        else:
            ranges_ref, deal_ref, offset_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        q_smem4, do_smem4, lse_smem4, delta_smem4, k_smem, v_smem, q_bar, k_bar, v_bar, k_free, v_free = scratch
        sm = lax.axis_index("sm")
        wg = lax.axis_index("wg")
        my_works = persistent_works(sm, n_tiles * n * b, num_sms)

        def work(i):
            """(tile, q head, batch row, key blocks [lo_all, hi_all)) of this program's i-th item."""
            tile, q_head, batch = persistent_work(sm, i, num_sms, n, n_tiles, deal_ref)
            return tile, q_head, batch, *union_range(ranges_ref, batch, 2 * tile)

        def copy_item(i, buffer):
            tile, q_head, batch = persistent_work(sm, i, num_sms, n, n_tiles, deal_ref)
            rows = pl.ds(tile * (2 * block_q) + wg * block_q, block_q)
            bar = q_bar.at[2 * buffer + wg]
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, q_head], q_smem4.at[buffer, wg], bar)
            plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, q_head], do_smem4.at[buffer, wg], bar)
            plgpu.copy_gmem_to_smem(lse_ref.at[batch, q_head, rows], lse_smem4.at[buffer, wg], bar)
            plgpu.copy_gmem_to_smem(delta_ref.at[batch, q_head, rows], delta_smem4.at[buffer, wg], bar)

        def compute_work(i, base):
            """One item; base: how many K/V blocks this program streamed before it (the ring's position)."""
            tile, q_head, batch, lo_all, hi_all = work(i)
            buffer = lax.rem(i, buffers)  # traced even for one buffer: the run_state scopes close over it
            if buffers == 2:
                @pl.when(i + 1 < my_works)  # the next item's operands load while this one runs
                def _():
                    copy_item(i + 1, 1 - buffer)
            else:  # no room for a second buffer (head dim 256): the operands load here
                copy_item(i, buffer)
            q_smem, do_smem = q_smem4.at[buffer, wg], do_smem4.at[buffer, wg]
            row0 = tile * (2 * block_q) + wg * block_q
            rows = pl.ds(row0, block_q)
            q_ids = _segment_ids(qseg_ref, batch, row0, block_q, ROWS) if segments else None
            q_off = offset_ref[batch]
            plgpu.barrier_wait(q_bar.at[2 * buffer + wg])
            lse = plgpu.load(lse_smem4.at[buffer, wg], layout=ROWS)
            dlt = plgpu.load(delta_smem4.at[buffer, wg], layout=ROWS)
            shape = (block_q, block_kv)

            def slot_of(j):
                return lax.rem(base + j - lo_all, jnp.array(stages, jnp.int32))

            def step(j, dq, masked: bool):
                slot = slot_of(j)
                # issued before the wgmmas, so the global-memory latency hides behind them
                k_ids = _segment_ids(kseg_ref, batch, j * block_kv, block_kv, COLS) if masked and segments else None
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                zeros = plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), WGMMA)

                def s_dp(refs):  # both products behind one wgmma wait
                    s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(dp_ref, do_smem, v_smem.at[slot].transpose((1, 0)))

                s, dp = pl.run_state(s_dp)((plgpu.ACC.init(zeros), plgpu.ACC.init(zeros)))
                plgpu.barrier_arrive(v_free.at[slot])
                p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(lse, shape, [0]))
                if masked:
                    r = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WGMMA)
                    c = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WGMMA)
                    keep = position_mask(mask, r + (row0 + q_off), c + j * block_kv)
                    if segments:
                        keep = keep & (lax.broadcast_in_dim(q_ids, shape, [0])
                                       == lax.broadcast_in_dim(k_ids, shape, [1]))
                    p = jnp.where(keep, p, 0.0)
                ds = p * (dp - lax.broadcast_in_dim(dlt, shape, [0]))

                def dq_scope(acc_ref):
                    plgpu.wgmma(acc_ref, ds.astype(dtype), k_smem.at[slot])

                dq = pl.run_state(dq_scope)(plgpu.ACC.init(dq))
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            def skip(j, dq):
                slot = slot_of(j)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            dq = plgpu.layout_cast(jnp.full((block_q, h), 0, jnp.float32), WGMMA)
            dq = walk_union(lo_all, hi_all, own_runs(ranges_ref, batch, 2 * tile + wg), step, skip, dq)
            q_smem[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[batch, rows, q_head])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the buffer is written again by a later item
            return base + hi_all - lo_all

        pl.when(wg < 2)(lambda: compute_items(my_works, compute_work, copy_item, buffers))

        pl.when(wg == 2)(lambda: stream_kv(my_works, work, groups, block_kv, stages, k_ref, v_ref, k_smem, v_smem,
                                           k_bar, v_bar, k_free, v_free))

    tf = tile_transforms()
    scratch = [
        plgpu.SMEM((buffers, 2, block_q, h), dtype, transforms=tf),  # [buffer, warpgroup]: Q, then dQ
        plgpu.SMEM((buffers, 2, block_q, h), dtype, transforms=tf),
        plgpu.SMEM((buffers, 2, block_q), jnp.float32),
        plgpu.SMEM((buffers, 2, block_q), jnp.float32),
        plgpu.SMEM((stages, block_kv, h), dtype, transforms=tf),
        plgpu.SMEM((stages, block_kv, h), dtype, transforms=tf),
        plgpu.Barrier(num_arrivals=4, num_barriers=2 * buffers),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ]
    segs = (q_seg, kv_seg) if segments else ()
    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct(q.shape, dtype), scratch_types=scratch,
        grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg", interpret=interpret,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(ranges, deal(ranges, n, num_sms, order), offset, *segs, q, k, v, do, lse2, delta)


def _dkv(ranges, offset, q_seg, kv_seg, q, k, v, do, lse2, delta, *, mask: MosaicMask, scale: float, block_q: int,
         block_kv: int, stages: int, parts: tuple, num_sms: int, order: str, interpret):
    """Persistent over (key tile, KV head, batch row) items like the dq kernel (a causal key tile t sees the
    queries from t on: the deal's sort puts the first tiles first)."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    groups = n // kh
    dtype = jnp.dtype(q.dtype)
    n_tiles = s // (2 * block_kv)
    qk_scale = scale * LOG2E
    segments = mask.segments
    want_dk, want_dv = "dk" in parts, "dv" in parts
    ring_bytes = 2 * stages * block_q * h * dtype.itemsize
    item_bytes = 2 * 2 * block_kv * h * dtype.itemsize  # both warpgroups' K and V tiles
    buffers = item_buffers(ring_bytes, item_bytes)

    def kernel(*refs):
        n_in = 11 if segments else 9
        n_out = len(parts)
        ins, outs, scratch = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
        if segments:
            ranges_ref, deal_ref, offset_ref, qseg_ref, kseg_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        else:
            ranges_ref, deal_ref, offset_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = ins
        out_refs = dict(zip(parts, outs))
        (k_smem4, v_smem4, q_smem, do_smem, lse_smem, delta_smem,
         kv_bar, q_bar, do_bar, q_free, do_free) = scratch
        sm = lax.axis_index("sm")
        wg = lax.axis_index("wg")
        my_works = persistent_works(sm, n_tiles * kh * b, num_sms)

        def item(i):
            """(key tile, KV head, batch row) of this program's i-th item."""
            return persistent_work(sm, i, num_sms, kh, n_tiles, deal_ref)

        def work(i):
            """item(i) and the query blocks [lo_all, hi_all) its two key tiles visit."""
            tile, kv_head, batch = item(i)
            return tile, kv_head, batch, *union_range(ranges_ref, batch, 2 * tile)

        def copy_item(i, buffer):
            tile, kv_head, batch = item(i)
            rows = pl.ds(tile * (2 * block_kv) + wg * block_kv, block_kv)
            bar = kv_bar.at[2 * buffer + wg]
            plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, kv_head], k_smem4.at[buffer, wg], bar)
            plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, kv_head], v_smem4.at[buffer, wg], bar)

        def compute_work(i, base):
            """One item; base: how many query-side stages this program streamed before it (the ring's position)."""
            tile, kv_head, batch, lo_all, hi_all = work(i)
            n_union = hi_all - lo_all
            buffer = lax.rem(i, buffers)  # traced even for one buffer: the run_state scopes close over it
            if buffers == 2:
                @pl.when(i + 1 < my_works)  # the next item's K/V load while this one runs
                def _():
                    copy_item(i + 1, 1 - buffer)
            else:  # no room for a second buffer (head dim 256): K/V load here
                copy_item(i, buffer)
            k_tile, v_tile = k_smem4.at[buffer, wg], v_smem4.at[buffer, wg]
            key0 = tile * (2 * block_kv) + wg * block_kv
            rows = pl.ds(key0, block_kv)
            k_ids = _segment_ids(kseg_ref, batch, key0, block_kv, ROWS) if segments else None
            q_off = offset_ref[batch]
            plgpu.barrier_wait(kv_bar.at[2 * buffer + wg])
            shape = (block_kv, block_q)
            own = own_runs(ranges_ref, batch, 2 * tile + wg)

            def slot_of(g, blk):
                return lax.rem(base + g * n_union + (blk - lo_all), jnp.array(stages, jnp.int32))

            def head_steps(g, carry):
                def step(blk, carry, masked: bool):
                    dk, dv = carry
                    slot = slot_of(g, blk)
                    # issued before the wgmma, so the global-memory latency hides behind it
                    q_ids = _segment_ids(qseg_ref, batch, blk * block_q, block_q, COLS) if masked and segments else None
                    plgpu.barrier_wait(q_bar.at[slot])

                    def st_scope(acc_ref):
                        plgpu.wgmma(acc_ref, k_tile, q_smem.at[slot].transpose((1, 0)))
                        return acc_ref[...]

                    st = pl.run_scoped(st_scope, plgpu.ACC(shape, jnp.float32))
                    lse = plgpu.load(lse_smem.at[slot], layout=COLS)
                    pt = jnp.exp2(st * qk_scale - lax.broadcast_in_dim(lse, shape, [1]))
                    if masked:
                        r = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WGMMA)
                        c = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=WGMMA)
                        keep = position_mask(mask, c + (blk * block_q + q_off), r + key0)
                        if segments:
                            keep = keep & (lax.broadcast_in_dim(k_ids, shape, [0])
                                           == lax.broadcast_in_dim(q_ids, shape, [1]))
                        pt = jnp.where(keep, pt, 0.0)
                    plgpu.barrier_wait(do_bar.at[slot])
                    if want_dk:
                        # dP^T first, alone: P^T's float32 registers end with dS^T, before dV's and dK's
                        # products are issued together, so at most dK, dV and two [64, 64] float32 tiles are live
                        zeros = plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), WGMMA)

                        def dpt_scope(dpt_ref):
                            plgpu.wgmma(dpt_ref, v_tile, do_smem.at[slot].transpose((1, 0)))

                        dpt = pl.run_state(dpt_scope)(plgpu.ACC.init(zeros))
                        dlt = plgpu.load(delta_smem.at[slot], layout=COLS)
                        pt16 = pt.astype(dtype) if want_dv else None
                        dst = (pt * (dpt - lax.broadcast_in_dim(dlt, shape, [1]))).astype(dtype)
                        if want_dv:
                            def dv_dk(refs):  # one wgmma wait for both products
                                dv_ref, dk_ref = refs
                                plgpu.wgmma(dv_ref, pt16, do_smem.at[slot])
                                plgpu.wgmma(dk_ref, dst, q_smem.at[slot])

                            dv, dk = pl.run_state(dv_dk)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                        else:
                            def dk_scope(acc_ref):
                                plgpu.wgmma(acc_ref, dst, q_smem.at[slot])

                            dk = pl.run_state(dk_scope)(plgpu.ACC.init(dk))
                        plgpu.barrier_arrive(do_free.at[slot])
                    else:
                        def dv_scope(acc_ref):
                            plgpu.wgmma(acc_ref, pt.astype(dtype), do_smem.at[slot])

                        dv = pl.run_state(dv_scope)(plgpu.ACC.init(dv))
                        plgpu.barrier_arrive(do_free.at[slot])
                    plgpu.barrier_arrive(q_free.at[slot])
                    return dk, dv

                def skip(blk, carry):
                    slot = slot_of(g, blk)
                    plgpu.barrier_wait(q_bar.at[slot])
                    plgpu.barrier_wait(do_bar.at[slot])
                    plgpu.barrier_arrive(do_free.at[slot])
                    plgpu.barrier_arrive(q_free.at[slot])
                    return carry

                return walk_union(lo_all, hi_all, own, step, skip, carry)

            zero = plgpu.layout_cast(jnp.full((block_kv, h), 0, jnp.float32), WGMMA)
            dk, dv = lax.fori_loop(0, groups, head_steps, (zero if want_dk else None, zero if want_dv else None))
            if want_dk:
                k_tile[...] = (dk * scale).astype(dtype)
            if want_dv:
                v_tile[...] = dv.astype(dtype)
            plgpu.commit_smem()
            if want_dk:
                plgpu.copy_smem_to_gmem(k_tile, out_refs["dk"].at[batch, rows, kv_head])
            if want_dv:
                plgpu.copy_smem_to_gmem(v_tile, out_refs["dv"].at[batch, rows, kv_head])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the buffers are written again by a later item
            return base + groups * n_union

        pl.when(wg < 2)(lambda: compute_items(my_works, compute_work, copy_item, buffers))

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def memory_work(i, base):
                _, kv_head, batch, lo_all, hi_all = work(i)
                n_union = hi_all - lo_all
                per_head = jnp.maximum(n_union, 1)

                @pl.loop(0, groups * n_union)
                def _(c):
                    g, blk = lax.div(c, per_head), lo_all + lax.rem(c, per_head)
                    gc = base + c  # the ring keeps streaming across items; a stage is reused once released
                    slot = lax.rem(gc, jnp.array(stages, jnp.int32))

                    @pl.when(gc >= stages)
                    def _():
                        plgpu.barrier_wait(q_free.at[slot])
                        plgpu.barrier_wait(do_free.at[slot])
                        # The compute warpgroups read lse and delta with plain loads (the generic proxy), and the
                        # TMA writes the stage again through the async proxy: PTX orders accesses across proxies
                        # only through a proxy fence, not through the barrier alone.
                        plgpu.commit_smem()

                    q_head = kv_head * groups + g
                    rows = pl.ds(blk * block_q, block_q)
                    plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, q_head], q_smem.at[slot], q_bar.at[slot])
                    plgpu.copy_gmem_to_smem(lse_ref.at[batch, q_head, rows], lse_smem.at[slot], q_bar.at[slot])
                    plgpu.copy_gmem_to_smem(do_ref.at[batch, rows, q_head], do_smem.at[slot], do_bar.at[slot])
                    plgpu.copy_gmem_to_smem(delta_ref.at[batch, q_head, rows], delta_smem.at[slot],
                                            do_bar.at[slot])

                return base + groups * n_union

            lax.fori_loop(0, my_works, memory_work, jnp.int32(0))

    tf = tile_transforms()
    scratch = [
        plgpu.SMEM((buffers, 2, block_kv, h), dtype, transforms=tf),  # [buffer, warpgroup]: K, then dK
        plgpu.SMEM((buffers, 2, block_kv, h), dtype, transforms=tf),  # V, then dV
        plgpu.SMEM((stages, block_q, h), dtype, transforms=tf),
        plgpu.SMEM((stages, block_q, h), dtype, transforms=tf),
        plgpu.SMEM((stages, block_q), jnp.float32),
        plgpu.SMEM((stages, block_q), jnp.float32),
        plgpu.Barrier(num_arrivals=2, num_barriers=2 * buffers),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
    ]
    segs = (q_seg, kv_seg) if segments else ()
    out_type = [jax.ShapeDtypeStruct(k.shape, dtype) for _ in parts]
    return plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch,
        grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg", interpret=interpret,
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(ranges, deal(ranges, kh, num_sms, order), offset, *segs, q, k, v, do, lse2, delta)


@functools.partial(jax.jit,
                   static_argnames=("mask", "scale", "block_q", "block_kv", "stages", "num_sms", "order",
                                    "interpret"))
def mosaic_dq(ranges, offset, q_seg, kv_seg, q, k, v, do, lse2, delta, *, mask, scale, block_q, block_kv, stages,
              num_sms, order, interpret=None):
    """dq [B,T,N,H] (T a multiple of 2 * block_q, S of block_kv); ranges over key blocks per query tile; num_sms
    programs deal the items in `order` (persistent.py); interpret: the Mosaic GPU interpreter's parameters, or
    None on a GPU."""
    return _dq(ranges, offset, q_seg, kv_seg, q, k, v, do, lse2, delta, mask=mask, scale=scale, block_q=block_q,
               block_kv=block_kv, stages=stages, num_sms=num_sms, order=order, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("mask", "scale", "block_q", "block_kv", "stages", "parts", "num_sms",
                                             "order", "interpret"))
def mosaic_dkv(ranges, offset, q_seg, kv_seg, q, k, v, do, lse2, delta, *, mask, scale, block_q, block_kv, stages,
               parts=("dk", "dv"), num_sms, order, interpret=None):
    """[dk, dv] (those `parts` names) [B,S,K,H] (S a multiple of 2 * block_kv, T of block_q); ranges over query
    blocks per key tile; num_sms programs deal the items in `order` (persistent.py); interpret: as mosaic_dq's."""
    return _dkv(ranges, offset, q_seg, kv_seg, q, k, v, do, lse2, delta, mask=mask, scale=scale, block_q=block_q,
                block_kv=block_kv, stages=stages, parts=parts, num_sms=num_sms, order=order, interpret=interpret)
