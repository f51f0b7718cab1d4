"""mjax-plan: rank every layout train.py would accept for a config on a machine by predicted step time, with the
memory each needs per device, and print the winner's train.py command.

  python scripts/plan.py --config=llama3-8b --seq_length=8192 --global_batch_size=128 --num_gpus=8 --gpu=h100

Any train.py config flag sets the model and run (the layout flags it varies itself: tp, pp, vpp, schedule, cp, ep,
expert-tp, fsdp, dp, SP, ZeRO-1, micro-batch, remat, and the FP8 recipe when one is given). --validate=K compiles
the top K on the devices present (--num_gpus must match them) and prints XLA's memory analysis beside the
prediction. Bad input: one line on stderr, exit code 2.
"""

import dataclasses
import json
import sys
from pathlib import Path

from absl import app, flags

from mjax.config import ConfigError
from mjax.config.flags import config_from_flags, define_config_flags
from mjax.plan.enumerate import REMAT_POLICIES, SearchSpace
from mjax.plan.machine import GPUS, machine_from
from mjax.plan.rank import GIB, format_table, make_plan, train_command

BAD_INPUT = 2

define_config_flags()  # --peak_tflops is the config's (logging.peak_tflops): the GPU's dense bf16 peak here too
flags.DEFINE_integer("num_gpus", None, "GPUs to plan for.")
flags.DEFINE_integer("gpus_per_node", 8, "GPUs per node (tensor parallelism stays within one).")
flags.DEFINE_string("gpu", None, f"{' | '.join(GPUS)}: memory, peak and links of that GPU.")
flags.DEFINE_float("gpu_memory_gib", None, "Usable memory per GPU (overrides --gpu's).")
flags.DEFINE_float("gemm_efficiency", 0.6, "Achieved / peak TFLOP/s of the model's GEMMs (measure it with "
                   "benchmarks/benchmark.py: its 'of ceiling' column).")
flags.DEFINE_float("intra_node_gbps", None, "GB/s per GPU within a node (default: --gpu's NVLink).")
flags.DEFINE_float("inter_node_gbps", None, "GB/s per GPU across nodes (default: 50, one 400 Gb/s NIC).")
flags.DEFINE_float("hbm_gbps", None, "GB/s of each GPU's memory (default: --gpu's datasheet figure).")
flags.DEFINE_float("comm_overlap", 0.5, "Fraction of the overlappable traffic (data-parallel, pipeline, ring) "
                   "hidden behind compute.")
flags.DEFINE_list("remat_policies", list(REMAT_POLICIES), "Recomputation policies to consider.")
flags.DEFINE_integer("max_pp", None, "Largest pipeline size to consider.")
flags.DEFINE_integer("max_cp", None, "Largest context-parallel size to consider.")
flags.DEFINE_integer("top", 10, "Rows of the ranked table.")
flags.DEFINE_integer("rejects", 5, "Rejected layouts to show.")
flags.DEFINE_integer("validate", 0, "Compile the top K on the devices present and print XLA's memory estimate.")
flags.DEFINE_string("json_out", None, "Write the ranked and rejected layouts here as JSON.")
FLAGS = flags.FLAGS


def _machine(cfg):
    if FLAGS.num_gpus is None:
        raise ConfigError("--num_gpus is required (the GPUs to plan for)")
    return machine_from(FLAGS.num_gpus, FLAGS.gpus_per_node, FLAGS.gpu, FLAGS.gpu_memory_gib,
                        cfg.logging.peak_tflops, gemm_efficiency=FLAGS.gemm_efficiency,
                        intra_node_gbps=FLAGS.intra_node_gbps, inter_node_gbps=FLAGS.inter_node_gbps,
                        hbm_gbps=FLAGS.hbm_gbps, comm_overlap=FLAGS.comm_overlap)


def _space(cfg):
    bad = [r for r in FLAGS.remat_policies if r not in REMAT_POLICIES]
    if bad or not FLAGS.remat_policies:
        raise ConfigError(f"--remat_policies={','.join(FLAGS.remat_policies)}: choose from {', '.join(REMAT_POLICIES)}")
    fp8 = (None,) if cfg.precision.fp8_recipe is None else (None, cfg.precision.fp8_recipe)
    return SearchSpace(remat_policies=tuple(FLAGS.remat_policies), fp8_recipes=fp8, max_pp=FLAGS.max_pp,
                       max_cp=FLAGS.max_cp)


def _validate(plan, machine, k: int) -> list[dict]:
    """Compiles the top k on the devices present; predicted (for these devices' attention kernel) vs XLA's
    estimate."""
    import jax  # noqa: PLC0415  (only --validate needs a backend)

    from mjax.plan.compiled import compiled_bytes  # noqa: PLC0415
    from mjax.plan.memory import memory  # noqa: PLC0415

    if len(jax.devices()) != machine.num_gpus:
        raise ConfigError(f"--validate compiles on the devices present ({len(jax.devices())}), but --num_gpus="
                          f"{machine.num_gpus}; plan for {len(jax.devices())} devices or drop --validate")
    rows = []
    for p in plan.ranked[:k]:
        predicted = memory(p.cfg, p.batching, machine.num_gpus, on_gpu=jax.default_backend() == "gpu").total
        got = compiled_bytes(p.cfg)
        rows.append({"layout": p.name, "predicted_gib": predicted / GIB,
                     "compiled_gib": None if got is None else got["total"] / GIB})
        compiled = "n/a" if got is None else f"{got['total'] / GIB:.2f}"
        error = "" if got is None else f" ({predicted / got['total'] - 1:+.1%})"
        print(f"validate {p.name:<62} predicted {predicted / GIB:.2f} GiB, XLA {compiled} GiB{error}", flush=True)
    return rows


def main(trial=None) -> int:
    """`trial(plan, machine) -> list of rows`: the --trial runs (scripts/plan.py passes the benchmark harness's;
    the library cannot import the benchmarks)."""
    cfg = config_from_flags()
    machine = _machine(cfg)
    plan = make_plan(cfg, machine, _space(cfg))
    print(format_table(plan, machine, FLAGS.top, FLAGS.rejects))
    if plan.ranked:
        print("winner:", train_command(plan.ranked[0].cfg, FLAGS.config))
    validated = _validate(plan, machine, FLAGS.validate) if FLAGS.validate else []
    trials = trial(plan, machine) if trial is not None else []
    if FLAGS.json_out:
        out = {"machine": dataclasses.asdict(machine), "refused": plan.refused,
               "ranked": [p.row(machine) | {"command": train_command(p.cfg, FLAGS.config)} for p in plan.ranked],
               "rejected": [p.row(machine) for p in plan.rejected], "validated": validated, "trials": trials}
        Path(FLAGS.json_out).write_text(json.dumps(out, indent=1))
    return 0


def entry(trial=None) -> None:
    def wrapped(argv):
        try:
            if len(argv) > 1:
                raise ConfigError(f"unexpected arguments: {' '.join(argv[1:])} (flags are written --name=value)")
            return main(trial)
        except ConfigError as e:
            sys.stderr.write(f"{Path(argv[0]).stem}: {e}\n")
            return BAD_INPUT

    app.run(wrapped)
