"""Multi-token prediction (mjax/model/mtp.py, mjax/train/mtp.py): the train step's losses and gradients against an
unrolled plain-JAX restatement (packed documents, masked tokens, two depths, two micro-batches); which token each
depth reads and predicts, at the sequence end, at document boundaries and in the context-parallel token order; the
config errors; and the FLOPs of MLA and MTP against Megatron's formula written out by hand."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mjax.config import ConfigError, load_config
from mjax.parallel.context_parallel import load_balance_order
from mjax.train import mtp
from mjax.train.metrics import flops_per_step
from mjax.train.loop import build
from tests.helpers.train_utils import FAST_COMPILE, document_batches, initial_state, tiny_config
from tests.unit.test_megatron_flags import parse  # noqa: F401  (the command-line fixture)

DEPTH, FACTOR, LR = 2, 0.3, 100.0  # a large SGD step reads the gradient back to ~eps |p| / LR
MODEL = dict(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
             vocab_size=64, mtp_num_layers=DEPTH, mtp_loss_scaling_factor=FACTOR)


# ---- an unrolled plain-JAX restatement, written from the DeepSeek-V3 paper and Megatron's MTP ----

def _rms(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * scale


def _block(p, x, pos, seg, c):
    """One Llama block over one row: x [T, D], pos / seg [T]."""
    n, k, hd = c.num_attention_heads, c.num_kv_heads, c.head_dim
    h = _rms(x, p["attn_norm"]["scale"], c.norm_epsilon)
    q = jnp.einsum("td,dnh->tnh", h, p["attn"]["q_proj"]["kernel"])
    kk = jnp.einsum("td,dnh->tnh", h, p["attn"]["k_proj"]["kernel"])
    v = jnp.einsum("td,dnh->tnh", h, p["attn"]["v_proj"]["kernel"])
    inv = 1.0 / c.rotary_base ** (jnp.arange(0, hd, 2) / hd)
    ang = pos[:, None, None] * inv  # [T, 1, hd/2]

    def rope(a):  # mjax's half-split rotation
        a1, a2 = a[..., :hd // 2], a[..., hd // 2:]
        return jnp.concatenate([a1 * jnp.cos(ang) - a2 * jnp.sin(ang), a2 * jnp.cos(ang) + a1 * jnp.sin(ang)], -1)

    q, kk = rope(q), rope(kk)
    kk, v = jnp.repeat(kk, n // k, axis=1), jnp.repeat(v, n // k, axis=1)  # [T, N, hd]
    t = x.shape[0]
    allowed = jnp.tril(jnp.ones((t, t), bool)) & (seg[:, None] == seg[None, :])
    s = jnp.einsum("qnh,knh->nqk", q, kk) / jnp.sqrt(hd)
    w = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
    x = x + jnp.einsum("nqk,knh,nhd->qd", w, v, p["attn"]["o_proj"]["kernel"])
    h = _rms(x, p["mlp_norm"]["scale"], c.norm_epsilon)
    gate, up = h @ p["mlp"]["gate_proj"]["kernel"], h @ p["mlp"]["up_proj"]["kernel"]
    return x + (jax.nn.silu(gate) * up) @ p["mlp"]["down_proj"]["kernel"]


def _ce(logits, target, vocab):  # [T, Vp], [T] -> [T]: padding columns excluded
    logits = logits[:, :vocab]
    return jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[:, None], -1)[:, 0]


def _ahead_by_hand(batch, k):
    """Depth k's (tokens read, positions, targets, mask) [B, T] by an explicit loop over positions."""
    b, t = batch["inputs"].shape
    out = [np.zeros((b, t), np.int32), np.zeros((b, t), np.int32), np.zeros((b, t), np.int32),
           np.zeros((b, t), np.float32)]
    for r in range(b):
        for i in range(t):
            j = i + k
            if j < t and batch["segment_ids"][r, j] == batch["segment_ids"][r, i]:
                out[0][r, i], out[1][r, i] = batch["inputs"][r, j], batch["positions"][r, j]
                out[2][r, i], out[3][r, i] = batch["targets"][r, j], batch["loss_mask"][r, j]
    return out


