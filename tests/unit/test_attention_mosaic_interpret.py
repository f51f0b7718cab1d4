"""The Mosaic GPU (Hopper) attention kernels on CPU, under JAX's Mosaic GPU interpreter (simulated warpgroups,
shared memory, barriers and TMA copies, with a happens-before race detector; jax >= 0.12): `flash_attention(...,
kernel="mosaic")` interpreted, forward output, log-sum-exp and every input gradient (a random cotangent on the LSE
too) against `reference_attention`. Three programs deal themselves the items; every kernel of every case has at
least four, so some program runs several and its rings stream on from one item into the next, as on the GPU.

Cases: causal, full, sliding window and packed documents; GQA, MQA and MHA; head dims 64, 128 and 256 (dK and dV
in two passes); queries fewer than keys (the default offset); ragged lengths padded to the blocks; the default
blocks, 64-row blocks throughout, and 128-row query tiles against 64-row key blocks (and back); a traced per-row
offset and a (query, key) segment-id pair, as context parallelism's blocks pass them."""

import jax
import jax.numpy as jnp
import pytest

from mjax.kernels.attention import AttentionUnsupported
from mjax.kernels.attention.flash import flash_attention
from mjax.kernels.attention.mosaic import MosaicBlocks, default_mosaic_blocks
from mjax.kernels.device import mosaic_interpreter_problem
from tests.helpers.flash_oracle import check, random_seed

INTERPRETER = mosaic_interpreter_problem() is None

B64 = MosaicBlocks(block_q=64, block_kv=64, block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64)
OTHER = MosaicBlocks(block_q=128, block_kv=64, block_q_dq=128, block_kv_dq=128, block_q_dkv=128, block_kv_dkv=64)

# (b, t, s, n, kh, h, dtype, causal, window, segments, blocks)
CASES = [
    pytest.param(1, 128, 256, 4, 2, 64, jnp.bfloat16, True, None, False, B64, id="gqa2-causal-t-lt-s"),
    pytest.param(1, 256, 256, 4, 2, 64, jnp.bfloat16, True, None, False, B64, id="gqa2-causal",
                 marks=pytest.mark.slow),
    pytest.param(1, 256, 256, 4, 2, 64, jnp.bfloat16, False, None, False, B64, id="gqa2-full",
                 marks=pytest.mark.slow),
    pytest.param(2, 200, 200, 2, 1, 64, jnp.bfloat16, True, 70, True, B64, id="mqa-window-packed-ragged",
                 marks=pytest.mark.slow),
    pytest.param(2, 128, 128, 2, 2, 128, jnp.float16, True, None, False, B64, id="mha-causal-f16-h128",
                 marks=pytest.mark.slow),
    pytest.param(2, 256, 256, 2, 1, 128, jnp.bfloat16, True, None, True, default_mosaic_blocks(128),
                 id="mqa-packed-default-blocks-h128", marks=pytest.mark.slow),
    pytest.param(1, 300, 300, 2, 2, 64, jnp.bfloat16, True, 100, False, OTHER, id="mha-window-ragged-other-blocks",
                 marks=pytest.mark.slow),
    pytest.param(2, 256, 256, 2, 1, 256, jnp.bfloat16, True, None, False, B64, id="mqa-causal-h256",
                 marks=pytest.mark.slow),
]


@pytest.mark.skipif(not INTERPRETER, reason="no Mosaic GPU interpreter of jax >= 0.12 here")
@pytest.mark.parametrize("b,t,s,n,kh,h,dtype,causal,window,segments,blocks", CASES)
def test_interpreted_kernels_match_reference(b, t, s, n, kh, h, dtype, causal, window, segments, blocks):
    check(random_seed(), b, t, s, n, kh, h, dtype, causal=causal, window=window, segments=segments, blocks=blocks,
          kernel="mosaic")


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETER, reason="no Mosaic GPU interpreter of jax >= 0.12 here")
def test_interpreted_kernels_with_a_per_row_offset_match_reference():
    """Context parallelism's blocks: a [B] offset array (the kernels' per-row operand), one row's first queries
    seeing no key at all."""
    check(random_seed(), 2, 128, 256, 4, 2, 64, jnp.bfloat16, causal=True, window=None, segments=False, blocks=B64,
          kernel="mosaic", offset=jnp.array([100, -30], jnp.int32))


@pytest.mark.slow
@pytest.mark.skipif(not INTERPRETER, reason="no Mosaic GPU interpreter of jax >= 0.12 here")
def test_interpreted_kernels_with_a_segment_pair_match_reference():
    """(q_segment_ids, kv_segment_ids) with T != S, as a ring step over another device's key chunk sees them."""
    check(random_seed(), 1, 128, 192, 2, 1, 64, jnp.bfloat16, causal=False, window=None, segments="pair",
          blocks=B64, kernel="mosaic")


@pytest.mark.skipif(INTERPRETER, reason="only where the interpreter is missing or jax < 0.12")
def test_without_the_interpreter_the_call_says_so():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(AttentionUnsupported, match="run off the GPU only interpreted"):
        flash_attention(q, q, q, kernel="mosaic", interpret=True, block_sizes=B64)
