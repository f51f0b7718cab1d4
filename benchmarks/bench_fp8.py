"""FP8/FP4 on the GPU in one run: HLO checks, GEMM throughput per recipe next to bf16, llama3.2-3b tokens/s.

    PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m benchmarks.bench_fp8 \
        --out=$OUT/bench_fp8.json --budget_s=226 2>&1 | tee $OUT/log.txt     (no grep in the pipe: it buffers)
    python -m benchmarks.bench_fp8 --smoke   # small shapes, tiny model: checks the script off GPU

Sections, in priority order, each saved to the JSON as soon as it ends (a timeout keeps what finished):
  hlo     an FP8 (tensorwise) train step of a small model compiles to FP8 GEMMs (cuBLASLt `$f8`, or XLA's own
          Triton GEMM fusions on f8 operands); the FP4 round trip survives XLA only behind the optimization barrier
  e2e     llama3.2-3b train steps, bf16 then fp8 tensorwise (same params, mock data): tokens/s and their ratio
  gemm    8192^3: the bf16 GEMM ceiling and the FP8 one (quantized operands straight into dot_general), the
          blockwise Pallas GEMM (a few tile shapes), then one linear layer's forward + dgrad + wgrad per recipe,
          quantization included, against bf16's three GEMMs
  quant   the quantization passes around a GEMM (amax, cast, transposed copy) in GB/s against a copy's
  hlo2    delayed / blockwise / nvfp4 train steps of the small model: which GEMM kernels each compiles to
"""

import functools
import gzip
import json
import os
import re
import time
import traceback

from absl import flags

from benchmarks.cli import BadInput, run_main

from mjax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from mjax.config import load_config  # noqa: E402
from mjax.kernels.quant import blockwise as fp8_blockwise, fp4  # noqa: E402
from mjax.kernels.quant.fp8 import E4M3, quantize  # noqa: E402
from mjax.kernels.quant.cast_transpose import cast_transpose, cast_transpose_local  # noqa: E402
from mjax.kernels.quant.block_gemm import GemmTiles, block_gemm_pallas  # noqa: E402
from mjax.kernels.quant import QuantPolicy, quantized_matmul  # noqa: E402
from benchmarks.harness import synthetic_batch, time_fn  # noqa: E402
from mjax.train.fp8_state import Fp8State  # noqa: E402
from mjax.train.loop import build  # noqa: E402
from mjax.train.metrics import flops_per_step  # noqa: E402

flags.DEFINE_string("out", os.path.join(os.environ.get("OUT", "/tmp"), "bench_fp8.json"),
                    "JSON results, rewritten after each section; HLO dumps go beside it.")
flags.DEFINE_bool("smoke", False, "Small shapes, tiny model: checks the script off GPU.")
flags.DEFINE_float("budget_s", 225.0, "Wall-clock budget: a section that would start past it is skipped.")
flags.DEFINE_float("gemm_deadline_s", 200.0, "The gemm section skips the remaining recipes past this many seconds.")
flags.DEFINE_list("gemm_cases", [], "Only the linear-layer rows whose recipe contains one of these, next to bf16's "
                  "(e.g. blockwise); every row when empty.")
flags.DEFINE_integer("e2e_batch", 8, "e2e: global batch size.")
flags.DEFINE_integer("e2e_micro", None, "e2e: micro-batch size (default: the global batch).")
flags.DEFINE_string("e2e_remat", "selective", "e2e: remat policy.")
flags.DEFINE_integer("e2e_seq", 4096, "e2e: sequence length.")
flags.DEFINE_integer("e2e_steps", 3, "e2e: timed steps per recipe.")
flags.DEFINE_list("sections", ["hlo", "fp4_fold", "e2e", "gemm", "hlo2"], "Which sections to run, in order.")
FLAGS = flags.FLAGS

