"""Loss curves of one model trained with each precision recipe from the same init and data, against bf16's.

  python -m benchmarks.convergence --config=tiny --train_iters=500 --recipes=bf16,tensorwise,delayed,nvfp4 --window=50

Every config flag of train.py applies to all runs (the data: the bundled corpus unless --data_path is given; the
bundled 0.35M tokens are memorized within a few hundred steps, so longer runs want a larger corpus, e.g. the Python
source installed on the machine through tools/source_corpus.py).
Prints one table: the mean loss of each window of --window steps per recipe, and each recipe's largest window
difference from the first recipe (bf16), then writes the same as JSON (--out).
"""

import json
import logging

from absl import flags

from benchmarks.cli import run_main

from mjax.config import ConfigError
from mjax.config.flags import config_from_flags, define_config_flags
from mjax.logging_setup import setup_logging
from mjax.xla_flags import apply_defaults

apply_defaults()  # before JAX initialises a backend

def _precision(**flags_):
    return lambda cfg: cfg.replace(precision=flags_)


RECIPES = {  # name -> the config of its run, from the base config
    "bf16": lambda cfg: cfg,
    # bf16 from another seed (init and data order): how far two bf16 runs drift apart, the noise floor of the table
    "bf16_seed": lambda cfg: cfg.replace(train=dict(seed=cfg.train.seed + 1)),
    "tensorwise": _precision(fp8_recipe="tensorwise"),
    "tensorwise_head": lambda cfg: cfg.replace(precision=dict(fp8_recipe="tensorwise", quantize_output_layer=True),
                                               execution=dict(cross_entropy_impl="fused")),
    "delayed": _precision(fp8_recipe="delayed"),
    "blockwise": _precision(fp8_recipe="blockwise"),
    "nvfp4": _precision(fp4_recipe="nvfp4"),
    "nvfp4_sr": _precision(fp4_recipe="nvfp4", fp4_stochastic_rounding=True),
    "mxfp4_rht": _precision(fp4_recipe="mxfp4", fp4_hadamard=True),
}

define_config_flags()
flags.DEFINE_list("recipes", ["bf16", "tensorwise", "delayed", "blockwise", "nvfp4", "mxfp4_rht"],
                  f"Recipes to train, the first is the reference: {', '.join(RECIPES)}.")
flags.DEFINE_integer("window", 50, "Steps per averaged window of the loss.")
flags.DEFINE_string("out", None, "Write the windows as JSON here.")
FLAGS = flags.FLAGS
log = logging.getLogger("mjax")


def windows(losses: list[float], size: int) -> list[float]:
    """Mean of each whole window of `size` steps."""
    n = len(losses) // size
    return [sum(losses[i * size:(i + 1) * size]) / size for i in range(n)]


def main():
    setup_logging()
    try:
        unknown = [r for r in FLAGS.recipes if r not in RECIPES]
        if unknown:
            raise ConfigError(f"--recipes: unknown {unknown}; choose from {', '.join(RECIPES)}")
        base = config_from_flags()
        if base.checkpoint.save or base.checkpoint.load:  # a later recipe would resume an earlier one's run
            raise ConfigError("--save / --load: each recipe trains from the same fresh init here; drop them")
        base = base.replace(logging=dict(progress=False, log_interval=1))  # one loss per step in the history
        from mjax.train.loop import train  # noqa: PLC0415

        curves, evals = {}, {}
        for name in FLAGS.recipes:
            cfg = RECIPES[name](base)
            result = train(cfg)
            losses = [float(r["loss"]) for r in result.history]
            if len(losses) < FLAGS.window:
                raise ConfigError(f"--train_iters={len(losses)} is shorter than one --window={FLAGS.window}")
            curves[name] = windows(losses, FLAGS.window)
            held_out = [r["eval_loss"] for r in result.eval_history if r["split"] == "valid"]
            evals[name] = float(held_out[-1]) if held_out else None
            log.info("%s: %s", name, " ".join(f"{v:.3f}" for v in curves[name]))
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2
    first = FLAGS.recipes[0]
    ref = curves[first]
    rows = {name: {"windows": w, "max_abs_diff": max(abs(a - b) for a, b in zip(w, ref)),
                   "final_eval_loss": evals[name]} for name, w in curves.items()}
    print(f"mean loss per {FLAGS.window} steps; max |diff| against {first}; held-out loss at the end "
          f"(--eval_interval) and its difference from {first}'s")
    for name, row in rows.items():
        ev = row["final_eval_loss"]
        held_out = "" if ev is None or evals[first] is None else f"   eval {ev:.3f} ({ev - evals[first]:+.3f})"
        print(f"{name:16} {' '.join(f'{v:.3f}' for v in row['windows'])}   {row['max_abs_diff']:.3f}{held_out}")
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"window": FLAGS.window, "config": base.to_dict(), "recipes": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
