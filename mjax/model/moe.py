"""Mixture-of-Experts layer (Megatron-LM's MoELayer: TopKRouter, grouped-GEMM experts, shared experts), in place of
the dense MLP of an MoE layer: `MoE(cfg, ...)(x [B, T, D]) -> (y [B, T, D], stats)`.

Parameters (names are what checkpoints and conversion tables use; logical axes in brackets):
    router/kernel                 [D, E]     ("embed", None)            normal(init_method_std)
    router/expert_bias            [E]        (None,)                    zeros, float32; only with
                                  --moe_router_enable_expert_bias. Never trained by gradients (its gradient is
                                  zero): the train step overwrites it with router.expert_bias_update once a step.
    experts/gate_proj/kernel      [E, D, F]  ("experts", "embed", "expert_mlp")  normal(init_method_std); SwiGLU only
    experts/up_proj/kernel        [E, D, F]  ("experts", "embed", "expert_mlp")  normal(init_method_std)
    experts/down_proj/kernel      [E, F, D]  ("experts", "expert_mlp", "embed")  normal(output_std: std / sqrt(2 L))
    shared_experts/...            an mjax.model.mlp.MLP of FFN size --moe_shared_expert_intermediate_size
    shared_expert_gate/kernel     [D, 1]     ("embed", None)            with --moe_shared_expert_gate:
                                  y_shared * sigmoid(x @ gate) (Qwen2-MoE)
F = --moe_ffn_hidden_size (default --ffn_hidden_size). Experts are SwiGLU (--activation=swiglu) or GELU.
With --fp8_recipe=delayed|tensorwise|blockwise each expert projection also holds experts/*/fp8_meta [E, 3]: per
expert the (input, weight, output-gradient) scales, an Fp8Meta as a Linear's [3] (not a parameter;
mjax/train/fp8_state.py; blockwise reads no scale from it and only reports amaxes through it, as a blockwise Linear).

Forward: the router logits x @ router/kernel in --moe_router_dtype (full-precision matmul), router.route picks the
top-k, then per dispatch group (one per shard of the logical `batch` axis, so under data parallelism the sort stays
local; 1 without a mesh) the assignments are sorted by expert (moe_dispatch.py), the gate and up projections run as
two grouped GEMMs, the SwiGLU output is multiplied by the routing weight (where
Megatron applies it), the down projection is a second grouped GEMM, and each token sums its slots. The grouped GEMMs
go through mjax.kernels.grouped_matmul with impl = --moe_grouped_gemm_impl (the execution config's, default
auto); under a per-tensor FP8 policy through its fp8_grouped_matmul (gate and up share one quantization of the
dispatched rows; x and the gradients have one scale per tensor over all dispatch groups, the weights one per
expert; kernels/grouped_matmul/fp8.py), under --fp8_recipe=blockwise through its blockwise_grouped_matmul (1x128
activation and 128x128 weight blocks, DeepSeek-V3's; kernels/grouped_matmul/fp8_blockwise.py). The router stays
in full precision (as Megatron keeps it out of FP8), the shared experts are an MLP and quantize as any MLP, the
shared-expert gate stays unquantized. Dropless
results do not depend on the number of dispatch groups; with --moe_expert_capacity_factor the capacity (and so what
is dropped) is per dispatch group, as Megatron's is per rank. Shared experts (and their gate) are added last.

stats (a flat dict of arrays; the caller reduces them; router dtype unless said):
    router_probs_sum        [B, E]  per sequence: sum of the aux-loss scores (differentiable); see router.py
    router_topk_count       [B, E]  int32, per sequence: tokens whose aux-loss top-k includes e (no gradient)
    router_z_sum            [B]     per sequence: sum of logsumexp(logits)^2 (differentiable)
    tokens_per_expert       [E]     int32: routed assignments per expert, before dropping
    kept_tokens_per_expert  [E]     int32: after dropping (= tokens_per_expert when dropless); the expert-bias
                                    update (router.expert_bias_update) sums these over the global batch, as
                                    Megatron counts its routing map after dropping
    dropped_assignments     []      int32: assignments dropped over capacity
router.py builds the losses from them (aux_loss, seq_aux_loss, global_aux_loss, z_loss).

Remat names (jax.ad_checkpoint.checkpoint_name), for --remat_policy=selective:
    moe_router_logits  [B*T, E]        router logits (router dtype)
    moe_dispatch       [G, R, D]       the tokens sorted into expert rows
    moe_up             [G, R, F]       the gate and the up grouped GEMM outputs (the up one alone for GELU experts)
    moe_hidden         [G, R, F]       the weighted SwiGLU (GELU) output, the down GEMM's input
    moe_down           [G, R, D]       the down grouped GEMM output, before each token sums its slots
    moe_out            [B, T, D]       the layer's output (routed + shared experts)
with G dispatch groups and R rows per group (tokens per group * k; E * capacity when padded to capacity). The
shared experts are an MLP and carry its names (mlp_up, mlp_hidden, mlp_out).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.grouped_matmul import blockwise_grouped_matmul, fp8_grouped_matmul, grouped_matmul
from mjax.kernels.options import FP8_RECIPES
from mjax.kernels.quant import per_tensor_spec
from mjax.kernels.swiglu import weighted_swiglu
from mjax.model import router as moe_router
from mjax.model.layers import Fp8Meta, Linear, output_std
from mjax.model.mlp import MLP
from mjax.model.moe_dispatch import permute, plan_dispatch, row_weights, unpermute
from mjax.sharding import constrain, param, shards


def _normal(rngs, shape, std, dtype):
    return std * jax.random.normal(rngs.params(), shape, dtype)


class Router(nnx.Module):
    """The gating linear [D, E] (and the aux-loss-free expert bias [E]); routing itself is mjax.model.router."""

    def __init__(self, cfg, *, param_dtype, rngs: nnx.Rngs):
        self.kernel = param(_normal(rngs, (cfg.hidden_size, cfg.num_experts), cfg.init_method_std, param_dtype),
                            ("embed", None))
        self.expert_bias = (param(jnp.zeros((cfg.num_experts,), jnp.float32), (None,))
                            if cfg.moe_router_enable_expert_bias else None)

    def logits(self, x, dtype):  # [..., D] -> [..., E] in the router dtype, at full precision (no TF32)
        return jnp.dot(x.astype(dtype), self.kernel[...].astype(dtype), precision=lax.Precision.HIGHEST)

    def bias(self):  # [E] or None; the bias is moved by the train step's rule, never by gradients
        return None if self.expert_bias is None else lax.stop_gradient(self.expert_bias[...])


class ExpertKernel(nnx.Module):
    """The stacked kernels [E, in, out] of one projection of every expert, and with FP8 their scales [E, 3]."""

    def __init__(self, shape, axes, *, std, param_dtype, fp8: bool = False, rngs: nnx.Rngs):
        self.kernel = param(_normal(rngs, shape, std, param_dtype), axes)
        self.fp8_meta = Fp8Meta(jnp.ones((shape[0], 3), jnp.float32), logical_axes=(None, None)) if fp8 else None


class Experts(nnx.Module):
    def __init__(self, cfg, *, param_dtype, quant=None, rngs: nnx.Rngs):
        e, d = cfg.num_experts, cfg.hidden_size
        f = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        self.gated = cfg.activation == "swiglu"
        self.quant = quant  # None: compute-dtype GEMMs (also what mjax.model.layers.without_quant sets)
        fp8 = quant is not None and quant.has_fp8_meta
        up = dict(axes=("experts", "embed", "expert_mlp"), std=cfg.init_method_std, param_dtype=param_dtype, fp8=fp8,
                  rngs=rngs)
        if self.gated:
            self.gate_proj = ExpertKernel((e, d, f), **up)
        self.up_proj = ExpertKernel((e, d, f), **up)
        self.down_proj = ExpertKernel((e, f, d), ("experts", "expert_mlp", "embed"), std=output_std(cfg),
                                      param_dtype=param_dtype, fp8=fp8, rngs=rngs)

    def kernels(self, dtype):
        """(gate [E, D, F] or None without SwiGLU, up [E, D, F], down [E, F, D]) in `dtype` (the master weights
        under an FP8 policy, which quantizes them itself). Gate and up stay two grouped GEMMs: fusing them as the
        dense MLP does would copy all experts' weights into one [E, D, 2F] array (and split its gradient) every
        micro-batch, which on moe-small cost more than the GEMM itself (docs/moe.md)."""
        cast = (lambda a: a) if self.quant is not None else (lambda a: a.astype(dtype))  # noqa: E731
        gate = cast(self.gate_proj.kernel[...]) if self.gated else None
        return gate, cast(self.up_proj.kernel[...]), cast(self.down_proj.kernel[...])

    def metas(self):
        """The FP8 scales (gate or None, up, down) [E, 3] under an FP8 policy, else None."""
        if self.quant is None:
            return None
        return (self.gate_proj.fp8_meta[...] if self.gated else None, self.up_proj.fp8_meta[...],
                self.down_proj.fp8_meta[...])


def _products(x, ws, metas, group_sizes, *, impl: str, quant):
    """x [R, D_in] times each of the expert weights ws [E, D_in, F_i] -> one [R, F_i] per weight: grouped GEMMs in
    the compute dtype, or in per-tensor or blockwise FP8 with one quantization of x for all of them."""
    if quant is None:
        return tuple(grouped_matmul(x, w, group_sizes, impl=impl) for w in ws)
    if quant.fp8_recipe == "blockwise":
        return blockwise_grouped_matmul(x, tuple(ws), group_sizes, tuple(metas), quant.fp8_format, impl=impl)
    return fp8_grouped_matmul(x, tuple(ws), group_sizes, tuple(metas), per_tensor_spec(quant), impl=impl)


def expert_rows(xs, weights, group_sizes, kernels, *, impl: str, quant=None, metas=None):
    """The experts on dispatched rows xs [R, D] with routing weights [R] -> [R, D]: grouped GEMMs, SwiGLU (or GELU)
    times the weight, grouped GEMM. `quant` (an FP8 QuantPolicy: per-tensor or blockwise) with `metas`
    (Experts.metas()) puts the GEMMs in FP8."""
    gate, up, down = kernels
    gate_meta, up_meta, down_meta = metas if metas is not None else (None, None, None)
    run = functools.partial(_products, group_sizes=group_sizes, impl=impl, quant=quant)
    if gate is not None:
        g, u = (checkpoint_name(t, "moe_up") for t in run(xs, (gate, up), (gate_meta, up_meta)))  # [R, D] -> [R, F]
        h = weighted_swiglu(g, u, weights).astype(xs.dtype)
    else:
        (u,) = run(xs, (up,), (up_meta,))
        h = jax.nn.gelu(checkpoint_name(u, "moe_up"), approximate=True)  # [R, D] -> [R, F]
        compute = jnp.promote_types(weights.dtype, jnp.float32)
        h = (h.astype(compute) * weights[:, None].astype(compute)).astype(xs.dtype)
    h = checkpoint_name(h, "moe_hidden")
    (y,) = run(h, (down,), (down_meta,))
    return checkpoint_name(y, "moe_down")  # [R, F] -> [R, D]


def _check(cfg, quant):
    fp8, fp4 = getattr(quant, "fp8_recipe", None), getattr(quant, "fp4_recipe", None)
    if quant is not None and (fp8 not in FP8_RECIPES or fp4 is not None):
        raise ValueError(f"MoE expert GEMMs take FP8 (--fp8_recipe=delayed|tensorwise|blockwise), not "
                         f"--fp8_recipe={fp8} --fp4_recipe={fp4}; change the recipe or build the MoE layers with "
                         "quant=None (kept in the compute dtype)")
    e, k = cfg.num_experts, cfg.moe_router_topk
    if not e or not 1 <= k <= e:
        raise ValueError(f"--moe_router_topk={k} must be between 1 and --num_experts={e}")
    if cfg.activation not in ("swiglu", "gelu"):
        raise ValueError(f"--activation={cfg.activation!r}: MoE experts are swiglu or gelu")
    if cfg.add_bias_linear:
        raise ValueError("--add_bias_linear: MoE experts and router have no biases here; unset it for MoE models")
    if cfg.moe_shared_expert_gate and not cfg.moe_shared_expert_intermediate_size:
        raise ValueError("--moe_shared_expert_gate needs --moe_shared_expert_intermediate_size (the shared experts)")
    if cfg.moe_router_enable_expert_bias and cfg.moe_router_score_function != "sigmoid":
        raise ValueError("--moe_router_enable_expert_bias needs --moe_router_score_function=sigmoid (as in "
                         "Megatron-LM): softmax routing ignores the expert bias")
    if cfg.moe_expert_capacity_factor is not None and cfg.moe_expert_capacity_factor <= 0:
        raise ValueError(f"--moe_expert_capacity_factor={cfg.moe_expert_capacity_factor} must be positive "
                         "(unset it for dropless)")
    if cfg.moe_pad_expert_input_to_capacity and cfg.moe_expert_capacity_factor is None:
        raise ValueError("--moe_pad_expert_input_to_capacity needs --moe_expert_capacity_factor")
    if cfg.moe_token_drop_policy not in moe_router.DROP_POLICIES:
        raise ValueError(f"--moe_token_drop_policy={cfg.moe_token_drop_policy!r} is not one of "
                         f"{', '.join(moe_router.DROP_POLICIES)}")
    moe_router.router_dtype(cfg.moe_router_dtype)


class MoE(nnx.Module):
    def __init__(self, cfg, *, dtype, param_dtype, quant=None, execution=None, dispatcher=None, rngs: nnx.Rngs):
        """execution: the kernel choices (--moe_grouped_gemm_impl); default auto. dispatcher: how tokens reach the
        experts, `dispatcher(layer, x, logits) -> (y, stats)` as `MoE.route_and_dispatch` (the default: every
        expert is local); training passes mjax.parallel.token_dispatcher's, which exchanges tokens over `expert`."""
        _check(cfg, quant)
        self.cfg, self.dtype, self.dispatcher = cfg, dtype, dispatcher
        self.grouped_gemm_impl = execution.moe_grouped_gemm_impl if execution is not None else "auto"
        self.router = Router(cfg, param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(cfg, param_dtype=param_dtype, quant=quant, rngs=rngs)
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared_experts = (MLP(dataclasses.replace(cfg, ffn_hidden_size=shared), dtype=dtype,
                                   param_dtype=param_dtype, quant=quant, rngs=rngs) if shared else None)
        self.shared_expert_gate = (Linear((cfg.hidden_size,), (1,), in_axes=("embed",), out_axes=(None,),
                                          std=cfg.init_method_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                   if cfg.moe_shared_expert_gate else None)

    def __call__(self, x, *, key=None):
        """x [B, T, D] -> (y [B, T, D] in the compute dtype, stats). `key`: the noise of
        --moe_router_force_load_balancing (required with it, unused without)."""
        cfg = self.cfg
        b, t, d = x.shape
        # On x [B, T, D] itself: flattening it first would gather a sequence split over context.
        logits = self.router.logits(x, moe_router.router_dtype(cfg.moe_router_dtype)).reshape(b * t, -1)  # [N, E]
        if cfg.moe_router_force_load_balancing:
            if key is None:
                raise ValueError("--moe_router_force_load_balancing draws random router logits: pass key= to MoE")
            logits = moe_router.force_balanced_logits(logits, key)
        logits = checkpoint_name(logits, "moe_router_logits")
        dispatch = self.dispatcher or MoE.route_and_dispatch
        y, stats = dispatch(self, x, logits)
        if self.shared_experts is not None:
            shared = self.shared_experts(x).astype(jnp.float32)
            if self.shared_expert_gate is not None:
                shared = shared * jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))  # [B, T, 1]
            y = y + shared
        y = checkpoint_name(constrain(y.astype(self.dtype), ("batch", "seq", "act_embed")), "moe_out")
        return y, stats

    def route(self, logits, expert_bias):
        """logits [N, E], the router's bias() [E] or None -> (weights [N, k] in the router dtype, experts [N, k]
        int32)."""
        cfg = self.cfg
        return moe_router.route(
            logits, topk=cfg.moe_router_topk, score_function=cfg.moe_router_score_function,
            pre_softmax=cfg.moe_router_pre_softmax, num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk, scaling_factor=cfg.moe_router_topk_scaling_factor,
            expert_bias=expert_bias, group_score_topk=cfg.moe_router_group_score_topk)

    def router_stats(self, logits, b):
        """The router's stats (see the module docstring) of b sequences' logits [N, E]."""
        cfg = self.cfg
        probs, topk_map = moe_router.aux_loss_scores(logits, topk=cfg.moe_router_topk,
                                                     score_function=cfg.moe_router_score_function)
        e = logits.shape[-1]
        return {"router_probs_sum": probs.reshape(b, -1, e).sum(1),  # [N, E] -> [B, E]
                "router_topk_count": topk_map.reshape(b, -1, e).sum(1),
                "router_z_sum": moe_router.z_loss_per_token(logits).reshape(b, -1).sum(1)}  # [N] -> [B]

    def route_and_dispatch(self, x, logits):
        """Every expert local: x [B, T, D], logits [B*T, E] -> (y [B, T, D] float32, stats)."""
        weights, experts = self.route(logits, self.router.bias())  # [N, k]
        y, dispatch = self.dispatch_groups(x, weights, experts)
        return y, {**self.router_stats(logits, x.shape[0]), **dispatch}

    def _groups(self, b):
        """Dispatch groups: one per shard of the logical batch axis. A batch that does not divide over them is not
        split by the mesh either; dropless results do not depend on the count, so one group does the same work."""
        groups = shards("batch")
        if b % groups == 0:
            return groups
        if self.cfg.moe_expert_capacity_factor is not None:
            raise ValueError(f"--moe_expert_capacity_factor: a batch of {b} sequences does not split over the "
                             f"{groups} batch shards, and the capacity is per shard; use a batch divisible by "
                             f"{groups} (or dropless MoE)")
        return 1

    def capacity(self, n: int) -> int | None:
        """The expert capacity of a dispatch group of n tokens (None: dropless)."""
        cfg = self.cfg
        if cfg.moe_expert_capacity_factor is None:
            return None
        return moe_router.expert_capacity(n, cfg.num_experts, cfg.moe_router_topk, cfg.moe_expert_capacity_factor)

    def plan(self, weights, experts, seqs: int, seq_len: int):
        """The dispatch plan (moe_dispatch.DispatchPlan) of one group of `seqs` sequences of `seq_len` tokens,
        weights / experts [seqs * seq_len, k]."""
        cfg = self.cfg
        # Megatron's tokens are sequence-major ([T, B] flattened): position priority is the position in the sequence,
        # then the sequence.
        seq_b, pos = jnp.divmod(jnp.arange(seqs * seq_len, dtype=jnp.int32), seq_len)
        return plan_dispatch(experts, weights, num_experts=cfg.num_experts, capacity=self.capacity(seqs * seq_len),
                             policy=cfg.moe_token_drop_policy, pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
                             priority=pos * seqs + seq_b)

    def expert_rows(self, xs, weights, group_sizes, kernels, metas):
        """The experts on dispatched rows (see expert_rows) with this layer's GEMM impl and precision."""
        return expert_rows(xs, weights, group_sizes, kernels, impl=self.grouped_gemm_impl, quant=self.experts.quant,
                           metas=metas)

    def dispatch_groups(self, x, weights, experts):
        """Every expert local: x [B, T, D], weights / experts [B*T, k] -> (y [B, T, D] float32, dispatch stats),
        one dispatch group per shard of the logical batch axis (vmapped; GSPMD splits them over the mesh)."""
        b, t, d = x.shape
        k = self.cfg.moe_router_topk
        g = self._groups(b)
        n = b // g * t  # tokens per dispatch group
        xg = constrain(x.astype(self.dtype).reshape(g, n, d), ("batch", None, "act_embed"))  # [B, T, D] -> [G, n, D]

        def group(x, weights, experts, kernels, metas):
            return self.dispatch_group(x, weights, experts, kernels, metas, b // g, t)

        y, plan = jax.vmap(group, in_axes=(0, 0, 0, None, None))(
            xg, weights.reshape(g, n, k), experts.reshape(g, n, k), self.experts.kernels(self.dtype),
            self.experts.metas())
        return y.reshape(b, t, d), dispatch_stats(plan.tokens_per_expert.sum(0), plan.kept_tokens_per_expert.sum(0))

    def dispatch_group(self, x, weights, experts, kernels, metas, seqs: int, seq_len: int):
        """One dispatch group of `seqs` sequences of `seq_len` tokens, every expert local: x [n, D], weights /
        experts [n, k] -> (y [n, D] float32, its plan)."""
        plan = self.plan(weights, experts, seqs, seq_len)
        xs = checkpoint_name(permute(x, plan.row_token, plan.row_valid, plan.dest, plan.keep), "moe_dispatch")
        rows = self.expert_rows(xs, row_weights(weights, plan), plan.group_sizes, kernels, metas)  # [R, D]
        return unpermute(rows, plan.dest, plan.keep, plan.row_token, plan.row_valid), plan  # -> [n, D]


def dispatch_stats(tokens, kept):
    """The dispatch stats from the routed and kept assignments per expert [E] of the whole batch."""
    return {"tokens_per_expert": tokens, "kept_tokens_per_expert": kept, "dropped_assignments": (tokens - kept).sum()}