F8_CALL = "__cublas$lt$matmul$f8"
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def kernel_census(hlo: str) -> dict:
    """Which GEMM kernels a compiled module calls (a scanned layer's GEMMs appear once). XLA may also pick its own
    Triton GEMM fusions ("__triton_nested_gemm_fusion"), FP8 ones among them (fused computations with f8 params)."""
    lines = hlo.splitlines()
    calls = [ln for ln in lines if "custom-call" in ln or "custom_call_target" in ln]
    fusions = [m.group(1) for ln in lines if "__triton_nested_gemm_fusion" in ln or '"__triton_gemm"' in ln
               for m in [re.search(r"calls=(%[\w.\-]+)", ln)] if m]
    headers = {ln.split(" ", 1)[0]: ln for ln in lines if ln.startswith("%")}
    return {"cublaslt_f8": sum(F8_CALL in ln for ln in calls),
            "cublas_other": sum(("__cublas$" in ln) and (F8_CALL not in ln) for ln in calls),
            "xla_triton_gemm": len(fusions),
            "xla_triton_gemm_f8": sum("f8e" in headers.get(f, "") for f in fusions),
            "pallas_block_gemm": hlo.count("mjax_fp8_block_gemm") > 0,
            "pallas_fp4_quant": "mjax_fp4_fake_quant" in hlo,
            "f4e2m1fn_present": "f4e2m1fn" in hlo,
            "cudnn": sum("__cudnn$" in ln for ln in calls)}


# ---------------------------------------------------------------- small-model train steps (HLO)

def small_config(**precision):
    cfg = load_config("tiny").replace(
        model=dict(num_layers=2, hidden_size=512, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=1024,
                   vocab_size=2048),
        train=dict(global_batch_size=4, seq_length=256, train_iters=10),
        precision={"compute_dtype": "bfloat16", **precision}, logging=dict(progress=False))
    return cfg


def compile_step(cfg, state=None):
    setup = build(cfg, jax.devices()[:1])
    state = setup.init_state(0) if state is None else state
    batch = synthetic_batch(cfg, setup)
    compiled, compile_s = setup.compile_step(state, batch)
    return setup, state, batch, compiled, compile_s


def hlo_section(recipes) -> dict:
    out = {}
    for name, precision in recipes.items():
        try:
            _, state, batch, compiled, compile_s = compile_step(small_config(**precision))
            with gzip.open(os.path.join(os.path.dirname(FLAGS.out), f"small_{name}.hlo.txt.gz"), "wt") as f:
                f.write(compiled.as_text())
            losses = []
            for _ in range(3):
                state, metrics = compiled(state, batch)
                losses.append(float(metrics["loss"]))
            out[name] = {"compile_s": round(compile_s, 1), "losses": losses, **kernel_census(compiled.as_text())}
        except Exception as e:  # noqa: BLE001  (report every failure, keep going)
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        print(f"[{elapsed():6.1f}s] hlo {name}: {out[name]}", flush=True)
    return out


def fp4_fold_check() -> dict:
    x = jax.random.normal(jax.random.key(0), (256, 256), jnp.float32)
    bare = jax.jit(lambda x: x.astype(fp4.E2M1).astype(jnp.float32)).lower(x).compile().as_text()
    kept = jax.jit(lambda x: fp4.fake_quant_reference(x, "nvfp4")).lower(x).compile().as_text()
    return {"bare_round_trip_keeps_e2m1": "f4e2m1fn" in bare, "with_barrier_keeps_e2m1": "f4e2m1fn" in kept}


# ---------------------------------------------------------------- GEMMs

