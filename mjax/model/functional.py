"""A functional view of CausalLM for training code: params are a plain nested dict of arrays.

`ModelDef` is static (hashable config + graph); `init(key)` builds params, `apply(params, tokens, ...)` runs the
model, `logical_axes()` gives the same dict with each leaf's logical axis names (for sharding and checkpoints).
"""

import dataclasses
from collections.abc import Callable
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mjax.config.execution import ExecutionConfig
from mjax.kernels.quant import QuantPolicy, policy_from_precision
from mjax.model.layers import Fp8Meta
from mjax.model.transformer import CausalLM, scan_runner


@dataclasses.dataclass(frozen=True)
class ModelDef:
    cfg: object  # ModelConfig
    dtype: str = "float32"
    param_dtype: str = "float32"
    quant: QuantPolicy | None = None  # the FP8/FP4 policy of the linear layers (mjax/kernels/quant/)
    execution: ExecutionConfig | None = None  # kernel choices; None: auto everywhere
    runner: Callable = scan_runner  # how each run of layers runs (training: mjax.parallel.remat.LayerRunner)
    dispatcher: Callable | None = None  # how MoE tokens reach experts (training: mjax.parallel.token_dispatcher)
    core_attention: Callable | None = None  # attention proper (training: mjax.parallel.context_parallel's)

    def module(self, key) -> CausalLM:
        return CausalLM(self.cfg, dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype),
                        quant=self.quant, execution=self.execution, runner=self.runner, dispatcher=self.dispatcher,
                        core_attention=self.core_attention,
                        rngs=nnx.Rngs(params=key))

    @functools.cached_property
    def _split(self):
        """(graphdef, params state, FP8 scales state or None)."""
        abstract = nnx.eval_shape(lambda: self.module(jax.random.key(0)))
        if self.quant is None or not self.quant.has_fp8_meta:
            return (*nnx.split(abstract, nnx.Param), None)
        return nnx.split(abstract, nnx.Param, Fp8Meta)

    @property
    def _graph(self):
        return self._split[:2]

    @property
    def has_fp8(self) -> bool:
        return self._split[2] is not None

    def init_fp8(self) -> dict:
        """The FP8 scales of every quantized linear layer ({} without FP8): [3] per layer, stacked layers
        [num_layers, 3]. They live in TrainState.fp8 (mjax/train/fp8_state.py), not among the params."""
        if not self.has_fp8:
            return {}
        return nnx.to_pure_dict(jax.tree.map(lambda v: jnp.ones(v.shape, v.dtype), self._split[2]))

    def init(self, key) -> dict:
        return nnx.to_pure_dict(nnx.state(self.module(key), nnx.Param))

    def abstract_params(self) -> dict:
        return jax.eval_shape(self.init, jax.random.key(0))

    def logical_axes(self) -> dict:
        _, state = self._graph
        axes = jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))
        return nnx.to_pure_dict(axes)

    def bind(self, params: dict, fp8: dict | None = None) -> CausalLM:
        """The NNX module holding `params` (inside a trace this is free). `params` may leave out entries the caller
        never touches, or hold a slice of the stacked `layers` (a pipeline stage binds only its own layers)."""
        graphdef, template = self._graph
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, params)
        if not self.has_fp8:
            return nnx.merge(graphdef, state)
        if fp8 is None:
            if self.quant.fp8_recipe == "delayed":
                raise ValueError("--fp8_recipe=delayed needs its scales: pass fp8=TrainState.fp8.scales to apply()")
            fp8 = self.init_fp8()  # current-scaling recipes only read the scales' gradient slot
        meta = jax.tree.map(lambda x: x, self._split[2])
        nnx.replace_by_pure_dict(meta, fp8)
        return nnx.merge(graphdef, state, meta)

    def apply(self, params, tokens, positions=None, segment_ids=None, fp8=None):
        """fp8: the FP8 scales dict (TrainState.fp8.scales); its gradient is the amax each layer observed."""
        return self.bind(params, fp8)(tokens, positions, segment_ids)

    @property
    def vocab_size(self) -> int:
        return self.cfg.padded_vocab_size()


def build_model(cfg, precision=None, execution=None, runner=scan_runner, dispatcher=None,
                core_attention=None) -> ModelDef:
    """ModelDef from a ModelConfig (and optional PrecisionConfig for compute/param dtypes and the FP8/FP4 policy,
    ExecutionConfig for the kernel choices, a layer runner for remat / scan, an MoE token dispatcher, the core
    attention)."""
    hooks = dict(execution=execution, runner=runner, dispatcher=dispatcher, core_attention=core_attention)
    if precision is None:
        return ModelDef(cfg, **hooks)
    return ModelDef(cfg, dtype=precision.compute_dtype, param_dtype=precision.params_dtype,
                    quant=policy_from_precision(precision), **hooks)


def count_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
