"""The training loop: build the mesh, model and state, run the jitted step, evaluate, log."""

import contextlib
import dataclasses
import logging
import time

import jax
import numpy as np

from mjax.train.checkpoint import Checkpointer, position_data
from mjax.model import build_model
from mjax.sharding import logical_sharding
from mjax.parallel.layout import Batching, describe_batching, validate_layout
from mjax.parallel.mesh import describe, make_mesh
from mjax.parallel.remat import LayerRunner
from mjax.parallel.attention_balance import balance_batch, imbalance, token_work
from mjax.parallel.context_parallel import ContextParallelAttention, to_context_layout
from mjax.parallel.token_dispatcher import TokenDispatcher
from mjax.parallel.rules import batch_sharding, logical_rules, param_shardings, state_shardings
from mjax.train.logger import MetricsLogger
from mjax.train.metrics import flops_per_step, peak_memory_bytes, peak_tflops
from mjax.train.optimizer import lr_schedule, make_optimizer
from mjax.train.preemption import StopSignals
from mjax.train.startup import log_compiled_memory, log_startup
from mjax.train.state import TrainState
from mjax.train.step import make_eval_step, make_train_step
from mjax.xla_flags import DETERMINISTIC_FLAGS, compile_options, deterministic_run

log = logging.getLogger("mjax")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf and --on_nonfinite=stop."""


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list  # the logged records
    eval_history: list  # {"step", "split", "eval_loss", "eval_ppl"} per evaluated split
    stopped_at: int | None = None  # the step a SIGTERM/SIGINT ended training at (after saving a checkpoint)


@dataclasses.dataclass
class Setup:
    """Everything built from a config before the first step."""
    cfg: object
    mesh: object
    rules: dict
    model: object
    tx: object
    schedule: object
    state_sharding: object
    batch_sharding: object
    batching: Batching
    abstract_state: object
    batch_stats: dict = dataclasses.field(default_factory=dict)  # of the batch place_batch placed last

    @property
    def micro_batches(self) -> int:
        return self.batching.micro_batches

    def sharding(self):
        """The logical-sharding context everything of this setup is traced under."""
        return logical_sharding(self.mesh, self.rules)

    def jit(self, fn, **kwargs):
        """jax.jit with the XLA options every compile of this run takes (--deterministic_mode)."""
        return jax.jit(fn, compiler_options=compile_options(self.cfg.execution), **kwargs)

    def _compile(self, lowered, compiler_options):
        """lowered.compile(compiler_options), which jax merges over the run's options: never one that undoes them,
        nor deterministic ops the model was not built for (its attention choice skips kernels that fail under them)."""
        options = compiler_options or {}
        clash = [k for k, v in (compile_options(self.cfg.execution) or {}).items() if k in options and options[k] != v]
        if clash:
            raise ValueError(f"compiler option {clash[0]} contradicts --deterministic_mode")
        late = [k for k in DETERMINISTIC_FLAGS if options.get(k) and not deterministic_run(self.cfg.execution)]
        if late:
            raise ValueError(f"compiler option {late[0]}: set --deterministic_mode instead, so that the model's kernel "
                             "choices know")
        return lowered.compile(compiler_options)

    def init_state(self, seed: int, compiler_options=None) -> TrainState:
        """A fresh state, made by a jitted init with the state's shardings; `compiler_options` as in compile_step."""
        key = jax.random.key(seed)
        init_key, rng = jax.random.split(key)

        def create(k):
            return TrainState.create(self.model.init(k), self.tx, rng, self.cfg.precision, self.model.init_fp8())

        with self.sharding():
            init = self._compile(self.jit(create, out_shardings=self.state_sharding).lower(init_key), compiler_options)
            return init(init_key)

    def state_from_params(self, params, rng) -> TrainState:
        """A train state around `params` with fresh optimizer (and FP8) state (--load_params_only)."""
        return TrainState.create(params, self.tx, rng, self.cfg.precision, self.model.init_fp8())

    def compile_step(self, state, batch, compiler_options=None):
        """(the compiled train step with this setup's shardings, state donated; compile seconds). `compiler_options`:
        XLA debug options for this compile only (e.g. {"xla_gpu_enable_triton_gemm": False}), as XLA_FLAGS would."""
        with self.sharding():
            step = self.jit(make_train_step(self.model, self.cfg, self.tx, self.schedule),
                            in_shardings=(self.state_sharding, self.batch_sharding),
                            out_shardings=(self.state_sharding, None), donate_argnums=0)
            t0 = time.perf_counter()
            compiled = self._compile(step.lower(state, batch), compiler_options)
        return compiled, time.perf_counter() - t0

    def place_batch(self, batch: dict) -> dict:
        """Process-local numpy [local batch, seq] -> global arrays [micro-batches, batch / micro-batches, seq], the
        sequence in the context-parallel token order (--cp > 1). Packed documents are first balanced over the
        ranks by attention work (mjax/parallel/attention_balance.py); the imbalance goes to `batch_stats`."""
        cfg, out = self.cfg, {}
        bins = next(iter(batch.values())).shape[0] // self.batching.micro_batch_size
        if cfg.data.reset_attention_mask and (cfg.parallel.cp > 1 or bins > 1):
            window, p = cfg.model.window_size, cfg.parallel
            parts = p.cp // {"a2a": p.cp, "a2a+p2p": (p.hierarchical_context_parallel_sizes or (1,))[0]}.get(
                p.cp_comm_type, 1)  # an all-to-all group's ranks share its work evenly
            # MoE: moving rows between micro-batches would change the per-micro-batch balancing terms and capacity
            if cfg.data.balance_attention_work and not cfg.model.num_experts:
                batch, self.batch_stats = balance_batch(batch, cp=p.cp, bins=bins, window=window, parts=parts)
            else:
                value = imbalance(token_work(batch["segment_ids"], window), p.cp, bins, parts)
                self.batch_stats = {"attention_imbalance": value, "attention_imbalance_before": value}
        for name, x in to_context_layout(batch, cfg.parallel.cp).items():
            local = x.reshape(self.micro_batches, x.shape[0] // self.micro_batches, *x.shape[1:])
            global_shape = (self.micro_batches, local.shape[1] * jax.process_count(), *x.shape[1:])
            out[name] = jax.make_array_from_process_local_data(self.batch_sharding, local, global_shape)
        return out


def build(cfg, devices=None) -> Setup:
    """Validates `cfg` against the devices (the one validation of a run) and builds what training needs."""
    devices = list(jax.devices() if devices is None else devices)
    batching = validate_layout(cfg, len(devices))
    mesh = make_mesh(cfg, devices)
    rules = logical_rules(cfg)
    p = cfg.parallel
    model = build_model(cfg.model, cfg.precision, cfg.execution, LayerRunner(cfg.execution),
                        TokenDispatcher(p.moe_token_dispatcher_type, cfg.execution.moe_alltoall_impl),
                        ContextParallelAttention(p.cp_comm_type, (p.hierarchical_context_parallel_sizes or (None,))[0],
                                                 deterministic=cfg.execution.deterministic_mode))
    schedule = lr_schedule(cfg.optimizer, cfg.train.train_iters)
    tx = make_optimizer(cfg.optimizer, schedule)
    abstract_params = model.abstract_params()
    p_sharding = param_shardings(mesh, model.logical_axes(), rules, abstract_params)
    abstract_state = jax.eval_shape(
        lambda p: TrainState.create(p, tx, jax.random.key(0), cfg.precision, model.init_fp8()), abstract_params)
    zero1 = cfg.parallel.use_distributed_optimizer
    return Setup(cfg, mesh, rules, model, tx, schedule, state_shardings(mesh, abstract_state, p_sharding, zero1),
                 batch_sharding(mesh), batching, abstract_state)


def checkpointer(setup: Setup, cfg=None, signals=None) -> Checkpointer:
    """The checkpoint hook of a setup (`cfg`: its config unless given, e.g. with other checkpoint flags)."""
    return Checkpointer(cfg or setup.cfg, abstract_state=setup.abstract_state, state_sharding=setup.state_sharding,
                        init_state=setup.init_state, state_from_params=setup.state_from_params,
                        mesh=describe(setup.mesh), signals=signals)


def evaluate(eval_fn, params, batches, setup, fp8=None) -> float:
    """Mean token loss over the evaluation batches (each a whole global batch, no accumulation)."""
    sharding = batch_sharding(setup.mesh, ndim=2, leading=False)
    total, count = 0.0, 0.0
    for batch in batches:
        placed = {k: jax.make_array_from_process_local_data(
            sharding, v, (v.shape[0] * jax.process_count(), *v.shape[1:]))
            for k, v in to_context_layout(batch, setup.cfg.parallel.cp).items()}
        s, c = eval_fn(params, placed, fp8)
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def _eval_factories(cfg, evals) -> dict:
    """{split name: factory of evaluation batches}: `valid*` splits run every --eval_interval, `test*` at the end."""
    evals = {} if evals is None else evals if isinstance(evals, dict) else {"valid": evals}
    if cfg.train.eval_interval and not any(name.startswith("valid") for name in evals):
        from mjax.config import ConfigError  # noqa: PLC0415

        raise ConfigError(f"--eval_interval={cfg.train.eval_interval} but there is no validation data: "
                          f"--split={cfg.data.split} gives the validation split nothing (or the data has none); "
                          "change --split or set --eval_interval=0")
    return evals


def train(cfg, *, data=None, devices=None, state=None) -> TrainResult:
    """Trains for cfg.train.train_iters steps. `data` is (train iterator, evaluation batches): a factory of
    validation batches, a dict {split name: factory} (see `_eval_factories`), or None."""
    signals = StopSignals()  # from the start: a SIGTERM while building or compiling stops cleanly too
    with signals:
        setup = build(cfg, devices)
        if data is None:  # before any state is built: a data or tokenizer mistake fails in seconds
            from mjax.data import build_data_iterators  # noqa: PLC0415

            data = build_data_iterators(cfg, process_index=jax.process_index(), process_count=jax.process_count())
        train_iter, evals = data[0], _eval_factories(cfg, data[1])
        with contextlib.closing(train_iter) if hasattr(train_iter, "close") else contextlib.nullcontext():
            ckpt, consumed = checkpointer(setup, signals=signals), 0
            if state is None:
                state, consumed = ckpt.restore_or_init()
            start = int(state.step)
            if start >= cfg.train.train_iters:
                ckpt.close()
                log.warning("nothing to train: the checkpoint is at step %d and --train_iters=%d; raise "
                            "--train_iters to train further", start, cfg.train.train_iters)
                return TrainResult(state, [], [])
            position_data(train_iter, consumed)
            return _run(cfg, setup, ckpt, state, start, consumed, train_iter, evals, signals)


def _run(cfg, setup, ckpt, state, start, consumed, train_iter, evals, signals) -> TrainResult:
    flops = flops_per_step(cfg.model, cfg.train.global_batch_size, cfg.train.seq_length)
    log_startup(setup, state, flops)
    log.info("%s", describe_batching(cfg, setup.batching))
    peak = peak_tflops(override=cfg.logging.peak_tflops)
    logger = MetricsLogger(cfg, start)
    history, eval_history = [], []
    with setup.sharding():
        eval_fn = setup.jit(make_eval_step(setup.model, cfg))

        def run_evals(step, prefix):
            for name, factory in evals.items():
                if name.startswith(prefix):
                    loss = evaluate(eval_fn, state.params, factory(), setup,
                                    state.fp8.scales if state.fp8 is not None else None)
                    record = {"step": step, "split": name, "eval_loss": loss, "eval_ppl": float(np.exp(min(loss, 50)))}
                    eval_history.append(record)
                    logger.log_eval(record)

        try:
            if signals.requested(start):
                log.warning("stopping before step %d on a signal: nothing trained, nothing to save", start + 1)
                return TrainResult(state, history, eval_history, start)
            first, stats = setup.place_batch(next(train_iter)), setup.batch_stats
            compiled, compile_s = setup.compile_step(state, first)
            log.info("compiled the train step in %.1fs", compile_s)
            log_compiled_memory(compiled)
            if signals.requested(start):
                log.warning("stopping before step %d on a signal: nothing trained, nothing to save", start + 1)
                return TrainResult(state, history, eval_history, start)
            batch, last_t, last_step = first, time.perf_counter(), start
            for step in range(start + 1, cfg.train.train_iters + 1):
                state, metrics = compiled(state, batch)
                used = stats  # the balance of this step's batch
                if step < cfg.train.train_iters:
                    batch, stats = setup.place_batch(next(train_iter)), setup.batch_stats
                if step % cfg.logging.log_interval == 0 or step == cfg.train.train_iters:
                    metrics = jax.device_get(metrics)
                    now = time.perf_counter()
                    step_time = (now - last_t) / (step - last_step)
                    record = _record(step, metrics, state, step_time, cfg, flops, peak, setup.mesh.size, compile_s)
                    record.update(used)
                    last_t, last_step = now, step
                    _check_finite(state, cfg)
                    history.append(record)
                    logger.log(record)
                logger.progress.update(step)
                if cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
                    run_evals(step, "valid")
                    last_t = time.perf_counter()
                if ckpt.after_step(step, state, consumed + (step - start) * cfg.train.global_batch_size):
                    return TrainResult(state, history, eval_history, step)
            if cfg.train.eval_interval:  # the test split once, at the end (as Megatron); 0 disables evaluation
                run_evals(cfg.train.train_iters, "test")
        finally:
            ckpt.close()
            logger.close()
    return TrainResult(state, history, eval_history, None)


def _record(step, metrics, state, step_time, cfg, flops, peak, num_devices, compile_s) -> dict:
    tflops = flops / step_time / num_devices / 1e12
    return {
        "step": step,
        "loss": float(metrics["loss"]),
        "grad_norm": float(metrics["grad_norm"]),
        "lr": float(metrics["lr"]),
        "z_loss": float(metrics["z_loss"]),
        "loss_scale": float(metrics["loss_scale"]) if cfg.precision.compute_dtype == "float16" else None,
        "step_time_s": step_time,
        "tokens_per_s": cfg.train.global_batch_size * cfg.train.seq_length / step_time,
        "tflops_per_device": tflops,
        "mfu": tflops / peak if peak else None,
        "peak_memory_bytes": peak_memory_bytes(),
        "skipped_steps": int(state.skipped_steps),
        "compile_s": compile_s,
        **({"pipeline_bubble": float(metrics["pipeline_bubble"])} if "pipeline_bubble" in metrics else {}),
        **{k: float(v) for k, v in metrics.items() if k.startswith(("moe_", "mtp_"))},
        **_fp8_record(metrics, cfg),
    }


def _fp8_record(metrics, cfg) -> dict:
    """FP8 numerics guards: warn on non-finite amaxes; with --fp8_log_stats also log the statistics, among them
    fp8_overflow, the tensors that saturated their delayed scale (routine when an amax grows; many of them every
    step call for --fp8_margin, a longer --fp8_amax_history_len or --fp8_recipe=tensorwise)."""
    stats = {k: float(v) for k, v in metrics.items() if k.startswith("fp8_")}
    if stats.get("fp8_nonfinite_amax", 0):
        log.warning("FP8: %d amaxes were not finite this step (their scales were kept); %d tensors saturated",
                    stats["fp8_nonfinite_amax"], stats.get("fp8_overflow", 0))
    return stats if cfg.precision.fp8_log_stats else {}


def _check_finite(state, cfg):
    first = int(state.first_nonfinite_step)
    if first >= 0 and cfg.train.on_nonfinite == "stop":
        raise NonFiniteError(
            f"the loss or gradient norm was NaN/Inf at step {first + 1}; that update and later ones were not "
            "applied. Lower --lr, check the data, or pass --on_nonfinite=skip to skip such steps and continue")