def gemm_section() -> dict:
    n = 512 if FLAGS.smoke else 8192
    m = k = n
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    g = (jax.random.normal(kg, (m, n), jnp.float32) * 1e-4).astype(jnp.bfloat16)
    flop = 2.0 * m * n * k
    rows, out = [], {"shape": [m, k, n]}

    def record(name, fn, fargs, gemms, base=None):
        try:
            compiled = fn.lower(*fargs).compile()
            census = kernel_census(compiled.as_text())
            t = time_fn(compiled, *fargs)
            row = {"case": name, "ms": round(t * 1e3, 3), "tflops": round(gemms * flop / t / 1e12, 1), **census}
            if base is not None:
                row["speedup_vs_bf16"] = round(base / t, 3)
        except Exception as e:  # noqa: BLE001
            row, t = {"case": name, "error": f"{type(e).__name__}: {e}"[:1500]}, None
        rows.append(row)
        print(f"[{elapsed():6.1f}s] gemm {row}", flush=True)
        return t

    cases = FLAGS.gemm_cases
    if not cases:  # the single-GEMM rows: ceilings and the blockwise kernel alone
        wb = w.astype(jnp.bfloat16)
        bf16 = record("bf16 x bf16 -> bf16 (ceiling)", jax.jit(lambda a, b: a @ b), (x, wb), 1)
        xq, wq = quantize(x, 448 / jnp.max(jnp.abs(x)).astype(jnp.float32), E4M3), quantize(w, 448 / 0.2, E4M3)
        dn = (((1,), (0,)), ((), ()))
        record("e4m3 x e4m3 -> bf16, operands pre-quantized (FP8 ceiling)",
               jax.jit(lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=jnp.bfloat16)), (xq, wq), 1,
               bf16)
        record("e4m3 dequantized via f32 -> bf16 (XLA scale-fusion form)",
               jax.jit(lambda a, b, s: jnp.dot(a.astype(jnp.float32) * s, b.astype(jnp.float32) * s,
                                               preferred_element_type=jnp.bfloat16)), (xq, wq, jnp.float32(0.5)), 1,
               bf16)
        aq, sa, _ = fp8_blockwise.quantize_rows(x, E4M3)
        bq, sb, _ = fp8_blockwise.quantize_tiles(w, E4M3)
        bq, sb = bq.T, fp8_blockwise.expand_cols(sb)  # [N, K]: K-major
        # The two fastest tiles of a first sweep on the GPU (docs/fp8.md).
        for tiles in (GemmTiles(128, 128, 8, 3), GemmTiles(64, 128, 4, 4)):
            interp = jax.default_backend() != "gpu"
            record(f"blockwise pallas GEMM {tiles}", jax.jit(
                lambda a, sa, b, sb, t=tiles: block_gemm_pallas(a, sa, b, sb, out_dtype=jnp.bfloat16, interpret=interp,
                                                                tiles=t)), (aq, sa, bq, sb), 1, bf16)
            if FLAGS.smoke:
                break

    def linear(policy):
        def f(x, w, g):
            meta = jnp.array([448 / 4.0, 448 / 0.2, 57344 / 1e-3], jnp.float32)  # delayed: plausible scales
            fwd = (lambda a, b: a @ b.astype(a.dtype)) if policy is None else (
                lambda a, b: quantized_matmul(policy, a, b, meta))
            y, vjp = jax.vjp(fwd, x, w)
            return (y, *vjp(g))
        return jax.jit(f)

    base3 = record("linear fwd+dgrad+wgrad: bf16", linear(None), (x, w, g), 3)
    for name, policy in [("tensorwise", QuantPolicy(fp8_recipe="tensorwise")),
                         ("delayed", QuantPolicy(fp8_recipe="delayed")),
                         ("tensorwise e4m3", QuantPolicy(fp8_recipe="tensorwise", fp8_format="e4m3")),
                         ("blockwise (pallas)", QuantPolicy(fp8_recipe="blockwise", quant_impl="pallas")),
                         ("blockwise (xla f32 reference)", QuantPolicy(fp8_recipe="blockwise", quant_impl="xla")),
                         ("nvfp4 emulated (pallas quant)", QuantPolicy(fp4_recipe="nvfp4", quant_impl="pallas")),
                         ("nvfp4 emulated (xla quant)", QuantPolicy(fp4_recipe="nvfp4", quant_impl="xla")),
                         ("mxfp4 emulated + RHT (pallas quant)",
                          QuantPolicy(fp4_recipe="mxfp4", fp4_hadamard=True, quant_impl="pallas"))]:
        if cases and not any(c in name for c in cases):
            continue
        record(f"linear fwd+dgrad+wgrad: {name}", linear(policy), (x, w, g), 3, base3)
        if elapsed() > FLAGS.gemm_deadline_s:
            rows.append({"case": "remaining recipes skipped", "reason": f"past {FLAGS.gemm_deadline_s}s"})
            break
    out["rows"] = rows
    return out


# ---------------------------------------------------------------- quantization passes

