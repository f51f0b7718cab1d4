"""The warp-specialised Mosaic GPU grouped matmul kernels (tiles with num_warps 8 or 12): a memory warpgroup issues
the TMA loads and one (8 warps) or two (12 warps) compute warpgroups issue the wgmmas, so the loads of a program's
next output tile start while the compute warpgroups are still storing the last one (the single-warpgroup kernels of
mosaic.py refill their pipeline after every tile), and the tile's TMA stores run on under the next tile's products.
Two compute warpgroups split the output tile's columns: each holds a [block_m, block_n / 2] accumulator, so a
128 x 256 tile (more operand reuse per loaded byte than one warpgroup's 128 x 192) fits the registers.
tiling.default_mosaic_tiling gives these tiles by default. The work lists, operand masking and row-slice stores are
those of mosaic.py.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mjax.kernels.grouped_matmul.mosaic_parts import (TMA_ROWS, live_visit, live_visits, mask_group_edges, store_rows,
                                                      swizzled, wgrad_bounds)
from mjax.kernels.grouped_matmul.schedule import max_row_tiles, row_tiles
from mjax.kernels.grouped_matmul.tiling import KernelTile, mosaic_compute_warpgroups, mosaic_epilogue_cols

MEMORY_REGISTERS = 40  # the memory warpgroup only computes addresses; the compute ones share the rest
REGISTER_FILE = 512  # registers a thread if one warpgroup had the SM's 64 Ki alone


def compute_registers(n_compute: int) -> int:
    """What emit_pipeline_warp_specialized gives a compute warpgroup (setmaxnreg: at most 256, a multiple of 8)."""
    return min(256, (REGISTER_FILE - MEMORY_REGISTERS) // n_compute // 8 * 8)


def _pipeline(body, context, specs, grid, stages, n_compute, **chaining):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=grid, memory_registers=MEMORY_REGISTERS, in_specs=specs, wg_axis="wg", num_compute_wgs=n_compute,
        max_concurrent_steps=stages, compute_context=context, **chaining)


def _kernel(body, out_type, scratch, num_sms, n_compute, interpret):
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(num_sms,), grid_names=("sm",),
        num_threads=n_compute + 1, thread_name="wg", interpret=interpret,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def _columns(ref, wg, width: int, axis: int):
    """The `width` columns (along `axis`) of compute warpgroup wg's share of a shared-memory tile."""
    if width == ref.shape[axis]:  # one compute warpgroup: all of it
        return ref
    index = [slice(None), slice(None)]
    index[axis] = pl.ds(pl.multiple_of(wg * width, width), width)
    return ref.at[tuple(index)]


