"""Attention speed on the GPU: mjax's flash attention kernels (Mosaic GPU on Hopper, Triton) against cuDNN
(jax.nn.dot_product_attention) and the unfused XLA reference, beside the bf16 matmul ceiling measured in the same
run. One table and JSON.

    python -m benchmarks.bench_attention --json_out=$OUT/attention.json
    python -m benchmarks.bench_attention --notune --seqs=4096
    python -m benchmarks.bench_attention --smoke --json_out=attention.json  # off GPU: tiny shapes, interpreted

1. Block-size sweep (--notune skips it): a few block/warp/stage configurations of the forward kernel, then of the
   two backward kernels alone on a saved forward output and LSE, at T=4096, B=8, 32 query / 8 KV heads, head dim
   128, causal, bf16. The fastest forward and the fastest backward go into the table.
   On a Hopper GPU also the Mosaic kernels' blocks (the default and mosaic.MOSAIC_CANDIDATES, forward and
   forward + backward, then the backward's two kernels and XLA's delta timed apart); --sweep_kernels picks which,
   --mosaic_candidates which of MOSAIC_CANDIDATES the Mosaic sweep tries.
2. Table: forward and forward + backward of mosaic (Hopper), pallas, cudnn and xla at each of --seqs with
   --tokens tokens per batch (xla's forward + backward skipped above --skip_xla_bwd_over; cudnn only where the
   capability table allows it), then, at the largest seq, packed documents (mosaic and pallas: cuDNN cannot mask
   them) and a sliding window of 1024. --passes=N times each case's implementations N times over, one after another
   (odd passes in reverse order): rows hold the median of their passes' times and each kernel's speed-up over cuDNN
   as the median of the passes' own ratios (`*_x_cudnn`, with their range); a packed row's time over the same
   kernel's on unpacked rows, timed in the same passes, likewise (`*_of_unpacked`); the target checks use
   --passes=3. On the GPU each row also holds the SM clock read after each of its loops, per pass
   (`*_clock_mhz`): a ratio means most between loops that ended at the same clock.
TFLOP/s count the causal half: forward 4*B*N*T*T*H/2, forward + backward 3.5x that and the backward alone 2.5x
(the flash convention: the backward's recomputation counted); packed rows count the full causal work. The
kernels' correctness on the GPU: tests/gpu/test_attention_kernels.py.
"""

import dataclasses
import json
import sys

from absl import flags

from benchmarks.cli import BadInput, run_main

from mjax.xla_flags import apply_defaults

apply_defaults()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.attention_cases import (DTYPE, causal_flops, inputs, rate, summarise_passes,  # noqa: E402
                                       time_or_error)
from benchmarks.harness import matmul_ceiling_tflops, sm_clock_mhz  # noqa: E402
from mjax.kernels.attention import dot_product_attention, why_unsupported  # noqa: E402
from mjax.kernels.attention.flash import flash_attention  # noqa: E402
from mjax.kernels.attention.flash_backward import flash_backward  # noqa: E402
from mjax.kernels.attention.flash_common import (BACKWARD_CANDIDATES, FORWARD_CANDIDATES, MaskSpec,  # noqa: E402
                                                 default_block_sizes, default_interpret, with_backward,
                                                 with_forward)
from mjax.kernels.attention.flash_forward import flash_forward  # noqa: E402
from mjax.kernels.attention.mosaic import (MOSAIC_CANDIDATES, default_mosaic_blocks,  # noqa: E402
                                           mosaic_backward_parts, mosaic_forward_op)

flags.DEFINE_string("json_out", "", "Write the environment, the sweep and the table as JSON here (rewritten after "
                    "each stage).")
flags.DEFINE_bool("smoke", False, "Tiny shapes, kernels interpreted: checks the script off GPU (at seqs 64,128, "
                  "or at --seqs where given).")
flags.DEFINE_bool("tune", True, "Sweep the block sizes first (--notune: the table uses the library's defaults).")
flags.DEFINE_list("sweep_kernels", ["pallas", "mosaic"], "Kernels whose block sizes --tune sweeps (the others "
                  "use their defaults).")
