"""Packed-documents timing of one source tree (PYTHONPATH picks it): fwd, dq, dkv, f+b ms and output hashes."""
import hashlib, sys
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp, numpy as np
from benchmarks.attention_cases import inputs
from benchmarks.bench_attention import packed_segments
from benchmarks.harness import time_fn
from mjax.kernels.attention.flash_common import MaskSpec
from mjax.kernels.attention.mosaic import MosaicBlocks, mosaic_backward_op, mosaic_backward_parts, mosaic_forward_op

tag, heads, t, b = sys.argv[1], (32, 8, 128), 8192, 4
q, k, v, do = inputs(t, b, heads)
seg = packed_segments(b, t)
spec = MaskSpec(causal=True, window=None, offset=0, kv_len=t, kv_len_padded=t, q_len_padded=t, segments=True)
kw = dict(spec=spec, scale=heads[2] ** -0.5, interpret=False, blocks=MosaicBlocks())
fwd = jax.jit(lambda q, k, v, s: mosaic_forward_op(q, k, v, s, s, **kw))
out, lse = fwd(q, k, v, seg)
dlse = jnp.zeros_like(lse)
bwd = jax.jit(lambda q, k, v, s, out, lse, do, dlse: mosaic_backward_op(q, k, v, s, s, out, lse, do, dlse, **kw))
def part(name):
    def f(q, k, v, s, out, lse, do, dlse):
        p = mosaic_backward_parts(q, k, v, s, s, out, lse, do, dlse, **kw)
        lse2, dlt = p["delta"]()
        return p[name](lse2, dlt)
    return jax.jit(f)
args = (q, k, v, seg, out, lse, do, dlse)
grads = bwd(*args)
digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in (out, lse, *grads))).hexdigest()[:16]
ms = {"fwd": time_fn(fwd, q, k, v, seg, min_s=0.3) * 1e3, "bwd": time_fn(bwd, *args, min_s=0.3) * 1e3,
      "dq": time_fn(part("dq"), *args, min_s=0.3) * 1e3, "dkv": time_fn(part("dkv"), *args, min_s=0.3) * 1e3}
spec0 = MaskSpec(causal=True, window=None, offset=0, kv_len=t, kv_len_padded=t, q_len_padded=t, segments=False)
kw0 = dict(kw, spec=spec0)
fwd0 = jax.jit(lambda q, k, v: mosaic_forward_op(q, k, v, None, None, **kw0))
out0, lse0 = fwd0(q, k, v)
bwd0 = jax.jit(lambda q, k, v, out, lse, do, dlse: mosaic_backward_op(q, k, v, None, None, out, lse, do, dlse, **kw0))
ms["causal_fwd"] = time_fn(fwd0, q, k, v, min_s=0.3) * 1e3
ms["causal_fb"] = ms["causal_fwd"] + time_fn(bwd0, q, k, v, out0, lse0, do, dlse, min_s=0.3) * 1e3
ms["ratio_fwd"] = ms["fwd"] / ms["causal_fwd"]
ms["ratio_fb"] = (ms["fwd"] + ms["bwd"]) / ms["causal_fb"]
print("RESULT", tag, " ".join(f"{k}={v:.3f}" for k, v in ms.items()), f"f+b={ms['fwd'] + ms['bwd']:.3f}",
      "outputs", digest, flush=True)
