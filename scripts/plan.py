"""Plan a run's parallel layout; the same program as `mjax-plan` (see mjax/plan/program.py for its flags), plus
--trial=K: run the top K layouts for a few steps of the real train step on the devices present (through
benchmarks/harness.py, as benchmarks/benchmark.py times a config) and print measured beside predicted."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks/ is not installed

from absl import flags  # noqa: E402

from mjax.config import ConfigError  # noqa: E402
from mjax.plan.program import entry  # noqa: E402

flags.DEFINE_integer("trial", 0, "Run the top K layouts for --trial_steps steps on the devices present and print "
                     "measured tokens/s and MFU beside the prediction, then the measured winner.")
flags.DEFINE_integer("trial_steps", 5, "Timed steps per --trial layout (after 2 warm-up steps).")
FLAGS = flags.FLAGS


def trial(plan, machine) -> list[dict]:
    if not FLAGS.trial:
        return []
    import jax  # noqa: PLC0415

    from benchmarks.harness import matmul_ceiling_tflops, run_case  # noqa: PLC0415

    if len(jax.devices()) != machine.num_gpus:
        raise ConfigError(f"--trial runs on the devices present ({len(jax.devices())}), but --num_gpus="
                          f"{machine.num_gpus}; plan for {len(jax.devices())} devices or drop --trial")
    ceiling = matmul_ceiling_tflops()
    rows = []
    for p in plan.ranked[:FLAGS.trial]:
        cfg = p.cfg.replace(logging=dict(peak_tflops=machine.peak_tflops))
        try:
            r = run_case(p.name, cfg, FLAGS.trial_steps, ceiling)
        except Exception as e:  # noqa: BLE001  (an out-of-memory or compile failure is a result, not a crash)
            rows.append({"layout": p.name, "predicted_step_s": p.time.total_s, "error": str(e).splitlines()[0]})
            print(f"trial {p.name:<62} failed: {rows[-1]['error'][:100]}", flush=True)
            continue
        rows.append({"layout": p.name, "predicted_step_s": p.time.total_s, "measured_step_s": r.step_time_s,
                     "tokens_per_s": r.tokens_per_s, "mfu": r.mfu, "compiled_gib": r.compiled_gib,
                     "predicted_gib": p.memory.total / 2**30})
        mfu = "n/a" if r.mfu is None else f"{r.mfu:.1%}"
        print(f"trial {p.name:<62} predicted {p.time.total_s:.4f} s, measured {r.step_time_s:.4f} s, "
              f"{r.tokens_per_s:,.0f} tokens/s, MFU {mfu}", flush=True)
    done = [r for r in rows if "measured_step_s" in r]
    if done:
        best = min(done, key=lambda r: r["measured_step_s"])
        print(f"measured winner: {best['layout']} ({best['tokens_per_s']:,.0f} tokens/s)")
    return rows


if __name__ == "__main__":
    entry(trial)
