"""Activation bytes a layout keeps for the backward, from the residuals JAX's autodiff saves when it traces the real
model under the run's recomputation policy (nothing is compiled or allocated): the model is traced as one device
of the layout sees it (heads, KV heads, FFN and vocab split over tp, experts over ep, the sequence over cp), at
one and at two sequences: what grows with the batch scales with the micro-batch size; the rest (the compute-dtype
copies of the weights the backward multiplies by) is kept once, whatever the micro-batch."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals (same traversal)

from mjax.kernels.attention import dot_product_attention
from mjax.model import build_model
from mjax.model.moe import MoE
from mjax.model.transformer import STACKS
from mjax.parallel.remat import LayerRunner
from mjax.sharding import single_device


@dataclasses.dataclass(frozen=True)
class Residuals:
    stream: int  # bytes per sequence of tensors [.., seq, hidden] (the residual stream)
    other: int  # bytes per sequence of everything else that grows with the batch
    fixed: int  # bytes kept whatever the batch (weights cast to the compute dtype)
    layer_weights: int  # bytes of the stacked layers' params the backward reads as they are (not cast: state)

    @property
    def per_sequence(self) -> int:
        return self.stream + self.other


def routed_sequence_share(cfg) -> int:
    """The sequence is split this many ways for MoE routing: cp, each context-parallel rank routing its own tokens
    (token_dispatcher.py's shard_map, manual over the sequence's context axes), except for FP8 experts all local
    (no ep): their dispatch groups split the batch only, so a context-parallel rank routes whole sequences."""
    p = cfg.parallel
    folded = p.expert_tensor_parallel_size not in (None, p.tp)
    split = p.ep * (p.tp if folded else 1) > 1
    return p.cp if split or cfg.precision.fp8_recipe is None else 1


def local_model(cfg):
    """The model config one device of the layout computes: its share of heads, KV heads, FFN, vocab and experts."""
    m, p = cfg.model, cfg.parallel
    tp = p.tp
    etp = tp if p.expert_tensor_parallel_size in (None, tp) else 1
    kv = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1  # fewer KV heads than tp: each device one
    changes = dict(num_attention_heads=m.num_attention_heads // tp, num_query_groups=kv, kv_channels=m.head_dim,
                   ffn_hidden_size=m.ffn_hidden_size // tp, vocab_size=m.padded_vocab_size() // tp,
                   make_vocab_size_divisible_by=1)
    if m.num_experts:
        # each device's experts compute on a receive buffer of ep blocks, each as large as one device's routed
        # rows (token_dispatcher.py: exact, never dropping): a local trace routing each token to top-k x ep of its
        # experts has as many rows; the trace holds seq / cp positions, a rank routes cp / share times as many.
        rows = m.moe_router_topk * p.ep * p.cp // routed_sequence_share(cfg)
        changes.update(num_experts=max(m.num_experts // p.ep, rows), moe_router_topk=rows,
                       moe_ffn_hidden_size=(m.moe_ffn_hidden_size or m.ffn_hidden_size) // etp)
        if m.moe_shared_expert_intermediate_size:
            changes["moe_shared_expert_intermediate_size"] = m.moe_shared_expert_intermediate_size // tp
        changes.update(moe_router_num_groups=None, moe_router_group_topk=None)
    return dataclasses.replace(m, **changes)


def _saved_bytes(model, params, batch: int, seq: int, hidden: int) -> tuple[int, int, int]:
    """(bytes of [.., seq, hidden] residuals, bytes of the others, bytes of the stacked layers' params read as they
    are) the backward of `batch` sequences keeps."""
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def hidden_sum(p, t):
        out = model.apply(p, t)
        return jnp.sum((out[0] if isinstance(out, tuple) else out).astype(jnp.float32))

    with single_device():  # the local model is one device's share: no mesh axis splits it further
        saved = saved_residuals(hidden_sum, params, tokens)
    stream = other = weights = 0
    for aval, source in saved:
        n = aval.size * aval.dtype.itemsize
        if "from the argument" in source:  # the weights themselves: counted as state
            weights += n if any(f"p['{k}']" in source for k in STACKS) else 0
        elif aval.shape and aval.shape[-1] == hidden and seq in aval.shape:
            stream += n
        else:
            other += n
    return stream, other, weights


def _checkpointed_dispatch(layer, x, logits):
    """The MoE dispatch region recomputed in the backward, as token_dispatcher.py runs it inside a pipeline stage."""
    return jax.checkpoint(lambda x, logits: MoE.route_and_dispatch(layer, x, logits))(x, logits)


def _checkpointed_attention(q, k, v, **options):
    """Core attention recomputed in the backward, as context_parallel.py runs it inside a pipeline stage."""
    return jax.checkpoint(functools.partial(dot_product_attention, **options))(q, k, v)


@functools.lru_cache(maxsize=1024)
def _residuals(model_cfg, precision, execution, seq: int, nested_moe: bool = False,
               nested_attention: bool = False) -> Residuals:
    """nested_*: the region runs in a shard_map nested in the pipeline's, which JAX cannot lower with saved
    residuals, so the code checkpoints it (its inputs are kept, the rest recomputed)."""
    attention = functools.partial(_checkpointed_attention if nested_attention else dot_product_attention,
                                  deterministic=execution.deterministic_mode)  # the kernel training would choose
    model = build_model(model_cfg, precision, execution, LayerRunner(execution),
                        _checkpointed_dispatch if nested_moe else None, attention)
    params = model.abstract_params()
    one, two = (_saved_bytes(model, params, b, seq, model_cfg.hidden_size) for b in (1, 2))
    stream, other = two[0] - one[0], two[1] - one[1]
    return Residuals(stream, other, one[0] + one[1] - stream - other, one[2])


def residuals(cfg, checkpointed: bool = True) -> Residuals:
    """Residual bytes on one device of the layout, per sequence (seq / cp positions) and fixed. checkpointed=False:
    as if no region were checkpointed for nesting (what a recomputed layer holds)."""
    nested = nested_regions(cfg) if checkpointed else (False, False)
    return _residuals(local_model(cfg), cfg.precision, cfg.execution, cfg.train.seq_length // cfg.parallel.cp,
                      *nested)


def nested_regions(cfg) -> tuple[bool, bool]:
    """(MoE dispatch, core attention): whether the layout runs it in a shard_map nested in the pipeline's (expert
    and context parallelism inside a pipeline stage), and so recomputes it in the backward."""
    m, p = cfg.model, cfg.parallel
    return p.pp > 1 and bool(m.num_experts) and p.ep > 1, p.pp > 1 and p.cp > 1


def model_activation_bytes(cfg, micro_batch_size: int, checkpointed: bool = True) -> tuple[int, int]:
    """(bytes one micro-batch's forward keeps for its backward over all layers on one device (no pipeline), of
    which fixed: kept once whatever the number of micro-batches in flight). checkpointed: as residuals()."""
    r = residuals(cfg, checkpointed)
    # Sequence parallelism does not shrink them: XLA keeps each block's all-gathered input [seq, hidden] for the
    # weight gradient (measured on tests/integration/test_plan_memory.py's tp2 + SP layout: dividing the residual
    # stream by tp under-predicts it by 19%, keeping it whole matches)
    return micro_batch_size * r.per_sequence + r.fixed, r.fixed
