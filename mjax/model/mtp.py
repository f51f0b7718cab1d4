"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2; Megatron's MultiTokenPredictionBlock):
--mtp_num_layers = D sequential depths after the model, depth k predicting at position t the token t + k + 1.

For k = 1..D, at every position t (all [B, T, D] but the concatenation):
    h'_k = eh_proj_k([enorm_k(Emb(token t + k)); hnorm_k(h_{k-1})])   [B, T, 2D] -> [B, T, D]
    h_k  = final_norm_k(block_k(h'_k))      block_k: one transformer layer of the model's last layer's kind
    logits_k = the model's output layer (h_k)
h_0 is the model's final-norm output, as Megatron's MTP block takes the decoder's output after its final layernorm
(hnorm normalises it again), and h_k is handed on after final_norm_k, as Megatron hands each depth's output on.
The embedding and the output layer are the model's own (shared, not copied); the concatenation puts the embedding
first, as Megatron and DeepSeek's released weights do. The block's attention sees positions t (RoPE, documents)
like the model's layers; which tokens are k ahead, and which positions have no target, training decides
(mjax/train/mtp.py).
"""

import jax.numpy as jnp
from flax import nnx

from mjax.model.layers import Linear, make_norm
from mjax.sharding import constrain

RESIDUAL = ("batch", "residual_seq", "act_embed")  # the residual stream's layout, as in mjax.model.transformer
DEPTHS = "mtp_layers"  # the logical axis the depths are stacked on (replicated: no mesh axis)


class MTPLayer(nnx.Module):
    """One depth: the two norms, the projection eh_proj [2D, D], a block and the norm before the shared head."""

    def __init__(self, cfg, block_cls, *, moe: bool, dtype, param_dtype, quant=None, rngs: nnx.Rngs, **block_kwargs):
        d = cfg.hidden_size
        self.enorm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)
        self.hnorm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)
        # Replicated over tensor, like MLA's low-rank projections: 2 D^2 per token beside a block's far larger GEMMs.
        self.eh_proj = Linear((2 * d,), (d,), in_axes=(None,), out_axes=("embed",), std=cfg.init_method_std,
                              dtype=dtype, param_dtype=param_dtype, quant=quant, rngs=rngs)
        self.block = block_cls(cfg, dtype=dtype, param_dtype=param_dtype, quant=quant, moe=moe, rngs=rngs,
                               **block_kwargs)
        self.final_norm = make_norm(cfg, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, h, emb, positions, segment_ids, moe_key=None):
        """h [B, T, D] (the previous depth's output), emb [B, T, D] (the embeddings of the tokens k ahead) ->
        (h_k [B, T, D], the block's MoE stats or None)."""
        x = jnp.concatenate([self.enorm(emb), self.hnorm(h)], axis=-1)  # [B, T, 2D]
        x = constrain(self.eh_proj(x), RESIDUAL)  # [B, T, 2D] -> [B, T, D]
        x, stats, _ = self.block(x, positions, segment_ids, moe_key)
        return self.final_norm(x), stats


class MultiTokenPrediction(nnx.Module):
    """The D depths, their params stacked on a leading `mtp_layers` axis [D, ...] and run as one layer stack."""

    def __init__(self, cfg, block_cls, *, moe: bool, quant=None, rngs: nnx.Rngs, **kwargs):
        self.quant = quant

        @nnx.split_rngs(splits=cfg.mtp_depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return MTPLayer(cfg, block_cls, moe=moe, quant=quant, rngs=rngs, **kwargs)

        self.layers = make(rngs)
        for _, var in nnx.iter_graph(self.layers):  # the stacked params gain the leading depth axis
            if isinstance(var, nnx.Variable):
                var.set_metadata("logical_axes", (DEPTHS,) + var.get_metadata()["logical_axes"])

    def __call__(self, h, embeddings, positions, segment_ids, runner, moe_keys=None):
        """h [B, T, D]: the model's final-norm output; embeddings [D, B, T, D]: depth k's embeddings of the tokens
        k ahead. runner: the model's layer runner (remat, scan). -> (every depth's output [D, B, T, D], the MoE
        stats stacked [D, ...] or None). Quantized layers stay quantized at every depth (Megatron runs its MTP
        layers in the global FP8 context, whatever --first_last_layers_bf16 keeps)."""
        graphdef, state = nnx.split(self.layers)

        def depth(h, xs):
            layer_state, emb, key = xs
            h, stats = nnx.merge(graphdef, layer_state)(h, emb, positions, segment_ids, key)
            return h, (h, stats)

        extra = self.quant.remat_keeps if self.quant is not None else ()
        _, (hs, stats) = runner(depth, h, (state, embeddings, moe_keys), extra)
        return hs, stats
