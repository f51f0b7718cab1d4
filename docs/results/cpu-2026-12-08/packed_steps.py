"""Block steps of the Mosaic attention kernels on bench_attention's causal and packed rows (T=8192, B=4, the
default blocks), counted from the kernels' own block runs: per kernel, the full (unmasked) and masked steps the
compute warpgroups run and the steps a warpgroup skips (blocks of its program's union outside its own runs), per
KV head's worth of work (heads multiply every count alike). From the repository root, on any machine:
    PYTHONPATH=. python docs/results/cpu-2026-12-08/packed_steps.py"""
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_attention import packed_segments
from mjax.kernels.attention.flash_common import MaskSpec
from mjax.kernels.attention.mosaic import MosaicBlocks, block_runs
from mjax.kernels.attention.mosaic_common import union_of_runs

T, B = 8192, 4


def steps(seg, block_q, block_kv, by_query):
    spec = MaskSpec(causal=True, window=None, offset=0, kv_len=T, kv_len_padded=T, q_len_padded=T,
                    segments=seg is not None)
    runs = np.asarray(block_runs(spec, jnp.zeros((B,), jnp.int32), seg, seg, block_q=block_q, block_kv=block_kv,
                                 by_query=by_query))  # [B, tiles, 4]
    lo, full_lo, full_hi, hi = (runs[..., i] for i in range(4))
    own = np.maximum(hi - lo, 0)
    full = np.maximum(full_hi - full_lo, 0)
    pairs = runs.reshape(B, -1, 2, 4)  # a program's item: two tiles, one per compute warpgroup
    union_lo, union_hi = union_of_runs(pairs[..., 0, 0], pairs[..., 0, 3], pairs[..., 1, 0], pairs[..., 1, 3])
    union = np.asarray(union_hi - union_lo)  # the kernels' own union: what a program's memory warpgroup streams
    return dict(full=int(full.sum()), masked=int((own - full).sum()), skipped=int(2 * union.sum() - own.sum()),
                items=pairs.shape[0] * pairs.shape[1], union=int(union.sum()))


blocks = MosaicBlocks()
seg = packed_segments(B, T)
kernels = (("forward", blocks.block_q, blocks.block_kv, True), ("dq", blocks.block_q_dq, blocks.block_kv_dq, True),
           ("dk/dv", blocks.block_q_dkv, blocks.block_kv_dkv, False))
print("packed cut points per row:", [(np.flatnonzero(np.diff(np.asarray(s))) + 1).tolist() for s in seg])
for name, bq, bk, by_query in kernels:
    c, p = steps(None, bq, bk, by_query), steps(seg, bq, bk, by_query)
    print(f"{name:8} causal {c}\n{'':8} packed {p}")
    print(f"{'':8} packed / causal: union steps {p['union'] / c['union']:.3f}, own steps "
          f"{(p['full'] + p['masked']) / (c['full'] + c['masked']):.3f}")
    print(f"{'':8} if a masked step costs m full steps: " + ", ".join(
        f"m={m}: {(p['full'] + m * p['masked']) / (c['full'] + m * c['masked']):.3f}" for m in (1.0, 1.5, 2.0)))
q = np.arange(T)
causal_pairs = B * T * (T + 1) // 2
same = (np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :]) & (q[None, None, :] <= q[None, :, None])
print(f"visible pairs, packed / causal: {same.sum() / causal_pairs:.4f}")
