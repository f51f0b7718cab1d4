"""Blockwise FP8 grouped matmul: the dispatch (auto is the reference off GPU and the kernels on it), the errors that
name the flag to change, and the benchmark script's blockwise cases end to end."""

import jax
import jax.numpy as jnp
import pytest

from mjax.kernels.grouped_matmul import (GroupedMatmulUnsupported, KernelTile, Tiling, blockwise_grouped_matmul,
                                         choose_impl, why_unsupported)
from mjax.kernels.quant.blockwise import BlockwiseUnsupported
from tests.unit.test_grouped_matmul_fp8_blockwise import CASES, G, make_inputs

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# ---- dispatch and errors ----

FACTS = dict(dtype=jnp.bfloat16, k=2048, n=768, blockwise=True)


def test_auto_is_the_reference_off_gpu_and_the_kernels_on_gpu():
    assert choose_impl("auto", backend="cpu", **FACTS) == "xla"
    assert choose_impl("auto", backend="gpu", **FACTS) == "pallas"
    sizes = CASES["ragged"]
    x, ws, _ = make_inputs(sizes)
    jaxpr = str(jax.make_jaxpr(lambda x: blockwise_grouped_matmul(x, ws[0], jnp.asarray(sizes), jnp.ones((G, 3))))(x))
    assert "ragged_dot" in jaxpr and "pallas_call" not in jaxpr and "f8_e4m3fn" in jaxpr


@pytest.mark.parametrize("facts,reason", [
    (dict(k=2048 + 64), "not multiples of 128"),
    (dict(n=768 + 32), "not multiples of 128"),
    (dict(tiling=Tiling.uniform(KernelTile(128, 128, 64))), "must step 128"),
    (dict(tiling=Tiling(KernelTile(128, 256, 128), KernelTile(128, 256, 128), KernelTile(128, 512, 128))),
     "N=768 to be a multiple of block_n=512"),
])
def test_kernels_that_cannot_take_the_call_raise_naming_the_flag(facts, reason):
    facts = {**FACTS, **facts}
    assert reason in why_unsupported("pallas", backend="gpu", **facts)
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl=auto") as err:
        choose_impl("auto", backend="gpu", **facts)
    assert reason in str(err.value)


def test_bad_arguments_raise():
    sizes = CASES["ragged"]
    x, ws, _ = make_inputs(sizes)
    gs, ones = jnp.asarray(sizes), jnp.ones((G, 3))
    with pytest.raises(BlockwiseUnsupported, match="--fp8_recipe=blockwise"):
        blockwise_grouped_matmul(x[:, :192], ws[0][:, :192], gs, ones)
    with pytest.raises(BlockwiseUnsupported, match="--moe_ffn_hidden_size"):
        blockwise_grouped_matmul(x, ws[0][..., :200], gs, ones)
    with pytest.raises(ValueError, match=r"meta must be \[G, 3\]"):
        blockwise_grouped_matmul(x, ws[0], gs, jnp.ones((3,)))
    with pytest.raises(ValueError, match="one meta per weight"):
        blockwise_grouped_matmul(x, ws, gs, (ones,))
    with pytest.raises(ValueError, match="--fp8_format"):
        blockwise_grouped_matmul(x, ws[0], gs, ones, "e5m2")
    with pytest.raises(GroupedMatmulUnsupported, match="--moe_grouped_gemm_impl"):
        blockwise_grouped_matmul(x, ws[0], gs, ones, impl="triton")


# ---- the benchmark (benchmarks/bench_grouped_matmul.py --fp8_blockwise) ----

@pytest.mark.slow
def test_benchmark_blockwise_smoke_run_tables_sweeps_and_checks(tmp_path):
    """The script's blockwise cases end to end off GPU (kernels interpreted; a subprocess, as its absl flags are
    global): the op, its kernels alone and the dense blockwise GEMM beside the bf16 rows, the sweep of its kernels
    (a tile not 128 deep refused), --check against its reference, and a shape blockwise cannot take skipped."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    out = tmp_path / "gmm_blockwise.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_grouped_matmul", "--shapes=2x192x256x128,4x40x64x32",
                           "--fp8_blockwise", "--check", "--min_time_s=0.001", "--dists=balanced,empty",
                           "--noragged_dot", "--tilings=32x128x128w4s3,32x128x64w4s3", f"--json_out={out}"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": "."})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "check: all PASS" in proc.stdout
    assert "4x40x64x32             blockwise rows skipped" in proc.stdout
    assert "blockwise FP8 kernels step 128 deep" in proc.stdout  # the 64-deep tile is refused, not run
    report = json.loads(out.read_text())
    assert {r["impl"] for r in report["main"] if r["shape"] == [2, 192, 256, 128]} == {
        "dense jnp.dot (ceiling)", "dense fp8 blockwise", "pallas", "pallas fp8 blockwise",
        "blockwise kernels mma=auto"}
    assert all(not r["error"] for r in report["main"])
    blockwise_checks = [r for r in report["check"] if r["reference"] == "blockwise reference (xla)"]
    assert len(blockwise_checks) == 3 and all(r["ok"] for r in blockwise_checks)
    assert report["best_tiles"]["2x192x256x128"] == {k: "32x128x128w4s3" for k in ("forward", "dgrad", "wgrad")}
