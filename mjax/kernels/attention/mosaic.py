"""The Mosaic GPU (Hopper) attention kernels behind the flash kernels' interface: block configuration, the block
runs each kernel reads, and the forward / backward ops that `sharded.py` runs per shard.

The runs come from the same range math as the Triton kernels (`MaskSpec.kv_block_ranges` / `q_block_ranges`:
causal, sliding window, key padding, the offset), evaluated per (batch row, tile) in XLA; segment ids narrow the
visited span (`segment_block_bounds`) and shrink the unmasked middle run to the first run of blocks whose ids are
all one document on both sides, so masked blocks are exactly the ones that can hold a masked entry.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from mjax.kernels.attention.errors import AttentionUnsupported
from mjax.kernels.attention.flash_common import LOG2E, MaskSpec, segment_block_bounds
from mjax.kernels.attention.mosaic_backward import mosaic_dkv, mosaic_dq
from mjax.kernels.attention.mosaic_common import MosaicMask
from mjax.kernels.attention.mosaic_forward import mosaic_forward
from mjax.kernels.attention.persistent import deal_order
from mjax.kernels.device import mosaic_interpreter, mosaic_interpreter_problem, sm_count

HEAD_DIMS = (64, 128, 256)  # wgmma tiles of 64 columns; other head dims are zero-padded up to the next of these
INTERPRET_PROGRAMS = 3  # interpreted, a few programs, so that a program deals itself several items


@dataclasses.dataclass(frozen=True)
class MosaicBlocks:
    """Rows per compute warpgroup and streamed block sizes of the three kernels; stages = shared-memory ring depth.
    A program holds two warpgroups' tiles, so T pads to a multiple of 2 * block_q (forward, dq) and S to one of
    2 * block_kv_dkv."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    block_q_dq: int = 64
    block_kv_dq: int = 64
    stages_dq: int = 2
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    stages_dkv: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("block") and (value < 64 or value & (value - 1)):
                raise ValueError(f"MosaicBlocks.{f.name}={value} must be a power of two >= 64 (wgmma)")
            if f.name.startswith("stages") and value < 1:
                raise ValueError(f"MosaicBlocks.{f.name}={value} must be >= 1")

    def clamp(self, q_len: int, kv_len: int) -> "MosaicBlocks":
        del q_len, kv_len  # sequences are padded up to the blocks instead
        return self

    @property
    def q_multiple(self) -> int:
        return max(2 * self.block_q, 2 * self.block_q_dq, self.block_q_dkv)

    @property
    def k_multiple(self) -> int:
        return max(self.block_kv, self.block_kv_dq, 2 * self.block_kv_dkv)


def default_mosaic_blocks(head_dim: int) -> MosaicBlocks:
    """Shared memory and registers per head dim: 256 needs 64-row K/V blocks in the forward."""
    if head_dim <= 64:
        return MosaicBlocks(block_kv=128, stages=3, stages_dq=3, stages_dkv=3)
    if head_dim <= 128:
        return MosaicBlocks()
    return MosaicBlocks(block_kv=64, stages=2, stages_dq=1, stages_dkv=1)


# The configurations benchmarks/bench_attention.py sweeps beside the default (head dim 128; docs/kernels.md has the
# H200 numbers); tests/gpu checks each against the reference.
MOSAIC_CANDIDATES = {
    "fwd-kv64-s3": MosaicBlocks(block_kv=64, stages=3),
    "fwd-kv64-s4": MosaicBlocks(block_kv=64, stages=4),
    "dq-kv128": MosaicBlocks(block_kv_dq=128),
    "dq-s3": MosaicBlocks(stages_dq=3),
    "dkv-s3": MosaicBlocks(stages_dkv=3),
}


def padded_head_dim(h: int) -> int:
    return next(d for d in HEAD_DIMS if d >= h)


def _mask(spec: MaskSpec) -> MosaicMask:
    return MosaicMask(causal=spec.causal, window=spec.window, kv_len=spec.kv_len, segments=spec.segments)


def _offsets(spec: MaskSpec, offset, batch: int):
    if spec.dynamic_offset:
        return jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (batch,))
    return jnp.full((batch,), spec.offset, jnp.int32)


