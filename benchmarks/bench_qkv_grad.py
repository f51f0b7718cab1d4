"""Bandwidth of the fused QKV gradient's assembly (dQ, dK rotated back by RoPE, dV -> [B, T, K, G + 2, H]): XLA's
autodiff of the split (a concatenate fusion) against the Pallas kernel (--qkv_grad_impl=pallas), with a
copy of the same bytes as the ceiling, measured in the same run. Default shapes: llama3.2-3b, 8 x 4096 tokens.

    python -m benchmarks.bench_qkv_grad [--smoke] [--out=qkv_grad.json]
"""

import json

from absl import flags

from benchmarks.cli import run_main

from mjax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mjax.kernels.qkv_rope_grad.pallas import qkv_rope_grad  # noqa: E402
from mjax.kernels.qkv_rope_grad import split_rotate  # noqa: E402
from mjax.model.rope import rope_cos_sin  # noqa: E402
from benchmarks.harness import time_fn  # noqa: E402

flags.DEFINE_bool("smoke", False, "Small shapes, kernel interpreted: checks the script off GPU.")
flags.DEFINE_string("out", "", "Write the rows as JSON here.")
FLAGS = flags.FLAGS


def main():
    b, t, k, g, h = (1, 256, 2, 3, 64) if FLAGS.smoke else (8, 4096, 8, 3, 128)
    interpret = jax.default_backend() != "gpu"
    key = jax.random.split(jax.random.key(0), 2)
    y = jax.random.normal(key[0], (b, t, k, g + 2, h), jnp.bfloat16)
    cos, sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(t), (b, t)),
                            1.0 / (500000.0 ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)))
    outs, vjp = jax.vjp(lambda y: split_rotate(y, cos, sin), y)
    cts = tuple(jax.random.normal(key[1], o.shape, o.dtype) for o in outs)
    moved = 2 * y.size * y.dtype.itemsize  # read the three gradients, write the fused one (angles: in L2)
    cases = [("copy of the same bytes (ceiling)", jax.jit(lambda y: y * 2), (y,)),
             ("xla: autodiff of the split (concatenate fusion)", jax.jit(lambda *c: vjp(c)[0]), cts),
             ("pallas: kernels/qkv_rope_grad/", jax.jit(lambda *c: qkv_rope_grad(*c, cos, sin, interpret=interpret)),
              cts)]
    rows, ceiling = [], None
    print(f"shape {[b, t, k, g + 2, h]} bf16, {moved / 1e6:.0f} MB moved per call")
    print(f"{'case':50} {'us':>9} {'GB/s':>7} {'of copy':>8}")
    for name, fn, args in cases:
        s = time_fn(fn, *args)
        gbs = moved / s / 1e9
        ceiling = ceiling or gbs
        rows.append({"case": name, "us": round(s * 1e6, 1), "GB/s": round(gbs), "of_copy": round(gbs / ceiling, 3)})
        print(f"{name:50} {s * 1e6:9.1f} {gbs:7.0f} {gbs / ceiling:8.3f}", flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"shape": [b, t, k, g + 2, h], "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    run_main(main)