def quant_section() -> dict:
    """The memory-bound work FP8 adds around each GEMM, on one [32768, 8192] bf16 activation (8 x 4096 tokens of a
    3B MLP): bytes moved per pass against a plain copy's rate measured in the same run."""
    m, n = (1024, 512) if FLAGS.smoke else (32768, 8192)
    x = jax.random.normal(jax.random.key(0), (m, n), jnp.bfloat16)
    scale = jnp.float32(100.0)
    rows = []
    cases = [  # name, fn, bytes moved per element
        ("copy x * 2 (ceiling)", lambda x: x * 2, 4),
        ("amax: max(abs(x))", lambda x: jnp.max(jnp.abs(x)).astype(jnp.float32), 2),
        ("amax: row maxima, then their max", lambda x: jnp.max(jnp.max(jnp.abs(x), axis=-1)).astype(jnp.float32), 2),
        ("quantize with a given scale", lambda x: quantize(x, scale, E4M3), 3),
        ("quantize + transposed copy", lambda x: (lambda q: (q, q.T))(quantize(x, scale, E4M3)), 4),
        ("cast-transpose kernel (quantize, both layouts, one pass)",
         lambda x: cast_transpose(x, scale, E4M3, interpret=jax.default_backend() != "gpu"), 4),
        ("cast-transpose kernel + amax (delayed: one pass)",
         lambda x: cast_transpose(x, scale, E4M3, interpret=jax.default_backend() != "gpu", with_amax=True), 4),
        ("tensorwise: amax, then quantize", lambda x: quantize(x, 448 / jnp.max(jnp.abs(x)).astype(jnp.float32),
                                                              E4M3), 5),
        ("delayed: quantize and amax in one pass",
         lambda x: (quantize(x, scale, E4M3), jnp.max(jnp.abs(x)).astype(jnp.float32)), 3),
    ]
    ceiling = None
    for name, fn, per_elem in cases:
        try:
            t = time_fn(jax.jit(fn), x)
            gbs = per_elem * m * n / t / 1e9
            ceiling = ceiling or gbs
            row = {"case": name, "us": round(t * 1e6, 1), "GB/s": round(gbs), "of_copy": round(gbs / ceiling, 3)}
        except Exception as e:  # noqa: BLE001
            row = {"case": name, "error": f"{type(e).__name__}: {e}"[:1500]}
        rows.append(row)
        print(f"[{elapsed():6.1f}s] quant {row}", flush=True)
    return {"shape": [m, n], "rows": rows}


CT_TILES = ((128, 128, 8), (128, 128, 4), (64, 256, 8), (64, 128, 4), (32, 128, 4), (128, 256, 8), (256, 64, 8))


def ct_tiles_section() -> dict:
    """The cast-transpose kernel's tile (rows, cols, warps) on the shapes a 3B FP8 step quantizes: the gate/up
    gradient, an activation, an f32 weight; GB/s moved against a copy of the same array in the same run."""
    interpret = jax.default_backend() != "gpu"
    shapes = (((256, 512), jnp.bfloat16, jnp.float8_e5m2),) if FLAGS.smoke else (
        ((32768, 16384), jnp.bfloat16, jnp.float8_e5m2), ((32768, 3072), jnp.bfloat16, E4M3),
        ((3072, 16384), jnp.float32, E4M3))
    rows = []
    for shape, dtype, qdtype in shapes:
        x = jax.random.normal(jax.random.key(0), shape, dtype)
        scale = jnp.ones((1,), jnp.float32)
        size = x.size * x.dtype.itemsize
        copy = time_fn(jax.jit(lambda x: x * 2), x)
        rows.append({"shape": list(shape), "dtype": jnp.dtype(dtype).name, "case": "copy (ceiling)",
                     "us": round(copy * 1e6, 1), "GB/s": round(2 * size / copy / 1e9)})
        print(f"[{elapsed():6.1f}s] ct_tiles {rows[-1]}", flush=True)
        for br, bc, warps in CT_TILES[:2] if FLAGS.smoke else CT_TILES:
            fn = jax.jit(functools.partial(cast_transpose_local, dtype=qdtype, interpret=interpret, tile=(br, bc),
                                           num_warps=warps))
            row = {"shape": list(shape), "dtype": jnp.dtype(dtype).name, "case": f"tile {br}x{bc}, {warps} warps"}
            try:
                t = time_fn(fn, x, scale)
                gbs = (size + 2 * x.size) / t / 1e9  # read x, write two 1-byte copies
                row.update(us=round(t * 1e6, 1), **{"GB/s": round(gbs), "of_copy": round(gbs / (2 * size / copy / 1e9), 3)})
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {e}"[:1500]
            rows.append(row)
            print(f"[{elapsed():6.1f}s] ct_tiles {row}", flush=True)
    return {"rows": rows}


# ---------------------------------------------------------------- end to end

