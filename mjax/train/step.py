"""The train step `(state, batch) -> (state, metrics)`: micro-batch gradient accumulation, fp16 loss scaling,
global-norm clipping, and updates that are never applied when the loss or gradients are not finite."""

import jax
import jax.numpy as jnp
import optax

from mjax.kernels import cross_entropy
from mjax.model import moe_terms
from mjax.parallel import pipeline
from mjax.parallel.pipeline_head import Head
from mjax.train import fp8_state, mtp
from mjax.train.state import TrainState


def hidden_states(model, params, micro, use_segments: bool, fp8=None, moe_keys=None):
    """(bound module, final hidden states [B, T, D], MoE stats) of one micro-batch. Segment ids reach attention only
    when documents are masked from each other (--reset_attention_mask), so plain causal runs keep fast kernels.
    fp8: the FP8 scales (TrainState.fp8.scales) when the model has FP8 layers."""
    module = model.bind(params, fp8 or None)
    segments = micro.get("segment_ids") if use_segments else None
    h, stats, _ = module.forward(micro["inputs"], micro.get("positions"), segments, moe_keys)
    return module, h, stats


@jax.named_scope("loss")
def head_sums(module, h, micro, model_cfg, execution, z_loss_coeff: float):
    """(loss sum, z-loss sum) over a micro-batch's unmasked tokens, from the final hidden states [B, T, D], by
    --cross_entropy_impl (mjax.kernels.cross_entropy)."""
    return cross_entropy.loss_sums(h, micro["targets"], micro["loss_mask"], impl=execution.cross_entropy_impl,
                                   vocab_size=model_cfg.vocab_size, z_loss_coeff=z_loss_coeff,
                                   chunk=execution.cross_entropy_chunk, compute_dtype=module.dtype,
                                   logits_fn=module.logits, output_layer=module.output_layer())


