"""A functional view of CausalLM for training code: params are a plain nested dict of arrays.

`ModelDef` is static (hashable config + graph); `init(key)` builds params, `apply(params, tokens, ...)` runs the
model, `logical_axes()` gives the same dict with each leaf's logical axis names (for sharding and checkpoints).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from mjax.model.transformer import CausalLM


@dataclasses.dataclass(frozen=True)
class ModelDef:
    cfg: object  # ModelConfig
    dtype: str = "float32"
    param_dtype: str = "float32"

    def module(self, key) -> CausalLM:
        return CausalLM(self.cfg, dtype=jnp.dtype(self.dtype), param_dtype=jnp.dtype(self.param_dtype),
                        rngs=nnx.Rngs(params=key))

    @functools.cached_property
    def _graph(self):
        abstract = nnx.eval_shape(lambda: self.module(jax.random.key(0)))
        graphdef, state = nnx.split(abstract, nnx.Param)
        return graphdef, state

    def init(self, key) -> dict:
        return nnx.to_pure_dict(nnx.state(self.module(key), nnx.Param))

    def abstract_params(self) -> dict:
        return jax.eval_shape(self.init, jax.random.key(0))

    def logical_axes(self) -> dict:
        _, state = self._graph
        axes = jax.tree.map(lambda v: v.get_metadata()["logical_axes"], state,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))
        return nnx.to_pure_dict(axes)

    def bind(self, params: dict) -> CausalLM:
        """The NNX module holding `params` (inside a trace this is free)."""
        graphdef, template = self._graph
        state = jax.tree.map(lambda x: x, template)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)

    def apply(self, params, tokens, positions=None, segment_ids=None):
        return self.bind(params)(tokens, positions, segment_ids)

    @property
    def vocab_size(self) -> int:
        return self.cfg.padded_vocab_size()


def build_model(cfg, precision=None) -> ModelDef:
    """ModelDef from a ModelConfig (and optional PrecisionConfig for compute/param dtypes)."""
    if precision is None:
        return ModelDef(cfg)
    return ModelDef(cfg, dtype=precision.compute_dtype, param_dtype=precision.params_dtype)


def count_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
