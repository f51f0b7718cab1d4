"""The flash-attention oracle check shared by both kernel families' tests: forward output, log-sum-exp and every
input gradient (with a random cotangent on the LSE too) of `flash_attention` against `reference_attention`."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from mjax.kernels.attention import reference_attention
from mjax.kernels.attention.flash import flash_attention

# relative Frobenius error allowed per input dtype (the kernel rounds P to the input dtype before P @ V)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1e-2, jnp.float16: 1.5e-3}


def random_seed():
    return int.from_bytes(os.urandom(4), "little")


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(seed, b, t, s, n, kh, h, dtype, segments):
    """q, k, v, do, dlse and the segment ids: None; segments=True: sorted ids [b, t] (packed documents, T == S);
    "pair": independently sorted query [b, t] and key [b, s] ids, as a ring step over another chunk's keys sees."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, t, n, h), jnp.float32).astype(dtype)
    dlse = jax.random.normal(ks[4], (b, n, t), jnp.float32)
    seg = None
    if segments == "pair":
        seg = (jnp.sort(jax.random.randint(ks[5], (b, t), 0, 3), axis=1),
               jnp.sort(jax.random.randint(ks[6], (b, s), 0, 3), axis=1))
    elif segments:  # sorted ids = packed documents of random lengths
        seg = jnp.sort(jax.random.randint(ks[5], (b, t), 0, 4), axis=1)
    return q, k, v, do, dlse, seg


def check(seed, b, t, s, n, kh, h, dtype, *, causal, window, segments, blocks, lse_grad=True, kernel="pallas",
          offset=None):
    """offset: where query i sits among the keys (an int or a [B] array; default S - T), as context parallelism's
    blocks pass it."""
    q, k, v, do, dlse, seg = inputs(seed, b, t, s, n, kh, h, dtype, segments)
    kw = dict(causal=causal, sliding_window=window, segment_ids=seg, return_lse=True, offset=offset)

    @jax.jit
    def both(q, k, v, do, dlse):
        dl = dlse if lse_grad else jnp.zeros_like(dlse)
        (o, lse), f_vjp = jax.vjp(lambda *a: flash_attention(*a, block_sizes=blocks, kernel=kernel, **kw), q, k, v)
        (ro, rlse), r_vjp = jax.vjp(lambda *a: reference_attention(*a, **kw), q, k, v)
        return (o, lse, *f_vjp((do, dl))), (ro, rlse, *r_vjp((do, dl)))

    got, want = both(q, k, v, do, dlse)
    msg = f"seed={seed} shape=(b{b},t{t},s{s},n{n},k{kh},h{h}) {jnp.dtype(dtype).name} causal={causal} window={window}"
    tol = TOL[dtype]
    o, lse, dq, dk, dv = got
    ro, rlse, rdq, rdk, rdv = want
    assert o.shape == ro.shape and o.dtype == ro.dtype, msg
    assert lse.shape == (b, n, t) and lse.dtype == jnp.float32, msg
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(rlse), err_msg=msg)
    fin = np.isfinite(np.asarray(rlse))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rlse)[fin], atol=2e-3, rtol=1e-4, err_msg=msg)
    for name, g, r in (("out", o, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        assert g.shape == r.shape and g.dtype == r.dtype, f"{name} {msg}"
        assert np.all(np.isfinite(np.asarray(g, np.float32))), f"{name} not finite: {msg}"
        assert rel(g, r) < tol, f"{name}: relative error {rel(g, r):.2e} >= {tol}: {msg}"