flags.DEFINE_list("mosaic_candidates", None, "Names of mosaic.MOSAIC_CANDIDATES the Mosaic sweep tries beside the "
                  "default (unset: all).")
flags.DEFINE_list("heads", ["32", "8", "128"], "Query heads, KV heads, head dim of every case.")
flags.DEFINE_list("seqs", ["2048", "4096", "8192"], "Sequence lengths of the table.")
flags.DEFINE_integer("tokens", 32768, "Batch * seq of each table row.")
flags.DEFINE_integer("skip_xla_bwd_over", 4096, "Skip xla's forward + backward above this seq (it materialises "
                     "the T x T logits and their gradient: at 8192 more than an H200 holds).")
flags.DEFINE_float("min_time_s", 0.25, "Timed seconds per case (after compile and one warm-up call).")
flags.DEFINE_integer("passes", 1, "Times each table case's implementations this many times over, one after another; "
                     "rows report the median and, against cuDNN, the median of each pass's speed-up.", lower_bound=1)
FLAGS = flags.FLAGS

HEAD_DIM = 128
TUNE_SEQ, TUNE_BATCH = 4096, 8
WINDOW = 1024
# --smoke: the same code paths at toy sizes; the sweep tries the first two configurations of each list (the blocks
# clamped to the sequence), as every interpreted compile costs seconds on a CPU; --seqs, where given, replaces seqs.
SMOKE = dict(heads=(4, 2, HEAD_DIM), tune=(128, 1), configs=2, seqs=[64, 128], tokens=128, skip_xla_bwd_over=64)


def packed_segments(b, t, seed=0):
    """[B, T] ids of 4 documents of random length per row (3 distinct cut points)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(np.stack([rng.choice(np.arange(1, t), size=3, replace=False) for _ in range(b)]), axis=1)
    return jnp.asarray((np.arange(t)[None, None, :] >= cuts[:, :, None]).sum(1), jnp.int32)  # [B, 3] -> [B, T]


def attention_fns(impl, blocks, interpret, window=None):
    """jit'ed forward(q, k, v, seg) and forward + backward(q, k, v, seg, do) -> (dq, dk, dv) of one impl."""
    def attend(q, k, v, seg):
        if impl in ("pallas", "mosaic"):
            return flash_attention(q, k, v, causal=True, sliding_window=window, segment_ids=seg, block_sizes=blocks,
                                   interpret=interpret, kernel=impl)
        return dot_product_attention(q, k, v, causal=True, sliding_window=window, segment_ids=seg, impl=impl)

    def fwd_bwd(q, k, v, seg, do):
        _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
        return vjp(do)

    return jax.jit(attend), jax.jit(fwd_bwd)


