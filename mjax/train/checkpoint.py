"""The training loop's checkpoints on Orbax's CheckpointManager: async saves, restore onto the current mesh,
preemption. The on-disk layout is mjax.storage.steps'.

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

from mjax.config.sections import current_names
from mjax.storage import params as params_io
from mjax.storage.steps import (FORMAT, CheckpointError, abspath, cause, check_shapes, exists, manager, ocp,
                                pick_step)
from mjax.train.preemption import StopSignals
from mjax.train.state import TrainState
from mjax.xla_flags import compile_options

log = logging.getLogger("mjax")


def split_state(state) -> tuple[dict, dict]:
    """TrainState (arrays or ShapeDtypeStructs) -> (params, plain nested dict of everything else)."""
    rest = serialization.to_state_dict(state)
    return rest.pop("params"), rest


def join_state(template: TrainState, params: dict, rest: dict) -> TrainState:
    return serialization.from_state_dict(template, {**rest, "params": params})


def _model_diff(saved_cfg: dict | None, cfg) -> str:
    saved_cfg = current_names(saved_cfg) if saved_cfg else None
    if not saved_cfg or "model" not in saved_cfg:
        return ""
    ours = cfg.to_dict()["model"]
    diffs = [f"--{k}={v!r} (this run: {ours[k]!r})" for k, v in saved_cfg["model"].items()
             if k in ours and ours[k] != v and k != "name"]
    return f" It was saved with {', '.join(diffs)}." if diffs else ""


# Differences from the saved config a resumed run reports: everything but what a continuation changes on purpose.
_EXPECTED_CHANGES = {"checkpoint", "logging", "train.train_iters", "parallel", "model.name"}


def _log_changed_settings(saved_cfg: dict | None, cfg, where: str) -> None:
    """A notice listing every setting that differs from the one the checkpoint recorded (data path, tokenizer,
    learning rate, ...): resuming with another value is allowed, never silent."""
    if not saved_cfg:
        return
    ours, changes = cfg.to_dict(), []
    for section, fields in current_names(saved_cfg).items():  # a config saved under earlier names compares too
        if section in _EXPECTED_CHANGES or not isinstance(fields, dict):
            continue
        for k, v in fields.items():
            now = ours.get(section, {}).get(k, v)
            if f"{section}.{k}" not in _EXPECTED_CHANGES and now != v:
                changes.append(f"--{section}.{k}: {v!r} -> {now!r}")
    if changes:
        log.warning("resuming %s with settings that differ from the ones it was saved with: %s", where,
                    "; ".join(changes))


class Checkpointer:
    """The training loop's checkpoint hook: `restore_or_init()`, then `after_step()` every step, and `close()` at
    the end (it waits for the last async save). `signals` (a StopSignals the caller has entered) says when a
    SIGTERM/SIGINT asks to save and stop."""

    def __init__(self, cfg, *, abstract_state, state_sharding, init_state, state_from_params, mesh: str,
                 signals=None):
        """abstract_state / state_sharding: the TrainState's shapes and the current mesh's shardings; init_state(seed)
        -> a fresh state; state_from_params(params, rng) -> a state with fresh optimizer state around `params`;
        mesh: the mesh in words (recorded with each save)."""
        self.cfg, c = cfg, cfg.checkpoint
        self.abstract_state, self.state_sharding, self.mesh = abstract_state, state_sharding, mesh
        self.init_state, self.state_from_params = init_state, state_from_params
        self._mngr = manager(c.save, save=True, async_save=c.async_save, keep=c.keep) if c.save else None
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
        same = self._mngr is not None and bool(c.load) and abspath(c.load) == abspath(c.save)
        # A run's own steps win (a requeued job resumes its progress), unless --ckpt_step names one of them.
        if own is not None and not (same and c.ckpt_step is not None):
            if c.load and not same:
                log.warning("--save=%s already holds step %d: resuming from it; --load=%s%s is not used", c.save,
                            own, c.load, "" if c.ckpt_step is None else f" --ckpt_step={c.ckpt_step}")
            return self._restore(self._mngr, own, c.save)
        if not c.load:
            return self.init_state(self.cfg.train.seed), 0
        if c.load_params_only:
            return self._init_from_params(c.load), 0
        if not same and params_io.is_mjax_checkpoint(c.load):
            raise CheckpointError(f"--load={c.load} is a converted (params-only) checkpoint with no optimizer state or "
                                  "step: add --load_params_only to start training from its weights")
        mngr = self._mngr if same else manager(c.load)
        steps = sorted(mngr.all_steps())
        if not steps:
            if same:
                log.info("no checkpoint in %s yet: starting from step 0", c.load)
                return self.init_state(self.cfg.train.seed), 0
            raise CheckpointError(f"--load={c.load} holds no checkpoint (no complete step directory); check the "
                                  "path, or drop --load to start from scratch")
        step = pick_step(steps, c.ckpt_step, c.load, CheckpointError)
        try:
            return self._restore(mngr, step, c.load)
        finally:
            if not same:
                mngr.close()

    def _abstract(self) -> TrainState:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract_state, self.state_sharding)

    def _restore(self, mngr, step: int, directory: str) -> tuple[TrainState, int]:
        orbax, where = ocp(), f"checkpoint step {step} in {directory}"
        t0 = time.perf_counter()
        abstract = self._abstract()
        params_t, rest_t = split_state(abstract)
        try:
            saved = mngr.restore(step, args=orbax.args.Composite(
                **{name: orbax.args.JsonRestore() for name in ("config", "data", "meta")}))
            meta = mngr.item_metadata(step)
        except Exception as e:  # Orbax raises many types; all mean the same to the user
            raise CheckpointError(f"cannot read {where}: {cause(e)}") from e
        hint = _model_diff(saved["config"], self.cfg)
        _log_changed_settings(saved["config"], self.cfg, where)
        for item, wanted in (("params", params_t), ("train_state", rest_t)):
            if meta[item] is None:
                item_dir = os.path.join(abspath(directory), str(step), item)
                raise CheckpointError(f"cannot read {where}: {item_dir}/_METADATA is missing or unreadable" if
                                      exists(item_dir) else f"{where} has no {item} item: not an mjax checkpoint")
            check_shapes(item, meta[item], wanted, where, hint)
        try:
            out = mngr.restore(step, args=orbax.args.Composite(params=orbax.args.StandardRestore(params_t),
                                                             train_state=orbax.args.StandardRestore(rest_t)))
        except Exception as e:
            raise CheckpointError(f"cannot read {where}: {cause(e)}") from e
        state = join_state(abstract, out["params"], out["train_state"])
        consumed = int(saved["data"]["consumed_samples"])
        log.info("restored %s onto mesh %s in %.1fs (saved on %s); data position %d samples", where,
                 self.mesh, time.perf_counter() - t0, saved["meta"]["mesh"], consumed)
        return state, consumed

    def _init_from_params(self, directory: str) -> TrainState:
        """Weights from a training checkpoint (its `params` item) or a converted one; fresh optimizer, step 0."""
        source = directory
        if not params_io.is_mjax_checkpoint(directory):
            mngr = manager(directory)
            steps = sorted(mngr.all_steps())
            mngr.close()
            if not steps:
                raise CheckpointError(f"--load={directory} holds neither a training checkpoint (step directories) "
                                      f"nor a converted one ({params_io.PARAMS}/ and {params_io.CONFIG})")
            step = pick_step(steps, self.cfg.checkpoint.ckpt_step, directory, CheckpointError)
            source = os.path.join(abspath(directory), str(step))
        abstract = self._abstract()
        t0 = time.perf_counter()
        try:
            params = params_io.restore(source, abstract.params)
        except Exception as e:
            raise CheckpointError(f"cannot load the params of {source}: {cause(e)}") from e
        key = jax.random.key(self.cfg.train.seed)
        _, rng = jax.random.split(key)  # as Setup.init_state: a fine-tune draws what a fresh run would
        state = jax.jit(self.state_from_params, out_shardings=self.state_sharding, donate_argnums=0,
                        compiler_options=compile_options(self.cfg.execution))(params, rng)
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
            orbax = ocp()
            params, rest = split_state(state)
            meta = {"format": FORMAT, "step": step, "mesh": self.mesh,
                    "process_count": jax.process_count(), "jax": jax.__version__}
            args = orbax.args.Composite(
                params=orbax.args.StandardSave(params), train_state=orbax.args.StandardSave(rest),
                config=orbax.args.JsonSave(self.cfg.to_dict()), meta=orbax.args.JsonSave(meta),
                data=orbax.args.JsonSave({"consumed_samples": int(consumed_samples)}))
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


def position_data(train_iter, consumed_samples: int) -> None:
    """Moves a caller-supplied train iterator to a restored position (mjax's own loader is built there)."""
    if not consumed_samples:
        return
    if not hasattr(train_iter, "restore"):
        raise CheckpointError(f"resuming needs the data iterator at sample {consumed_samples}, but the iterator "
                              "given to train() has no restore(); pass an mjax DataIterator or data=None")
    train_iter.restore({"consumed_samples": consumed_samples})


