"""On the GPU: the compiled Pallas kernels with a traced per-row query offset, and the blockwise backward that
context parallelism's ring runs, against the same oracles as tests/unit/test_attention_blocks.py (fp32 inputs:
the kernels' fp32 dots run at full precision, so the CPU tolerances hold; the XLA reference's dots are asked for
full precision too, as XLA:GPU would otherwise run them in TF32).

    JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests/gpu -q -rs
"""

import jax
import pytest

from tests.unit import test_attention_blocks as blocks

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")]


@pytest.mark.parametrize("window,segments", [(None, False), (7, False), (None, True), (12, True)])
def test_traced_offsets_compile_and_match(window, segments):
    with jax.default_matmul_precision("float32"):
        blocks.test_traced_offset_matches_numpy("pallas", window, segments)


@pytest.mark.parametrize("window,segments", [(None, False), (20, True)])
def test_blockwise_backward_compiles_and_adds_up(window, segments):
    blocks._whole.cache_clear()  # a reference computed outside the precision scope would be reused
    with jax.default_matmul_precision("float32"):
        blocks.test_blocks_add_up_to_the_whole_gradient("pallas", window, segments)