def row_block_matmul(a, w, group_sizes, *, tile: KernelTile, transpose_w: bool, num_sms: int, interpret):
    """out [M, C] = a [M, D] . w[g] [D, C] per group (transpose_w: w[g] [C, D] contracted transposed); zero rows
    past sum(group_sizes).

    A program's tiles run as one chained pipeline (`pipeline_state`): after its first tile the memory warpgroup
    never drains, so the next tile's first loads are in flight while this tile's last products and its stores
    run. Chaining needs the depth steps to be a multiple of num_stages (else each tile drains the ring) and the
    pipeline's own release of a stage right after its step (delay_release=0); the compute warpgroups release each
    stage themselves one step later, once the wgmma that reads it is done (manual consumed barriers), so
    consecutive wgmmas still overlap."""
    rows, depth = a.shape
    groups = w.shape[0]
    cols = w.shape[1] if transpose_w else w.shape[2]
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    n_compute = mosaic_compute_warpgroups(tile)
    wg_cols, epi_cols = bn // n_compute, mosaic_epilogue_cols(tile, a.dtype.itemsize)
    visits = row_tiles(group_sizes, rows, bm, TMA_ROWS)  # [4, T]
    live = live_visits(visits, groups)  # [1]
    n_visits, n_col_blocks = max_row_tiles(rows, groups, bm), -(-cols // bn)
    tf = swizzled(a.dtype)
    steps = depth // bk
    stages = min(tile.num_stages, steps)
    chained = steps % stages == 0

    def specs(j):  # a: the visit's window of rows; w: its group's weights
        w_spec = (plgpu.BlockSpec((bn, bk), lambda d: (j, d), transforms=tf) if transpose_w
                  else plgpu.BlockSpec((bk, bn), lambda d: (d, j), transforms=tf))
        return [plgpu.BlockSpec((bm, bk), lambda d: (0, d), transforms=tf), w_spec]

    def pipeline(body, context, j, state):
        return _pipeline(body, context, specs(j), (steps,), stages, n_compute,
                         pipeline_state=state if chained else None, manual_consumed_barriers=True)

    def body(visits_gmem, live_gmem, a_gmem, w_gmem, out_gmem, o_smem):
        # One allocation for all tiles (the specs' shapes are all it depends on): no barrier between tiles.
        allocations = pipeline(None, None, 0, None).get_allocations(a_gmem.at[pl.ds(0, bm)], w_gmem.at[0])

        @functools.partial(pl.run_scoped, allocs=allocations, collective_axes="wg")
        def _(allocs):
            wg = lax.axis_index("wg")
            is_compute = wg < n_compute
            staging = o_smem.at[jnp.minimum(wg, n_compute - 1)]  # this compute warpgroup's [bm, epi_cols]

            def release(step):  # the stage of depth step `step` may be overwritten
                for barrier in allocs["flat_consumed_barrier_refs"]:
                    plgpu.barrier_arrive(barrier.at[lax.rem(step, stages)])

            def mma(idx, a_smem, w_smem, _a_consumed, _w_consumed, acc_ref):
                if transpose_w:  # w_smem [bn, bk]: this warpgroup's rows, contracted transposed
                    plgpu.wgmma(acc_ref, a_smem, _columns(w_smem, wg, wg_cols, 0).transpose((1, 0)))
                else:
                    plgpu.wgmma(acc_ref, a_smem, _columns(w_smem, wg, wg_cols, 1))
                plgpu.wgmma_wait(1)  # the previous step's wgmma is done with its stage

                @pl.when(idx[0] > 0)
                def _():
                    release(idx[0] - 1)

                return acc_ref

            @plgpu.nd_loop((n_visits * n_col_blocks,), collective_axes="sm", init_carry=jnp.int32(0))
            def _(loop_info: plgpu.NDLoopInfo, carry):
                seg, row0, first, last, j = live_visit(visits_gmem, live_gmem[0], loop_info.index[0], n_col_blocks,
                                                       tile.group_m, groups)
                window = a_gmem.at[pl.ds(pl.multiple_of(row0, TMA_ROWS), bm)]  # past M: TMA reads zeros
                col0 = j * bn + wg * wg_cols

                def store(acc):  # acc [bm, wg_cols]: in epi_cols slices through the staging tile
                    for e in range(0, wg_cols, epi_cols):
                        @pl.when(col0 + e < cols)  # a partial column tile's warpgroups past C store nothing
                        def _(e=e):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores have read staging
                            part = acc if epi_cols == wg_cols else acc[:, e:e + epi_cols]
                            store_rows(part, staging, out_gmem, row0, first - row0, last - first, col0 + e, bm,
                                       epi_cols)

                def context(run):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, wg_cols)))
                    def _(acc_ref):
                        run(acc_ref)
                        plgpu.wgmma_wait(0)
                        release(steps - 1)
                        store(acc_ref[...])

                # The first tile of this program fills the ring; the others find it filled (no STOP: the ring
                # is not drained at the end, every load issued is consumed).
                state = jnp.where(carry > 0, int(plgpu.PipelinePipeline.STEADY), int(plgpu.PipelinePipeline.START))

                @pl.when(seg < groups)
                def _():
                    pipeline(mma, context, j, state)(window, w_gmem.at[seg], allocations=allocs)

                @pl.when((seg == groups) & is_compute)  # the padding rows: zeros
                def _():
                    store(plgpu.layout_cast(jnp.zeros((bm, wg_cols), jnp.float32), plgpu.Layout.WGMMA))

                return carry | (seg < groups).astype(jnp.int32)

            plgpu.wait_smem_to_gmem(0)

    kernel = _kernel(body, jax.ShapeDtypeStruct((rows, cols), a.dtype),
                     [plgpu.SMEM((n_compute, bm, epi_cols), a.dtype)], num_sms, n_compute, interpret)
    return kernel(visits, live, a, w)


