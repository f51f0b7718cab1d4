"""Bytes per device of the train state (params, optimizer moments, FP8 state) and of the fp32 gradients, from the
same abstract state and sharding rules train.py builds, on an abstract mesh: exact for any device count, with
nothing allocated and no device present."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from mjax.config import ExecutionConfig, ParallelConfig
from mjax.model import build_model
from mjax.model.transformer import STACKS
from mjax.parallel.mesh import AXES, mesh_shape
from mjax.parallel.remat import LayerRunner
from mjax.parallel.rules import add_axis, bytes_per_device, logical_rules, param_shardings, state_shardings
from mjax.parallel.token_dispatcher import TokenDispatcher
from mjax.parallel.context_parallel import ContextParallelAttention
from mjax.train.optimizer import lr_schedule, make_optimizer
from mjax.train.state import TrainState


@functools.lru_cache(maxsize=16)
def _abstract(model_cfg, precision, execution, optimizer, train_iters):
    """(model, abstract params, abstract train state): they depend on the model and precision, not the layout."""
    model = build_model(model_cfg, precision, execution, LayerRunner(execution), TokenDispatcher("alltoall", "auto"),
                        ContextParallelAttention("p2p", None))
    tx = make_optimizer(optimizer, lr_schedule(optimizer, train_iters))
    params = model.abstract_params()
    state = jax.eval_shape(lambda p: TrainState.create(p, tx, jax.random.key(0), precision, model.init_fp8()), params)
    return model, params, state


def state_bytes(cfg, num_devices: int) -> dict[str, int]:
    """{"params", "grads", "optimizer", "other", "layer_params"} bytes per device ("other": FP8 amax histories and
    scales, the step, the rng, the loss scale; "layer_params": the part of "params" in the stacked layers, which a
    pipeline splits over its stages)."""
    p = cfg.parallel  # the fields the shardings depend on (the schedule, micro-batch and recomputation do not)
    parallel = ParallelConfig(tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp, fsdp=p.fsdp, dp=p.dp,
                              sequence_parallel=p.sequence_parallel,
                              expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                              use_distributed_optimizer=p.use_distributed_optimizer)
    base = dataclasses.replace(cfg, parallel=parallel, execution=ExecutionConfig(),
                               train=dataclasses.replace(cfg.train, micro_batch_size=None))
    return dict(_state_bytes(base, num_devices))


@functools.lru_cache(maxsize=4096)
def _state_bytes(cfg, num_devices: int) -> tuple:
    model, params, state = _abstract(cfg.model, cfg.precision, cfg.execution, cfg.optimizer, cfg.train.train_iters)
    shape = mesh_shape(cfg, num_devices)
    mesh = AbstractMesh(tuple(shape[a] for a in AXES), AXES)
    p_sharding = param_shardings(mesh, model.logical_axes(), logical_rules(cfg), params)
    s_sharding = state_shardings(mesh, state, p_sharding, cfg.parallel.use_distributed_optimizer)
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
    # with ZeRO-1 XLA keeps the accumulated fp32 gradients split like the moments they update, over data and
    # context (measured over data: tests/integration/test_plan_memory.py); otherwise sharded as the params
    grad_sharding = (jax.tree.map(lambda sh, g: add_axis(add_axis(sh, g.shape, "data"), g.shape, "context"),
                                  p_sharding, grads) if cfg.parallel.use_distributed_optimizer else p_sharding)
    total = bytes_per_device(state, s_sharding)
    out = {"params": bytes_per_device(state.params, s_sharding.params),
           "optimizer": bytes_per_device(state.opt_state, s_sharding.opt_state),
           "grads": bytes_per_device(grads, grad_sharding)}
    out["other"] = total - out["params"] - out["optimizer"]
    out["layer_params"] = bytes_per_device({k: v for k, v in state.params.items() if k in STACKS},
                                           {k: v for k, v in s_sharding.params.items() if k in STACKS})
    return tuple(out.items())