def make_train_step(model, cfg, tx, schedule):
    """`batch` arrays are [micro-batches, batch, seq]; the loss is the mean over every unmasked token of the step,
    so accumulating micro-batches gives exactly the large-batch gradient."""
    precision, z_coeff, clip = cfg.precision, cfg.train.z_loss_coeff, cfg.optimizer.clip_grad
    fp16 = precision.compute_dtype == "float16"
    dynamic_scale = fp16 and precision.loss_scale is None
    stop_on_nonfinite = cfg.train.on_nonfinite == "stop"
    use_segments = cfg.data.reset_attention_mask

    def micro_sums(module, h, micro):  # (loss sum, z sum); also the start of the pipeline head (last_stage_sums)
        return head_sums(module, h, micro, cfg.model, cfg.execution, z_coeff)

    depth = cfg.model.mtp_depth
    main_moe = cfg.model.moe_layer_pattern().count(True)
    num_moe = main_moe + (depth if depth and cfg.model.mtp_is_moe() else 0)  # the MTP blocks' MoE layers last

    def micro_loss(params, fp8_scales, micro, denom, scale, moe_carry, mtp_denoms):
        counts, m, keys, num_micro = moe_carry
        main_keys, mtp_keys = (None, None) if keys is None else (
            keys[:main_moe], keys[main_moe:] if cfg.model.mtp_is_moe() else None)  # dense MTP blocks: no keys
        module, h, stats = hidden_states(model, params, micro, use_segments, fp8_scales, main_keys)
        total, z = micro_sums(module, h, micro)
        objective = total * scale / denom
        sums = {}
        if depth:  # multi-token prediction (train/mtp.py); its MoE blocks' stats join the model's
            depth_sums, mtp_stats = mtp.loss_sums(module, h, micro, cfg, use_segments, moe_keys=mtp_keys)
            objective = objective + scale * mtp.objective(depth_sums, mtp_denoms, cfg.model)
            sums["mtp_loss_sums"] = jax.lax.stop_gradient(depth_sums)
            if mtp_stats is not None:
                stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats) if stats else mtp_stats
        if stats:  # the MoE layers' load-balancing and router z-loss terms (model/moe_terms.py)
            terms, counts, moe_sums = moe_terms.objective(stats, cfg.model, counts, m)
            objective = objective + scale * terms / num_micro
            sums.update(moe_sums)
        return objective, (total, z, counts, sums)

    def last_stage_sums(module, h, micro, embedded):  # what the pipeline's head computes (parallel/pipeline_head.py)
        total, z = micro_sums(module, h, micro)
        terms, sums = {"loss": total}, {"z": z}
        if depth:  # the MTP depths run where the loss runs; embedded: their lookups, made outside the stages
            terms["mtp"], stats = mtp.loss_sums(module, h, micro, cfg, use_segments, embedded)
            if stats is not None:  # no running counts, as in the stages: global_aux_loss is refused with --pp > 1
                counts = moe_terms.zero_counts(stats["router_topk_count"].sum(-2).shape)
                terms["mtp_moe"], _, moe_sums = moe_terms.objective(stats, cfg.model, counts, jnp.zeros((), jnp.int32))
                sums.update(moe_sums)
        return terms, sums

    pipeline_head = Head(last_stage_sums, (lambda module, micro: mtp.embeddings(module, micro, cfg, use_segments))
                         if depth else None)

    @jax.named_scope("optimizer")
    def optimizer_update(state, grads, grad_norm, moe_sums):  # (new params, new optimizer state)
        if clip > 0:
            factor = jnp.minimum(1.0, clip / (grad_norm + 1e-6))
            grads = jax.tree.map(lambda g: g * factor, grads)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        if num_moe:
            kept = moe_sums["kept_tokens_per_expert"]  # [MoE layers, E]: the model's, then the MTP blocks'
            new_params = moe_terms.update_expert_bias(new_params, kept[:main_moe], cfg.model)
            new_params = mtp.update_expert_bias(new_params, kept[main_moe:], cfg.model)
        return new_params, new_opt

    def moe_zeros():  # the MoE carry of the accumulation: running top-k counts, the step's router (and MTP) sums
        sums = {"mtp_loss_sums": jnp.zeros((depth,))} if depth else {}
        if not num_moe:
            return jnp.zeros(()), sums
        e = cfg.model.num_experts
        sums.update({"moe_aux_loss": jnp.zeros(()), "moe_z_loss": jnp.zeros(()), "dropped_assignments": jnp.zeros(()),
                     "tokens_per_expert": jnp.zeros((num_moe, e)), "kept_tokens_per_expert": jnp.zeros((num_moe, e))})
        return moe_terms.zero_counts((num_moe, e)), sums

    def step(state: TrainState, batch):
        num_micro = batch["inputs"].shape[0]
        denom = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
        mtp_denoms = mtp.denominators(batch, depth, cfg.parallel.cp, use_segments) if depth else None
        scale = state.loss_scale.scale if fp16 else jnp.ones((), jnp.float32)
        # The FP8 scales' "gradients" are the amaxes each layer observed (kernels/quant/fp8.py): max over micro-batches.
        fp8_scales = state.fp8.scales if state.fp8 is not None else {}
        grad_fn = jax.grad(micro_loss, argnums=(0, 1), has_aux=True)

        def accumulate(carry, xs):
            grads, amaxes, loss_sum, z_sum, counts, moe_sums = carry
            micro, m = xs
            keys = (moe_terms.router_keys(state.rng, state.step, m, num_moe)
                    if cfg.model.moe_router_force_load_balancing else None)
            (g, a), (l, z, counts, sums) = grad_fn(state.params, fp8_scales, micro, denom, scale,
                                                   (counts, m, keys, num_micro), mtp_denoms)
            return (jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.maximum, amaxes, a), loss_sum + l,
                    z_sum + z, counts, jax.tree.map(jnp.add, moe_sums, sums)), None

        pipeline_metrics = {}
        if cfg.parallel.pp > 1:  # the micro-batches stream through pipeline stages instead
            weights = {"loss": scale / denom}  # of each term of last_stage_sums, as micro_loss weighs them
            if depth:
                weights["mtp"] = scale * mtp.depth_weights(mtp_denoms, cfg.model)
                if cfg.model.mtp_is_moe():
                    weights["mtp_moe"] = scale / num_micro
            stage_batch = mtp.with_ahead(batch, depth, cfg.parallel.cp, use_segments) if depth else batch
            grads, amaxes, (terms, sums), pipeline_metrics["pipeline_bubble"], moe_sums = pipeline.loss_and_grads(
                model, cfg.parallel, state.params, stage_batch, pipeline_head, weights, use_segments,
                scale / num_micro, fp8_scales)
            loss_sum, z_sum = terms["loss"], sums.pop("z")
            moe_sums = moe_terms.concat_sums(moe_sums, sums)  # the MTP blocks' after the model's MoE layers
            if depth:
                moe_sums["mtp_loss_sums"] = terms["mtp"]
        else:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
            counts, moe_sums = moe_zeros()
            init = (zeros, jax.tree.map(jnp.zeros_like, fp8_scales), jnp.zeros((), jnp.float32),
                    jnp.zeros((), jnp.float32), counts, moe_sums)
            (grads, amaxes, loss_sum, z_sum, _, moe_sums), _ = jax.lax.scan(
                accumulate, init, (batch, jnp.arange(num_micro)))
        grads = jax.tree.map(lambda g: g / scale, grads)

        loss = loss_sum / denom
        grad_norm = optax.tree.norm(grads)
        moe_metrics = moe_terms.metrics(moe_sums, num_micro) if num_moe else {}
        mtp_metrics = mtp.metrics(moe_sums["mtp_loss_sums"], mtp_denoms) if depth else {}
        loss_finite = jnp.isfinite(loss)
        finite = loss_finite & jnp.isfinite(grad_norm)

        # An fp16 overflow with dynamic scaling is routine (skip and shrink the scale); any other NaN/Inf is recorded,
        # and with on_nonfinite=stop no update is applied from then on (the loop raises at its next check).
        bad = ~loss_finite if dynamic_scale else ~finite
        first_bad = jnp.where((state.first_nonfinite_step < 0) & bad, state.step, state.first_nonfinite_step)
        apply = finite & ~(stop_on_nonfinite & (first_bad >= 0))

        @jax.named_scope("optimizer")
        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)

        new_fp8, fp8_stats = state.fp8, {}
        if state.fp8 is not None:  # a skipped step's amaxes are not trusted: the FP8 state is kept like the params
            new_fp8, fp8_stats = fp8_state.update(state.fp8, amaxes, precision)
            new_fp8 = keep(new_fp8, state.fp8)
        new_params, new_opt = optimizer_update(state, grads, grad_norm, moe_sums)
        new_state = state.replace(
            step=state.step + 1, params=keep(new_params, state.params), opt_state=keep(new_opt, state.opt_state),
            loss_scale=state.loss_scale.update(finite, precision, dynamic_scale),
            first_nonfinite_step=first_bad, skipped_steps=state.skipped_steps + (~apply).astype(jnp.int32),
            fp8=new_fp8)
        metrics = {"loss": loss, "grad_norm": grad_norm, "z_loss": z_sum / denom, "num_tokens": denom,
                   "loss_scale": state.loss_scale.scale, "update_applied": apply,
                   "lr": schedule(state.step - state.skipped_steps), **fp8_stats, **pipeline_metrics, **moe_metrics,
                   **mtp_metrics}
        return new_state, metrics

    return step


def make_eval_step(model, cfg):
    def masked_sums(module, h, batch):  # (loss sum, token count) from the final hidden states [B, T, D]
        return head_sums(module, h, batch, cfg.model, cfg.execution, 0.0)[0], jnp.sum(batch["loss_mask"])

    def last_stage_sums(module, h, batch, _):  # the pipeline's head: nothing to differentiate
        loss_sum, count = masked_sums(module, h, batch)
        return {}, {"loss": loss_sum, "count": count}

    def eval_step(params, batch, fp8=None):  # batch: [batch, seq]; fp8: TrainState.fp8.scales with FP8 layers
        if cfg.parallel.pp > 1:  # through the stages, rather than gathering every layer onto every device
            _, sums = pipeline.loss_sums(model, cfg.parallel, params, batch, Head(last_stage_sums),
                                         cfg.data.reset_attention_mask)
            return sums["loss"], sums["count"]
        module, h, _ = hidden_states(model, params, batch, cfg.data.reset_attention_mask, fp8)
        return masked_sums(module, h, batch)

    return eval_step
