"""How the layer stack runs, applied to the model from outside (the model code knows neither): activation
recomputation (--remat_policy, --remat_save_names) and scanned or unrolled layers (--scan_layers).

A runner is what CausalLM calls for each run of same-kind layers: `runner(layer, x, xs, extra_names)` -> (x, ys),
with layer(x, xs_one) -> (x, ys_one) one block and xs stacked [n, ...]. The model's own default is a plain scan
(mjax.model.transformer.scan_runner); training builds this one from the execution config.
"""

import dataclasses

import jax
import jax.numpy as jnp

from mjax.kernels.attention import ATTN_CORE, cudnn_forward_primitives
from mjax.model.transformer import split_stacked


def remat_policy(execution, extra_names=()):
    """None (no remat), or a jax.checkpoint policy: 'full' saves nothing, 'selective' saves the named tensors
    (--remat_save_names and `extra_names`, e.g. the FP8 copies a quantized layer keeps)."""
    if execution.remat_policy == "none":
        return None
    if execution.remat_policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    names = tuple(dict.fromkeys((*execution.remat_save_names, *extra_names)))
    by_name = jax.checkpoint_policies.save_only_these_names(*names)
    if ATTN_CORE not in names or execution.attention_impl not in ("auto", "cudnn") or jax.default_backend() != "gpu":
        return by_name
    cudnn = cudnn_forward_primitives()  # its results carry no name: found by primitive
    return lambda prim, *args, **params: prim in cudnn or by_name(prim, *args, **params)


@dataclasses.dataclass(frozen=True)
class LayerRunner:
    """The execution config's way of running a layer stack (hashable: it is part of the model's static graph)."""
    execution: object  # ExecutionConfig

    def __call__(self, layer, x, xs, extra_names=()):
        policy = remat_policy(self.execution, extra_names)
        scan = self.execution.scan_layers
        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=not scan)
        if scan:
            return jax.lax.scan(layer, x, xs)
        n = jax.tree.leaves(xs)[0].shape[0]
        outs = []
        for one in split_stacked(xs, [1] * n):  # unrolled: one compiled block per layer
            x, o = layer(x, jax.tree.map(lambda a: jnp.squeeze(a, 0), one))
            outs.append(jax.tree.map(lambda a: a[None], o))
        return x, jax.tree.map(lambda *a: jnp.concatenate(a), *outs)
