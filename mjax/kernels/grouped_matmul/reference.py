"""The pure-JAX grouped matmul (impl="xla"): `lax.ragged_dot` accumulated in float32, gradients by its autodiff.
It runs anywhere and is the dispatch's CPU default; on the GPU image it expands to dense work (far slower than the
Pallas kernels, docs/moe.md), so it is never the GPU default.

ragged_dot batches only when every operand has the batch at axis 0 ("vmap over any dim but 0 - NYI"), so a vmap
with w shared would fail. The forward and its autodiff vjp are therefore each wrapped in a vmap rule that
broadcasts the unbatched operands first (w is then copied per batch item: fine for a reference), and tied together
by a custom_vjp (custom_vmap functions are not differentiable themselves).
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap


def _product(x, w, group_sizes):
    return lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)  # [M, N]


def _product_vjp(x, w, group_sizes, dy):
    _, vjp = jax.vjp(lambda x, w: _product(x, w, group_sizes), x, w)
    return vjp(dy)  # (dx [M, K], dw [G, K, N])


def _batch_every_operand(fn):
    """fn with a vmap rule that broadcasts unbatched operands to the batch before vmapping fn."""
    wrapped = custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        args = [a if batched else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, batched in zip(args, in_batched)]
        out = jax.vmap(fn)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped


# The product and its vjp, batchable with any operand unbatched (also the FP8 path's GEMMs on dequantized operands).
ragged_product = _batch_every_operand(_product)
ragged_product_vjp = _batch_every_operand(_product_vjp)


@jax.custom_vjp
def _reference(x, w, group_sizes):
    return ragged_product(x, w, group_sizes)


def _reference_fwd(x, w, group_sizes):
    return ragged_product(x, w, group_sizes), (x, w, group_sizes)


def _reference_bwd(residuals, dy):
    x, w, group_sizes = residuals
    return (*ragged_product_vjp(x, w, group_sizes, dy.astype(x.dtype)), None)


_reference.defvjp(_reference_fwd, _reference_bwd)


def grouped_matmul_reference(x, w, group_sizes):
    """x [M, K] rows sorted by group, w [G, K, N], group_sizes [G] -> [M, N] in x.dtype (padding rows 0)."""
    return _reference(x, w, group_sizes.astype(jnp.int32))