def sweep(heads, t, b, configs, ceiling, interpret, rows):
    """The fastest forward configuration, then the fastest backward on top of it; None if no forward ran."""
    q, k, v, do = inputs(t, b, heads)
    flop = causal_flops(b, t, heads[0], heads[2])
    base = default_block_sizes(heads[2])
    best_fwd, best_s = None, float("inf")
    for bq, bk, w, s in FORWARD_CANDIDATES[:configs]:
        cfg = with_forward(base, (bq, bk, w, s))
        seconds, err = time_or_error(attention_fns("pallas", cfg, interpret)[0], q, k, v, None,
                                     min_s=FLAGS.min_time_s)
        row = {"kind": "fwd", "config": f"bq={bq} bk={bk} warps={w} stages={s}", "error": err}
        if seconds is not None:
            rate(row, "", flop, seconds, ceiling)
            if seconds < best_s:
                best_fwd, best_s = cfg, seconds
        rows.append(row)
        print_sweep_row(row)
    if best_fwd is None:
        return None
    # The backward alone: both kernels on this forward's output and LSE (saved once), as the custom_vjp calls them.
    fwd_blocks = best_fwd.clamp(t, t)
    spec = MaskSpec(causal=True, window=None, offset=0, kv_len=t, kv_len_padded=t, q_len_padded=t, segments=False)
    scale = heads[2] ** -0.5
    out, lse = flash_forward(q, k, v, None, None, spec=spec, blocks=fwd_blocks, scale=scale, interpret=interpret)
    dlse = jnp.zeros_like(lse)
    best_bwd, best_s = None, float("inf")
    for candidate in BACKWARD_CANDIDATES[:configs]:
        cfg = with_backward(best_fwd, candidate)
        backward = jax.jit(lambda q, k, v, out, lse, do, dlse, blocks=cfg.clamp(t, t): flash_backward(
            q, k, v, None, None, out, lse, do, dlse, spec=spec, blocks=blocks, scale=scale, interpret=interpret))
        seconds, err = time_or_error(backward, q, k, v, out, lse, do, dlse, min_s=FLAGS.min_time_s)
        row = {"kind": "bwd", "config": f"dq={candidate[0]} dkv={candidate[1]}", "error": err}
        if seconds is not None:
            rate(row, "", 2.5 * flop, seconds, ceiling)
            if seconds < best_s:
                best_bwd, best_s = cfg, seconds
        rows.append(row)
        print_sweep_row(row)
    return best_bwd or best_fwd


def sweep_mosaic(heads, t, b, ceiling, rows):
    """The Mosaic kernels' blocks: the forward fields of the fastest forward and the dq / dk-dv fields of the
    fastest backward (forward + backward minus forward) among the default and MOSAIC_CANDIDATES."""
    q, k, v, do = inputs(t, b, heads)
    flop = causal_flops(b, t, heads[0], heads[2])
    names = MOSAIC_CANDIDATES if FLAGS.mosaic_candidates is None else FLAGS.mosaic_candidates
    candidates = {"default": default_mosaic_blocks(heads[2]), **{name: MOSAIC_CANDIDATES[name] for name in names}}
    best = {"fwd": (float("inf"), None), "bwd": (float("inf"), None)}
    for name, cfg in candidates.items():
        fwd, fwd_bwd = attention_fns("mosaic", cfg, False)
        f, err = time_or_error(fwd, q, k, v, None, min_s=FLAGS.min_time_s)
        fb, err = (None, err) if f is None else time_or_error(fwd_bwd, q, k, v, None, do, min_s=FLAGS.min_time_s)
        for kind, seconds, work in (("fwd", f, flop), ("bwd", None if fb is None else fb - f, 2.5 * flop)):
            row = {"kind": f"mosaic {kind}", "config": name, "error": err}
            if seconds is not None:
                rate(row, "", work, seconds, ceiling)
                best[kind] = min(best[kind], (seconds, name), key=lambda x: x[0])
            rows.append(row)
            print_sweep_row(row)
    if best["fwd"][1] is not None:
        backward_kernels(heads, t, b, candidates["default"], ceiling, rows)
    if best["fwd"][1] is None or best["bwd"][1] is None:
        return None
    fwd_cfg, bwd_cfg = candidates[best["fwd"][1]], candidates[best["bwd"][1]]
    return dataclasses.replace(bwd_cfg, block_q=fwd_cfg.block_q, block_kv=fwd_cfg.block_kv, stages=fwd_cfg.stages)


