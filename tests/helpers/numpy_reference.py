"""Independent NumPy (float64) forward passes: of the GPT-2 and Llama-family decoders from an mjax params dict
(`forward`), and of Llama-style decoders with mixtures of experts from Hugging Face tensors (`forward_hf`).

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
    if cfg.window_size:
        allowed &= (pos[:, None] - pos[None, :]) < cfg.window_size
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


# ---- Llama-style decoders with mixtures of experts, straight from Hugging Face tensors ----
# A restatement of the HF modeling code (Llama, Mistral, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and DeepSeek-MoE's
# modeling_deepseek.py) that reads tensors by their HF names in torch's Linear layout [out, in]; it shares nothing
# with mjax/convert, so it checks the conversion tables as well as the model.

def _moe_layer(cfg: dict, i: int) -> bool:
    kind = cfg["model_type"]
    if kind in ("mixtral", "olmoe"):
        return True
    if kind in ("qwen2_moe", "qwen3_moe"):
        return i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % (cfg.get("decoder_sparse_step") or 1) == 0
    if kind == "deepseek":
        return bool(cfg.get("n_routed_experts")) and i >= (cfg.get("first_k_dense_replace") or 0) and \
            i % (cfg.get("moe_layer_freq") or 1) == 0
    return False


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _swiglu_hf(x, w_gate, w_up, w_down):  # x [T, D]; weights [F, D], [F, D], [D, F]
    g = x @ w_gate.T
    return (g / (1 + np.exp(-g)) * (x @ w_up.T)) @ w_down.T


def _hf_moe(x, w, p, cfg, routing, layer):
    """x [T, D] -> [T, D]: softmax router, top-k, the family's renormalisation, experts, shared experts."""
    kind = cfg["model_type"]
    mixtral = kind == "mixtral"
    k = cfg["num_experts_per_tok"]
    pre = p + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    logits = x @ w[pre + "gate.weight"].T  # [T, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, -1)
    ids = order[:, :k]
    top = np.take_along_axis(probs, ids, -1)  # [T, k]
    renorm = mixtral or (cfg.get("norm_topk_prob", False) and (kind != "deepseek" or k > 1))
    if renorm:
        top = top / top.sum(-1, keepdims=True)
    if routing is not None:
        ranked = np.take_along_axis(probs, order, -1)
        routing.append((layer, np.sort(ids, -1), float((ranked[:, k - 1] - ranked[:, k]).min())))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, weight in zip(ids[t], top[t]):
            e = f"{pre}experts.{j}."
            out[t] += weight * _swiglu_hf(x[t:t + 1], *(w[e + n + ".weight"] for n in names))[0]
    shared = "mlp.shared_expert." if kind == "qwen2_moe" else "mlp.shared_experts."
    if p + shared + "gate_proj.weight" in w:
        s = _swiglu_hf(x, *(w[p + shared + n + ".weight"] for n in names))
        if kind == "qwen2_moe":
            s = s / (1 + np.exp(-(x @ w[p + "mlp.shared_expert_gate.weight"].T)))  # [T, 1] gate
        out = out + s
    return out


def forward_hf(tensors: dict, cfg: dict, tokens, routing: list | None = None):
    """tokens [B, T] -> logits [B, T, vocab] (float64) from HF tensors {name: array} and config.json `cfg`.
    `routing`, if given, receives per MoE layer and batch row (HF layer index, top-k ids [T, k] ascending, the
    smallest gap between the k-th and the next probability: how far the choice is from a tie)."""
    w = {n: np.asarray(a, np.float64) for n, a in tensors.items()}
    out = [_hf_forward_one(w, cfg, row, routing) for row in np.asarray(tokens)]
    return np.stack(out)


def _hf_forward_one(w, cfg, toks, routing):
    kind, eps = cfg["model_type"], cfg.get("rms_norm_eps", 1e-6)
    n, d = cfg["num_attention_heads"], cfg["hidden_size"]
    kv = cfg.get("num_key_value_heads") or n
    hd = cfg.get("head_dim") or d // n
    rope = cfg.get("rope_parameters") or {}
    assert rope.get("rope_type", "default") == "default" and not cfg.get("rope_scaling"), "default RoPE only"
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    inv = np.array([1.0 / theta ** (2 * i / hd) for i in range(hd // 2)])
    t = len(toks)
    pos = np.arange(t)
    allowed = np.tril(np.ones((t, t), bool))
    window = cfg.get("sliding_window") if kind in ("mistral", "mixtral") else None
    if window:
        allowed &= (pos[:, None] - pos[None, :]) < window
    x = w["model.embed_tokens.weight"][toks]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        proj = {}
        for name in ("q", "k", "v"):
            y = h @ w[f"{p}self_attn.{name}_proj.weight"].T
            if f"{p}self_attn.{name}_proj.bias" in w:
                y = y + w[f"{p}self_attn.{name}_proj.bias"]
            if name != "v" and kind == "olmoe":  # OLMoE: one norm over the whole projection
                y = _rms(y, w[f"{p}self_attn.{name}_norm.weight"], eps)
            y = y.reshape(t, -1, hd)
            if name != "v" and kind == "qwen3_moe":  # Qwen3: per head
                y = _rms(y, w[f"{p}self_attn.{name}_norm.weight"], eps)
            proj[name] = _rope(y, pos, inv) if name != "v" else y
        ctx = np.zeros((t, n, hd))
        for head in range(n):
            g = head // (n // kv)
            s = np.where(allowed, proj["q"][:, head] @ proj["k"][:, g].T / math.sqrt(hd), -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            ctx[:, head] = (a / a.sum(-1, keepdims=True)) @ proj["v"][:, g]
        x = x + ctx.reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if _moe_layer(cfg, i):
            x = x + _hf_moe(h, w, p, cfg, routing, i)
        else:
            x = x + _swiglu_hf(h, *(w[f"{p}mlp.{m}_proj.weight"] for m in ("gate", "up", "down")))
    x = _rms(x, w["model.norm.weight"], eps)
    return x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T
