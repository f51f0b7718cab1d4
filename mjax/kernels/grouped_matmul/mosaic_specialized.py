"""The warp-specialised Mosaic GPU grouped matmul kernels (tiles with num_warps=8): a memory warpgroup issues the
TMA loads and a compute warpgroup issues the wgmmas, so the loads of a program's next output tile start while the
compute warpgroup is still storing the last one (the single-warpgroup kernels of mosaic.py refill their pipeline
after every tile), and the tile's TMA stores run on under the next tile's products. tiling.default_mosaic_tiling
gives these tiles by default. The work lists, operand masking and row-slice stores are those of mosaic.py.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mjax.kernels.grouped_matmul.mosaic_parts import TMA_ROWS, mask_group_edges, store_rows, swizzled, wgrad_bounds
from mjax.kernels.grouped_matmul.schedule import max_row_tiles, row_tiles
from mjax.kernels.grouped_matmul.tiling import KernelTile

MEMORY_REGISTERS = 40  # the memory warpgroup only computes addresses; the compute one takes the rest
COMPUTE_REGISTERS = 256  # what emit_pipeline_warp_specialized gives one compute warpgroup (setmaxnreg: at most 256)


def _pipeline(body, context, specs, grid, stages, **chaining):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=grid, memory_registers=MEMORY_REGISTERS, in_specs=specs, wg_axis="wg", num_compute_wgs=1,
        max_concurrent_steps=stages, compute_context=context, **chaining)


def _kernel(body, out_type, scratch, num_sms):
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(num_sms,), grid_names=("sm",), num_threads=2,
        thread_name="wg", compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def row_block_matmul(a, w, group_sizes, *, tile: KernelTile, transpose_w: bool, num_sms: int):
    """out [M, C] = a [M, D] . w[g] [D, C] per group (transpose_w: w[g] [C, D] contracted transposed); zero rows
    past sum(group_sizes).

    A program's tiles run as one chained pipeline (`pipeline_state`): after its first tile the memory warpgroup
    never drains, so the next tile's first loads are in flight while this tile's last products and its stores
    run. Chaining needs the depth steps to be a multiple of num_stages (else each tile drains the ring) and the
    pipeline's own release of a stage right after its step (delay_release=0); the compute warpgroup releases each
    stage itself one step later, once the wgmma that reads it is done (manual consumed barriers), so consecutive
    wgmmas still overlap."""
    rows, depth = a.shape
    groups = w.shape[0]
    cols = w.shape[1] if transpose_w else w.shape[2]
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    visits = row_tiles(group_sizes, rows, bm, TMA_ROWS)  # [4, T]
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
        return _pipeline(body, context, specs(j), (steps,), stages, pipeline_state=state if chained else None,
                         manual_consumed_barriers=True)

    def body(visits_gmem, a_gmem, w_gmem, out_gmem, o_smem):
        # One allocation for all tiles (the specs' shapes are all it depends on): no barrier between tiles.
        allocations = pipeline(None, None, 0, None).get_allocations(a_gmem.at[pl.ds(0, bm)], w_gmem.at[0])

        @functools.partial(pl.run_scoped, allocs=allocations, collective_axes="wg")
        def _(allocs):
            is_compute = lax.axis_index("wg") == 0

            def release(step):  # the stage of depth step `step` may be overwritten
                for barrier in allocs["flat_consumed_barrier_refs"]:
                    plgpu.barrier_arrive(barrier.at[lax.rem(step, stages)])

            def mma(idx, a_smem, w_smem, _a_consumed, _w_consumed, acc_ref):
                plgpu.wgmma(acc_ref, a_smem, w_smem.transpose((1, 0)) if transpose_w else w_smem)
                plgpu.wgmma_wait(1)  # the previous step's wgmma is done with its stage

                @pl.when(idx[0] > 0)
                def _():
                    release(idx[0] - 1)

                return acc_ref

            @plgpu.nd_loop((n_visits * n_col_blocks,), collective_axes="sm", init_carry=jnp.int32(0))
            def _(loop_info: plgpu.NDLoopInfo, carry):
                t, j = plgpu.planar_snake(loop_info.index[0], (n_visits, n_col_blocks), 1, tile.group_m)
                seg, row0, first, last = (visits_gmem[i, t] for i in range(4))
                window = a_gmem.at[pl.ds(pl.multiple_of(row0, TMA_ROWS), bm)]  # past M: TMA reads zeros

                def store(acc):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores have read o_smem
                    store_rows(acc, o_smem, out_gmem, row0, first - row0, last - first, j * bn, bm, bn)

                def context(run):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn)))
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
                    store(plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA))

                return carry | (seg < groups).astype(jnp.int32)

            plgpu.wait_smem_to_gmem(0)

    kernel = _kernel(body, jax.ShapeDtypeStruct((rows, cols), a.dtype), [plgpu.SMEM((bm, bn), a.dtype)], num_sms)
    return kernel(visits, a, w)


def wgrad(x, dy, group_sizes, *, tile: KernelTile, num_sms: int):
    """dw [G, K, N] = x_g^T dy_g per group, zeros for an empty group.

    A tile's trip count (its group's chunks) is known only at run time, which `emit_pipeline_warp_specialized`
    cannot chain, so the ring is driven here: both warpgroups walk the program's tiles in the same order and count
    the chunks of all of them as one sequence of steps; step s uses stage s % num_stages. The memory warpgroup
    loads step s once the compute warpgroup has released step s - num_stages (never waiting at a tile's end); the
    compute warpgroup releases a step once the wgmma after it is issued and the one reading it is done, and a tile's
    last step after its final wgmma_wait."""
    (rows, k), n = x.shape, dy.shape[1]
    groups = group_sizes.shape[0]
    bm, bn, bk, stages = tile.block_m, tile.block_n, tile.block_k, tile.num_stages
    bounds = wgrad_bounds(group_sizes, rows, bk)  # [5, G]
    n_k_blocks, n_n_blocks = k // bm, n // bn
    tf = swizzled(x.dtype)

    def body(bounds_gmem, x_gmem, dy_gmem, dw_gmem, o_smem):
        def each_tile(per_tile):
            """per_tile(g, i, j, bounds of g, first step) for this program's tiles, in the same order on both
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
                           consumed=plgpu.Barrier(num_arrivals=1, num_barriers=stages), collective_axes="wg")
        def _(x_ring, dy_ring, produced, consumed):
            @pl.when(lax.axis_index("wg") == 1)
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

            @pl.when(lax.axis_index("wg") == 0)
            def _():
                plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

                def compute(g, i, j, group, first_step):
                    start, end, origin, n_chunks, into_padding = group

                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn)))
                    def _(acc_ref):
                        @pl.loop(0, n_chunks)
                        def _(c):
                            step = first_step + c
                            slot = lax.rem(step, stages)
                            plgpu.barrier_wait(produced.at[slot])
                            x_smem, dy_smem = x_ring.at[slot], dy_ring.at[slot]
                            mask_group_edges(c, n_chunks, start, end, origin, into_padding, bk, x_smem, dy_smem)
                            plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)  # [bk, bm]^T [bk, bn]
                            plgpu.wgmma_wait(1)  # the previous step's wgmma is done with its stage

                            @pl.when(c > 0)
                            def _():
                                plgpu.barrier_arrive(consumed.at[lax.rem(step - 1, stages)])

                        plgpu.wgmma_wait(0)

                        @pl.when(n_chunks > 0)
                        def _():
                            plgpu.barrier_arrive(consumed.at[lax.rem(first_step + n_chunks - 1, stages)])

                        acc = acc_ref[...]  # no chunks (an empty group): the zero accumulator
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's store has read o_smem
                        o_smem[...] = acc.astype(o_smem.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem, dw_gmem.at[g, pl.ds(i * bm, bm), pl.ds(j * bn, bn)])

                each_tile(compute)
                plgpu.wait_smem_to_gmem(0)

    kernel = _kernel(body, jax.ShapeDtypeStruct((groups, k, n), x.dtype),
                     [plgpu.SMEM((bm, bn), x.dtype, transforms=tf)], num_sms)
    return kernel(bounds, x, dy)
