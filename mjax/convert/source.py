"""What a checkpoint path is, decided in one place for export, `load_pretrained` and mjax-generate.

    converted   `mjax-convert --direction=hf_to_mjax` output: config.json + params/ (+ tokenizer files)
    training    an `mjax-train --save` directory (its latest step unless a step is asked for), or one
                `<save>/<step>` directory; the config is the one saved with that step
    hf          a Hugging Face model directory: config.json + safetensors
"""

import dataclasses
import json
from pathlib import Path

from mjax.config import Config, from_dict
from mjax.storage import params as params_io
from mjax.convert.spec import ConversionError, InputError


@dataclasses.dataclass(frozen=True)
class Source:
    kind: str  # "converted" | "training" | "hf"
    directory: Path  # holds params/ (converted, training: <save>/<step>) or the safetensors (hf)
    config: Config | None  # the saved mjax Config; None for hf (built from its config.json)
    step: int | None = None  # training only

    def describe(self) -> str:
        return f"step {self.step} of {self.directory.parent}" if self.kind == "training" else str(self.directory)


def _training_steps(directory: Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and (p / params_io.PARAMS).is_dir())


def resolve(path, step: int | None = None, flag: str = "--input") -> Source:
    """The Source at `path`; `step` picks a step of a training checkpoint (default: its latest). `flag` names the
    path in errors (the script's flag that gave it)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{flag}={path} does not exist")
    if not path.is_dir():
        raise InputError(f"{flag}={path} is a file; a checkpoint is a directory")
    if params_io.is_mjax_checkpoint(path):
        source = Source("converted", path, from_dict(json.loads((path / params_io.CONFIG).read_text())))
    elif (path / "config.json").exists():
        source = Source("hf", path, None)
    else:
        return _training(path, step, flag)
    if step is not None:
        raise InputError(f"--ckpt_step={step}: {flag}={path} is not a training checkpoint (it holds one set of "
                         "weights)")
    return source


def _training(path: Path, step: int | None, flag: str) -> Source:
    run, steps = path, _training_steps(path)
    if path.name.isdigit() and (path / params_io.PARAMS).is_dir():  # a step directory itself
        if step is not None and step != int(path.name):
            raise InputError(f"--ckpt_step={step}: {path} is the directory of step {path.name}")
        run, steps, step = path.parent, [int(path.name)], int(path.name)
    if not steps:
        raise ConversionError(f"{flag}={path} is not a checkpoint: expected config.json and params/ (a converted mjax "
                              "checkpoint), step directories (mjax-train --save) or config.json and "
                              "*.safetensors (Hugging Face)")
    from mjax.storage.steps import pick_step, saved_config  # noqa: PLC0415

    step = pick_step(steps, step, run, InputError)
    try:
        config = saved_config(str(run), step)
    except Exception as e:  # CheckpointError, or one of the many types Orbax raises for an unreadable item
        raise ConversionError(f"{run}: cannot read the config saved with step {step}: {e}") from e
    return Source("training", run / str(step), config, step)
