"""Multi-head latent attention (mjax/model/mla.py) against a float64 NumPy restatement of DeepSeek-V2's equations
(arXiv 2405.04434, section 2.1) with YaRN (arXiv 2309.00071) written here from the papers, plus its config checks
and the core-attention injection point."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mjax.config import Config, ConfigError, ModelConfig
from mjax.config.validate import REMAT_NAMES, validate
from mjax.kernels.attention import dot_product_attention
from mjax.model.mla import LATENT_NORM_EPS, MLAttention
from mjax.sharding import single_device
from tests.unit.test_megatron_flags import parse  # noqa: F401  (the command-line fixture)

BASE = dict(hidden_size=32, num_attention_heads=4, multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=8,
            qk_pos_emb_head_dim=6, v_head_dim=5, init_method_std=0.3, num_layers=2)
YARN = dict(rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_positions=8, rope_yarn_mscale=1.0,
            rope_yarn_mscale_all_dim=0.8, rotary_base=100.0)
CASES = {"q_lora": dict(BASE, q_lora_rank=10), "no_q_lora": dict(BASE, q_lora_rank=None),
         "q_lora_yarn": dict(BASE, q_lora_rank=10, **YARN), "no_q_lora_yarn_v_full": dict(BASE, v_head_dim=14, **YARN)}
# fp32 model against the float64 oracle: measured max |error| 3e-7 to 1.2e-6 over the cases, on outputs up to ~2.7
# (f32 rounding through five GEMMs and a softmax); 2e-5 leaves CPU-to-CPU margin and is far below a wrong term.
ATOL = 2e-5


def _rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + LATENT_NORM_EPS) * w


def _mscale(factor, m):
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _inv_freq(c: ModelConfig):
    """RoPE inverse frequencies of the dr rotated dims; YaRN's 'NTK-by-parts' blend when enabled."""
    dr = c.qk_pos_emb_head_dim
    inv = np.array([c.rotary_base ** (-2 * i / dr) for i in range(dr // 2)])
    if c.rope_scaling != "yarn":
        return inv

    def dim_of(rotations):  # the dim index whose wavelength fits `rotations` turns into the original context
        return dr * math.log(c.rope_original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(c.rotary_base))

    lo, hi = max(math.floor(dim_of(c.rope_yarn_beta_fast)), 0), min(math.ceil(dim_of(c.rope_yarn_beta_slow)), dr - 1)
    out = []
    for i, f in enumerate(inv):
        gamma = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep the frequency, 1: interpolate it
        out.append((1 - gamma) * f + gamma * f / c.rope_scaling_factor)
    return np.array(out)


def _rope(x, pos, inv, factor):
    """x [T, ..., dr], rotating dim i with dim i + dr/2 by angle pos * inv[i]; magnitudes times YaRN's factor."""
    half = x.shape[-1] // 2
    ang = pos[:, None] * inv[None, :]  # [T, dr/2]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    a, b = x[..., :half], x[..., half:]
    return factor * np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def mla_oracle(p: dict, x, pos, c: ModelConfig):
    """One sequence: x [T, D] -> [T, D], causal, float64, one head at a time."""
    n, kv_rank, dn, dr = c.num_attention_heads, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim
    yarn = c.rope_scaling == "yarn"
    rope_factor = 1.0
    if yarn:
        m, m_all = c.rope_yarn_mscale, c.rope_yarn_mscale_all_dim
        rope_factor = _mscale(c.rope_scaling_factor, m) / _mscale(c.rope_scaling_factor, m_all)
    scale = (dn + dr) ** -0.5 * (_mscale(c.rope_scaling_factor, c.rope_yarn_mscale_all_dim) ** 2 if yarn else 1.0)
    inv = _inv_freq(c)
    if c.q_lora_rank is None:
        q = np.einsum("td,dnh->tnh", x, p["q_proj"])
    else:
        c_q = _rms(x @ p["q_down_proj"], p["q_norm"])  # [T, Rq]: the compressed query
        q = np.einsum("tr,rnh->tnh", c_q, p["q_up_proj"])
    down = x @ p["kv_down_proj"]
    c_kv = _rms(down[:, :kv_rank], p["kv_norm"])  # [T, C]: the compressed keys and values
    k_r = _rope(down[:, kv_rank:], pos, inv, rope_factor)  # [T, dr]: the one RoPE key
    up = np.einsum("tc,cnh->tnh", c_kv, p["kv_up_proj"])
    t = x.shape[0]
    heads = []
    for h in range(n):
        q_h = np.concatenate([q[:, h, :dn], _rope(q[:, h, dn:], pos, inv, rope_factor)], -1)  # [T, dn + dr]
        k_h = np.concatenate([up[:, h, :dn], k_r], -1)  # the RoPE key is shared by all heads
        v_h = up[:, h, dn:]
        s = q_h @ k_h.T * scale
        s[np.triu_indices(t, 1)] = -np.inf
        w = np.exp(s - s.max(-1, keepdims=True))
        heads.append((w / w.sum(-1, keepdims=True)) @ v_h)
    return np.einsum("tnv,nvd->td", np.stack(heads, 1), p["o_proj"])


def _module(c, core_attention=None, seed=0):
    with single_device():
        mod = MLAttention(c, dtype=jnp.float32, param_dtype=jnp.float32, core_attention=core_attention,
                          rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for norm in ("q_norm", "kv_norm"):  # norms away from one, so a missing scale shows
        if hasattr(mod, norm):
            s = getattr(mod, norm).scale
            s[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(s.shape), jnp.float32)
    return mod


def _params(mod) -> dict:
    names = ("q_proj", "q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj", "o_proj")
    p = {n: np.asarray(getattr(mod, n).kernel[...], np.float64) for n in names if hasattr(mod, n)}
    p.update({n: np.asarray(getattr(mod, n).scale[...], np.float64) for n in ("q_norm", "kv_norm") if hasattr(mod, n)})
    return p


@pytest.mark.parametrize("case", CASES)
def test_mla_matches_the_numpy_oracle(case):
    c = ModelConfig(**CASES[case])
    mod = _module(c)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 11, c.hidden_size)).astype(np.float32)
    pos = np.stack([np.arange(11), np.arange(5, 16)]).astype(np.int32)  # past the original context: YaRN matters
    with single_device():
        out, _ = mod(jnp.asarray(x), jnp.asarray(pos))
    p = _params(mod)
    want = np.stack([mla_oracle(p, x[b].astype(np.float64), pos[b].astype(np.float64), c) for b in range(2)])
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(np.asarray(out), want, atol=ATOL, rtol=0)
    if c.rope_scaling == "yarn":  # YaRN is visible: the unscaled equations differ by far more than the tolerance
        plain = dataclasses.replace(c, rope_scaling="none")
        other = np.stack([mla_oracle(p, x[b].astype(np.float64), pos[b].astype(np.float64), plain) for b in range(2)])
        assert np.abs(other - want).max() > 100 * ATOL


def test_core_attention_gets_qk_and_zero_padded_v_head_dims():
    """The injection point context parallelism uses: Q/K of dn + dr dims, V zero-padded to them, output sliced."""
    c = ModelConfig(**CASES["q_lora"])
    calls = []

    def core(q, k, v, **kw):
        calls.append((q.shape, k.shape, v.shape, np.asarray(v[..., c.v_head_dim:])))
        return dot_product_attention(q, k, v, **kw)

    mod = _module(c, core_attention=core)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 7, c.hidden_size)), jnp.float32)
    pos = jnp.arange(7, dtype=jnp.int32)[None]
    with single_device():
        out, _ = mod(x, pos)
        ref, _ = _module(c)(x, pos)
    (qs, ks, vs, pad), = calls
    assert qs == ks == vs == (1, 7, 4, 14)
    assert not pad.any()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_logical_axes_put_heads_on_tensor():
    mod = _module(ModelConfig(**CASES["q_lora"]))
    axes = {n: getattr(mod, n).kernel.get_metadata()["logical_axes"]
            for n in ("q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj", "o_proj")}
    assert axes == {"q_down_proj": ("embed", None), "q_up_proj": (None, "heads", "head_dim"),
                    "kv_down_proj": ("embed", None), "kv_up_proj": (None, "heads", "head_dim"),
                    "o_proj": ("heads", "head_dim", "embed")}
    assert "mla_up" in REMAT_NAMES


