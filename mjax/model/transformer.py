"""Decoder-only transformer: pre-norm blocks stacked on a leading `layers` axis and run with scan."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mjax.kernels.attention import ATTN_CORE, is_attention_kernel
from mjax.model.attention import Attention
from mjax.model.layers import Embed, Linear, make_norm, without_quant
from mjax.model.mlp import MLP
from mjax.model.sharding import constrain, param

RESIDUAL = ("batch", "residual_seq", "act_embed")


class Block(nnx.Module):
    def __init__(self, cfg, *, dtype, param_dtype, quant=None, rngs: nnx.Rngs):
        self.attn_norm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)
        self.attn = Attention(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=rngs)
        self.mlp_norm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)
        self.mlp = MLP(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=rngs)

    def __call__(self, x, positions, segment_ids):  # x: [B, T, D]
        # The named scopes label the compiled ops (and so the profile, mjax/train/profile.py) by model part.
        with jax.named_scope("norm"):
            h = checkpoint_name(self.attn_norm(x), "norm")
        with jax.named_scope("attention"):
            x = constrain(x + self.attn(h, positions, segment_ids), RESIDUAL)
        with jax.named_scope("norm"):
            h = checkpoint_name(self.mlp_norm(x), "norm")
        with jax.named_scope("mlp"):
            return constrain(x + self.mlp(h), RESIDUAL)


def default_positions(tokens):  # [B, T] -> [B, T]: 0..T-1 in every row
    return jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)


def remat_policy(cfg, extra_names=()):
    """None (no remat), or a jax.checkpoint policy: 'full' saves nothing, 'selective' saves the named tensors
    (cfg.remat_save_names and `extra_names`)."""
    if cfg.remat_policy == "none":
        return None
    if cfg.remat_policy == "full":
        return jax.checkpoint_policies.nothing_saveable
    names = tuple(dict.fromkeys((*cfg.remat_save_names, *extra_names)))
    by_name = jax.checkpoint_policies.save_only_these_names(*names)
    if ATTN_CORE not in names:
        return by_name
    return lambda prim, *args, **params: is_attention_kernel(prim) or by_name(prim, *args, **params)


def split_stacked(tree, sizes):
    """A tree of stacked [L, ...] leaves -> one tree per run of `sizes` layers. Split, not indexing: the gradient
    of a split is one concatenate, that of L index ops is L zero-padded full-size copies added up (an unrolled
    3B step spent ~45 ms in those additions)."""
    if len(sizes) == 1:
        return [tree]
    leaves, treedef = jax.tree.flatten(tree)
    parts = [jnp.split(a, np.cumsum(sizes)[:-1]) for a in leaves]
    return [treedef.unflatten([p[j] for p in parts]) for j in range(len(sizes))]


class CausalLM(nnx.Module):
    """Token ids [B, T] -> logits [B, T, padded vocab] (fp32). Layers live stacked in `self.layers`.

    `quant` (a mjax.kernels.quant.QuantPolicy or None) is the precision policy of the linear layers."""

    def __init__(self, cfg, *, dtype=jnp.float32, param_dtype=jnp.float32, quant=None, rngs: nnx.Rngs):
        if cfg.num_experts is not None:
            raise NotImplementedError(
                f"model {cfg.name!r} has num_experts={cfg.num_experts}: MoE layers are not implemented yet")
        self.cfg, self.dtype, self.quant = cfg, dtype, quant
        self.vocab = cfg.padded_vocab_size()
        d = cfg.hidden_size
        head_quant = quant if quant is not None and quant.output_layer else None
        tied = not cfg.untie_embeddings_and_output_weights
        self.embed = Embed(self.vocab, d, std=cfg.init_method_std, dtype=dtype, param_dtype=param_dtype,
                           quant=head_quant if tied else None, rngs=rngs)
        if cfg.position_embedding_type == "learned":
            self.pos_embed = param(cfg.init_method_std * jax.random.normal(
                rngs.params(), (cfg.max_position_embeddings, d), param_dtype), (None, "embed"))

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):
            return Block(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=rngs)

        self.layers = make_layers(rngs)
        for _, var in nnx.iter_graph(self.layers):  # stacked params gain a leading `layers` axis
            if isinstance(var, nnx.Variable):
                var.set_metadata("logical_axes", ("layers",) + var.get_metadata()["logical_axes"])
        self.final_norm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)
        if not tied:
            self.lm_head = Linear((d,), (self.vocab,), in_axes=("embed",), out_axes=("vocab",),
                                  std=cfg.init_method_std, dtype=dtype, param_dtype=param_dtype, quant=head_quant,
                                  rngs=rngs)

    def embed_tokens(self, tokens, positions):
        """Token (and learned position) embeddings [B, T, D] in compute dtype, laid out as the residual stream."""
        # Looked up with the sequence whole: a vocab-parallel table then costs a masked lookup and one reduction
        # of [B, T, D] instead of an all-gather of the table; sequence parallelism splits the result afterwards.
        with jax.named_scope("embedding"):
            x = constrain(self.embed(tokens), ("batch", "seq", "act_embed"))  # [B, T, D]
            if self.cfg.position_embedding_type == "learned":
                x = x + jnp.take(self.pos_embed[...], positions, axis=0).astype(self.dtype)
            return constrain(x, RESIDUAL)

    def run_layers(self, x, positions, segment_ids):
        """The stacked blocks over x [B, T, D]. A pipeline stage binds only its own slice of `layers`, so the
        number of layers run is the leading dim of the stacked params, not cfg.num_layers."""
        cfg = self.cfg
        graphdef, state = nnx.split(self.layers)

        def make_layer(quantized):
            def layer(x, layer_state):
                block = nnx.merge(graphdef, layer_state)
                return (block if quantized else without_quant(block))(x, positions, segment_ids), None

            policy = remat_policy(cfg, self.quant.remat_keeps if self.quant is not None and quantized else ())
            return layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=not cfg.scan_layers)

        n = jax.tree.leaves(state)[0].shape[0]
        segments = self._layer_segments(n)
        for (start, stop, quantized), seg in zip(segments, split_stacked(state, [b - a for a, b, _ in segments])):
            layer = make_layer(quantized)
            if cfg.scan_layers:
                x, _ = jax.lax.scan(layer, x, seg)
            else:
                for one in split_stacked(seg, [1] * (stop - start)):
                    x, _ = layer(x, jax.tree.map(lambda a: jnp.squeeze(a, 0), one))
        return x

    def _layer_segments(self, n: int) -> list[tuple[int, int, bool]]:
        """(start, stop, quantized) runs of layers: --first_last_layers_bf16 keeps the ends in compute dtype, each
        run scanned separately (the quantized/bf16 choice is static, so one scan cannot switch it)."""
        if self.quant is None or self.quant.bf16_layers == (0, 0):
            return [(0, n, self.quant is not None)]
        first, last = self.quant.bf16_layers
        bounds = [(0, first, False), (first, n - last, True), (n - last, n, False)]
        return [b for b in bounds if b[1] > b[0]]

    def hidden_states(self, tokens, positions=None, segment_ids=None):
        """The final-norm output [B, T, D] in compute dtype."""
        if positions is None:
            positions = default_positions(tokens)
        x = self.embed_tokens(tokens, positions)
        return self.final_norm(self.run_layers(x, positions, segment_ids))

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
        out = self.embed.attend(h) if not self.cfg.untie_embeddings_and_output_weights else self.lm_head(h)
        return constrain(out.astype(jnp.float32), ("batch", "seq", "vocab"))

    def __call__(self, tokens, positions=None, segment_ids=None):
        return self.logits(self.hidden_states(tokens, positions, segment_ids))
