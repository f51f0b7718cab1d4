"""The fused QKV projection's split with RoPE, whose backward assembles the gradient of the [B, T, K, G + 2, H]
projection output from dQ, dK (rotated back) and dV: autodiff's concatenate (`xla`, reference.py) or one Pallas pass
(`pallas`, pallas.py). `--qkv_grad_impl=auto|xla|pallas` (auto: pallas on a GPU when Triton can tile the head
dim, else xla)."""

import jax
import jax.numpy as jnp

from mjax.kernels.options import qkv_kernel_tiles
from mjax.kernels.qkv_rope_grad.reference import rotate, split_rotate

__all__ = ["rotate", "split_qkv", "split_rotate", "use_qkv_grad_kernel"]


def use_qkv_grad_kernel(impl: str, head_dim: int) -> bool:
    """--qkv_grad_impl: auto takes the kernel on a GPU when it can tile the head dim (faster there:
    docs/performance.md)."""
    if impl == "auto":
        return jax.default_backend() == "gpu" and qkv_kernel_tiles(head_dim)
    return impl == "pallas"


@jax.custom_vjp
def split_qkv(y, cos, sin):
    """The fused QKV output y [B, T, K, G + 2, H] (per KV head: G query heads, K, V) -> q [B, T, K*G, H] and k
    [B, T, K, H] rotated by cos, sin [B, T, H/2], and v [B, T, K, H]; the backward assembles y's gradient in one
    Pallas pass (pallas.py) instead of autodiff's concatenate."""
    return split_rotate(y, cos, sin)


def _split_qkv_bwd(res, grads):
    from mjax.kernels.qkv_rope_grad.pallas import qkv_rope_grad  # noqa: PLC0415  (import only when chosen)

    cos, sin = res
    dy = qkv_rope_grad(*grads, cos, sin, interpret=jax.default_backend() != "gpu")  # [B, T, K, G + 2, H]
    return dy, jnp.zeros_like(cos), jnp.zeros_like(sin)


split_qkv.defvjp(lambda y, cos, sin: (split_rotate(y, cos, sin), (cos, sin)), _split_qkv_bwd)
