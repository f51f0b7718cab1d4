"""absl flags for every Config field: `--section.field=value`, plus Megatron-style short aliases
(`--train_iters`, `--lr`, `--tp`, ...), `--config=<preset or file>`, and `--bf16` / `--fp16`."""

import dataclasses
import types
import typing

from absl import flags

from mjax.config.base import ConfigError
from mjax.config.load import load_config
from mjax.config.sections import SECTIONS, Config

FLAGS = flags.FLAGS
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _parse(text: str, typ, flag: str):
    """Parses a flag string into the field's annotated type."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if text.lower() in ("none", "null", ""):
            return None
        return _parse(text, args[0], flag)
    if origin is tuple:
        return tuple(_parse(x, typing.get_args(typ)[0], flag) for x in text.replace(",", " ").split())
    try:
        if typ is bool:
            return _BOOL_WORDS[text.lower()]
        return typ(text)
    except (KeyError, ValueError):
        raise ConfigError(f"--{flag}={text!r} is not a valid {getattr(typ, '__name__', typ)}") from None


def _fields():
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield section, f, hints[f.name]


def define_config_flags() -> None:
    """Defines the flags once; safe to call again."""
    if "config" in FLAGS:
        return
    flags.DEFINE_string("config", "tiny", "A preset name (see configs/), a .py or a .json config file.")
    flags.DEFINE_boolean("bf16", None, "Compute in bfloat16 (the default).")
    flags.DEFINE_boolean("fp16", None, "Compute in float16 with dynamic loss scaling.")
    for section, f, typ in _fields():
        dotted, help_text = f"{section}.{f.name}", f.metadata.get("help", "")
        define = flags.DEFINE_boolean if typ is bool else flags.DEFINE_string  # --flag / --noflag for booleans
        define(dotted, None, help_text or dotted)
        if "flag" in f.metadata:  # one line either way, as --helpfull lists it
            alias = f"{help_text.rstrip('.')} (alias of --{dotted})." if help_text else f"Alias of --{dotted}."
            define(f.metadata["flag"], None, alias)


def config_from_flags(base: Config | None = None) -> Config:
    """The preset named by --config, with every given flag applied over it."""
    cfg = base or load_config(FLAGS.config)
    overrides: dict[str, dict] = {}
    for section, f, typ in _fields():
        names = [f"{section}.{f.name}"] + ([f.metadata["flag"]] if "flag" in f.metadata else [])
        given = [n for n in names if FLAGS[n].present]
        if len(given) > 1 and FLAGS[given[0]].value != FLAGS[given[1]].value:
            raise ConfigError(f"--{given[0]} and --{given[1]} set the same field to different values")
        if given:
            value = FLAGS[given[0]].value
            overrides.setdefault(section, {})[f.name] = value if typ is bool else _parse(value, typ, given[0])
    if FLAGS.bf16 and FLAGS.fp16:
        raise ConfigError("--bf16 and --fp16 are both set; choose one")
    if FLAGS.fp16:
        overrides.setdefault("precision", {})["compute_dtype"] = "float16"
    elif FLAGS.bf16:
        overrides.setdefault("precision", {})["compute_dtype"] = "bfloat16"
    return cfg.replace(**overrides)
