"""Decoder-only transformer: pre-norm blocks stacked on a leading `layers` axis and run with scan.

Dense blocks live stacked in `layers` [L_dense, ...], MoE blocks (attention + mjax.model.moe.MoE as `mlp`) in
`moe_layers` [L_moe, ...]; ModelConfig.moe_layer_pattern() says which kind each layer of the model is, and runs of
consecutive layers of one kind are scanned as one.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.config.execution import ExecutionConfig
from mjax.model.attention import Attention
from mjax.model.layers import Embed, Linear, make_norm, without_quant
from mjax.model.mla import MLAttention
from mjax.model.mlp import MLP
from mjax.model.moe import MoE
from mjax.model.mtp import MultiTokenPrediction
from mjax.sharding import constrain, param

RESIDUAL = ("batch", "residual_seq", "act_embed")
STACKS = ("layers", "moe_layers")  # the stacked-layer params: dense blocks, MoE blocks


class Block(nnx.Module):
    def __init__(self, cfg, *, dtype, param_dtype, quant=None, moe: bool = False, execution=None, dispatcher=None,
                 core_attention=None, rngs: nnx.Rngs):
        execution = execution or ExecutionConfig()
        self.attn_norm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)
        attention = MLAttention if cfg.multi_latent_attention else Attention
        self.attn = attention(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, execution=execution,
                              core_attention=core_attention, rngs=rngs)
        self.mlp_norm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)
        if moe:
            self.mlp = MoE(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, execution=execution,
                           dispatcher=dispatcher, rngs=rngs)
        else:
            self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=rngs)

    def __call__(self, x, positions, segment_ids, moe_key=None, cache=None):
        """x [B, T, D] -> (x [B, T, D], the MoE layer's stats or None, the updated KV cache or None). `moe_key`: the
        router noise of --moe_router_force_load_balancing; `cache`: the layer's KV cache when decoding."""
        # The named scopes label the compiled ops (and so the profile, benchmarks/profile.py) by model part.
        with jax.named_scope("norm"):
            h = checkpoint_name(self.attn_norm(x), "norm")
        with jax.named_scope("attention"):
            out, cache = self.attn(h, positions, segment_ids, cache)
            x = constrain(x + out, RESIDUAL)
        with jax.named_scope("norm"):
            h = checkpoint_name(self.mlp_norm(x), "norm")
        if isinstance(self.mlp, MoE):
            with jax.named_scope("moe"):
                y, stats = self.mlp(h, key=moe_key)
                return constrain(x + y, RESIDUAL), stats, cache
        with jax.named_scope("mlp"):
            return constrain(x + self.mlp(h), RESIDUAL), None, cache


def default_positions(tokens):  # [B, T] -> [B, T]: 0..T-1 in every row
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def scan_runner(layer, x, xs, extra_names=()):
    """The model's own way to run a stack of same-kind layers: a plain scan, no recomputation. Training applies
    its remat policy and scan choice from outside (mjax.parallel.remat.LayerRunner); extra_names are the remat
    names a quantized layer would keep, meaningless without remat."""
    del extra_names
    return jax.lax.scan(layer, x, xs)


def split_stacked(tree, sizes):
    """A tree of stacked [L, ...] leaves -> one tree per run of `sizes` layers. Split, not indexing: the gradient
    of a split is one concatenate, that of L index ops is L zero-padded full-size copies added up (their cost in an
    unrolled step: docs/performance.md)."""
    if len(sizes) == 1:
        return [tree]
    leaves, treedef = jax.tree.flatten(tree)
    parts = [jnp.split(a, np.cumsum(sizes)[:-1]) for a in leaves]
    return [treedef.unflatten([p[j] for p in parts]) for j in range(len(sizes))]


class CausalLM(nnx.Module):
    """Token ids [B, T] -> logits [B, T, padded vocab] (fp32). Dense blocks live stacked in `self.layers`, MoE
    blocks in `self.moe_layers` (each present only when the model has layers of that kind).

    `quant` (a mjax.kernels.quant.QuantPolicy or None) is the precision policy of the linear layers."""

    def __init__(self, cfg, *, dtype=jnp.float32, param_dtype=jnp.float32, quant=None, execution=None,
                 runner=scan_runner, dispatcher=None, core_attention=None, rngs: nnx.Rngs):
        """execution: the kernel choices (mjax.config.ExecutionConfig; default: auto everywhere); runner: how each
        run of layers is run (remat, scan: see scan_runner); dispatcher: how MoE tokens reach their experts (see
        mjax.model.moe.MoE; default: all experts local); core_attention: softmax(q k^T) v over the heads (see
        mjax.model.attention.Attention; default: dot_product_attention on whole sequences)."""
        execution = execution or ExecutionConfig()
        self.cfg, self.dtype, self.quant, self.runner = cfg, dtype, quant, runner
        self.vocab = cfg.padded_vocab_size()
        d = cfg.hidden_size
        head_quant = quant if quant is not None and quant.quantize_output_layer else None
        tied = not cfg.untie_embeddings_and_output_weights
        self.embed = Embed(self.vocab, d, std=cfg.init_method_std, dtype=dtype, param_dtype=param_dtype,
                           quant=head_quant if tied else None, rngs=rngs)
        if cfg.position_embedding_type == "learned":
            self.pos_embed = param(cfg.init_method_std * jax.random.normal(
                rngs.params(), (cfg.max_position_embeddings, d), param_dtype), (None, "embed"))
        pattern = cfg.moe_layer_pattern()
        for name, moe, count in (("layers", False, pattern.count(False)), ("moe_layers", True, pattern.count(True))):
            if count:
                setattr(self, name, _stacked_blocks(cfg, count, moe, dtype=dtype, param_dtype=param_dtype,
                                                    quant=quant, execution=execution, dispatcher=dispatcher,
                                                    core_attention=core_attention, rngs=rngs))
        self.final_norm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)
        if not tied:
            self.lm_head = Linear((d,), (self.vocab,), in_axes=("embed",), out_axes=("vocab",),
                                  std=cfg.init_method_std, dtype=dtype, param_dtype=param_dtype, quant=head_quant,
                                  rngs=rngs)
        if cfg.mtp_depth:  # made last, so the model's other params are the same with or without it
            self.mtp = MultiTokenPrediction(cfg, Block, moe=cfg.mtp_is_moe(), dtype=dtype, param_dtype=param_dtype,
                                            quant=quant, execution=execution, dispatcher=dispatcher,
                                            core_attention=core_attention, rngs=rngs)

    def embed_tokens(self, tokens, positions):
        """Token (and learned position) embeddings [B, T, D] in compute dtype, laid out as the residual stream."""
        # Looked up with the sequence whole: a vocab-parallel table then costs a masked lookup and one reduction
        # of [B, T, D] instead of an all-gather of the table; sequence parallelism splits the result afterwards.
        with jax.named_scope("embedding"):
            x = constrain(self.embed(tokens), ("batch", "seq", "act_embed"))  # [B, T, D]
            if self.cfg.position_embedding_type == "learned":
                x = x + jnp.take(self.pos_embed[...], positions, axis=0).astype(self.dtype)
            return constrain(x, RESIDUAL)

    def run_layers(self, x, positions, segment_ids, moe_keys=None, cache=None, pattern=None):
        """The stacked blocks over x [B, T, D] -> (x, MoE stats: each key stacked [MoE layers run, ...], {} without
        MoE layers; the updated KV cache or None). A pipeline stage binds only its own slices of the stacks, so the
        layers run are the leading dims of the bound stacks, in the order `pattern` gives their kinds (True: MoE;
        default: the model's first layers'). `moe_keys` [MoE layers run]: router noise keys
        (--moe_router_force_load_balancing), or None; `cache` when decoding (mjax.inference): {stack: {"k", "v"}
        [layers, B, S, K, H]}, or with MLA {stack: {"latent", "k_rope"} [layers, B, S, ...]} (mla_cache_shapes)."""
        cfg = self.cfg
        split = {name: nnx.split(getattr(self, name)) for name in STACKS if hasattr(self, name)}
        counts = {name: jax.tree.leaves(state)[0].shape[0] for name, (_, state) in split.items()}
        if pattern is None:
            pattern = cfg.moe_layer_pattern()[:sum(counts.values())]
        segments = self._layer_segments(pattern)

        def pieces(tree, name):  # a stacked tree's slices, one per segment of stack `name` (None: no tree)
            sizes = [b - a for s, a, b, _ in segments if s == name]
            return iter(split_stacked(tree, sizes) if tree is not None else [None] * len(sizes))

        params = {name: pieces(split[name][1], name) for name in split}
        keys = {name: pieces(moe_keys if name == "moe_layers" else None, name) for name in split}
        caches = {name: pieces(None if cache is None else cache[name], name) for name in split}
        stats, new_cache = [], {name: [] for name in split}
        for name, start, stop, quantized in segments:
            layer = self._layer_fn(split[name][0], positions, segment_ids, quantized)
            seg = (next(params[name]), next(keys[name]), next(caches[name]))
            extra = self.quant.remat_keeps if self.quant is not None and quantized else ()
            x, (st, c) = self.runner(layer, x, seg, extra)
            if name == "moe_layers":
                stats.append(st)
            new_cache[name].append(c)
        concat = lambda parts: jax.tree.map(lambda *a: jnp.concatenate(a), *parts)  # noqa: E731
        return (x, concat(stats) if stats else {},
                None if cache is None else {name: concat(parts) for name, parts in new_cache.items()})

    @staticmethod
    def _layer_fn(graphdef, positions, segment_ids, quantized: bool):
        """One block as a scan body: (x, (layer state, router key, KV cache)) -> (x, (MoE stats, KV cache))."""
        def layer(x, xs):
            layer_state, key, cache = xs
            block = nnx.merge(graphdef, layer_state)
            x, stats, cache = (block if quantized else without_quant(block))(x, positions, segment_ids, key, cache)
            return x, (stats, cache)

        return layer

    def _layer_segments(self, pattern) -> list[tuple[str, int, int, bool]]:
        """(stack, start, stop within the stack, quantized) runs of consecutive layers of one kind and precision, in
        model order: --first_last_layers_bf16 keeps the ends in compute dtype, and each run is scanned separately
        (the block kind and the quantized/bf16 choice are static, so one scan cannot switch them)."""
        n = len(pattern)
        first, last = (0, 0) if self.quant is None else self.quant.bf16_layers
        runs, seen = [], {name: 0 for name in STACKS}
        for i, moe in enumerate(pattern):
            name = STACKS[int(moe)]
            key = (name, self.quant is not None and first <= i < n - last)
            if runs and (runs[-1][0], runs[-1][3]) == key:
                runs[-1][2] += 1
            else:
                runs.append([name, seen[name], seen[name] + 1, key[1]])
            seen[name] += 1
        return [tuple(r) for r in runs]

    def forward(self, tokens, positions=None, segment_ids=None, moe_keys=None, cache=None):
        """(the final-norm output [B, T, D] in compute dtype, MoE stats, the updated KV cache) of run_layers."""
        if positions is None:
            positions = default_positions(tokens)
        x = self.embed_tokens(tokens, positions)
        x, stats, cache = self.run_layers(x, positions, segment_ids, moe_keys, cache)
        return self.final_norm(x), stats, cache

    def mtp_embeddings(self, mtp_inputs, mtp_positions):
        """The tokens k ahead [D, B, T] (and their positions) of depths k = 1..D -> their embeddings [D, B, T, D]."""
        return jnp.stack([self.embed_tokens(ids, pos) for ids, pos in zip(mtp_inputs, mtp_positions)])

    def mtp_hidden_states(self, h, embeddings, positions, segment_ids=None, moe_keys=None):
        """Multi-token prediction (mjax/model/mtp.py) after `forward`: h [B, T, D] its final-norm output, embeddings
        [D, B, T, D] mtp_embeddings', positions [B, T] the model's -> (each depth's output [D, B, T, D] for the
        output layer, MoE stats stacked [D, ...] or None)."""
        return self.mtp(h, embeddings, positions, segment_ids, self.runner, moe_keys)

    def hidden_states(self, tokens, positions=None, segment_ids=None):
        """The final-norm output [B, T, D] in compute dtype."""
        return self.forward(tokens, positions, segment_ids)[0]

    def output_layer(self):
        """(weight, vocab axis, precision policy, FP8 scales) of the output layer: the tied embedding [V, D] (axis 0)
        or lm_head [D, V] (axis 1); policy and scales are None unless it is quantized (--quantize_output_layer)."""
        if self.cfg.untie_embeddings_and_output_weights:
            layer, w, axis = self.lm_head, self.lm_head.kernel[...], 1
        else:
            layer, w, axis = self.embed, self.embed.embedding[...], 0
        return w, axis, layer.quant, None if layer.fp8_meta is None else layer.fp8_meta[...]

    def logits(self, h):
        """[B, T, D] -> fp32 logits [B, T, padded vocab]."""
        h = constrain(h, ("batch", "seq", "act_embed"))  # as the MLP's input (mjax/model/mlp.py)
        out = self.embed.attend(h) if not self.cfg.untie_embeddings_and_output_weights else self.lm_head(h)
        return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))

    def __call__(self, tokens, positions=None, segment_ids=None):
        return self.logits(self.hidden_states(tokens, positions, segment_ids))


def _stacked_blocks(cfg, count: int, moe: bool, **kwargs):
    """`count` Blocks with their params stacked on a leading `layers` axis."""
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Block(cfg, moe=moe, **{k: v for k, v in kwargs.items() if k != "rngs"}, rngs=rngs)

    blocks = make(kwargs["rngs"])
    for _, var in nnx.iter_graph(blocks):  # stacked params gain a leading `layers` axis
        if isinstance(var, nnx.Variable):
            var.set_metadata("logical_axes", ("layers",) + var.get_metadata()["logical_axes"])
    return blocks
