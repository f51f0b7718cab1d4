"""The step directories of a training run (`mjax-train --save DIR`), read by training and by conversion.

`DIR/<step>/` holds Orbax items: params/ (the plain params dict, the layout of a converted checkpoint's params/),
train_state/ (optimizer state, step, RNG key, loss scale, guards, FP8 scaling state), config/ (`Config.to_dict()`
as JSON), data/ (the data-loader position) and meta/ (mesh and versions). Orbax writes `DIR/<step>.orbax-
checkpoint-tmp*` and renames it when every process has finished, so a crash mid-save leaves the previous step as the
latest; leftover tmp directories are ignored and removed by the next run.
"""

import logging
import os

import jax

from mjax.config import from_dict

log = logging.getLogger("mjax")
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, unreadable, or of another model."""


def ocp():
    import orbax.checkpoint as orbax  # noqa: PLC0415  (heavy; imported only when checkpointing)

    return orbax


def abspath(d: str) -> str:
    return d if "://" in d else os.path.abspath(d)


def manager(directory: str, *, save: bool = False, async_save: bool = True, keep: int | None = None):
    """A CheckpointManager; one that only reads neither creates `directory` nor cleans up in it."""
    orbax = ocp()
    path = abspath(directory)
    if not save and not exists(path):
        raise CheckpointError(f"--load={directory} does not exist")
    handlers = {"params": orbax.StandardCheckpointHandler(), "train_state": orbax.StandardCheckpointHandler(),
                **{name: orbax.JsonCheckpointHandler() for name in ("config", "data", "meta")}}
    options = orbax.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=save,
                                             cleanup_tmp_directories=save)
    return orbax.CheckpointManager(path, options=options, item_handlers=handlers)


def exists(path: str) -> bool:
    from etils import epath  # noqa: PLC0415  (Orbax's path library: local and cloud paths)

    return epath.Path(path).exists()


def flat(tree) -> dict:
    """{"a/b/c": leaf} of a pytree or an Orbax metadata tree."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf for path, leaf in leaves}


def cause(e: BaseException) -> str:
    """The innermost cause of an Orbax/TensorStore error (the one naming the file), shortened."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    msg = str(e)
    return f"{type(e).__name__}: {msg[:600]}{' ...' if len(msg) > 600 else ''}"


def _stored_shape(leaf) -> tuple:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # Orbax stores a typed key as its key data
        leaf = jax.eval_shape(jax.random.key_data, leaf)
    return tuple(leaf.shape)


def check_shapes(item: str, stored_tree, wanted_tree, where: str, hint: str = "") -> None:
    """Raises CheckpointError naming the first parameter path whose shape (or presence) differs."""
    stored = {p: tuple(x.shape) for p, x in flat(stored_tree).items()}
    wanted = {p: _stored_shape(x) for p, x in flat(wanted_tree).items()}
    problems = [f"{item}/{p} is missing from the checkpoint" for p in wanted if p not in stored]
    problems += [f"{item}/{p} has shape {stored[p]} in the checkpoint but {w} in this model"
                 for p, w in wanted.items() if p in stored and stored[p] != w]
    problems += [f"the checkpoint has {item}/{p}, which this model lacks" for p in stored if p not in wanted]
    if problems:
        more = f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else ""
        raise CheckpointError(f"{where} holds another model: {problems[0]}{more}.{hint}")


def pick_step(steps: list[int], requested: int | None, directory, error=ValueError) -> int:
    """The step to read from a directory holding sorted `steps`: the latest, or the one --ckpt_step names."""
    step = steps[-1] if requested is None else requested
    if step not in steps:
        raise error(f"--ckpt_step={step}: {directory} holds steps {steps}")
    return step


def restore_json(mngr, step: int, item: str) -> dict:
    orbax = ocp()
    return mngr.restore(step, args=orbax.args.Composite(**{item: orbax.args.JsonRestore()}))[item]


def saved_config(directory: str, step: int | None = None):
    """The Config a training checkpoint was saved with (latest step unless `step`)."""
    mngr = manager(directory)
    try:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{directory} holds no checkpoint")
        return from_dict(restore_json(mngr, step, "config"))
    finally:
        mngr.close()
