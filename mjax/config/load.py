"""Presets and config files: `load_config("llama3.2-1b")`, a `.py` defining `config()`, or a `.json`."""

import importlib.util
import json
import os
from pathlib import Path

from mjax.config.base import ConfigError
from mjax.config.sections import Config, from_dict

PRESETS = Path(__file__).resolve().parent / "presets"  # shipped inside the package; `configs/` links here


def configs_dir() -> Path:
    return Path(os.environ.get("MJAX_CONFIGS_DIR", PRESETS))


def preset_names() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.py") if not p.stem.startswith("_"))


def load_config(name_or_path: str) -> Config:
    """A preset name (`llama3.2-1b`), a `.py` file defining `config() -> Config`, or a `.json` of `to_dict()`."""
    path = Path(name_or_path)
    if not path.suffix or not path.exists():
        stem = name_or_path.replace(".", "_").replace("-", "_")
        path = configs_dir() / f"{stem}.py"
        if not path.exists():
            raise ConfigError(
                f"--config={name_or_path}: no such preset or file. Presets: {', '.join(preset_names())}")
    if path.suffix == ".json":
        return from_dict(json.loads(path.read_text()))
    if path.suffix != ".py":
        raise ConfigError(f"--config={name_or_path}: expected a preset name, a .py or a .json file")
    spec = importlib.util.spec_from_file_location(f"mjax_preset_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "config"):
        raise ConfigError(f"{path} defines no `config()` function returning mjax.config.Config")
    return module.config()
