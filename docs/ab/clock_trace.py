"""Clock trace under load: nvidia-smi samples SM clock and power every 20 ms while the 128-group skewed grouped
forward runs loops of 50 and 2000 calls and a dense GEMM of equal FLOPs runs 2000; prints each phase's wall
window and time per call, so the samples can be lined up with them."""
import subprocess, sys, time, os
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp
from benchmarks.grouped_cases import group_sizes, operands
from mjax.kernels.grouped_matmul import grouped_matmul

out = os.environ.get("OUT", ".")
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader",
                        "-lms", "20"], stdout=open(f"{out}/clock_samples.csv", "w"))
g, r, n, k = 128, 512, 768, 2048
x, w, dy = operands(g, r, n, k, jnp.bfloat16)
gs = jnp.asarray(group_sizes("skewed", g, r))
fwd = jax.jit(lambda x, w, gs: grouped_matmul(x, w, gs, impl="mosaic"))
dense = jax.jit(lambda a, b: a @ b)
wd = w[0]
jax.block_until_ready((fwd(x, w, gs), dense(x, wd)))
time.sleep(2.0)  # idle: let the clock recover

def loop(name, f, args, n):
    jax.block_until_ready(f(*args))
    t0 = time.time()
    for _ in range(n):
        o = f(*args)
    jax.block_until_ready(o)
    t1 = time.time()
    print(f"PHASE {name} n={n} start={t0:.3f} end={t1:.3f} us_per_call={(t1 - t0) / n * 1e6:.1f}", flush=True)

for rnd in range(2):
    loop(f"fwd50#{rnd}", fwd, (x, w, gs), 50)
    loop(f"fwd2000#{rnd}", fwd, (x, w, gs), 2000)
    loop(f"fwd50_after#{rnd}", fwd, (x, w, gs), 50)
    loop(f"dense2000#{rnd}", dense, (x, wd), 2000)
    loop(f"dense50_after#{rnd}", dense, (x, wd), 50)
    time.sleep(2.0)
    loop(f"dense50_cool#{rnd}", dense, (x, wd), 50)
    time.sleep(2.0)
smi.terminate()
print("EPOCH_NOW", time.time())
