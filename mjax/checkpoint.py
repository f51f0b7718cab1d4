"""Distributed checkpoints on Orbax's CheckpointManager: async saves, restore onto the current mesh, preemption.

`--save DIR` writes, per saved step, `DIR/<step>/` holding Orbax items:
    params/       an Orbax PyTree of the plain params dict (the layout of a converted checkpoint's `<dir>/params`, so
                  `--load_params_only` reads both through `mjax.convert.orbax_io`)
    train_state/  the rest of TrainState: optimizer state, step, RNG key, loss scale, guards (and FP8 scaling state
                  once TrainState holds it)
    config/       `Config.to_dict()` as JSON;  data/  the data-loader position;  meta/  mesh and versions
Orbax writes `DIR/<step>.orbax-checkpoint-tmp*` and renames it when every process has finished, so a crash mid-save
leaves the previous step as the latest; leftover tmp directories are ignored and removed by the next run.

Restore builds the abstract state from the *current* mesh's shardings, so Orbax reads each device's shard from disk
onto any layout; nothing is gathered on one host.

`--save DIR` that already holds checkpoints resumes from its latest (a re-queued job reruns the same command);
`--load DIR` resumes from DIR (latest, or `--ckpt_step`); `--load_params_only` takes only the weights.
"""

import logging
import os
import time

import jax
from flax import serialization

from mjax.config import from_dict
from mjax.parallel.mesh import describe
from mjax.train.preemption import StopSignals
from mjax.train.state import TrainState

log = logging.getLogger("mjax")
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, unreadable, or of another model."""


def _ocp():
    import orbax.checkpoint as ocp  # noqa: PLC0415  (heavy; imported only when checkpointing)

    return ocp


def _abspath(d: str) -> str:
    return d if "://" in d else os.path.abspath(d)


def _manager(directory: str, *, save: bool = False, async_save: bool = True, keep: int | None = None):
    """A CheckpointManager; one that only reads neither creates `directory` nor cleans up in it."""
    ocp = _ocp()
    path = _abspath(directory)
    if not save and not _exists(path):
        raise CheckpointError(f"--load={directory} does not exist")
    handlers = {"params": ocp.StandardCheckpointHandler(), "train_state": ocp.StandardCheckpointHandler(),
                **{name: ocp.JsonCheckpointHandler() for name in ("config", "data", "meta")}}
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=save,
                                           cleanup_tmp_directories=save)
    return ocp.CheckpointManager(path, options=options, item_handlers=handlers)


def _exists(path: str) -> bool:
    from etils import epath  # noqa: PLC0415  (Orbax's path library: local and cloud paths)

    return epath.Path(path).exists()


def split_state(state) -> tuple[dict, dict]:
    """TrainState (arrays or ShapeDtypeStructs) -> (params, plain nested dict of everything else)."""
    rest = serialization.to_state_dict(state)
    return rest.pop("params"), rest


def join_state(template: TrainState, params: dict, rest: dict) -> TrainState:
    return serialization.from_state_dict(template, {**rest, "params": params})


def _flat(tree) -> dict:
    """{"a/b/c": leaf} of a pytree or an Orbax metadata tree."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf for path, leaf in leaves}


def _cause(e: BaseException) -> str:
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
    stored = {p: tuple(x.shape) for p, x in _flat(stored_tree).items()}
    wanted = {p: _stored_shape(x) for p, x in _flat(wanted_tree).items()}
    problems = [f"{item}/{p} is missing from the checkpoint" for p in wanted if p not in stored]
    problems += [f"{item}/{p} has shape {stored[p]} in the checkpoint but {w} in this model"
                 for p, w in wanted.items() if p in stored and stored[p] != w]
    problems += [f"the checkpoint has {item}/{p}, which this model lacks" for p in stored if p not in wanted]
    if problems:
        more = f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else ""
        raise CheckpointError(f"{where} holds another model: {problems[0]}{more}.{hint}")


def _model_diff(saved_cfg: dict | None, cfg) -> str:
    if not saved_cfg or "model" not in saved_cfg:
        return ""
    ours = cfg.to_dict()["model"]
    diffs = [f"--{k}={v!r} (this run: {ours[k]!r})" for k, v in saved_cfg["model"].items()
             if k in ours and ours[k] != (tuple(v) if isinstance(v, list) else v) and k != "name"]
    return f" It was saved with {', '.join(diffs)}." if diffs else ""


# Differences from the saved config a resumed run reports: everything but what a continuation changes on purpose.
_EXPECTED_CHANGES = {"checkpoint", "logging", "train.train_iters", "parallel", "model.name"}


