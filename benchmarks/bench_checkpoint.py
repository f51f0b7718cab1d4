"""Checkpoint cost on the real model: how long an async save holds the train loop, how long the write takes while
training continues, how long a synchronous save would hold it, and how long a restore onto the current mesh takes.

    python3 -m benchmarks.bench_checkpoint --out=ckpt.json            # llama3.2-1b, mock data, GPU
    python3 -m benchmarks.bench_checkpoint --config=tiny --seq_length=128 --batch=8  # a quick CPU check

"loop held" = the save() call plus the extra time of the next step over the median step (the device-to-host copy
is what blocks; the write to disk runs in Orbax's background thread). The first save of a process also pays one-time
set-up (Orbax jit-compiles its shard-slicing helpers), so two async saves are timed.
"""

import json
import os
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import flags

from benchmarks.cli import run_main

from mjax.train.loop import checkpointer
from mjax.config import load_config
from benchmarks.harness import synthetic_batch
from mjax.train.loop import build

flags.DEFINE_string("config", "llama3.2-1b", "Preset name or config file.")
flags.DEFINE_integer("seq_length", 4096, "Sequence length.")
flags.DEFINE_integer("batch", 8, "Global batch size.")
flags.DEFINE_string("remat_policy", "selective", "Activation recomputation policy.")
flags.DEFINE_string("dir", None, "Where checkpoints go (a temporary directory by default).")
flags.DEFINE_string("out", None, "JSON results.")
FLAGS = flags.FLAGS


def _blocked(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def _dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    root = FLAGS.dir or tempfile.mkdtemp(prefix="mjax_bench_ckpt_")
    cfg = load_config(FLAGS.config).replace(
        execution=dict(remat_policy=FLAGS.remat_policy),
        train=dict(global_batch_size=FLAGS.batch, seq_length=FLAGS.seq_length, train_iters=1000),
        data=dict(mock_data=True), logging=dict(progress=False),
        checkpoint=dict(save=os.path.join(root, "async"), async_save=True, keep=1))
    setup = build(cfg)
    state, init_s = _blocked(setup.init_state, cfg.train.seed)
    batch = synthetic_batch(cfg, setup)
    compiled, _ = setup.compile_step(state, batch)
    step, times = 0, []

    def train_step():
        nonlocal state, step
        (state, _), dt = _blocked(compiled, state, batch)
        step += 1
        return dt

    for _ in range(3):
        train_step()
    times = [train_step() for _ in range(5)]
    base = statistics.median(times)
    ckpt = checkpointer(setup)
    saves = []
    for label in ("async save 1 (first: one-time set-up)", "async save 2"):
        reference = jax.tree.map(jnp.copy, state) if label.endswith("2") else None
        saved_step, t0 = step, time.perf_counter()
        ckpt.save(step, state, step * FLAGS.batch)
        call = time.perf_counter() - t0
        after, done = [], None
        while len(after) < 40 and (done is None or len(after) < 3):
            after.append(train_step())
            if done is None and not ckpt.saving():
                done = time.perf_counter() - t0
        ckpt.wait()
        done = done or time.perf_counter() - t0
        saves.append(dict(name=label, step=saved_step, save_call_s=call, next_step_extra_s=max(after[0] - base, 0),
                          loop_held_s=call + max(after[0] - base, 0), write_done_s=done,
                          steps_during_write=len(after), extra_step_time_during_write_s=sum(
                              max(t - base, 0) for t in after)))
    ckpt.close()
    size = _dir_bytes(os.path.join(root, "async", str(saved_step)))

    # Restore the second async checkpoint onto the current mesh and check it is the state it was taken from.
    load_cfg = cfg.replace(checkpoint=dict(save=None, load=os.path.join(root, "async"), ckpt_step=saved_step))
    t0 = time.perf_counter()
    restored, _ = checkpointer(setup, load_cfg).restore_or_init()
    jax.block_until_ready(restored)
    restore_s = time.perf_counter() - t0
    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(
        jax.tree.leaves(jax.tree.map(_key_data, restored)), jax.tree.leaves(jax.tree.map(_key_data, reference))))
    del restored, reference
    shutil.rmtree(os.path.join(root, "async"), ignore_errors=True)  # room on disk for the next one

    sync_cfg = cfg.replace(checkpoint=dict(save=os.path.join(root, "sync"), async_save=False, keep=1))
    sync = checkpointer(setup, sync_cfg)
    t0 = time.perf_counter()
    sync.save(step, state, step * FLAGS.batch, wait=True)
    sync_s = time.perf_counter() - t0
    sync.close()

    result = dict(config=FLAGS.config, seq_length=FLAGS.seq_length, global_batch_size=FLAGS.batch,
                  device=jax.devices()[0].device_kind, num_devices=jax.device_count(),
                  checkpoint_bytes=size, init_s=init_s, median_step_s=base, saves=saves,
                  sync_save_s=sync_s, restore_s=restore_s, restored_equals_saved=same,
                  write_gb_per_s=size / 1e9 / saves[-1]["write_done_s"], read_gb_per_s=size / 1e9 / restore_s,
                  jax=jax.__version__)
    print(_table(result))
    print(json.dumps(result, indent=2))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(result, f, indent=2)
    if not FLAGS.dir:
        shutil.rmtree(root, ignore_errors=True)


def _key_data(x):
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


def _table(r) -> str:
    lines = [f"{r['config']} (seq {r['seq_length']}, batch {r['global_batch_size']}) on {r['num_devices']} x "
             f"{r['device']}: checkpoint {r['checkpoint_bytes'] / 2**30:.2f} GiB, median step {r['median_step_s']:.3f}s",
             f"{'':<40} {'save() call':>11} {'next step +':>11} {'loop held':>10} {'written after':>13} "
             f"{'steps meanwhile':>15}"]
    for s in r["saves"]:
        lines.append(f"{s['name']:<40} {s['save_call_s']:>10.2f}s {s['next_step_extra_s']:>10.2f}s "
                     f"{s['loop_held_s']:>9.2f}s {s['write_done_s']:>12.2f}s {s['steps_during_write']:>15d}")
    lines.append(f"{'synchronous save (for comparison)':<40} {r['sync_save_s']:>10.2f}s")
    lines.append(f"restore onto the current mesh: {r['restore_s']:.2f}s ({r['read_gb_per_s']:.2f} GB/s); "
                 f"restored == saved: {r['restored_equals_saved']}")
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