def _first_run(full):
    """[..., n] bool -> (a, b): the first run of True along the last axis ((n, n) when there is none)."""
    n = full.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    a = jnp.where(full.any(-1), jnp.argmax(full, -1), n).astype(jnp.int32)
    after = (idx >= a[..., None]) & ~full
    b = jnp.where(after.any(-1), jnp.argmax(after, -1), n).astype(jnp.int32)
    return a, b


def _uniform(seg, block):
    b, length = seg.shape
    blocks = seg.reshape(b, length // block, block)
    lo, hi = blocks.min(-1), blocks.max(-1)
    return jnp.where(lo == hi, lo, -1), lo == hi  # the block's one id (or -1), whether it has one


def block_runs(spec: MaskSpec, offsets, q_seg, kv_seg, *, block_q: int, block_kv: int, by_query: bool):
    """[B, tiles, 4] int32 (lo, full_lo, full_hi, hi): per query tile of block_q rows the key blocks of block_kv
    it visits (by_query), or per key tile of block_kv rows the query blocks of block_q (not by_query)."""
    n_tiles = (spec.q_len_padded // block_q) if by_query else (spec.kv_len_padded // block_kv)
    seg_bounds = seg_full = None
    if spec.segments:
        kv_lo, kv_hi, q_lo, q_hi = segment_block_bounds(q_seg, kv_seg, block_q, block_kv)
        seg_bounds = (kv_lo, kv_hi) if by_query else (q_lo, q_hi)
        q_id, q_one = _uniform(q_seg, block_q)
        k_id, k_one = _uniform(kv_seg, block_kv)
        same = q_one[:, :, None] & k_one[:, None, :] & (q_id[:, :, None] == k_id[:, None, :])  # [B, nq, nk]
        seg_full = _first_run(same if by_query else jnp.swapaxes(same, 1, 2))

    def one(tile, off, bounds):
        s = spec.at(off)
        if by_query:
            lo, full_lo, full_hi, hi, _, _ = s.kv_block_ranges(tile, block_q, block_kv, bounds)
        else:
            lo, full_lo, full_hi, hi, _, _ = s.q_block_ranges(tile, block_q, block_kv, bounds)
        return jnp.stack([lo, full_lo, full_hi, hi])

    tiles = jnp.arange(n_tiles, dtype=jnp.int32)
    if seg_bounds is None:
        runs = jax.vmap(lambda off: jax.vmap(lambda t: one(t, off, None))(tiles))(offsets)
    else:
        runs = jax.vmap(lambda off, lo, hi: jax.vmap(lambda t, a, b: one(t, off, (a, b)))(tiles, lo, hi))(
            offsets, *seg_bounds)
    if seg_full is not None:  # unmasked only where both sides are one and the same document
        lo, full_lo, full_hi, hi = (runs[..., i] for i in range(4))
        full_lo = jnp.clip(jnp.maximum(full_lo, seg_full[0]), lo, hi)
        full_hi = jnp.clip(jnp.minimum(full_hi, seg_full[1]), full_lo, hi)
        runs = jnp.stack([lo, full_lo, full_hi, hi], axis=-1)
    return runs.astype(jnp.int32)


def _deal(x, tile_rows: int, spec: MaskSpec, interpret: bool):
    """(programs, deal order) of a persistent kernel over the (tile of tile_rows rows, head, batch row) items of
    x [B, L, heads, H]: one program per SM (INTERPRET_PROGRAMS interpreted)."""
    (b, length, heads, _), num_sms = x.shape, INTERPRET_PROGRAMS if interpret else sm_count()
    return num_sms, deal_order(num_sms, heads, length // tile_rows, b, spec.causal, spec.segments)


def _interpreter(interpret: bool):
    """The Mosaic GPU interpreter's parameters where `interpret` asks for it (off the GPU, races detected), else
    None."""
    if not interpret:
        return None
    if (problem := mosaic_interpreter_problem()) is not None:
        raise AttentionUnsupported(f"the mosaic attention kernels run off the GPU only interpreted: {problem}")
    return mosaic_interpreter()


def mosaic_forward_op(q, k, v, q_seg, kv_seg, offset=None, *, spec: MaskSpec, blocks: MosaicBlocks, scale: float,
                      interpret: bool):
    """The Mosaic forward on padded q [B,Tp,N,H], k/v [B,Sp,K,H] -> (out, lse [B,N,Tp] natural log); interpret:
    under the Mosaic GPU interpreter (off the GPU)."""
    offsets = _offsets(spec, offset, q.shape[0])
    runs = block_runs(spec, offsets, q_seg, kv_seg, block_q=blocks.block_q, block_kv=blocks.block_kv, by_query=True)
    num_sms, order = _deal(q, 2 * blocks.block_q, spec, interpret)
    return mosaic_forward(runs, offsets, q_seg, kv_seg, q, k, v, mask=_mask(spec), scale=scale,
                          block_q=blocks.block_q, block_kv=blocks.block_kv, stages=blocks.stages, num_sms=num_sms,
                          order=order, interpret=_interpreter(interpret))


def mosaic_backward_parts(q, k, v, q_seg, kv_seg, out, lse, do, dlse, offset=None, *, spec: MaskSpec,
                          blocks: MosaicBlocks, scale: float, interpret: bool) -> dict:
    """The backward's stages as thunks (for timing them apart): "delta" (XLA: lse2 and rowsum(O dO) - dlse),
    "dq" -> dq, "dkv" -> (dk, dv)."""
    offsets = _offsets(spec, offset, q.shape[0])
    mask = _mask(spec)

    def delta():
        lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)  # rows that saw nothing: P = exp2(s - inf) = 0
        return lse2, jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32)) - dlse

    def dq(lse2=None, dlt=None):
        lse2, dlt = delta() if lse2 is None else (lse2, dlt)
        runs = block_runs(spec, offsets, q_seg, kv_seg, block_q=blocks.block_q_dq, block_kv=blocks.block_kv_dq,
                          by_query=True)
        num_sms, order = _deal(q, 2 * blocks.block_q_dq, spec, interpret)
        return mosaic_dq(runs, offsets, q_seg, kv_seg, q, k, v, do, lse2, dlt, mask=mask, scale=scale,
                         block_q=blocks.block_q_dq, block_kv=blocks.block_kv_dq, stages=blocks.stages_dq,
                         num_sms=num_sms, order=order, interpret=_interpreter(interpret))

    def dkv(lse2=None, dlt=None):
        lse2, dlt = delta() if lse2 is None else (lse2, dlt)
        runs = block_runs(spec, offsets, q_seg, kv_seg, block_q=blocks.block_q_dkv, block_kv=blocks.block_kv_dkv,
                          by_query=False)
        num_sms, order = _deal(k, 2 * blocks.block_kv_dkv, spec, interpret)
        call = functools.partial(mosaic_dkv, runs, offsets, q_seg, kv_seg, q, k, v, do, lse2, dlt, mask=mask,
                                 scale=scale, block_q=blocks.block_q_dkv, block_kv=blocks.block_kv_dkv,
                                 stages=blocks.stages_dkv, num_sms=num_sms, order=order,
                                 interpret=_interpreter(interpret))
        if q.shape[-1] > 128:  # one [64, 256] float32 accumulator per warpgroup: dk and dv in two passes
            (dk,), (dv,) = call(parts=("dk",)), call(parts=("dv",))
            return dk, dv
        return tuple(call(parts=("dk", "dv")))

    return {"delta": delta, "dq": dq, "dkv": dkv}


def mosaic_backward_op(q, k, v, q_seg, kv_seg, out, lse, do, dlse, offset=None, *, spec: MaskSpec,
                       blocks: MosaicBlocks, scale: float, interpret: bool):
    """(dq, dk, dv) of the padded operands, given the forward's out and lse and the cotangents do, dlse."""
    parts = mosaic_backward_parts(q, k, v, q_seg, kv_seg, out, lse, do, dlse, offset, spec=spec, blocks=blocks,
                                  scale=scale, interpret=interpret)
    lse2, dlt = parts["delta"]()
    dk, dv = parts["dkv"](lse2, dlt)
    return parts["dq"](lse2, dlt), dk, dv