def e2e_section(results, save) -> dict:
    if FLAGS.smoke:
        cfg = load_config("tiny").replace(train=dict(global_batch_size=4, seq_length=128),
                                          precision=dict(compute_dtype="bfloat16"))
    else:
        cfg = load_config("llama3.2-3b").replace(  # the preset of docs/performance.md's one-GPU rows
            execution=dict(remat_policy=FLAGS.e2e_remat),
            train=dict(global_batch_size=FLAGS.e2e_batch, micro_batch_size=FLAGS.e2e_micro, seq_length=FLAGS.e2e_seq,
                       train_iters=100))
    cfg = cfg.replace(data=dict(mock_data=True), logging=dict(progress=False))
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    flops = flops_per_step(cfg.model, cfg.train.global_batch_size, cfg.train.seq_length)
    out = {"config": {"model": cfg.model.name, "global_batch": cfg.train.global_batch_size,
                      "micro_batch": cfg.train.micro_batch_size, "seq": cfg.train.seq_length,
                      "remat": cfg.execution.remat_policy}}
    state = None
    for name, precision in (("bf16", {}), ("fp8_tensorwise", dict(fp8_recipe="tensorwise"))):
        if elapsed() > FLAGS.budget_s - 50:  # room for a row: a 3B compile and 4 steps (times: docs/fp8.md)
            out[name] = {"skipped": f"{elapsed():.0f}s of the {FLAGS.budget_s}s budget spent"}
            break
        try:
            c = cfg.replace(precision=precision)
            if state is not None:  # reuse the bf16 run's params and optimizer state; add the FP8 state
                model = build(c, jax.devices()[:1]).model
                state = state.replace(fp8=Fp8State.create(model.init_fp8(), c.precision.fp8_amax_history_len))
            t = time.perf_counter()
            setup, state, batch, compiled, compile_s = compile_step(c, state)
            init_s = time.perf_counter() - t - compile_s
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            steps = 1 if FLAGS.smoke else FLAGS.e2e_steps
            t = time.perf_counter()
            for _ in range(steps):
                state, metrics = compiled(state, batch)
            loss = float(metrics["loss"])
            dt = (time.perf_counter() - t) / steps
            hlo = compiled.as_text()
            with gzip.open(os.path.join(os.path.dirname(FLAGS.out), f"e2e_{name}.hlo.txt.gz"), "wt") as f:
                f.write(hlo)
            out[name] = {"step_s": round(dt, 4), "tokens_per_s": round(tokens / dt, 1),
                         "model_tflops": round(flops / dt / 1e12, 1), "mfu_989": round(flops / dt / 989e12, 4),
                         "loss": loss, "compile_s": round(compile_s, 1), "init_s": round(init_s, 1),
                         **kernel_census(hlo)}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        print(f"[{elapsed():6.1f}s] e2e {name}: {out[name]}", flush=True)
        results["e2e"] = out
        save()
    if "tokens_per_s" in out.get("bf16", {}) and "tokens_per_s" in out.get("fp8_tensorwise", {}):
        out["fp8_speedup"] = round(out["fp8_tensorwise"]["tokens_per_s"] / out["bf16"]["tokens_per_s"], 3)
    return out


def main():
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    results = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
               "backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", "")}

    def save():
        results["elapsed_s"] = round(elapsed(), 1)
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=1)

    sections = [
        ("hlo", lambda: hlo_section({"tensorwise": dict(fp8_recipe="tensorwise")})),
        ("fp4_fold", fp4_fold_check),
        ("e2e", lambda: e2e_section(results, save)),
        ("gemm", gemm_section),
        ("quant", quant_section),
        ("ct_tiles", ct_tiles_section),
        ("hlo2", lambda: hlo_section({"delayed": dict(fp8_recipe="delayed"),
                                            "blockwise": dict(fp8_recipe="blockwise"),
                                            "nvfp4": dict(fp4_recipe="nvfp4")})),
    ]
    chosen = FLAGS.sections
    unknown = set(chosen) - {name for name, _ in sections}
    if unknown:
        raise BadInput(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(n for n, _ in sections)}")
    for name, fn in sections:
        if name not in chosen:
            continue
        if elapsed() > FLAGS.budget_s - 10:
            results[name] = {"skipped": f"{elapsed():.0f}s of the {FLAGS.budget_s}s budget spent"}
            continue
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        print(f"[{elapsed():6.1f}s] section {name} done", flush=True)
        save()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_main(main)
