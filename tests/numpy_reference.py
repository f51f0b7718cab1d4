"""An independent NumPy (float64) forward pass of the GPT-2 and Llama-family decoders, from a params dict.

Written from the papers / Hugging Face semantics, sharing no code with mjax.model: the oracle for model tests.
"""

import math

import numpy as np


def _norm(x, p, cfg):
    if cfg.normalization == "rmsnorm":
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_epsilon) * p["scale"]
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + cfg.norm_epsilon) * p["scale"] + p["bias"]


def _inv_freq(cfg):
    d = cfg.head_dim
    inv = np.array([1.0 / cfg.rotary_base ** (2 * i / d) for i in range(d // 2)])
    if cfg.rope_scaling != "llama3":
        return inv
    out = []
    for f in inv:  # Llama 3.1 reference: piecewise by wavelength
        wavelen = 2 * math.pi / f
        lo = cfg.rope_original_max_positions / cfg.rope_low_freq_factor
        hi = cfg.rope_original_max_positions / cfg.rope_high_freq_factor
        if wavelen < hi:
            out.append(f)
        elif wavelen > lo:
            out.append(f / cfg.rope_scaling_factor)
        else:
            s = (cfg.rope_original_max_positions / wavelen - cfg.rope_low_freq_factor) / (
                cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
            out.append((1 - s) * f / cfg.rope_scaling_factor + s * f)
    return np.array(out)


def _rope(x, pos, inv):  # x [T, N, H]
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _lin(x, p, n_in=1):
    y = np.tensordot(x, p["kernel"], axes=n_in)
    return y + p["bias"] if "bias" in p else y


def forward(params, tokens, cfg, segment_ids=None):
    """tokens [B, T] -> logits [B, T, padded vocab] in float64."""
    p = _to64(params)
    out = []
    for b in range(tokens.shape[0]):
        seg = None if segment_ids is None else segment_ids[b]
        out.append(_forward_one(p, tokens[b], cfg, seg))
    return np.stack(out)


def _forward_one(p, toks, cfg, seg):
    t = len(toks)
    pos = np.arange(t)
    x = p["embed"]["embedding"][toks]
    if cfg.position_embedding_type == "learned":
        x = x + p["pos_embed"][pos]
    allowed = np.tril(np.ones((t, t), bool))
    if cfg.sliding_window:
        allowed &= (pos[:, None] - pos[None, :]) < cfg.sliding_window
    if seg is not None:
        allowed &= seg[:, None] == seg[None, :]
    inv = _inv_freq(cfg)
    n, k = cfg.num_attention_heads, cfg.num_kv_heads
    for i in range(cfg.num_layers):
        L = _layer(p["layers"], i)
        h = _norm(x, L["attn_norm"], cfg)
        q, kk, v = (_lin(h, L["attn"][name]) for name in ("q_proj", "k_proj", "v_proj"))
        if cfg.position_embedding_type == "rope":
            q, kk = _rope(q, pos, inv), _rope(kk, pos, inv)
        ctx = np.zeros_like(q)
        for head in range(n):
            kv = head // (n // k)
            s = q[:, head] @ kk[:, kv].T / math.sqrt(cfg.head_dim)
            s = np.where(allowed, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            ctx[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + _lin(ctx, L["attn"]["o_proj"], 2)
        h = _norm(x, L["mlp_norm"], cfg)
        up = _lin(h, L["mlp"]["up_proj"])
        if cfg.activation == "swiglu":
            g = _lin(h, L["mlp"]["gate_proj"])
            act = g / (1 + np.exp(-g)) * up
        else:
            act = 0.5 * up * (1 + np.tanh(math.sqrt(2 / math.pi) * (up + 0.044715 * up**3)))
        x = x + _lin(act, L["mlp"]["down_proj"])
    x = _norm(x, p["final_norm"], cfg)
    if cfg.untie_embeddings_and_output_weights:
        return x @ p["lm_head"]["kernel"]
    return x @ p["embed"]["embedding"].T


def _layer(tree, i):
    return {k: _layer(v, i) if isinstance(v, dict) else v[i] for k, v in tree.items()}


def _to64(tree):
    return {k: _to64(v) if isinstance(v, dict) else np.asarray(v, np.float64) for k, v in tree.items()}