def backward_kernels(heads, t, b, cfg, ceiling, rows):
    """The Mosaic backward's two kernels alone on a saved forward, TFLOP/s of their own matmuls: dq does 3 and
    dk/dv 4 products of the forward's 2 (the rest of the backward's time is XLA's delta = rowsum(O dO))."""
    q, k, v, do = inputs(t, b, heads)
    flop = causal_flops(b, t, heads[0], heads[2])
    spec = MaskSpec(causal=True, window=None, offset=0, kv_len=t, kv_len_padded=t, q_len_padded=t, segments=False)
    kw = dict(spec=spec, blocks=cfg, scale=heads[2] ** -0.5, interpret=False)
    out, lse = jax.jit(lambda q, k, v: mosaic_forward_op(q, k, v, None, None, **kw))(q, k, v)
    args = (q, k, v, out, lse, do, jnp.zeros_like(lse))

    def part(name):
        def run(q, k, v, out, lse, do, dlse, *lse2_delta):
            parts = mosaic_backward_parts(q, k, v, None, None, out, lse, do, dlse, **kw)
            return parts[name](*lse2_delta)
        return jax.jit(run)

    lse2_delta = part("delta")(*args)
    for name, key, work in (("delta (XLA)", "delta", 0.0), ("dq kernel", "dq", 1.5 * flop),
                            ("dk/dv kernel", "dkv", 2.0 * flop)):
        extra = () if key == "delta" else lse2_delta
        seconds, err = time_or_error(part(key), *args, *extra, min_s=FLAGS.min_time_s)
        row = {"kind": "mosaic bwd part", "config": name, "error": err}
        if seconds is not None:
            rate(row, "", work, seconds, ceiling)
        rows.append(row)
        print_sweep_row(row)


def hopper() -> bool:
    return jax.default_backend() == "gpu" and jax.devices()[0].compute_capability == "9.0"


def print_sweep_row(row):
    timing = (f"{row['ms']:9.3f} ms {row['tflops']:8.4g} TFLOP/s {row['of_ceiling']:6.1%} of ceiling"
              if row["error"] is None else f"failed: {row['error']}")
    print(f"sweep {row['kind']} {row['config']:44} {timing}", flush=True)


