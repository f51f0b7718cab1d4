"""The grouped matmul's float64 oracle for the kernel tests: per-group products of the same bf16 values."""

import numpy as np


def per_group_products(x, w, dy, sizes):
    """float64 per-group products of the bf16 values: y, dx, dw (padding rows zero)."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        y[rows], dx[rows], dw[g] = x[rows] @ w[g], dy[rows] @ w[g].T, x[rows].T @ dy[rows]
        start += size
    return y, dx, dw


def assert_per_group(sizes, x, w, dy, y, dx, dw):
    """y, dx, dw equal the per-group products within one bf16 ulp of the largest value, twice (both accumulate in
    float32 and round once to bf16); the padding rows of y and dx are zero."""
    total = sum(sizes)
    want = per_group_products(x[:total], w, dy[:total], sizes)
    for name, got, ref in zip(("y", "dx", "dw"), (y, dx, dw), want):
        got = np.asarray(got, np.float64)
        if name != "dw":
            assert np.all(got[total:] == 0), f"{name}: padding rows are not zero"
            got = got[:total]
            ref = ref[:total]
        err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
        assert err <= 2.0**-7, f"{name}: max error / max |ref| = {err:.2e}"
