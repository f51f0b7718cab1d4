"""The warp-specialised Mosaic GPU grouped matmul kernels (tiles with num_warps=8): a memory warpgroup issues the
TMA loads and a compute warpgroup issues the wgmmas, so the loads of a program's next output tile start while the
compute warpgroup is still storing the last one (the single-warpgroup kernels of mosaic.py refill their pipeline
after every tile), and the tile's TMA stores run on under the next tile's products. The work lists, operand
masking and row-slice stores are those of mosaic.py.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mjax.kernels.grouped_matmul.mosaic_parts import mask_group_edges, store_rows, swizzled, wgrad_bounds
from mjax.kernels.grouped_matmul.schedule import max_row_tiles, row_tiles
from mjax.kernels.grouped_matmul.tiling import KernelTile

MEMORY_REGISTERS = 40  # the memory warpgroup only computes addresses; the compute one takes the rest


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
    visits = row_tiles(group_sizes, rows, bm)  # [4, T]
    n_visits, n_col_blocks = max_row_tiles(rows, groups, bm), -(-cols // bn)
    tf = swizzled(a.dtype)
    steps = depth // bk
    stages = min(tile.num_stages, steps)
    chained = steps % stages == 0

    def specs(block, j):
        w_spec = (plgpu.BlockSpec((bn, bk), lambda d: (j, d), transforms=tf) if transpose_w
                  else plgpu.BlockSpec((bk, bn), lambda d: (d, j), transforms=tf))
        return [plgpu.BlockSpec((bm, bk), lambda d: (block, d), transforms=tf), w_spec]

    def pipeline(body, context, block, j, state):
        return _pipeline(body, context, specs(block, j), (steps,), stages, pipeline_state=state if chained else None,
                         manual_consumed_barriers=True)

    def body(visits_gmem, a_gmem, w_gmem, out_gmem, o_smem):
        # One allocation for all tiles (the specs' shapes are all it depends on): no barrier between tiles.
        allocations = pipeline(None, None, 0, 0, None).get_allocations(a_gmem, w_gmem.at[0])

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
                seg, block, first, last = (visits_gmem[i, t] for i in range(4))
                row0 = block * bm

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
                    pipeline(mma, context, block, j, state)(a_gmem, w_gmem.at[seg], allocations=allocs)

                @pl.when((seg == groups) & is_compute)  # the padding rows: zeros
                def _():
                    store(plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA))

                return carry | (seg < groups).astype(jnp.int32)

            plgpu.wait_smem_to_gmem(0)

    kernel = _kernel(body, jax.ShapeDtypeStruct((rows, cols), a.dtype), [plgpu.SMEM((bm, bn), a.dtype)], num_sms)
    return kernel(visits, a, w)


def wgrad(x, dy, group_sizes, *, tile: KernelTile, num_sms: int):
    """dw [G, K, N] = x_g^T dy_g per group, zeros for an empty group."""
    (rows, k), n = x.shape, dy.shape[1]
    groups = group_sizes.shape[0]
    bm, bn, bk = tile.block_m, tile.block_n, tile.block_k
    bounds = wgrad_bounds(group_sizes, rows, bk)  # [4, G]
    n_k_blocks, n_n_blocks = k // bm, n // bn
    tf = swizzled(x.dtype)

    def specs(i, j):
        return [plgpu.BlockSpec((bk, bm), lambda c: (c, i), transforms=tf, delay_release=1),
                plgpu.BlockSpec((bk, bn), lambda c: (c, j), transforms=tf, delay_release=1)]

    def body(bounds_gmem, x_gmem, dy_gmem, dw_gmem, o_smem):
        # A static grid of num_stages steps allocates what the run-time trip counts use (a static grid shorter
        # than num_stages would shrink the ring).
        allocations = _pipeline(None, None, specs(0, 0), (tile.num_stages,), tile.num_stages).get_allocations(
            x_gmem, dy_gmem)

        @functools.partial(pl.run_scoped, allocs=allocations, collective_axes="wg")
        def _(allocs):
            @plgpu.nd_loop((groups, n_k_blocks * n_n_blocks), collective_axes="sm")
            def _(loop_info: plgpu.NDLoopInfo):
                g = loop_info.index[0]
                i, j = plgpu.planar_snake(loop_info.index[1], (n_k_blocks, n_n_blocks), 1, tile.group_m)
                start, end, block_start, n_chunks = (bounds_gmem[r, g] for r in range(4))

                def mma(c, x_smem, dy_smem, acc_ref):
                    mask_group_edges(c[0], n_chunks, start, end, bk, x_smem, dy_smem)
                    plgpu.wgmma(acc_ref, x_smem.transpose((1, 0)), dy_smem)  # [bk, bm]^T [bk, bn] -> [bm, bn]
                    plgpu.wgmma_wait(1)
                    return acc_ref

                def context(run):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn)))
                    def _(acc_ref):
                        run(acc_ref)  # no chunks (an empty group): the zero accumulator
                        acc = acc_ref[...]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        o_smem[...] = acc.astype(o_smem.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem, dw_gmem.at[g, pl.ds(i * bm, bm), pl.ds(j * bn, bn)])

                group_rows = pl.ds(pl.multiple_of(block_start, bk), rows)  # may run past M: never read there
                _pipeline(mma, context, specs(i, j), (n_chunks,), tile.num_stages)(
                    x_gmem.at[group_rows, :], dy_gmem.at[group_rows, :], allocations=allocs)

            plgpu.wait_smem_to_gmem(0)

    kernel = _kernel(body, jax.ShapeDtypeStruct((groups, k, n), x.dtype),
                     [plgpu.SMEM((bm, bn), x.dtype, transforms=tf)], num_sms)
    return kernel(bounds, x, dy)
