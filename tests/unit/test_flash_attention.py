"""The Pallas flash-attention kernel against the pure-JAX reference, in interpret mode on CPU.

Fresh random inputs on every run (the seed is in each failure message). Forward output, log-sum-exp and every
input gradient (with a random cotangent on the LSE too) are compared with `reference_attention` over a grid of
shapes, masks, dtypes and GQA ratios; small blocks (16/32) make even these short sequences span many blocks,
ragged tails included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.attention import AttentionUnsupported
from mjax.kernels.attention.flash import flash_attention
from mjax.kernels.attention.flash_common import BlockSizes, MaskSpec, segment_block_bounds
from tests.helpers.flash_oracle import check, inputs, random_seed
from tests.helpers.gpu_lowering import lower_for_h200

# jax warns on every Triton-lowered pallas_call; pytest's own warning filters would show it 15 times
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

SMALL = BlockSizes(block_q=32, block_k=16, block_q_dq=16, block_k_dq=32, block_q_dkv=32, block_k_dkv=16,
                   num_warps=4, num_stages=2)
TINY = BlockSizes(block_q=16, block_k=16, block_q_dq=16, block_k_dq=16, block_q_dkv=16, block_k_dkv=16)
# (b, t, s, n, kh, h, dtype, causal, window, segments, blocks)
GRID = [
    pytest.param(1, 64, 64, 2, 2, 64, jnp.bfloat16, True, None, False, SMALL, id="mha-causal-bf16-h64"),
    pytest.param(2, 100, 100, 4, 1, 32, jnp.float32, True, None, False, SMALL, id="mqa-causal-ragged-f32"),
    pytest.param(1, 80, 80, 4, 2, 64, jnp.float32, True, 15, False, TINY, id="gqa2-window-f32"),
    pytest.param(1, 96, 96, 4, 2, 64, jnp.bfloat16, True, None, True, SMALL, id="gqa2-packed-bf16"),
    pytest.param(1, 48, 48, 2, 1, 128, jnp.float16, False, None, False, SMALL, id="full-f16-h128"),
    pytest.param(1, 40, 72, 4, 2, 32, jnp.float32, True, None, False, TINY, id="t-lt-s-causal-f32"),
    pytest.param(1, 72, 40, 2, 1, 32, jnp.float32, True, 20, False, TINY, id="t-gt-s-window-empty-rows-f32"),
    pytest.param(1, 90, 90, 4, 1, 128, jnp.float16, True, 31, True, SMALL, id="mqa-window-packed-ragged-f16"),
    pytest.param(1, 56, 56, 2, 2, 40, jnp.float32, False, 13, True, TINY, id="noncausal-window-packed-h40-f32"),
    pytest.param(1, 32, 32, 2, 1, 256, jnp.bfloat16, True, None, False, SMALL, id="mqa-causal-bf16-h256"),
]


@pytest.mark.parametrize("b,t,s,n,kh,h,dtype,causal,window,segments,blocks", GRID)
def test_matches_reference(b, t, s, n, kh, h, dtype, causal, window, segments, blocks):
    check(random_seed(), b, t, s, n, kh, h, dtype, causal=causal, window=window, segments=segments, blocks=blocks)


def test_packed_batch_equals_separate_documents():
    seed = random_seed()
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.permutation([13, 13, 38])]  # 64 tokens, ragged against the 16/32 blocks
    t, n, kh, h = sum(lengths), 4, 2, 32
    q, k, v, do, _, _ = inputs(seed, 1, t, t, n, kh, h, jnp.float32, False)
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    bounds = np.cumsum([0, *lengths])

    def packed(q, k, v):
        return flash_attention(q, k, v, segment_ids=seg, sliding_window=16, block_sizes=SMALL)

    def separate(q, k, v):
        outs = [flash_attention(q[:, a:z], k[:, a:z], v[:, a:z], sliding_window=16, block_sizes=SMALL)
                for a, z in zip(bounds[:-1], bounds[1:])]
        return jnp.concatenate(outs, axis=1)

    @jax.jit
    def both(q, k, v, do):
        o1, vjp1 = jax.vjp(packed, q, k, v)
        o2, vjp2 = jax.vjp(separate, q, k, v)
        return (o1, *vjp1(do)), (o2, *vjp2(do))

    for name, a, b in zip(("out", "dq", "dk", "dv"), *both(q, k, v, do)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5,
                                   err_msg=f"{name} seed={seed} lengths={lengths}")


def test_segment_pair_for_ring_attention():
    """(q_segment_ids, kv_segment_ids) with T != S, as one ring step over a key chunk sees them."""
    check(random_seed(), 1, 32, 48, 2, 1, 32, jnp.float32, causal=False, window=None, segments="pair", blocks=TINY)


@pytest.mark.parametrize("bad,match", [
    (dict(h=300), "head dims"),
    (dict(h=36), "head dims"),
    (dict(dtype=jnp.int8), "bfloat16"),
    (dict(kh=3), "multiple of KV heads"),
    (dict(window=0), "sliding_window"),
    (dict(s=24, segments=True), "equal query and key lengths"),
])
def test_unsupported_raises_clearly(bad, match):
    p = dict(t=16, s=16, n=4, kh=2, h=32, dtype=jnp.bfloat16, window=None, segments=False) | bad
    q = jnp.zeros((1, p["t"], p["n"], p["h"]), p["dtype"])
    k = jnp.zeros((1, p["s"], p["kh"], p["h"]), p["dtype"])
    seg = jnp.zeros((1, p["t"]), jnp.int32) if p["segments"] else None
    with pytest.raises(AttentionUnsupported, match=match):
        flash_attention(q, k, k, sliding_window=p["window"], segment_ids=seg)


def test_block_sizes_must_be_powers_of_two():
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_q=48)


def test_block_ranges_match_brute_force():
    """The block-skipping math, exhaustively against the dense mask: every block with a visible entry is visited,
    and every block run without the positional mask is entirely visible (segment ids are applied in every run)."""
    rng = np.random.default_rng(random_seed())
    for _ in range(150):
        bq, bk = (int(x) for x in rng.choice([16, 32, 64], 2))
        t = int(rng.integers(1, 200))
        edges = [0, 1, 2, -1, -2, bk - 1, bk - 2, bk + 1, 1 - bk, 2 - bk, bq - 1, bq - 2, 1 - bq]  # off-by-one bait
        s = max(1, t + int(rng.choice(edges)) if rng.integers(2) else int(rng.integers(1, 200)))
        causal = bool(rng.integers(2))
        window = None if rng.integers(4) == 0 else max(1, int(rng.choice([*edges, *rng.integers(1, 100, 3)])))
        mult_q, mult_k = max(bq, 32), max(bk, 32)
        tp, sp = -(-t // mult_q) * mult_q, -(-s // mult_k) * mult_k
        segments = rng.integers(3) == 0
        spec = MaskSpec(causal=causal, window=window, offset=s - t, kv_len=s, kv_len_padded=sp, q_len_padded=tp,
                        segments=segments)
        qpos = np.arange(tp)[:, None] + s - t
        kpos = np.arange(sp)[None, :]
        positional = np.broadcast_to((kpos < s) & ((kpos <= qpos) if causal else True)
                                     & ((qpos - kpos < window) if window else True), (tp, sp))
        dense, bounds = positional, None
        if segments:  # sorted (packed) or arbitrary ids, edge-padded as flash_attention pads them
            q_seg, kv_seg = rng.integers(0, 5, t), rng.integers(0, 5, s)
            if rng.integers(2):
                q_seg, kv_seg = np.sort(q_seg), np.sort(kv_seg)
            q_seg, kv_seg = np.pad(q_seg, (0, tp - t), mode="edge"), np.pad(kv_seg, (0, sp - s), mode="edge")
            dense = positional & (q_seg[:, None] == kv_seg[None, :])
            bounds = [x[0] for x in segment_block_bounds(q_seg[None], kv_seg[None], bq, bk, xp=np)]
        dense = dense.copy()
        dense[t:] = False  # padded query rows may compute anything; they are sliced off
        case = f"bq={bq} bk={bk} t={t} s={s} causal={causal} window={window} segments={segments}"
        for qi in range(tp // bq):  # forward / dq walk: key blocks of one query block
            sb = None if bounds is None else (bounds[0][qi], bounds[1][qi])
            ranges = [x if isinstance(x, bool) else int(x) for x in spec.kv_block_ranges(qi, bq, bk, sb)]
            rows = slice(qi * bq, (qi + 1) * bq)
            _check_runs(dense[rows].reshape(bq, -1, bk).any(axis=(0, 2)),
                        positional[rows].reshape(bq, -1, bk).all(axis=(0, 2)), *ranges, case)
        for kj in range(sp // bk):  # dk/dv walk: query blocks of one key block
            sb = None if bounds is None else (bounds[2][kj], bounds[3][kj])
            ranges = [x if isinstance(x, bool) else int(x) for x in spec.q_block_ranges(kj, bq, bk, sb)]
            cols = slice(kj * bk, (kj + 1) * bk)
            _check_runs(dense[:, cols].reshape(-1, bq, bk).any(axis=(1, 2)),
                        positional[:, cols].reshape(-1, bq, bk).all(axis=(1, 2)), *ranges, case)


def _check_runs(any_visible, all_visible, lo, a, b, hi, head, tail, case):
    assert 0 <= lo <= a <= b <= hi <= len(any_visible), case
    visited = np.zeros(len(any_visible), bool)
    visited[lo:hi] = True
    assert not np.any(any_visible & ~visited), f"skips a visible block: {case}"
    assert np.all(all_visible[a:b]), f"runs a partly masked block unmasked: {case}"
    assert head or lo == a, case
    assert tail or b == hi, case


@pytest.mark.parametrize("t,s,causal,window,segments,h,dtype", [
    (250, 250, True, None, False, 128, jnp.bfloat16),  # ragged keys, no window (the case a GPU run caught)
    (200, 300, False, None, False, 64, jnp.float16),
    (300, 200, True, 64, False, 256, jnp.bfloat16),
    (250, 250, True, 64, True, 128, jnp.bfloat16),
    (256, 256, False, None, True, 64, jnp.float32),
])
def test_lowers_to_valid_triton_ir(t, s, causal, window, segments, h, dtype):
    """Without a GPU: lower forward+backward for CUDA against an abstract H200 and run the MLIR verifier on every
    Triton module -- invalid IR otherwise only shows up when XLA parses it on the GPU."""
    q = jax.ShapeDtypeStruct((1, t, 4, h), dtype)
    k = jax.ShapeDtypeStruct((1, s, 2, h), dtype)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32) if segments else None

    def fwd_bwd(q, k, v, seg):
        attn = lambda q, k, v: flash_attention(q, k, v, causal=causal, sliding_window=window, segment_ids=seg,  # noqa: E731
                                               return_lse=True, interpret=False)
        out, vjp = jax.vjp(attn, q, k, v)
        return vjp(out)

    assert lower_for_h200(fwd_bwd, q, k, k, seg) == 3  # forward, dq, dk/dv