@pytest.mark.slow  # a train step or a plan compiled: over 7 s on 2 cores
def test_mla_model_gradients_are_finite_and_reach_every_projection():
    from mjax.model.transformer import CausalLM  # noqa: PLC0415

    c = ModelConfig(**dict(CASES["q_lora_yarn"], vocab_size=64))
    with single_device():
        model = CausalLM(c, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)
        tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 9)), jnp.int32)

        def loss(params):
            return jnp.mean(jax.nn.logsumexp(nnx.merge(graphdef, params)(tokens), -1))

        grads = jax.grad(loss)(params)
    attn = grads["layers"]["attn"]
    for name in ("q_down_proj", "q_up_proj", "kv_down_proj", "kv_up_proj", "o_proj"):
        g = np.asarray(attn[name]["kernel"][...])
        assert np.isfinite(g).all() and np.abs(g).max() > 0, name


@pytest.mark.parametrize("change, flag", [
    (dict(v_head_dim=15), "v_head_dim"),
    (dict(qk_pos_emb_head_dim=5), "qk_pos_emb_head_dim"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(kv_channels=16), "kv_channels"),
    (dict(num_query_groups=2), "num_query_groups"),
    (dict(multi_latent_attention=False, rope_scaling="yarn"), "multi_latent_attention"),
    (dict(rope_scaling="yarn", rope_yarn_beta_slow=40.0), "beta_slow"),
])
def test_inconsistent_sizes_name_the_flag(change, flag):
    cfg = Config().replace(model=dict(CASES["q_lora"], **change))
    with pytest.raises(ConfigError, match=flag):
        validate(cfg)


def test_megatron_spellings_of_the_mla_flags(parse):
    cfg = parse("--config=deepseek_v2_lite", "--q-lora-rank", "64", "--kv-lora-rank", "32", "--qk-head-dim", "16",
                "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--rotary-scaling-factor", "4",
                "--mscale-all-dim", "0.5", "--no-multi-latent-attention", "--multi-latent-attention")
    m = cfg.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim) == (True, 64, 32, 16, 8, 12)
    assert (m.rope_scaling, m.rope_scaling_factor, m.rope_yarn_mscale_all_dim) == ("yarn", 4.0, 0.5)
