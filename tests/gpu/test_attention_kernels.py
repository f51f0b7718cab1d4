"""On the GPU: the compiled flash-attention kernels (Pallas Triton, and Pallas Mosaic GPU on Hopper) against the
float32 reference.

Forward output, LSE and dq/dk/dv (random cotangents on the output and on the LSE) on fresh random inputs (the seed
is in each failure message), over shapes, masks, dtypes and GQA ratios, and over the block configurations the
H200 tuning sweep tries. Skipped off GPU by tests/conftest.py, which also defaults JAX_PLATFORMS to cpu, so run:

    JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests/gpu -q -rs
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.kernels.attention import reference_attention
from mjax.kernels.attention.flash import flash_attention
from mjax.kernels.attention.flash_common import (BACKWARD_CANDIDATES, FORWARD_CANDIDATES, default_block_sizes,
                                                 with_backward, with_forward)

# jax warns on every Triton-lowered pallas_call
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# Relative Frobenius error allowed on out/dq/dk/dv per input dtype (the kernel rounds P to the input dtype before
# P @ V); the LSE is float32 in both, compared by its largest absolute error.
TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}
LSE_ATOL = 1e-2


@dataclasses.dataclass(frozen=True)
class Case:
    b: int
    t: int
    n: int  # query heads
    kh: int  # key/value heads
    h: int
    dtype: str  # "bfloat16", "float16" or "float32"
    causal: bool
    window: int | None = None
    segments: bool = False  # packed documents: sorted random segment ids
    s: int | None = None  # key length; t when None

    @property
    def kv_len(self) -> int:
        return self.t if self.s is None else self.s


CASES = [
    pytest.param(Case(2, 1024, 8, 8, 128, "bfloat16", causal=True), id="mha-causal-bf16-h128"),
    pytest.param(Case(1, 2048, 32, 8, 128, "bfloat16", causal=True), id="gqa32to8-causal-bf16-h128"),
    pytest.param(Case(2, 997, 8, 1, 64, "float16", causal=True, window=256, segments=True),
                 id="mqa-window256-packed-ragged-f16-h64"),
    pytest.param(Case(1, 772, 16, 4, 128, "bfloat16", causal=True, segments=True),
                 id="gqa4-packed-ragged-bf16-h128"),
    pytest.param(Case(1, 512, 4, 2, 256, "bfloat16", causal=False), id="gqa2-full-bf16-h256"),
    pytest.param(Case(1, 384, 8, 4, 128, "float16", causal=True, s=647), id="gqa2-causal-t384-s647-f16-h128"),
    pytest.param(Case(1, 256, 4, 2, 64, "float32", causal=True), id="causal-f32-h64"),
]

# Cases run again under each non-default block configuration (bf16, head dim 128).
BLOCK_CASES = [
    pytest.param(Case(1, 772, 16, 4, 128, "bfloat16", causal=True, segments=True), id="gqa4-packed-ragged-bf16"),
    pytest.param(Case(1, 384, 8, 2, 128, "bfloat16", causal=True, window=100, s=647), id="window100-t384-s647-bf16"),
]
def _block_configs():
    base = default_block_sizes(128)
    configs = {}
    for bq, bk, w, st in FORWARD_CANDIDATES:
        configs[f"fwd-{bq}x{bk}-w{w}-s{st}"] = with_forward(base, (bq, bk, w, st))
    for (qa, ka, wa, sa), (qb, kb, wb, sb) in BACKWARD_CANDIDATES:
        name = f"bwd-dq{qa}x{ka}-w{wa}-s{sa}-dkv{qb}x{kb}-w{wb}-s{sb}"
        configs[name] = with_backward(base, ((qa, ka, wa, sa), (qb, kb, wb, sb)))
    # the default is what CASES run
    return [pytest.param(cfg, id=name) for name, cfg in configs.items() if cfg != base]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _hopper() -> bool:
    return jax.default_backend() == "gpu" and jax.devices()[0].compute_capability == "9.0"


def _assert_matches_reference(case: Case, blocks=None, kernel="pallas"):
    seed = int.from_bytes(os.urandom(4), "little")
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    b, t, s, n, kh, h = case.b, case.t, case.kv_len, case.n, case.kh, case.h

    def rand(key, shape, dtype=jnp.dtype(case.dtype)):
        return jax.random.normal(key, shape, jnp.float32).astype(dtype)

    q, k, v = rand(ks[0], (b, t, n, h)), rand(ks[1], (b, s, kh, h)), rand(ks[2], (b, s, kh, h))
    do, dlse = rand(ks[3], (b, t, n, h)), rand(ks[4], (b, n, t), jnp.float32)
    seg = jnp.sort(jax.random.randint(ks[5], (b, t), 0, 5), axis=1) if case.segments else None
    kw = dict(causal=case.causal, sliding_window=case.window, segment_ids=seg, return_lse=True)

    def out_lse_and_grads(f):
        def g(q, k, v, do, dlse):
            (o, lse), vjp = jax.vjp(f, q, k, v)
            return (o, lse, *vjp((do, dlse)))
        return jax.jit(g)(q, k, v, do, dlse)

    got = out_lse_and_grads(lambda q, k, v: flash_attention(q, k, v, block_sizes=blocks, kernel=kernel, **kw))
    with jax.default_matmul_precision("float32"):  # else XLA:GPU runs the fp32 reference in TF32
        want = out_lse_and_grads(lambda q, k, v: reference_attention(q, k, v, **kw))

    msg = f"seed={seed} {case} kernel={kernel} blocks={blocks}"
    tol = TOL[case.dtype]
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want, strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert g.shape == w.shape, f"{name} shape {g.shape} != {w.shape}: {msg}"
        if name == "lse":  # -inf exactly where a row sees no key
            np.testing.assert_array_equal(np.isfinite(g), np.isfinite(w), err_msg=f"lse finite pattern: {msg}")
            fin = np.isfinite(w)
            err = float(np.max(np.abs(g[fin] - w[fin])))
            assert err < LSE_ATOL, f"lse: max abs error {err:.2e} >= {LSE_ATOL}: {msg}"
        else:
            assert np.all(np.isfinite(g)), f"{name} not finite: {msg}"
            err = _rel(g, w)
            assert err < tol, f"{name}: relative error {err:.2e} >= {tol}: {msg}"


@pytest.mark.gpu
def test_flash_attention_compiles_to_the_triton_custom_call():
    """On the GPU the kernel is the compiled Triton custom call, not interpret mode."""
    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    hlo = jax.jit(lambda q: flash_attention(q, q[:, :, :2], q[:, :, :2])).lower(q).compile().as_text()
    assert "triton" in hlo.lower()


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_the_reference(case):
    _assert_matches_reference(case)


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", _block_configs())
@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_configurations_match_the_reference(case, blocks):
    _assert_matches_reference(case, blocks)


MOSAIC_CASES = [c for c in CASES if c.values[0].dtype != "float32"] + [
    pytest.param(Case(2, 640, 8, 2, 128, "bfloat16", causal=True, window=200, segments=True),
                 id="gqa4-window200-packed-bf16-h128"),
    pytest.param(Case(1, 512, 4, 4, 256, "float16", causal=True), id="mha-causal-f16-h256"),
    pytest.param(Case(2, 384, 4, 2, 256, "bfloat16", causal=True, segments=True), id="gqa2-causal-packed-bf16-h256"),
    pytest.param(Case(1, 448, 8, 1, 96, "bfloat16", causal=True, s=900), id="mqa-causal-t448-s900-bf16-h96"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MOSAIC_CASES)
def test_mosaic_kernels_match_the_reference(case):
    if not _hopper():
        pytest.skip("the Mosaic GPU attention kernels need a Hopper GPU (compute capability 9.0)")
    _assert_matches_reference(case, kernel="mosaic")


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["row", "tile", "work"])
@pytest.mark.parametrize("case", MOSAIC_CASES)
def test_mosaic_persistent_kernels_on_three_programs_match_the_reference(case, order, monkeypatch):
    """The persistent kernels (forward, dq, dk/dv) on 3 programs, so that every program runs many items one after
    another (the streamed ring and the per-item buffers carried from item to item), in each deal order ("work":
    picked on the block runs at run time); with one program per SM most cases here give a program one item."""
    if not _hopper():
        pytest.skip("the Mosaic GPU attention kernels need a Hopper GPU (compute capability 9.0)")
    from mjax.kernels.attention import mosaic  # noqa: PLC0415

    monkeypatch.setattr(mosaic, "sm_count", lambda: 3)
    monkeypatch.setattr(mosaic, "deal_order", lambda *_: order)
    _assert_matches_reference(case, kernel="mosaic")


def _mosaic_block_configs():
    from mjax.kernels.attention.mosaic import MOSAIC_CANDIDATES  # noqa: PLC0415

    return [pytest.param(cfg, id=name) for name, cfg in MOSAIC_CANDIDATES.items()]


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", _mosaic_block_configs())
@pytest.mark.parametrize("case", BLOCK_CASES)
def test_mosaic_block_configurations_match_the_reference(case, blocks):
    if not _hopper():
        pytest.skip("the Mosaic GPU attention kernels need a Hopper GPU (compute capability 9.0)")
    _assert_matches_reference(case, blocks, kernel="mosaic")
