"""Benchmark a preset's train step on synthetic data: one table, plus the same as JSON.

  python -m benchmarks.benchmark --config=llama3.2-1b --steps=10 --sweep="remat_policy=selective,none;micro_batch_size=2,4"

Each sweep dimension is `field=v1,v2` over Config fields (dotted, or the short flag names); dimensions are
separated by `;` and combined as a grid; a tuple field's value joins its items with `+`
(`remat_save_names=qkv_proj+mlp_out`). The dimension `xla` sweeps XLA options for the step's compile:
`xla=default,xla_gpu_enable_triton_gemm:false+xla_gpu_enable_command_buffer:` (`name:value` joined by `+`).
Every config flag of train.py also applies (the base of the sweep).
"""

import dataclasses
import itertools
import json
import logging
import os

from absl import flags

from benchmarks.cli import run_main

from mjax.config import ConfigError
from mjax.config.flags import config_from_flags, define_config_flags
from mjax.logging_setup import setup_logging
from mjax.xla_flags import apply_defaults

apply_defaults()  # before JAX initialises a backend

define_config_flags()
flags.DEFINE_integer("steps", 10, "Timed steps per case (after 2 warm-up steps).")
flags.DEFINE_string("sweep", "", "Grid over config fields, e.g. 'remat_policy=none,selective;micro_batch_size=1,2'.")
flags.DEFINE_string("json_out", None, "Write the results here as JSON.")
flags.DEFINE_integer("num_devices", None, "Use only the first N devices (default: all).")
flags.DEFINE_string("hlo_dir", None, "Write each case's compiled HLO here (gzipped text).")
flags.DEFINE_boolean("baseline", False, "Also time a plain-JAX Llama step on the same shapes (one device).")
flags.DEFINE_integer("profile_steps", 0, "Trace this many more steps per case and print where device time went.")
FLAGS = flags.FLAGS
log = logging.getLogger("mjax")


def _field_index():
    """short flag name or 'section.field' -> (section, field)."""
    from mjax.config import SECTIONS  # noqa: PLC0415

    index = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            index[f"{section}.{f.name}"] = (section, f.name)
            index.setdefault(f.name, (section, f.name))
            if "flag" in f.metadata:
                index[f.metadata["flag"]] = (section, f.name)
    return index


def parse_sweep(text: str) -> list[dict]:
    """'a=1,2;b=x' -> [{'a': '1', 'b': 'x'}, {'a': '2', 'b': 'x'}]."""
    dims = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        if "=" not in part:
            raise ConfigError(f"--sweep: {part!r} is not field=v1,v2")
        name, values = part.split("=", 1)
        dims.append([(name.strip(), v.strip()) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*dims)] if dims else [{}]


def xla_options(text: str) -> dict | None:
    """'default' -> None; 'a:1+b:false' -> {'a': 1, 'b': False} (XLA debug options for one compile)."""
    if text in ("", "default"):
        return None
    options = {}
    for item in text.split("+"):
        if ":" not in item:
            raise ConfigError(f"--sweep: xla option {item!r} is not name:value")
        name, value = item.split(":", 1)
        lowered = value.lower()
        options[name] = (True if lowered == "true" else False if lowered == "false"
                         else int(value) if value.lstrip("-").isdigit() else value)
    return options


def apply_case(cfg, case: dict):
    """(config with the case's field values, XLA options of the case or None)."""
    import typing  # noqa: PLC0415

    from mjax.config.flags import _parse  # noqa: PLC0415

    index, overrides = _field_index(), {}
    case = dict(case)
    options = xla_options(case.pop("xla", ""))
    for name, text in case.items():
        if name not in index:
            raise ConfigError(f"--sweep: unknown config field {name!r}")
        section, field = index[name]
        typ = typing.get_type_hints(type(getattr(cfg, section)))[field]
        if typing.get_origin(typ) is tuple:  # ',' separates sweep values, so a tuple's items are joined by '+'
            text = text.replace("+", ",")
        overrides.setdefault(section, {})[field] = _parse(text, typ, name)
    return cfg.replace(**overrides), options


def _failed(name, error):
    from benchmarks.harness import Result  # noqa: PLC0415

    nan = float("nan")
    return Result(name, nan, nan, nan, None, nan, nan, nan, nan, error=str(error).splitlines()[0])


def main():
    setup_logging()
    import jax  # noqa: PLC0415

    from benchmarks.harness import format_table, matmul_ceiling_tflops, run_baseline, run_case  # noqa: PLC0415

    try:
        base = config_from_flags()
        cases = [(", ".join(f"{k}={v}" for k, v in c.items()) or "base", *apply_case(base, c))
                 for c in parse_sweep(FLAGS.sweep)]
    except ConfigError as e:
        log.error("configuration error: %s", e)
        return 2
    devices = jax.devices()[: FLAGS.num_devices] if FLAGS.num_devices else jax.devices()
    ceiling = matmul_ceiling_tflops()
    results = []
    for name, cfg, options in cases:
        log.info("case %s", name)
        try:
            hlo = None
            if FLAGS.hlo_dir:
                os.makedirs(FLAGS.hlo_dir, exist_ok=True)
                safe = "".join(c if c.isalnum() else "_" for c in name)
                hlo = f"{FLAGS.hlo_dir}/{cfg.model.name}_{len(devices)}dev_{safe}.hlo.txt.gz"
            results.append(run_case(name, cfg, FLAGS.steps, ceiling, devices, hlo, options, FLAGS.profile_steps))
            if results[-1].profile is not None:
                print(f"profile of case {name}:\n{results[-1].profile.format()}", flush=True)
        except Exception as e:  # a case that does not fit (OOM, bad layout) is reported, the sweep goes on
            log.error("case %s failed: %s", name, str(e).splitlines()[0][:300])
            results.append(_failed(name, e))
    if FLAGS.baseline:
        log.info("case plain-JAX baseline")
        try:
            results.append(run_baseline(base, FLAGS.steps, ceiling))
        except Exception as e:  # reported in the table like any case that does not fit
            log.error("baseline failed: %s", str(e).splitlines()[0][:300])
            results.append(_failed("plain-JAX baseline (1 device)", e))
    print(format_table(results, ceiling))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"ceiling_tflops": ceiling, "devices": len(devices),
                       "device_kind": devices[0].device_kind, "results": [dataclasses.asdict(r) for r in results]},
                      f, indent=1)
    return 1 if any(r.error for r in results) and len(results) == 1 else 0


if __name__ == "__main__":
    run_main(main)