def table_cases(seqs):
    big = max(seqs)
    window = min(WINDOW, big // 2)
    return [(t, None, False) for t in seqs] + [(big, None, True), (big, window, False)]


def table(heads, seqs, tokens, skip_xla_bwd_over, blocks, ceiling, interpret, rows, cudnn_skips, clock):
    """blocks: {impl: its block configuration} for pallas and mosaic (mosaic absent: no Hopper GPU); clock() -> the
    GPU's SM clock in MHz (or None), read after each timed loop."""
    n, _, h = heads
    for t, window, packed in table_cases(seqs):
        b = max(1, tokens // t)
        q, k, v, do = inputs(t, b, heads, seed=t)
        seg = packed_segments(b, t) if packed else None
        flop = causal_flops(b, t, n, h, window)
        kernels = [i for i in ("mosaic", "pallas") if i in blocks]
        impls = []
        for impl in kernels if packed else kernels + ["cudnn", "xla"]:
            if impl == "cudnn":
                reason = why_unsupported("cudnn", backend=jax.default_backend(), dtype=DTYPE, head_dim=h,
                                         segment_ids=False, return_lse=False, causal=True, sliding_window=window,
                                         q_len=t, kv_len=t)
                if reason:
                    cudnn_skips.append({"seq": t, "window": window, "reason": reason})
                    print(f"| cudnn{f' window={window}' if window else '':23} | {t:6d} | skipped: {reason}", flush=True)
                    continue
            impls.append(impl)
        fns = {impl: attention_fns(impl, blocks.get(impl), interpret, window) for impl in impls}
        skip_bwd = {impl: impl == "xla" and t > skip_xla_bwd_over for impl in impls}
        times = {impl: [] for impl in impls}  # per pass: timed()'s 5 values
        unpacked = {impl: [] for impl in impls} if packed else None  # the same kernel without the ids, same passes

        def timed(impl, ids):
            """(forward s, forward + backward s, error, the SM clock after each loop that ran)."""
            fwd, fwd_bwd = fns[impl]
            f, err = time_or_error(fwd, q, k, v, ids, min_s=FLAGS.min_time_s)
            f_clock, fb, fb_clock = None if f is None else clock(), None, None
            if f is not None and not skip_bwd[impl]:
                fb, err = time_or_error(fwd_bwd, q, k, v, ids, do, min_s=FLAGS.min_time_s)
                fb_clock = None if fb is None else clock()
            return f, fb, err, f_clock, fb_clock

        # every implementation once a pass, as the clock drifts over a long run; a packed kernel also unpacked (the
        # packed target is a ratio to that), both in one clock state; odd passes reversed, so that a drift within a
        # pass does not favour whichever runs first
        order = [entry for impl in impls
                 for entry in ([(impl, unpacked[impl], None)] if packed else []) + [(impl, times[impl], seg)]]
        for pass_index in range(FLAGS.passes):
            for impl, timings, ids in order if pass_index % 2 == 0 else order[::-1]:
                timings.append(timed(impl, ids))
        for impl in impls:
            label = impl + (" packed (4 docs/row)" if packed else "") + (f" window={window}" if window else "")
            row = {"impl": impl, "label": label, "seq": t, "batch": b, "window": window, "packed": packed,
                   "fwd_bwd_skipped": skip_bwd[impl]}
            versus = times.get("cudnn") if impl in kernels else None
            rows.append(summarise_passes(row, times[impl], versus, flop, ceiling, unpacked and unpacked[impl]))
            print_table_row(rows[-1])


def table_header(ceiling, heads):
    return (f"bf16 matmul ceiling measured in this run: {ceiling:.4g} TFLOP/s ('of ceil' = TFLOP/s / ceiling); "
            f"{heads[0]} q heads, {heads[1]} kv heads, head dim {heads[2]}, causal, bf16\n"
            f"| {'impl':28} | {'seq':>6} | {'B':>4} | {'fwd ms':>9} | {'TFLOP/s':>8} | {'of ceil':>7} | "
            f"{'f+b ms':>9} | {'TFLOP/s':>8} | {'of ceil':>7} |")


def print_table_row(row):
    cells = []
    for prefix in ("fwd_", "fwd_bwd_"):
        if f"{prefix}ms" in row:
            ms, tflops, of_ceiling = (row[f"{prefix}{key}"] for key in ("ms", "tflops", "of_ceiling"))
            cells.append(f"{ms:9.3f} | {tflops:8.4g} | {of_ceiling:7.1%}")
        else:
            cells.append(f"{'skipped' if prefix == 'fwd_bwd_' and row['fwd_bwd_skipped'] else '-':>9} | "
                         f"{'-':>8} | {'-':>7}")
    tail = ""
    for title, key in ((" vs cuDNN", "x_cudnn"), (" of unpacked", "of_unpacked")):
        ratios = [f"{what} {row[p + key]:.3f}x" for what, p in (("fwd", "fwd_"), ("f+b", "fwd_bwd_")) if p + key in row]
        tail += f"{title}: {', '.join(ratios)}" if ratios else ""
    clocks = [f"{a or '-'}/{b or '-'}" for a, b in zip(row.get("fwd_clock_mhz", ()), row.get("fwd_bwd_clock_mhz", ()))]
    tail += f" MHz after fwd/f+b: {' '.join(clocks)}" if any(c != "-/-" for c in clocks) else ""
    tail += f" {row['error']}" if row["error"] else ""
    print(f"| {row['label']:28} | {row['seq']:6d} | {row['batch']:4d} | {cells[0]} | {cells[1]} |{tail}", flush=True)


def parse_heads(values):
    try:
        heads = tuple(int(x) for x in values)
    except ValueError:
        heads = ()
    if len(heads) != 3 or min(heads) < 1 or heads[0] % heads[1]:
        raise BadInput(f"--heads={','.join(values)}: expected query heads, KV heads (dividing them), head dim")
    return heads


def parse_seqs(values):
    try:
        seqs = [int(s) for s in values]
    except ValueError:
        seqs = []
    if not seqs or min(seqs) < 2:
        raise BadInput(f"--seqs={','.join(values)}: expected comma-separated sequence lengths >= 2")
    return seqs


def main():
    seqs = parse_seqs(FLAGS.seqs)
    if FLAGS.tokens < 1 or FLAGS.min_time_s <= 0:
        raise BadInput(f"--tokens={FLAGS.tokens} must be >= 1 and --min_time_s={FLAGS.min_time_s} > 0")
    unknown = sorted(set(FLAGS.mosaic_candidates or ()) - set(MOSAIC_CANDIDATES))
    if unknown:
        raise BadInput(f"--mosaic_candidates: unknown {unknown}; known: {sorted(MOSAIC_CANDIDATES)}")
    if jax.default_backend() != "gpu" and not FLAGS.smoke:
        raise BadInput(f"no GPU (JAX backend {jax.default_backend()}): the kernels would run interpreted at "
                             "full size for hours; pass --smoke to check the script at toy sizes")
    if FLAGS.smoke:
        heads, (tune_t, tune_b) = SMOKE["heads"], SMOKE["tune"]
        seqs = seqs if FLAGS["seqs"].present else SMOKE["seqs"]
        tokens, skip_xla_bwd_over = SMOKE["tokens"], SMOKE["skip_xla_bwd_over"]
    else:
        heads, (tune_t, tune_b) = parse_heads(FLAGS.heads), (TUNE_SEQ, TUNE_BATCH)
        tokens, skip_xla_bwd_over = FLAGS.tokens, FLAGS.skip_xla_bwd_over
    interpret = FLAGS.smoke or default_interpret()
    dev = jax.devices()[0]
    report = {"env": {"jax": jax.__version__, "device": dev.device_kind, "platform": dev.platform,
                      "python": sys.version.split()[0], "smoke": FLAGS.smoke, "interpret": interpret},
              "shape": {"heads": heads[0], "kv_heads": heads[1], "head_dim": heads[2], "dtype": "bfloat16",
                        "causal": True, "tokens": tokens, "tune_seq": tune_t, "tune_batch": tune_b},
              "tuning": [], "table": [], "cudnn_skipped": []}

    def save():
        if FLAGS.json_out:
            with open(FLAGS.json_out, "w") as f:
                json.dump(report, f, indent=1)

    print(f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}; kernels "
          f"{'interpreted' if interpret else 'compiled (Triton)'}", flush=True)
    ceiling = matmul_ceiling_tflops(256 if FLAGS.smoke else None)
    report["matmul_ceiling_tflops"] = ceiling
    save()

    blocks = None
    if FLAGS.tune and "pallas" in FLAGS.sweep_kernels:
        print(f"\nblock-size sweep at T={tune_t}, B={tune_b} (ceiling {ceiling:.4g} TFLOP/s):", flush=True)
        configs = SMOKE["configs"] if FLAGS.smoke else None
        blocks = sweep(heads, tune_t, tune_b, configs, ceiling, interpret, report["tuning"])
        if blocks is None:
            print("sweep: no forward configuration ran; the table uses the defaults", flush=True)
    blocks = {"pallas": blocks or default_block_sizes(heads[2])}
    if hopper() and not FLAGS.smoke:  # the Mosaic GPU kernels: timed on Hopper only (their interpreter is for tests)
        mosaic = None
        if FLAGS.tune and "mosaic" in FLAGS.sweep_kernels:
            print(f"\nmosaic block sweep at T={tune_t}, B={tune_b}:", flush=True)
            mosaic = sweep_mosaic(heads, tune_t, tune_b, ceiling, report["tuning"])
        blocks["mosaic"] = mosaic or default_mosaic_blocks(heads[2])
    report["blocks"] = {impl: dataclasses.asdict(cfg) for impl, cfg in blocks.items()}
    print(f"\nblock sizes for the table: {report['blocks']}", flush=True)
    save()

    print("\n" + table_header(ceiling, heads), flush=True)
    table(heads, seqs, tokens, skip_xla_bwd_over, blocks, ceiling, interpret, report["table"],
          report["cudnn_skipped"], sm_clock_mhz if jax.default_backend() == "gpu" else lambda: None)
    save()
    failed = [r["label"] for r in report["table"] if r["impl"] in ("pallas", "mosaic") and r["error"]]
    if failed:
        print(f"\nthe kernels failed on: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    run_main(main)