def wgrad(x, dy, group_sizes, *, tile: KernelTile, num_sms: int, interpret):
    """dw [G, K, N] = x_g^T dy_g per group, zeros for an empty group.

    A tile's trip count (its group's chunks) is known only at run time, which `emit_pipeline_warp_specialized`
    cannot chain, so the ring is driven here: all warpgroups walk the program's tiles in the same order and count
    the chunks of all of them as one sequence of steps; step s uses stage s % num_stages. The memory warpgroup
    loads step s once the compute warpgroups have released step s - num_stages (never waiting at a tile's end); a
    compute warpgroup releases a step once the wgmma after it is issued and the one reading it is done, and a
    tile's last step after its final wgmma_wait. Each compute warpgroup masks the dy columns it multiplies; both
    mask all of x when they must, with no barrier between them: each rewrites every element of the tile with the
    value it already holds or with zero, so whichever write lands, and whenever the other's wgmma reads, it reads
    the bits it would have read alone."""
    (rows, k), n = x.shape, dy.shape[1]
    groups = group_sizes.shape[0]
    bm, bn, bk, stages = tile.block_m, tile.block_n, tile.block_k, tile.num_stages
    n_compute = mosaic_compute_warpgroups(tile)
    wg_cols, epi_cols = bn // n_compute, mosaic_epilogue_cols(tile, x.dtype.itemsize)
    bounds = wgrad_bounds(group_sizes, rows, bk)  # [5, G]
    n_k_blocks, n_n_blocks = k // bm, n // bn
    tf = swizzled(x.dtype)

    def body(bounds_gmem, x_gmem, dy_gmem, dw_gmem, o_smem):
        def each_tile(per_tile):
            """per_tile(g, i, j, bounds of g, first step) for this program's tiles, in the same order on all
            warpgroups."""
            @plgpu.nd_loop((groups, n_k_blocks * n_n_blocks), collective_axes="sm", init_carry=jnp.int32(0))
            def _(loop_info: plgpu.NDLoopInfo, carry):
                g = loop_info.index[0]
                i, j = plgpu.planar_snake(loop_info.index[1], (n_k_blocks, n_n_blocks), 1, tile.group_m)
                group = tuple(bounds_gmem[r, g] for r in range(5))  # start, end, origin, n_chunks, into_padding
                per_tile(g, i, j, group, carry)  # carry: the first step of this tile
                return carry + group[3]

        @functools.partial(pl.run_scoped, x_ring=plgpu.SMEM((stages, bk, bm), x.dtype, transforms=tf),
                           dy_ring=plgpu.SMEM((stages, bk, bn), dy.dtype, transforms=tf),
                           produced=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
                           consumed=plgpu.Barrier(num_arrivals=n_compute, num_barriers=stages),
                           collective_axes="wg")
        def _(x_ring, dy_ring, produced, consumed):
            wg = lax.axis_index("wg")

            @pl.when(wg == n_compute)
            def _():
                plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

                def load(g, i, j, group, first_step):
                    _, _, origin, n_chunks, _ = group

                    @pl.loop(0, n_chunks)
                    def _(c):
                        step = first_step + c
                        slot = lax.rem(step, stages)

                        @pl.when(step >= stages)
                        def _():
                            plgpu.barrier_wait(consumed.at[slot])

                        chunk = pl.ds(pl.multiple_of(origin + c * bk, TMA_ROWS), bk)  # past M: TMA reads zeros
                        plgpu.copy_gmem_to_smem(x_gmem.at[chunk, pl.ds(i * bm, bm)], x_ring.at[slot],
                                                produced.at[slot])
                        plgpu.copy_gmem_to_smem(dy_gmem.at[chunk, pl.ds(j * bn, bn)], dy_ring.at[slot],
                                                produced.at[slot])

                each_tile(load)

            @pl.when(wg < n_compute)
            def _():
                plgpu.set_max_registers(compute_registers(n_compute), action="increase")
                staging = o_smem.at[jnp.minimum(wg, n_compute - 1)]  # this compute warpgroup's [bm, epi_cols]

                def compute(g, i, j, group, first_step):
                    start, end, origin, n_chunks, into_padding = group

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, wg_cols)))
                    def _(acc_ref):
                        @pl.loop(0, n_chunks)
                        def _(c):
                            step = first_step + c
                            slot = lax.rem(step, stages)
                            plgpu.barrier_wait(produced.at[slot])
                            x_smem, dy_smem = x_ring.at[slot], _columns(dy_ring.at[slot], wg, wg_cols, 1)
                            mask_group_edges(c, n_chunks, start, end, origin, into_padding, bk, x_smem, dy_smem)
                            plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)  # [bk, bm]^T [bk, wg_cols]
                            plgpu.wgmma_wait(1)  # the previous step's wgmma is done with its stage

                            @pl.when(c > 0)
                            def _():
                                plgpu.barrier_arrive(consumed.at[lax.rem(step - 1, stages)])

                        plgpu.wgmma_wait(0)

                        @pl.when(n_chunks > 0)
                        def _():
                            plgpu.barrier_arrive(consumed.at[lax.rem(first_step + n_chunks - 1, stages)])

                        acc = acc_ref[...]  # no chunks (an empty group): the zero accumulator
                        col0 = j * bn + wg * wg_cols
                        for e in range(0, wg_cols, epi_cols):
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores have read staging
                            staging[...] = (acc if epi_cols == wg_cols else acc[:, e:e + epi_cols]).astype(x.dtype)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(staging, dw_gmem.at[g, pl.ds(i * bm, bm),
                                                                         pl.ds(col0 + e, epi_cols)])

                each_tile(compute)
                plgpu.wait_smem_to_gmem(0)

    kernel = _kernel(body, jax.ShapeDtypeStruct((groups, k, n), x.dtype),
                     [plgpu.SMEM((n_compute, bm, epi_cols), x.dtype, transforms=tf)], num_sms, n_compute,
                     interpret)
    return kernel(bounds, x, dy)