def _reference(params, batch, c):
    """(objective, main loss, [depth losses]): main mean CE + factor x mean over depths of each depth's mean CE."""
    p, vocab = params, c.vocab_size
    depth_data = [_ahead_by_hand(batch, k) for k in range(1, c.mtp_depth + 1)]
    main_sum, depth_sums = 0.0, [0.0] * c.mtp_depth
    for r in range(batch["inputs"].shape[0]):
        pos, seg = jnp.asarray(batch["positions"][r]), jnp.asarray(batch["segment_ids"][r])
        x = p["embed"]["embedding"][batch["inputs"][r]]
        stack = p["layers"]
        for i in range(c.num_layers):
            x = _block(jax.tree.map(lambda a, i=i: a[i], stack), x, pos, seg, c)
        h = _rms(x, p["final_norm"]["scale"], c.norm_epsilon)
        main_sum = main_sum + jnp.sum(_ce(h @ p["lm_head"]["kernel"], batch["targets"][r], vocab)
                                      * batch["loss_mask"][r])
        for k in range(c.mtp_depth):
            ids, _, targets, mask = (a[r] for a in depth_data[k])
            d = jax.tree.map(lambda a, k=k: a[k], p["mtp"]["layers"])
            e = _rms(p["embed"]["embedding"][ids], d["enorm"]["scale"], c.norm_epsilon)
            x = jnp.concatenate([e, _rms(h, d["hnorm"]["scale"], c.norm_epsilon)], -1) @ d["eh_proj"]["kernel"]
            h = _rms(_block(d["block"], x, pos, seg, c), d["final_norm"]["scale"], c.norm_epsilon)
            depth_sums[k] = depth_sums[k] + jnp.sum(_ce(h @ p["lm_head"]["kernel"], jnp.asarray(targets), vocab)
                                                    * mask)
    main = main_sum / batch["loss_mask"].sum()
    depths = [s / max(d[3].sum(), 1.0) for s, d in zip(depth_sums, depth_data)]
    return main + c.mtp_loss_scaling_factor * sum(depths) / len(depths), main, depths


@pytest.mark.slow  # a train step or a plan compiled: over 7 s on 2 cores
def test_train_step_matches_the_unrolled_reference():
    cfg = tiny_config(model=MODEL, train=dict(global_batch_size=4, micro_batch_size=2, seq_length=16),
                      data=dict(reset_attention_mask=True, balance_attention_work=False),
                      optimizer=dict(optimizer="sgd", lr=LR, weight_decay=0.0, clip_grad=0.0))
    batch = next(document_batches(cfg, seed=3, mean_length=6))
    batch["loss_mask"] = (np.random.default_rng(4).random(batch["loss_mask"].shape) > 0.2).astype(np.float32)
    setup = build(cfg, jax.devices()[:1])
    state = initial_state(setup)
    params = jax.tree.map(np.array, jax.device_get(state.params))
    step, _ = setup.compile_step(state, setup.place_batch(batch), FAST_COMPILE)
    new_state, metrics = step(state, setup.place_batch(batch))
    grads = jax.tree.map(lambda a, b: (a - b) / LR, params, jax.device_get(new_state.params))

    def objective(p):
        total, main, depths = _reference(p, batch, cfg.model)
        return total, (main, depths)

    (_, (main, depths)), ref_grads = jax.value_and_grad(objective, has_aux=True)(params)  # eager: faster here
    # float32 both ways: the losses are within 6e-8 relative of a float64 run of the reference
    np.testing.assert_allclose(metrics["loss"], main, rtol=1e-6)
    for k in range(DEPTH):
        np.testing.assert_allclose(metrics[f"mtp_{k + 1}_loss"], depths[k], rtol=1e-6)
    assert not np.allclose(depths[0], depths[1], rtol=1e-3)  # the depths are different predictions
    flat, ref_flat = jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)
    for (path, g), r in zip(flat, ref_flat):
        # Measured: within 3e-7 of each leaf's largest gradient, or 6e-10 absolute (the read-back's eps |p| / LR for
        # the norm scales, |p| = 1); a reference without the document masks misses by 0.86 of the largest.
        err, bound = np.abs(g - r).max(), 1e-5 * np.abs(r).max() + 3e-9
        assert err <= bound, (jax.tree_util.keystr(path), err, bound)
    mtp_grads = jax.tree.leaves(grads["mtp"])
    assert all(np.abs(g).max() > 0 for g in mtp_grads)  # every MTP parameter learns


