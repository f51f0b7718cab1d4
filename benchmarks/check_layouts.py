"""Every parallel layout that fits the devices gives the one-device losses: a table, on CPU or GPU.

  python -m benchmarks.check_layouts --steps=5 [--json_out=layouts.json] [--layouts="tp2 sp dp4,pp2 dp4"]

Runs a small Llama-style model in fp32 (matmuls at full precision) on the same synthetic batches for every layout:
one compile of the train step per layout, nothing else (GEMM autotuning off: the model is tiny and the check is
about numbers, not speed).
"""

import json
import os

import jax
import numpy as np
from absl import flags

from benchmarks.cli import BadInput, run_main

from mjax.xla_flags import apply_defaults

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
apply_defaults()
flags.DEFINE_integer("steps", 5, "Training steps per layout.")
flags.DEFINE_integer("seq_length", 256, "Tokens per sequence (a multiple of 2: sequence parallelism splits it).")
flags.DEFINE_string("json_out", None, "Write the table here as JSON.")
flags.DEFINE_list("layouts", None, "Only these layouts, by their names in the table (default: every layout that "
                  "fits the devices).")
FLAGS = flags.FLAGS


def layouts(n: int) -> dict:
    out = {f"dp{n}": {}, f"fsdp{n}": dict(fsdp=n), f"zero1 dp{n}": dict(use_distributed_optimizer=True)}
    if n >= 2:
        out[f"tp2 sp dp{n // 2}"] = dict(tp=2, sequence_parallel=True)
        out[f"tp2 fsdp{n // 2}"] = dict(tp=2, fsdp=n // 2)
        out[f"pp2 dp{n // 2}"] = dict(pp=2)
        for comm in ("p2p", "all_gather", "a2a"):  # context parallelism, each comm type (8 heads: a2a up to cp8)
            out[f"cp{n} {comm}"] = dict(cp=n, cp_comm_type=comm)
    if n >= 4:
        out[f"cp{n} a2a+p2p"] = dict(cp=n, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=(2, n // 2))
        out[f"cp2 tp2 sp dp{n // 4}"] = dict(cp=2, tp=2, sequence_parallel=True)
        out[f"cp2 pp2 dp{n // 4}"] = dict(cp=2, pp=2)
    return out


def chosen_layouts(n: int, names: list[str] | None) -> dict:
    """The layouts of `n` devices named by --layouts (all of them without it), in the table's order."""
    every = layouts(n)
    if names is None:
        return every
    unknown = [name for name in names if name not in every]
    if unknown or not names:
        what = f"unknown {unknown}" if unknown else "no layout named"
        raise BadInput(f"--layouts={','.join(names)}: {what}; on {n} devices choose from {', '.join(every)}")
    return {name: parallel for name, parallel in every.items() if name in names}


def step_losses(cfg, devices, steps: int) -> list[float]:
    """Losses of `steps` train steps of cfg on `devices`, on the synthetic batches of seeds 0..steps-1."""
    from benchmarks.harness import synthetic_batch  # noqa: PLC0415
    from mjax.train.loop import build  # noqa: PLC0415

    setup = build(cfg, devices)
    state = setup.init_state(cfg.train.seed)
    compiled, _ = setup.compile_step(state, synthetic_batch(cfg, setup))
    losses = []
    for i in range(steps):
        state, metrics = compiled(state, synthetic_batch(cfg, setup, seed=i))
        losses.append(float(metrics["loss"]))
    return losses


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    from mjax.config import load_config  # noqa: PLC0415
    from mjax.logging_setup import setup_logging  # noqa: PLC0415

    setup_logging()
    if FLAGS.seq_length < 2 or FLAGS.seq_length % 2:
        raise BadInput(f"--seq_length={FLAGS.seq_length}: expected an even length >= 2")
    n = jax.device_count()
    chosen = chosen_layouts(n, FLAGS.layouts)
    base = load_config("tiny").replace(
        model=dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=512,
                   vocab_size=1024),
        train=dict(train_iters=FLAGS.steps, global_batch_size=4 * n, micro_batch_size=2, seq_length=FLAGS.seq_length),
        precision=dict(compute_dtype="float32"),
        # Plain SGD with a large step: each loss then depends on the size of every earlier gradient (Adam would
        # normalise a wrongly scaled gradient away), and the losses move enough to tell layouts apart.
        optimizer=dict(optimizer="sgd", lr=0.5, lr_warmup_iters=0, weight_decay=0.0, clip_grad=0.0))
    reference = step_losses(base, jax.devices()[:1], FLAGS.steps)
    print(f"{'layout':<16} {'max rel diff vs 1 device':>26}   losses", flush=True)
    print(f"{'1 device':<16} {'':>26}   {' '.join(f'{x:.5f}' for x in reference)}", flush=True)
    rows = []
    for name, parallel in chosen.items():  # each row printed and saved as it ends: a time limit keeps them
        try:
            got = step_losses(base.replace(parallel=parallel), jax.devices(), FLAGS.steps)
            row = {"layout": name, "max_rel_diff": float(np.max(np.abs(np.subtract(got, reference)) /
                                                                np.abs(reference))), "losses": got}
            print(f"{name:<16} {row['max_rel_diff']:>26.2e}   {' '.join(f'{x:.5f}' for x in got)}", flush=True)
        except Exception as e:  # a failing layout is a failed row; the others still run
            row = {"layout": name, "max_rel_diff": float("inf"), "error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{name:<16} {'failed':>26}   {row['error'][:200]}", flush=True)
        rows.append(row)
        if FLAGS.json_out:
            with open(FLAGS.json_out, "w") as f:
                json.dump({"devices": n, "kind": jax.devices()[0].device_kind, "reference": reference,
                           "rows": rows}, f)
    return 0 if all(r["max_rel_diff"] < 1e-4 for r in rows) else 1


if __name__ == "__main__":
    run_main(main)
