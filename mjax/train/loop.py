"""The training loop: build the mesh, model and state, run the jitted step, evaluate, log."""

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from mjax.checkpoint import Checkpointer, position_data
from mjax.config_validation import resolve_batch
from mjax.model import build_model, logical_sharding
from mjax.model.functional import count_params
from mjax.parallel.mesh import describe, make_mesh
from mjax.parallel.rules import batch_sharding, bytes_per_device, logical_rules, param_shardings, state_shardings
from mjax.train.logger import MetricsLogger
from mjax.train.metrics import flops_per_step, peak_memory_bytes, peak_tflops
from mjax.train.optimizer import lr_schedule, make_optimizer
from mjax.train.state import TrainState
from mjax.train.step import make_eval_step, make_train_step

log = logging.getLogger("mjax")


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf and --on_nonfinite=stop."""


@dataclasses.dataclass
class TrainResult:
    state: TrainState
    history: list  # the logged records
    eval_history: list
    stopped_at: int | None = None  # the step a SIGTERM/SIGINT ended training at (after saving a checkpoint)


@dataclasses.dataclass
class Setup:
    """Everything built from a config before the first step."""
    cfg: object
    mesh: object
    model: object
    tx: object
    schedule: object
    state_sharding: object
    batch_sharding: object
    micro_batches: int
    abstract_state: object

    def init_state(self, seed: int) -> TrainState:
        key = jax.random.key(seed)
        init_key, rng = jax.random.split(key)

        def create(k):
            return TrainState.create(self.model.init(k), self.tx, rng, self.cfg.precision, self.model.init_fp8())

        with logical_sharding(self.mesh, logical_rules(self.cfg)):
            return jax.jit(create, out_shardings=self.state_sharding)(init_key)

    def compile_step(self, state, batch, compiler_options=None):
        """(the compiled train step with this setup's shardings, state donated; compile seconds). Traced under
        the logical sharding rules, as everything of this setup must be. `compiler_options`: XLA debug options
        for this compile only (e.g. {"xla_gpu_enable_triton_gemm": False}), as XLA_FLAGS would set them."""
        with logical_sharding(self.mesh, logical_rules(self.cfg)):
            step = jax.jit(make_train_step(self.model, self.cfg, self.tx, self.schedule),
                           in_shardings=(self.state_sharding, self.batch_sharding),
                           out_shardings=(self.state_sharding, None), donate_argnums=0)
            t0 = time.perf_counter()
            compiled = step.lower(state, batch).compile(compiler_options)
        return compiled, time.perf_counter() - t0

    def place_batch(self, batch: dict) -> dict:
        """Process-local numpy [local batch, seq] -> global arrays [micro-batches, batch / micro-batches, seq]."""
        out = {}
        for name, x in batch.items():
            local = x.reshape(self.micro_batches, x.shape[0] // self.micro_batches, *x.shape[1:])
            global_shape = (self.micro_batches, local.shape[1] * jax.process_count(), *x.shape[1:])
            out[name] = jax.make_array_from_process_local_data(self.batch_sharding, local, global_shape)
        return out


def build(cfg, devices=None) -> Setup:
    devices = list(jax.devices() if devices is None else devices)
    cfg.validate(len(devices))
    mesh = make_mesh(cfg, devices)
    rules = logical_rules(cfg)
    _, _, micro_batches = resolve_batch(cfg, len(devices))
    model = build_model(cfg.model, cfg.precision)
    schedule = lr_schedule(cfg.optimizer, cfg.train.train_iters)
    tx = make_optimizer(cfg.optimizer, cfg.train.train_iters)
    abstract_params = model.abstract_params()
    p_sharding = param_shardings(mesh, model.logical_axes(), rules, abstract_params)
    abstract_state = jax.eval_shape(
        lambda p: TrainState.create(p, tx, jax.random.key(0), cfg.precision, model.init_fp8()), abstract_params)
    zero1 = cfg.parallel.use_distributed_optimizer
    return Setup(cfg, mesh, model, tx, schedule, state_shardings(mesh, abstract_state, p_sharding, zero1),
                 batch_sharding(mesh), micro_batches, abstract_state)


def _log_startup(setup: Setup, state, flops):
    cfg, m = setup.cfg, setup.cfg.model
    n = count_params(state.params)
    log.info("model %s: %.3fB parameters, %d layers, hidden %d, heads %d/%d, vocab %d (padded %d)", m.name, n / 1e9,
             m.num_layers, m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.vocab_size,
             setup.model.vocab_size)
    log.info("mesh %s over %d %s devices; micro-batches per step %d", describe(setup.mesh), setup.mesh.size,
             jax.devices()[0].platform, setup.micro_batches)
    log.info("precision: compute %s, params %s; %.3f TFLOP per step (Megatron formula)",
             cfg.precision.compute_dtype, cfg.precision.params_dtype, flops / 1e12)
    a, s = setup.abstract_state, setup.state_sharding
    params_b = bytes_per_device(a.params, s.params)
    opt_b = bytes_per_device(a.opt_state, s.opt_state)
    grads_b = bytes_per_device(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), a.params),
                               s.params)  # accumulated in fp32 whatever --params_dtype is (train/step.py)
    log.info("per device: params %s, optimizer state %s, gradients %s (fp32, sharded as params)%s",
             _gib(params_b), _gib(opt_b), _gib(grads_b),
             " [ZeRO-1: optimizer state split over data]" if cfg.parallel.use_distributed_optimizer else "")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def compiled_memory(compiled):
    """XLA's own accounting of a compiled step per device: (memory analysis, arguments + outputs - donated +
    temporaries in bytes), or None where the backend gives none."""
    try:
        m = compiled.memory_analysis()
    except (AttributeError, NotImplementedError, RuntimeError):
        return None
    if m is None:
        return None
    return m, m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def _log_compiled_memory(compiled):
    """The memory each device will need for the compiled step."""
    analysis = compiled_memory(compiled)
    if analysis is None:
        return
    m, total = analysis
    log.info("compiled step memory per device: arguments %s, outputs %s (donated %s), temporaries %s -> "
             "expected peak about %s", _gib(m.argument_size_in_bytes), _gib(m.output_size_in_bytes),
             _gib(m.alias_size_in_bytes), _gib(m.temp_size_in_bytes), _gib(total))


def evaluate(eval_fn, params, batches, setup, fp8=None) -> float:
    """Mean token loss over the validation batches (each a whole global batch, no accumulation)."""
    sharding = batch_sharding(setup.mesh, ndim=2, leading=False)
    total, count = 0.0, 0.0
    for batch in batches:
        placed = {k: jax.make_array_from_process_local_data(
            sharding, v, (v.shape[0] * jax.process_count(), *v.shape[1:])) for k, v in batch.items()}
        s, c = eval_fn(params, placed, fp8)
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def train(cfg, *, data=None, devices=None, state=None) -> TrainResult:
    """Trains for cfg.train.train_iters steps. `data` is (train iterator, valid-batches factory or None)."""
    setup = build(cfg, devices)
    ckpt, consumed = Checkpointer(cfg, setup), 0
    if state is None:
        state, consumed = ckpt.restore_or_init()
    if data is None:
        from mjax.data import build_data_iterators  # noqa: PLC0415

        data = build_data_iterators(cfg, process_index=jax.process_index(), process_count=jax.process_count(),
                                    consumed_samples=consumed)
    else:
        position_data(data[0], consumed)
    train_iter, valid_batches = data
    flops = flops_per_step(cfg.model, cfg.train.global_batch_size, cfg.train.seq_length)
    _log_startup(setup, state, flops)
    peak = peak_tflops(override=cfg.logging.peak_tflops)
    rules = logical_rules(cfg)

    with logical_sharding(setup.mesh, rules):
        eval_fn = jax.jit(make_eval_step(setup.model, cfg))
        first = setup.place_batch(next(train_iter))
        compiled, compile_s = setup.compile_step(state, first)
        log.info("compiled the train step in %.1fs", compile_s)
        _log_compiled_memory(compiled)

        logger = MetricsLogger(cfg, int(state.step))
        history, eval_history = [], []
        start = int(state.step)
        batch, last_t, last_step = first, time.perf_counter(), start
        ckpt.start()
        try:
            for step in range(start + 1, cfg.train.train_iters + 1):
                state, metrics = compiled(state, batch)
                if step < cfg.train.train_iters:
                    batch = setup.place_batch(next(train_iter))
                if step % cfg.logging.log_interval == 0 or step == cfg.train.train_iters:
                    metrics = jax.device_get(metrics)
                    now = time.perf_counter()
                    step_time = (now - last_t) / (step - last_step)
                    record = _record(step, metrics, state, step_time, cfg, flops, peak, setup.mesh.size, compile_s)
                    last_t, last_step = now, step
                    _check_finite(state, cfg)
                    history.append(record)
                    logger.log(record)
                logger.progress.update(step)
                if valid_batches is not None and cfg.train.eval_interval and step % cfg.train.eval_interval == 0:
                    loss = evaluate(eval_fn, state.params, valid_batches(), setup,
                                    state.fp8.scales if state.fp8 is not None else None)
                    eval_history.append({"step": step, "eval_loss": loss})
                    log.info("step %6d | eval loss %.4f | eval ppl %.2f", step, loss, float(np.exp(min(loss, 50))))
                    last_t = time.perf_counter()
                if ckpt.after_step(step, state, consumed + (step - start) * cfg.train.global_batch_size):
                    break
        finally:
            ckpt.close()
            logger.close()
            if hasattr(train_iter, "close"):
                train_iter.close()
    return TrainResult(state, history, eval_history, ckpt.stopped_at)


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