@pytest.mark.slow  # a train step or a plan compiled: over 7 s on 2 cores
def test_dense_mtp_blocks_after_an_moe_model_with_router_noise():
    """The MTP blocks take the last layer's kind: after a dense last layer they take no router keys, even when
    --moe_router_force_load_balancing draws keys for the model's MoE layers."""
    model = dict(MODEL, num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                 moe_layer_freq="[1,0]", moe_router_force_load_balancing=True)
    cfg = tiny_config(model=model, train=dict(global_batch_size=2, micro_batch_size=2, seq_length=16))
    assert cfg.model.moe_layer_pattern() == (True, False) and not cfg.model.mtp_is_moe()
    setup = build(cfg, jax.devices()[:1])
    state = initial_state(setup)
    batch = setup.place_batch(next(document_batches(cfg, seed=1)))
    step, _ = setup.compile_step(state, batch, FAST_COMPILE)
    _, metrics = step(state, batch)
    assert all(np.isfinite(metrics[k]) for k in ("loss", "mtp_1_loss", "mtp_2_loss"))


# ---- which token each depth reads and predicts ----

def _batch(b=2, t=16, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.cumsum(rng.random((b, t)) < 0.25, axis=1).astype(np.int32)
    return {"inputs": rng.integers(1, 50, (b, t)).astype(np.int32), "targets": rng.integers(1, 50, (b, t)).astype(
        np.int32), "loss_mask": (rng.random((b, t)) > 0.3).astype(np.float32),
        "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(), "segment_ids": seg}


@pytest.mark.parametrize("use_segments", [True, False])
def test_each_depth_reads_and_predicts_the_tokens_ahead(use_segments):
    batch = _batch()
    if not use_segments:  # documents not kept apart: only the sequence end stops a depth (Megatron's plain roll)
        batch["segment_ids"] = np.ones_like(batch["segment_ids"])
    got = mtp.depth_inputs(batch, 3, 1, use_segments)
    for k in range(1, 4):
        ids, pos, targets, mask = _ahead_by_hand(batch, k)
        np.testing.assert_array_equal(got["inputs"][k - 1], ids)
        np.testing.assert_array_equal(got["positions"][k - 1], pos)
        np.testing.assert_array_equal(got["targets"][k - 1], targets)
        np.testing.assert_array_equal(got["loss_mask"][k - 1], mask)
        assert not np.asarray(got["loss_mask"][k - 1][:, -k:]).any()  # nothing to predict past the end
    np.testing.assert_array_equal(mtp.denominators({k: v[None] for k, v in batch.items()}, 3, 1, use_segments),
                                  np.asarray(got["loss_mask"]).reshape(3, -1).sum(-1))


@pytest.mark.parametrize("cp", [2, 4])
def test_the_context_parallel_order_shifts_the_same_tokens(cp):
    batch = _batch(t=32, seed=1)
    natural = mtp.depth_inputs(batch, 2, 1, True)
    order = load_balance_order(32, cp)
    got = mtp.depth_inputs({k: v[:, order] for k, v in batch.items()}, 2, cp, True)
    for name in natural:
        np.testing.assert_array_equal(got[name], np.asarray(natural[name])[..., order], err_msg=name)


# ---- config errors ----

@pytest.mark.parametrize("change, flags", [
    # with --pp > 1 the depths run on the last stage; a layout string must place them there (Megatron's m)
    (dict(parallel=dict(pp=2, pipeline_model_parallel_layout="Et|L")), ("--pipeline_model_parallel_layout", "places 0",
                                                                        f"--mtp_num_layers={DEPTH}")),
    (dict(parallel=dict(pp=2, pipeline_model_parallel_layout="Et|mL")), ("places 1", f"--mtp_num_layers={DEPTH}")),
    (dict(model=dict(MODEL, mtp_num_layers=-1)), ("--mtp_num_layers",)),
    (dict(model=dict(MODEL, mtp_loss_scaling_factor=-0.1)), ("--mtp_loss_scaling_factor",)),
    (dict(model=dict(MODEL, mtp_num_layers=4), train=dict(seq_length=4)), ("--mtp_num_layers", "--seq_length")),
])
def test_config_errors_name_the_flags(change, flags):
    cfg = tiny_config(model=MODEL).replace(**change)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert all(f in str(e.value) for f in flags), str(e.value)


def test_megatron_spellings_of_the_mtp_flags(parse):
    m = parse("--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.2").model
    assert (m.mtp_num_layers, m.mtp_loss_scaling_factor, m.mtp_depth) == (1, 0.2, 1)
    assert load_config("tiny").model.mtp_depth == 0  # off by default


# ---- FLOPs: Megatron's num_floating_point_operations, written out for one V3-shaped model ----

def _megatron_flops(m, batch: int, seq: int, mtp: int) -> float:
    """Megatron-LM's transformer_flops with multi_latent_attention, restated term by term from its source text."""
    h, n, vocab = m.hidden_size, m.num_attention_heads, m.padded_vocab_size()
    pattern = [0] * m.moe_first_dense_layers + [1] * (m.num_layers - m.moe_first_dense_layers)
    num_moe, num_dense = sum(pattern) + pattern[-1] * mtp, m.num_layers - sum(pattern) + (1 - pattern[-1]) * mtp
    num_layers = m.num_layers + mtp
    q_term = m.q_lora_rank * (h + n * (m.qk_head_dim + m.qk_pos_emb_head_dim) + 1)
    attn = 3 * 2 * (q_term + m.kv_lora_rank * (h + n * (m.qk_head_dim + m.v_head_dim) + 1)
                    + h * m.qk_pos_emb_head_dim + n * m.v_head_dim * h
                    + seq * n * (m.qk_head_dim + m.qk_pos_emb_head_dim) / 2 + seq * n * m.v_head_dim / 2)
    mlp = 3 * 2 * h * (m.ffn_hidden_size * 3 * num_dense + m.moe_ffn_hidden_size * m.moe_router_topk * 3 * num_moe
                       + m.moe_shared_expert_intermediate_size * 3 * num_moe)
    mtp_terms = 3 * 2 * mtp * (3 * h + 2 * h * h)
    logit = 3 * 2 * h * vocab * (mtp + 1)
    return batch * seq * (mlp + attn * num_layers + mtp_terms + logit)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_flops_follow_megatrons_mla_and_mtp_terms(depth):
    m = dataclasses.replace(load_config("deepseek-v3").model, mtp_num_layers=depth or None)
    assert flops_per_step(m, 8, 4096) == pytest.approx(_megatron_flops(m, 8, 4096, depth), rel=1e-12)


def test_flops_of_mla_without_q_lora():
    m = load_config("deepseek-v2-lite").model
    h, n, qk = m.hidden_size, m.num_attention_heads, m.qk_head_dim + m.qk_pos_emb_head_dim
    rank_one = dataclasses.replace(m, q_lora_rank=1)  # the same model with a rank-1 query LoRA
    per_layer = (flops_per_step(m, 1, 1) - flops_per_step(rank_one, 1, 1)) / m.num_layers
    # a full-rank query projection h n (qk + pe) in place of the LoRA's 1 (h + n (qk + pe) + 1), times 6
    assert per_layer == 6 * (h * n * qk - (h + n * qk + 1))
