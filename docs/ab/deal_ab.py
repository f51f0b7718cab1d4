"""A/B of the attention kernels' deal (PYTHONPATH picks the tree): ms of forward, backward, dq and the dk/dv stage
(each with XLA's delta and block runs) at causal T=4096 (B=8), 8192 (B=4) and packed 8192 (4 documents a row),
and a hash of the outputs. `python deal_ab.py TAG [row]`: row passes segments=False to deal_order, so the
causal model picks the order ("row" for all three kernels at these shapes)."""
import hashlib, sys
from mjax.xla_flags import apply_defaults
apply_defaults()
import jax, jax.numpy as jnp, numpy as np
from benchmarks.attention_cases import inputs
from benchmarks.bench_attention import packed_segments
from benchmarks.harness import time_fn
from mjax.kernels.attention import mosaic
from mjax.kernels.attention.flash_common import MaskSpec

tag, heads = sys.argv[1], (32, 8, 128)
if sys.argv[2:] == ["row"]:
    order = mosaic.deal_order
    mosaic.deal_order = lambda *a: order(*a[:5], False)  # segments dropped: the causal model's choice
for t, b, packed in ((4096, 8, False), (8192, 4, False), (8192, 4, True)):
    q, k, v, do = inputs(t, b, heads)
    seg = packed_segments(b, t) if packed else None
    spec = MaskSpec(causal=True, window=None, offset=0, kv_len=t, kv_len_padded=t, q_len_padded=t, segments=packed)
    kw = dict(spec=spec, scale=heads[2] ** -0.5, interpret=False, blocks=mosaic.MosaicBlocks())
    fwd = jax.jit(lambda q, k, v, s: mosaic.mosaic_forward_op(q, k, v, s, s, **kw))
    out, lse = fwd(q, k, v, seg)
    dlse = jnp.zeros_like(lse)
    bwd = jax.jit(lambda *a: mosaic.mosaic_backward_op(*a[:4], a[3], *a[4:], **kw))

    def stage(name):
        def run(q, k, v, s, out, lse, do, dlse):
            p = mosaic.mosaic_backward_parts(q, k, v, s, s, out, lse, do, dlse, **kw)
            return p[name](*p["delta"]())
        return jax.jit(run)

    args = (q, k, v, seg, out, lse, do, dlse)
    grads = bwd(*args)
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in (out, lse, *grads))).hexdigest()[:16]
    ms = {"fwd": time_fn(fwd, q, k, v, seg, min_s=0.3) * 1e3, "bwd": time_fn(bwd, *args, min_s=0.3) * 1e3,
          "dq": time_fn(stage("dq"), *args, min_s=0.3) * 1e3, "dkv": time_fn(stage("dkv"), *args, min_s=0.3) * 1e3}
    ms["fb"] = ms["fwd"] + ms["bwd"]
    print("RESULT", tag, f"T={t} packed={packed}", " ".join(f"{k}={v:.3f}" for k, v in ms.items()),
          "outputs", digest, flush=True)