def _log_changed_settings(saved_cfg: dict | None, cfg, where: str) -> None:
    """A notice listing every setting that differs from the one the checkpoint recorded (data path, tokenizer,
    learning rate, ...): resuming with another value is allowed, never silent."""
    if not saved_cfg:
        return
    ours, changes = cfg.to_dict(), []
    for section, fields in saved_cfg.items():
        if section in _EXPECTED_CHANGES or not isinstance(fields, dict):
            continue
        for k, v in fields.items():
            now = ours.get(section, {}).get(k, v)
            if f"{section}.{k}" not in _EXPECTED_CHANGES and now != (tuple(v) if isinstance(v, list) else v):
                changes.append(f"--{section}.{k}: {v!r} -> {now!r}")
    if changes:
        log.warning("resuming %s with settings that differ from the ones it was saved with: %s", where,
                    "; ".join(changes))


def pick_step(steps: list[int], requested: int | None, directory, error=ValueError) -> int:
    """The step to read from a directory holding sorted `steps`: the latest, or the one --ckpt_step names."""
    step = steps[-1] if requested is None else requested
    if step not in steps:
        raise error(f"--ckpt_step={step}: {directory} holds steps {steps}")
    return step


class Checkpointer:
    """The training loop's checkpoint hook: `restore_or_init()`, then `after_step()` every step, and `close()` at
    the end (it waits for the last async save). `signals` (a StopSignals the caller has entered) says when a
    SIGTERM/SIGINT asks to save and stop."""

    def __init__(self, cfg, setup, signals=None):
        self.cfg, self.setup, c = cfg, setup, cfg.checkpoint
        self._mngr = _manager(c.save, save=True, async_save=c.async_save, keep=c.keep) if c.save else None
        self._signals = signals or StopSignals()
        self._last_saved = None
        self.stopped_at = None  # the step a stop signal ended training at
        self.save_call_s: list[float] = []  # time each save() call held the loop

    # ---- restore ----

    def restore_or_init(self) -> tuple[TrainState, int]:
        """(state, consumed global samples): from a checkpoint when one is asked for, else freshly initialised."""
        try:
            return self._restore_or_init()
        except BaseException:
            self.close()
            raise

    def _restore_or_init(self) -> tuple[TrainState, int]:
        c = self.cfg.checkpoint
        own = self._mngr.latest_step() if self._mngr is not None else None
        same = self._mngr is not None and bool(c.load) and _abspath(c.load) == _abspath(c.save)
        # A run's own steps win (a requeued job resumes its progress), unless --ckpt_step names one of them.
        if own is not None and not (same and c.load_step is not None):
            if c.load and not same:
                log.warning("--save=%s already holds step %d: resuming from it; --load=%s%s is not used", c.save,
                            own, c.load, "" if c.load_step is None else f" --ckpt_step={c.load_step}")
            return self._restore(self._mngr, own, c.save)
        if not c.load:
            return self.setup.init_state(self.cfg.train.seed), 0
        if c.load_params_only:
            return self._init_from_params(c.load), 0
        from mjax.convert import orbax_io  # noqa: PLC0415

        if not same and orbax_io.is_mjax_checkpoint(c.load):
            raise CheckpointError(f"--load={c.load} is a converted (params-only) checkpoint with no optimizer state or "
                                  "step: add --load_params_only to start training from its weights")
        mngr = self._mngr if same else _manager(c.load)
        steps = sorted(mngr.all_steps())
        if not steps:
            if same:
                log.info("no checkpoint in %s yet: starting from step 0", c.load)
                return self.setup.init_state(self.cfg.train.seed), 0
            raise CheckpointError(f"--load={c.load} holds no checkpoint (no complete step directory); check the "
                                  "path, or drop --load to start from scratch")
        step = pick_step(steps, c.load_step, c.load, CheckpointError)
        try:
            return self._restore(mngr, step, c.load)
        finally:
            if not same:
                mngr.close()

    def _abstract(self) -> TrainState:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.setup.abstract_state, self.setup.state_sharding)

    def _restore(self, mngr, step: int, directory: str) -> tuple[TrainState, int]:
        ocp, where = _ocp(), f"checkpoint step {step} in {directory}"
        t0 = time.perf_counter()
        abstract = self._abstract()
        params_t, rest_t = split_state(abstract)
        try:
            saved = mngr.restore(step, args=ocp.args.Composite(
                **{name: ocp.args.JsonRestore() for name in ("config", "data", "meta")}))
            meta = mngr.item_metadata(step)
        except Exception as e:  # Orbax raises many types; all mean the same to the user
            raise CheckpointError(f"cannot read {where}: {_cause(e)}") from e
        hint = _model_diff(saved["config"], self.cfg)
        _log_changed_settings(saved["config"], self.cfg, where)
        for item, wanted in (("params", params_t), ("train_state", rest_t)):
            if meta[item] is None:
                item_dir = os.path.join(_abspath(directory), str(step), item)
                raise CheckpointError(f"cannot read {where}: {item_dir}/_METADATA is missing or unreadable" if
                                      _exists(item_dir) else f"{where} has no {item} item: not an mjax checkpoint")
            check_shapes(item, meta[item], wanted, where, hint)
        try:
            out = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(params_t),
                                                             train_state=ocp.args.StandardRestore(rest_t)))
        except Exception as e:
            raise CheckpointError(f"cannot read {where}: {_cause(e)}") from e
        state = join_state(abstract, out["params"], out["train_state"])
        consumed = int(saved["data"]["consumed_samples"])
        log.info("restored %s onto mesh %s in %.1fs (saved on %s); data position %d samples", where,
                 describe(self.setup.mesh), time.perf_counter() - t0, saved["meta"]["mesh"], consumed)
        return state, consumed

    def _init_from_params(self, directory: str) -> TrainState:
        """Weights from a training checkpoint (its `params` item) or a converted one; fresh optimizer, step 0."""
        from mjax.convert import orbax_io  # noqa: PLC0415

        source = directory
        if not orbax_io.is_mjax_checkpoint(directory):
            mngr = _manager(directory)
            steps = sorted(mngr.all_steps())
            mngr.close()
            if not steps:
                raise CheckpointError(f"--load={directory} holds neither a training checkpoint (step directories) "
                                      f"nor a converted one ({orbax_io.PARAMS}/ and {orbax_io.CONFIG})")
            step = pick_step(steps, self.cfg.checkpoint.load_step, directory, CheckpointError)
            source = os.path.join(_abspath(directory), str(step))
        abstract = self._abstract()
        t0 = time.perf_counter()
        try:
            params = orbax_io.restore(source, abstract.params)
        except Exception as e:
            raise CheckpointError(f"cannot load the params of {source}: {_cause(e)}") from e
        key = jax.random.key(self.cfg.train.seed)
        _, rng = jax.random.split(key)  # as Setup.init_state: a fine-tune draws what a fresh run would
        create = lambda p, r: TrainState.create(p, self.setup.tx, r, self.cfg.precision,  # noqa: E731
                                                self.setup.model.init_fp8())
        state = jax.jit(create, out_shardings=self.setup.state_sharding, donate_argnums=0)(params, rng)
        log.info("loaded params only from %s in %.1fs: fresh optimizer state, step 0", source,
                 time.perf_counter() - t0)
        return state

    # ---- save ----

    def after_step(self, step: int, state: TrainState, consumed_samples: int) -> bool:
        """Periodic and final saves; True when a stop signal asks the loop to end after this step (then the
        checkpoint of this step is complete on disk before this returns)."""
        interval, final = self.cfg.checkpoint.save_interval, step == self.cfg.train.train_iters
        stop = self._signals.requested(step)
        if self._mngr is not None and (stop or final or (interval and step % interval == 0)):
            self.save(step, state, consumed_samples, wait=stop)
        if stop:
            self.stopped_at = step
            where = f"checkpoint of step {step} is in {self.cfg.checkpoint.save}" if self._mngr else "no --save"
            log.warning("stopping at step %d on a signal: %s", step, where)
        return stop

    def save(self, step: int, state: TrainState, consumed_samples: int, wait: bool = False) -> None:
        if self._mngr is None:
            raise CheckpointError("save() without --save")
        if self._last_saved != step:
            ocp = _ocp()
            params, rest = split_state(state)
            meta = {"format": FORMAT, "step": step, "mesh": describe(self.setup.mesh),
                    "process_count": jax.process_count(), "jax": jax.__version__}
            args = ocp.args.Composite(
                params=ocp.args.StandardSave(params), train_state=ocp.args.StandardSave(rest),
                config=ocp.args.JsonSave(self.cfg.to_dict()), meta=ocp.args.JsonSave(meta),
                data=ocp.args.JsonSave({"consumed_samples": int(consumed_samples)}))
            t0 = time.perf_counter()
            self._mngr.save(step, args=args, force=True)
            self.save_call_s.append(time.perf_counter() - t0)
            self._last_saved = step
            log.info("checkpoint step %d -> %s (%s; the loop waited %.2fs)", step, self.cfg.checkpoint.save,
                     "async" if self.cfg.checkpoint.async_save else "sync", self.save_call_s[-1])
        if wait:
            self._mngr.wait_until_finished()

    def saving(self) -> bool:
        """Whether an async save is still being written."""
        return self._mngr is not None and self._mngr.is_saving_in_progress()

    def wait(self) -> None:
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for the last save to finish."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()
            self._mngr.close()
            self._mngr = None


def _ocp_restore_json(mngr, step: int, item: str) -> dict:
    ocp = _ocp()
    return mngr.restore(step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()}))[item]


def position_data(train_iter, consumed_samples: int) -> None:
    """Moves a caller-supplied train iterator to a restored position (mjax's own loader is built there)."""
    if not consumed_samples:
        return
    if not hasattr(train_iter, "restore"):
        raise CheckpointError(f"resuming needs the data iterator at sample {consumed_samples}, but the iterator "
                              "given to train() has no restore(); pass an mjax DataIterator or data=None")
    train_iter.restore({"consumed_samples": consumed_samples})


def saved_config(directory: str, step: int | None = None):
    """The Config a training checkpoint was saved with (latest step unless `step`)."""
    mngr = _manager(directory)
    try:
        step = mngr.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"{directory} holds no checkpoint")
        return from_dict(_ocp_restore_json(mngr, step, "config"))
    finally:
        mngr.close()
