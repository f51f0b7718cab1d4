"""Shared pieces of the Pallas flash-attention kernels: block sizes, the mask spec, and the block-range math.

Every kernel walks blocks of one sequence axis while the grid walks blocks of the other. For each visited block
the range math below decides, from static mask facts and the program ids, which blocks can hold a visible entry
at all (the rest are skipped) and which are fully visible (those skip the positional mask). The visited range is
split into three runs: masked head, unmasked middle, masked tail. Segment ids, when given, are always applied.

Positions: query row i sits at key position i + offset, offset = kv_len - q_len (the reference's convention) or,
with `dynamic_offset`, a per-row int32 operand (a context-parallel ring step's block), so a query attends key j when
    causal          j <= i + offset
    sliding window  i + offset - j < window
    padding         j < kv_len
    segments        q_segment[i] == kv_segment[j]
"""

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and Triton launch parameters; powers of two, >= 16. Clamped to the (padded) sequence lengths."""

    # Defaults: the fastest of the configurations tried on an H200 (jax 0.11.2) at T=4096, H=128, GQA 32/8,
    # causal, bf16 -- see docs/kernels.md.
    block_q: int = 128  # forward
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    block_q_dq: int = 128  # backward, dq kernel
    block_k_dq: int = 64
    num_warps_dq: int = 8
    num_stages_dq: int = 3
    block_q_dkv: int = 64  # backward, dk/dv kernel
    block_k_dkv: int = 128
    num_warps_dkv: int = 8
    num_stages_dkv: int = 3

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("block") and (value < 16 or value & (value - 1)):
                raise ValueError(f"BlockSizes.{f.name}={value} must be a power of two >= 16")

    def clamp(self, q_len: int, kv_len: int) -> "BlockSizes":
        tq, tk = pow2_at_least(q_len), pow2_at_least(kv_len)
        return dataclasses.replace(
            self, block_q=min(self.block_q, tq), block_k=min(self.block_k, tk),
            block_q_dq=min(self.block_q_dq, tq), block_k_dq=min(self.block_k_dq, tk),
            block_q_dkv=min(self.block_q_dkv, tq), block_k_dkv=min(self.block_k_dkv, tk))

    @property
    def q_multiple(self) -> int:
        return max(self.block_q, self.block_q_dq, self.block_q_dkv)

    @property
    def k_multiple(self) -> int:
        return max(self.block_k, self.block_k_dq, self.block_k_dkv)


def default_block_sizes(head_dim: int) -> BlockSizes:
    """Starting points for Hopper; head dim 256 needs smaller tiles to fit registers and shared memory."""
    if head_dim <= 64:
        return BlockSizes(block_q=128, block_k=64, num_warps=4, num_stages=3)  # untuned
    if head_dim <= 128:
        return BlockSizes()
    return BlockSizes(block_q=64, block_k=64, num_warps=8, num_stages=2,
                      block_q_dq=64, block_k_dq=64, num_warps_dq=8, num_stages_dq=1,
                      block_q_dkv=64, block_k_dkv=64, num_warps_dkv=8, num_stages_dkv=1)


# The block configurations swept on the GPU (benchmarks/bench_attention.py; docs/kernels.md has the H200 numbers),
# each on top of the other pass's default: forward (block_q, block_k, warps, stages) and backward (the dq kernel's,
# the dk/dv kernel's).
FORWARD_CANDIDATES = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 4)]
BACKWARD_CANDIDATES = [
    ((128, 64, 8, 2), (64, 128, 8, 2)),
    ((128, 64, 4, 2), (64, 64, 4, 2)),
    ((64, 64, 4, 3), (64, 64, 4, 3)),
    ((128, 32, 4, 3), (32, 128, 8, 3)),
    ((64, 128, 8, 2), (128, 64, 8, 2)),
    ((128, 64, 8, 3), (64, 128, 8, 3)),
]


def with_forward(blocks: BlockSizes, candidate) -> BlockSizes:
    bq, bk, warps, stages = candidate
    return dataclasses.replace(blocks, block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)


def with_backward(blocks: BlockSizes, candidate) -> BlockSizes:
    (qa, ka, wa, sa), (qb, kb, wb, sb) = candidate
    return dataclasses.replace(blocks, block_q_dq=qa, block_k_dq=ka, num_warps_dq=wa, num_stages_dq=sa,
                               block_q_dkv=qb, block_k_dkv=kb, num_warps_dkv=wb, num_stages_dkv=sb)


def pow2_at_least(n: int) -> int:
    return max(16, 1 << max(0, (n - 1).bit_length()))


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Static facts about the mask (hashable: it is part of the kernels' static configuration)."""

    causal: bool
    window: int | None
    offset: int  # key position of query 0: kv_len - q_len of the unpadded inputs, unless dynamic_offset
    kv_len: int  # unpadded key length; keys at or past it are padding
    kv_len_padded: int
    q_len_padded: int
    segments: bool
    dynamic_offset: bool = False  # the offset is a kernel operand, one per batch row (context-parallel blocks)

    def at(self, offset) -> "MaskSpec":
        """This spec with a traced offset (inside a kernel: the row's operand) in place of the static one."""
        return dataclasses.replace(self, offset=offset)

    def apply(self, s, q_rows, k_cols, *, masked: bool, row_seg=None, col_seg=None, transposed: bool = False):
        """Scores `s` with the position mask (when `masked`) and the segment mask set to -inf; also whether any mask
        applied. `row_seg`/`col_seg` are the segment ids along s's rows and columns (queries and keys, or keys and
        queries when `transposed`)."""
        mask = self.position_mask(q_rows, k_cols, transposed=transposed) if masked else None
        if self.segments:
            seg = row_seg[:, None] == col_seg[None, :]
            mask = seg if mask is None else mask & seg
        return (s, False) if mask is None else (jnp.where(mask, s, -jnp.inf), True)

    def position_mask(self, q_rows, k_cols, *, transposed: bool = False):
        """Bool [len(q_rows), len(k_cols)] (or its transpose) from absolute indices; None when nothing applies."""
        if transposed:
            q_pos, k_pos = (q_rows + self.offset)[None, :], k_cols[:, None]
        else:
            q_pos, k_pos = (q_rows + self.offset)[:, None], k_cols[None, :]
        mask = None

        def conj(a, b):
            return b if a is None else a & b

        if self.causal:
            mask = conj(mask, k_pos <= q_pos)
        if self.window is not None:
            mask = conj(mask, q_pos - k_pos < self.window)
        if self.kv_len != self.kv_len_padded:
            mask = conj(mask, k_pos < self.kv_len)
        return mask

    # ---- ranges of key blocks for the query block qi (forward and dq) ----
    def kv_block_ranges(self, qi, bq: int, bk: int, seg_bounds=None):
        """(lo, full_lo, full_hi, hi, head, tail): visit key blocks [lo, hi); [full_lo, full_hi) needs no positional
        mask; head/tail say statically whether [lo, full_lo) / [full_hi, hi) can be non-empty. `seg_bounds`
        (lo, hi) narrows the visit to the blocks whose segment ids can match (see segment_block_bounds)."""
        n_k = self.kv_len_padded // bk
        first_q = qi * bq + self.offset  # key position of the first query row
        last_q = first_q + bq - 1
        if self.causal:
            hi = _cdiv(jnp.clip(last_q + 1, 0, self.kv_len), bk)
            full_hi = _div(jnp.maximum(first_q + 1, 0), bk)
        else:
            hi = _cdiv(self.kv_len, bk)
            full_hi = n_k
        if self.kv_len != self.kv_len_padded or self.kv_len % bk:
            full_hi = jnp.minimum(full_hi, self.kv_len // bk)
        if self.window is not None:
            lo = _div(jnp.maximum(first_q - self.window + 1, 0), bk)
            full_lo = _div(jnp.maximum(last_q - self.window + bk, 0), bk)
        else:
            lo = 0
            full_lo = 0
        head, tail = self.window is not None, self.causal or self.kv_len != self.kv_len_padded
        return (*_three_runs(lo, full_lo, full_hi, hi, seg_bounds), head, tail)

    # ---- ranges of query blocks for the key block kj (dk/dv) ----
    def q_block_ranges(self, kj, bq: int, bk: int, seg_bounds=None):
        """Query-block ranges for key block kj, same meaning as kv_block_ranges."""
        n_q = self.q_len_padded // bq
        first_k = kj * bk
        last_k = first_k + bk - 1
        if self.causal:  # query i sees key j when i >= j - offset
            lo = _div(jnp.maximum(first_k - self.offset, 0), bq)
            full_lo = _cdiv(jnp.maximum(last_k - self.offset, 0), bq)
        else:
            lo = 0
            full_lo = 0
        if self.window is not None:  # query i sees key j when i < j - offset + window
            hi = _cdiv(jnp.clip(last_k - self.offset + self.window, 0, self.q_len_padded), bq)
            full_hi = _div(jnp.maximum(first_k - self.offset + self.window, 0), bq)
        else:
            hi = n_q
            full_hi = n_q
        if self.kv_len != self.kv_len_padded:
            # a block holding padded keys is never fully visible
            # (int32 operands, not Python ints: Pallas-Triton types weak literals in a select like its predicate)
            full_hi = jnp.where(last_k < self.kv_len, jnp.asarray(full_hi, jnp.int32), jnp.int32(0))
        head, tail = self.causal, self.window is not None or self.kv_len != self.kv_len_padded
        return (*_three_runs(lo, full_lo, full_hi, hi, seg_bounds), head, tail)


def _three_runs(lo, full_lo, full_hi, hi, seg_bounds=None):
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    if seg_bounds is not None:  # segment masks apply in every run, so narrowing [lo, hi) is always safe
        lo, hi = jnp.maximum(lo, seg_bounds[0]), jnp.minimum(hi, seg_bounds[1])
    hi = jnp.maximum(hi, 0)
    lo = jnp.minimum(lo, hi)
    a = jnp.clip(jnp.asarray(full_lo, jnp.int32), lo, hi)
    b = jnp.clip(jnp.asarray(full_hi, jnp.int32), a, hi)
    return lo, a, b, hi


def _div(x, d: int):
    """Floor division of a non-negative traced int by a static positive int (lax.div is supported by Triton)."""
    return lax.div(jnp.asarray(x, jnp.int32), jnp.int32(d))


def _cdiv(x, d: int):
    return _div(jnp.asarray(x, jnp.int32) + (d - 1), d)


def segment_block_bounds(q_seg, kv_seg, bq: int, bk: int, xp=jnp):
    """Per query block the span [lo, hi) of key blocks whose segment ids can equal one of its own, and per key
    block the span of query blocks; [B, nq] and [B, nk] int32 each. Blocks overlap when their [min, max] id
    ranges do, so this is exact for sorted (packed) ids and a safe superset for any ids. (xp=numpy for tests.)"""
    b, tp = q_seg.shape
    sp = kv_seg.shape[1]
    qmin, qmax = q_seg.reshape(b, tp // bq, bq).min(-1), q_seg.reshape(b, tp // bq, bq).max(-1)
    kmin, kmax = kv_seg.reshape(b, sp // bk, bk).min(-1), kv_seg.reshape(b, sp // bk, bk).max(-1)
    overlap = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])  # [B, nq, nk]

    def span(ov):  # first and one-past-last True along the last axis; (0, 0) if none
        n = ov.shape[-1]
        first = xp.argmax(ov, axis=-1)
        last = n - xp.argmax(ov[..., ::-1], axis=-1)
        anyv = ov.any(-1)
        return xp.where(anyv, first, 0).astype(xp.int32), xp.where(anyv, last, 0).astype(xp.int32)

    kv_lo, kv_hi = span(overlap)
    q_lo, q_hi = span(xp.swapaxes(overlap, 1, 2))
    return kv_lo, kv_hi, q_lo, q_hi


def run_blocks(ranges, body, carry):
    """Runs body(j, carry, masked) over [lo, hi) as masked head, unmasked middle, masked tail.

    `ranges` is what kv_block_ranges/q_block_ranges return; a run whose static flag is False is provably empty.
    """
    lo, full_lo, full_hi, hi, head, tail = ranges
    if head:
        carry = lax.fori_loop(lo, full_lo, lambda j, c: body(j, c, True), carry)
    carry = lax.fori_loop(full_lo, full_hi, lambda j, c: body(j, c, False), carry)
    if tail:
        carry = lax.fori_loop(full_hi, hi, lambda j, c: body(j, c, True), carry)
    return carry


def dot(a, b, *, trans_a=False, trans_b=False):
    """fp32-accumulating block matmul; fp32 operands use full precision (Triton would otherwise use tf32)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return pltriton.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def compiler_params(num_warps: int, num_stages: int):
    """Always explicit: a bare pallas_call picks a different GPU lowering in jax 0.11 and 0.12."""
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def default_interpret() -> bool:
    return jax.default_backend() != "gpu"


# jax 0.11+ warns on every Triton-lowered pallas_call that the backend is deprecated in favour of Mosaic GPU. We
# choose Triton on purpose (docs/kernels.md says why); keep that one message out of every training log.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def kernel_refs(refs, spec: MaskSpec, n_inputs: int, n_outputs: int):
    """Splits a kernel's refs: (fixed inputs, spec with this row's offset, (qseg, kseg, lo, hi) or Nones, outputs).
    The optional operands follow the fixed inputs: the offset (dynamic_offset), then the segment inputs."""
    inputs, rest = refs[:n_inputs], list(refs[n_inputs:len(refs) - n_outputs])
    if spec.dynamic_offset:
        spec = spec.at(rest.pop(0)[...])
    segments = tuple(rest) if spec.segments else (None,) * 4
    return inputs, spec, segments, refs[len(refs) - n_outputs:]


def offset_input(offset):
    """(BlockSpec, array) of the per-row offset operand [B] int32 of a kernel gridded (block, batch, head)."""
    return pl.BlockSpec((None,), lambda i, bi, hi: (bi,)), offset


def query_block_segment_inputs(q_seg, kv_seg, bq: int, bk: int, sp: int, nq: int):
    """(BlockSpecs, arrays) of the segment inputs of a kernel gridded (query block, batch, head) with query blocks
    visited last-first: this block's query ids, all key ids, and its span of visible key blocks."""
    kv_lo, kv_hi, _, _ = segment_block_bounds(q_seg, kv_seg, bq, bk)
    row = lambda i, bi, hi: (bi, nq - 1 - i)  # noqa: E731
    specs = [pl.BlockSpec((None, bq), row), pl.BlockSpec((None, sp), lambda i, bi, hi: (bi, 0)),
             pl.BlockSpec((None, None), row), pl.BlockSpec((None, None), row)]
    return specs, [q_seg, kv_seg, kv_lo, kv_hi]
