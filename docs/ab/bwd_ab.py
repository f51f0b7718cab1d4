"""Backward A/B of one source tree (PYTHONPATH picks it): causal T=4096 (B=8) and 8192 (B=4); ms of forward,
backward, the dk/dv stage (its kernel, XLA's delta and block runs), cuDNN f+b in the same process; output hashes.
(The packed branches are kept from the run that wrote docs/results/h100-2026-12-07c/fence_*.log, which timed no
packed case.)"""
import hashlib, sys
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp, numpy as np
from benchmarks.attention_cases import inputs
from benchmarks.bench_attention import packed_segments
from benchmarks.harness import time_fn
from mjax.kernels.attention.flash_common import MaskSpec
from mjax.kernels.attention.mosaic import MosaicBlocks, mosaic_backward_op, mosaic_backward_parts, mosaic_forward_op

tag, heads = sys.argv[1], (32, 8, 128)
for t, b, packed in ((4096, 8, False), (8192, 4, False)):
    q, k, v, do = inputs(t, b, heads)
    seg = packed_segments(b, t) if packed else None
    spec = MaskSpec(causal=True, window=None, offset=0, kv_len=t, kv_len_padded=t, q_len_padded=t, segments=packed)
    kw = dict(spec=spec, scale=heads[2] ** -0.5, interpret=False, blocks=MosaicBlocks())
    fwd = jax.jit(lambda q, k, v, s: mosaic_forward_op(q, k, v, s, s, **kw))
    out, lse = fwd(q, k, v, seg)
    dlse = jnp.zeros_like(lse)
    bwd = jax.jit(lambda q, k, v, s, out, lse, do, dlse: mosaic_backward_op(q, k, v, s, s, out, lse, do, dlse, **kw))

    def dkv(q, k, v, s, out, lse, do, dlse):
        p = mosaic_backward_parts(q, k, v, s, s, out, lse, do, dlse, **kw)
        return p["dkv"](*p["delta"]())
    dkv = jax.jit(dkv)
    args = (q, k, v, seg, out, lse, do, dlse)
    grads = bwd(*args)
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in (out, lse, *grads))).hexdigest()[:16]
    ms = {"fwd": time_fn(fwd, q, k, v, seg, min_s=0.3) * 1e3, "bwd": time_fn(bwd, *args, min_s=0.3) * 1e3,
          "dkv": time_fn(dkv, *args, min_s=0.3) * 1e3}
    ms["fb"] = ms["fwd"] + ms["bwd"]
    if not packed:
        def cud(q, k, v, do):
            o, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                          implementation="cudnn"), q, k, v)
            return o, vjp(do)
        ms["cudnn_fb"] = time_fn(jax.jit(cud), q, k, v, do, min_s=0.3) * 1e3
        ms["ratio"] = ms["cudnn_fb"] / ms["fb"]
    print("RESULT", tag, f"T={t} packed={packed}", " ".join(f"{k}={v:.3f}" for k, v in ms.items()),
          "outputs", digest, flush=True)
