"""Tiles of the dense blockwise FP8 GEMM (mjax/kernels/quant/block_gemm.py) on the GPU, beside the bf16 GEMM of the
same shape measured in the same run: TFLOP/s per tiling per shape (e4m3 operands quantized beforehand, 1x128 row
scales on both, the layout the linear layers hand the kernel). Default shapes: DeepSeek-V3's linear layers at 4096
tokens (q_down, q_up, kv_up, o_proj, dense MLP up and down, and one wgrad-shaped product).

    python -m benchmarks.bench_block_gemm --json_out=$OUT/block_gemm.json
    python -m benchmarks.bench_block_gemm --shapes=4096x4096x4096 --tiles=128x128w8s3,128x64w4s4
"""

import json

from absl import flags

from benchmarks.cli import BadInput, run_main

from mjax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.harness import time_fn  # noqa: E402
from mjax.kernels.quant import blockwise  # noqa: E402
from mjax.kernels.quant.block_gemm import GemmTiles, block_gemm_pallas  # noqa: E402

SHAPES = ("4096x7168x1536,4096x1536x24576,4096x512x32768,4096x16384x7168,4096x7168x18432,4096x18432x7168,"
          "7168x4096x18432")
TILES = "128x128w8s3,128x64w4s4,64x128w4s4,128x128w4s4,64x64w4s4,128x256w8s3,128x64w4s3,64x128w4s3"
FLAGS = flags.FLAGS
flags.DEFINE_string("shapes", SHAPES, "MxKxN, comma-separated.")
flags.DEFINE_string("tiles", TILES, "BMxBNwWARPSsSTAGES, comma-separated.")
flags.DEFINE_string("json_out", "", "Write every row as JSON here.")


def parse(text: str, pattern: str, fn):
    try:
        return [fn(item) for item in text.split(",") if item]
    except ValueError:
        raise BadInput(f"cannot read {text!r} as {pattern}[,...]") from None


def tiles_of(item: str) -> GemmTiles:
    dims, rest = item.split("w")
    bm, bn = dims.split("x")
    warps, stages = rest.split("s")
    return GemmTiles(int(bm), int(bn), int(warps), int(stages))


def main():
    shapes = parse(FLAGS.shapes, "MxKxN", lambda s: tuple(int(v) for v in s.split("x")))
    if any(len(s) != 3 for s in shapes):
        raise BadInput(f"--shapes={FLAGS.shapes!r}: expected MxKxN[,...]")
    tiles = parse(FLAGS.tiles, "BMxBNwWARPSsSTAGES", tiles_of)
    if jax.default_backend() != "gpu":
        raise BadInput("the blockwise GEMM tiles are timed on a GPU (no GPU found)")
    e4m3, rows = jnp.float8_e4m3fn, []
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: TFLOP/s = 2 M K N / time", flush=True)
    for m, k, n in shapes:
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        b = jax.random.normal(jax.random.key(1), (n, k), jnp.bfloat16)
        aq, sa, _ = blockwise.quantize_rows(a, e4m3)
        bq, sb, _ = blockwise.quantize_rows(b, e4m3)  # [N, K/128]: the kernel takes [K/128, N]
        flop = 2 * m * n * k
        row = {"shape": f"{m}x{k}x{n}", "bf16": flop / time_fn(jax.jit(lambda x, y: x @ y.T), a, b) / 1e12}
        for t in tiles:
            f = jax.jit(lambda a, sa, b, sb, t=t: block_gemm_pallas(a, sa, b, sb, out_dtype=jnp.bfloat16, tiles=t))
            name = f"{t.bm}x{t.bn}w{t.num_warps}s{t.num_stages}"
            try:
                row[name] = flop / time_fn(f, aq, sa, bq, sb.T, min_s=0.1) / 1e12
            except Exception as e:  # noqa: BLE001  (a tiling that does not fit costs only its cell)
                row[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        rows.append(row)
        print(" | ".join(f"{key} {v:.0f}" if isinstance(v, float) else f"{key} {v}" for key, v in row.items()),
              flush=True)
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    run_main(main)
