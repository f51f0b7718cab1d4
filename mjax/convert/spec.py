"""The conversion mechanism: a model family is data (tables of tensor names and small two-way transforms).

A `Rule` ties one Hugging Face tensor to one or more mjax parameters (several when HF fuses them, e.g. GPT-2's
`c_attn` = Q, K, V). A `Transform` converts in both directions and states the HF shape it expects, so a wrong
checkpoint fails with the tensor's name instead of a reshape error. Rules whose mjax parameters the model does not
have (a bias the config turns off, `lm_head` when embeddings are tied, the dense stack of an all-MoE model) are
skipped.

Names containing `{i}` are per layer: their mjax parameters live in one stack of blocks, `layers/...` (the dense
blocks) or `moe_layers/...` (the MoE blocks), stacked on a leading axis in model order, and `{i}` runs over the HF
layer indices of that stack's kind only (ModelConfig.moe_layer_pattern()): with pattern [MoE, dense, MoE] a
`moe_layers/...` rule reads HF layers 0 and 2 into rows 0 and 1, a `layers/...` rule HF layer 1 into row 0. The
multi-token prediction depths (`mtp/...`, [depths, ...]) are the HF layers after the model's (DeepSeek-V3 numbers
them num_hidden_layers + k). Names that also contain `{j}` are per routed expert (one HF tensor per expert, as the
Hub stores them): their mjax parameters have a second stacked axis, [layers of the stack, experts, ...].

A rule with `repeated_in` set is a whole-model tensor that HF repeats in every layer of that stack (DeepSeek-V3's
MTP layers hold copies of the embedding and the output layer, which mjax shares): export writes the copies, import
checks that each equals the tensor it copies.
"""

import dataclasses
from collections.abc import Callable

import numpy as np

from mjax.storage import ConversionError, InputError, flatten, unflatten  # noqa: F401  (the conversion's own)

STACKS = ("layers", "moe_layers", "mtp")  # mjax's stacked blocks: dense, MoE (mjax.model.transformer), MTP depths


@dataclasses.dataclass(frozen=True)
class Dims:
    """Sizes the transforms need, and the layer layout, from a ModelConfig."""
    d: int  # hidden
    n: int  # query heads
    k: int  # KV heads
    h: int  # head dim
    f: int  # MLP hidden
    v: int  # vocab (tokenizer)
    vp: int  # padded vocab (mjax tables)
    moe_pattern: tuple[bool, ...]  # per HF layer: whether it is an MoE block
    e: int = 0  # routed experts per MoE layer
    rope: int = 0  # multi-latent attention: the RoPE dims of each query head and of the shared key
    mtp: int = 0  # multi-token prediction depths

    @classmethod
    def of(cls, m) -> "Dims":
        return cls(m.hidden_size, m.num_attention_heads, m.num_kv_heads, m.head_dim, m.ffn_hidden_size,
                   m.vocab_size, m.padded_vocab_size(), m.moe_layer_pattern(), m.num_experts or 0,
                   m.qk_pos_emb_head_dim if m.multi_latent_attention else 0, m.mtp_depth)

    @property
    def layers(self) -> int:
        return len(self.moe_pattern)

    def layer_indices(self, stack: str) -> list[int]:
        """The HF layer indices whose blocks stack `stack` holds, in order (row r of the stack is HF layer [r])."""
        if stack == "mtp":  # the depths follow the model's layers
            return list(range(self.layers, self.layers + self.mtp))
        moe = STACKS.index(stack) == 1
        return [i for i, is_moe in enumerate(self.moe_pattern) if is_moe == moe]


@dataclasses.dataclass(frozen=True)
class Transform:
    """HF array <-> tuple of mjax arrays (one per target; per layer for per-layer rules)."""
    name: str
    to_mjax: Callable[[np.ndarray, Dims], tuple]
    to_hf: Callable[[tuple, Dims], np.ndarray]
    hf_shape: Callable[[tuple, Dims], tuple]  # (mjax target shapes, dims) -> the HF shape


def _single(name, fwd, inv, shape):
    return Transform(name, lambda x, d: (fwd(x, d),), lambda ys, d: inv(ys[0], d), lambda s, d: shape(s[0], d))


def _pad_rows(x, rows):  # [V, ...] -> [rows, ...] with zero rows appended
    if x.shape[0] == rows:
        return x
    out = np.zeros((rows,) + x.shape[1:], x.dtype)
    out[: x.shape[0]] = x
    return out


IDENTITY = _single("identity", lambda x, d: x, lambda y, d: y, lambda s, d: s)
# torch Linear weight [out, in] <-> mjax kernel [in, out]
LINEAR = _single("linear", lambda x, d: x.T, lambda y, d: y.T, lambda s, d: s[::-1])
# q/k/v projection: [heads * head_dim, D] <-> [D, heads, head_dim]
HEADS_OUT = _single("heads_out", lambda x, d: x.T.reshape(x.shape[1], -1, d.h),  # [D, heads, H]
                    lambda y, d: y.reshape(y.shape[0], -1).T, lambda s, d: (s[1] * s[2], s[0]))
# o projection: [D, heads * head_dim] <-> [heads, head_dim, D]
HEADS_IN = _single("heads_in", lambda x, d: x.T.reshape(-1, d.h, x.shape[0]),  # [N, H, D]
                   lambda y, d: y.reshape(-1, y.shape[-1]).T, lambda s, d: (s[2], s[0] * s[1]))
# q/k/v bias: [heads * head_dim] <-> [heads, head_dim]
HEADS_BIAS = _single("heads_bias", lambda x, d: x.reshape(-1, d.h), lambda y, d: y.reshape(-1),
                     lambda s, d: (s[0] * s[1],))
# Conv1D (GPT-2) weights are already [in, out]: only the head axes are split or merged.
CONV_HEADS_OUT = _single("conv_heads_out", lambda x, d: x.reshape(x.shape[0], -1, d.h),  # [D, heads, H]
                         lambda y, d: y.reshape(y.shape[0], -1), lambda s, d: (s[0], s[1] * s[2]))
CONV_HEADS_IN = _single("conv_heads_in", lambda x, d: x.reshape(-1, d.h, x.shape[1]),  # [N, H, D]
                        lambda y, d: y.reshape(-1, y.shape[-1]), lambda s, d: (s[0] * s[1], s[2]))
# Embedding [V, D] <-> [padded V, D]: padded rows are zero on import and dropped on export.
EMBED = _single("embed", lambda x, d: _pad_rows(x, d.vp), lambda y, d: y[: d.v], lambda s, d: (d.v, s[1]))
# Output layer [V, D] <-> kernel [D, padded V]
LM_HEAD = _single("lm_head", lambda x, d: _pad_rows(x, d.vp).T, lambda y, d: y[:, : d.v].T, lambda s, d: (d.v, s[0]))


def fused(parts: tuple[Transform, ...], axis: int, sizes: Callable[[Dims], tuple]) -> Transform:
    """One HF tensor holding several mjax tensors side by side along `axis` of the HF layout (QKV, gate/up);
    `sizes(dims)` gives each part's extent along that axis."""

    def to_mjax(x, d):
        pieces = np.split(x, np.cumsum(sizes(d))[:-1], axis=axis)
        return tuple(p.to_mjax(piece, d)[0] for p, piece in zip(parts, pieces))

    def to_hf(ys, d):
        return np.concatenate([p.to_hf((y,), d) for p, y in zip(parts, ys)], axis=axis)

    def hf_shape(shapes, d):
        shape = list(parts[0].hf_shape((shapes[0],), d))
        shape[axis] = sum(sizes(d))
        return tuple(shape)

    return Transform("fused(" + ",".join(p.name for p in parts) + ")", to_mjax, to_hf, hf_shape)


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str  # HF tensor name; `{i}` marks a per-layer tensor, `{j}` (with `{i}`) a per-expert one
    mjax: tuple[str, ...]  # mjax parameter paths, "/"-separated ("layers/attn/q_proj/kernel")
    transform: Transform = IDENTITY
    repeated_in: str | None = None  # a whole-model tensor HF repeats in each layer of this stack (copies)

    def __post_init__(self):  # a malformed table is a programming error: fail when the module loads
        stacks = {p.split("/", 1)[0] for p in self.mjax}
        if self.repeated_in is not None:
            if not self.per_layer or self.per_expert or self.repeated_in not in STACKS or stacks & set(STACKS):
                raise ValueError(f"rule {self.hf!r}: a repeated tensor is per layer ({{i}}) of one of {STACKS} and "
                                 f"targets whole-model parameters: {self.mjax}")
        elif self.per_layer and (len(stacks) != 1 or not stacks <= set(STACKS)):
            raise ValueError(f"rule {self.hf!r}: per-layer targets must all be in one of {STACKS}: {self.mjax}")
        if self.per_expert and not self.per_layer:
            raise ValueError(f"rule {self.hf!r}: a per-expert name ({{j}}) must be per layer ({{i}}) too")

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.hf

    @property
    def stack(self) -> str | None:
        """The stack of blocks whose layers a per-layer rule's `{i}` runs over; None for a whole-model tensor."""
        if self.repeated_in is not None:
            return self.repeated_in
        return self.mjax[0].split("/", 1)[0] if self.per_layer else None

    @property
    def stacked_axes(self) -> int:
        """Leading axes of the mjax parameters that the rule's HF tensors are stacked on (layers, experts)."""
        return 0 if self.repeated_in is not None else int(self.per_layer) + int(self.per_expert)


def rule(hf: str, mjax: str | tuple[str, ...], transform: Transform = IDENTITY,
         repeated_in: str | None = None) -> Rule:
    return Rule(hf, (mjax,) if isinstance(mjax, str) else tuple(mjax), transform, repeated_in)


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its HF architectures, the tensor table and the config translation (both directions)."""
    name: str
    architectures: tuple[str, ...]
    rules: tuple[Rule, ...]
    config_from_hf: Callable[[dict], dict]  # HF config.json -> ModelConfig fields
    config_to_hf: Callable[[object], dict]  # ModelConfig -> HF config.json entries
    ignore: tuple[str, ...] = ()  # suffixes of HF tensors that hold no weights (e.g. causal-mask buffers)
    strip_prefixes: tuple[str, ...] = ()  # a name missing from the file is also looked up without these prefixes
    tied_output: str = "lm_head.weight"  # ignored when present in a tied model (HF ties it to the embedding)

    def active_rules(self, param_shapes: dict) -> list[Rule]:
        """The rules whose mjax targets the model has; a rule with only some of its targets is an error."""
        active = []
        for r in self.rules:
            present = [p in param_shapes for p in r.mjax]
            if all(present):
                active.append(r)
            elif any(present):
                missing = [p for p, ok in zip(r.mjax, present) if not ok]
                raise ConversionError(f"{self.name}: HF tensor {r.hf!r} maps to {', '.join(r.mjax)} but the model "
                                      f"config has no {', '.join(missing)}")
        covered = {p for r in active for p in r.mjax}
        unmapped = sorted(set(param_shapes) - covered)
        if unmapped:
            raise ConversionError(f"{self.name}: no HF tensor maps to mjax parameter(s) {', '.join(unmapped)}; "
                                  "this config is outside what the family's table covers")
        return active

    @staticmethod
    def hf_tensors(r: Rule, dims: Dims) -> list[tuple[tuple, str]]:
        """[(index into the stacked mjax arrays, HF name)] of a rule, in stacking order: () for a whole-model
        tensor, (row,) per layer of the rule's stack, (row, expert) per expert."""
        if not r.per_layer:
            return [((), r.hf)]
        layers = dims.layer_indices(r.stack)
        if not r.per_expert:
            return [((row,), r.hf.format(i=i)) for row, i in enumerate(layers)]
        return [((row, j), r.hf.format(i=i, j=j)) for row, i in enumerate(layers) for j in range(dims.e)]


# ---- config translation helpers (tables of (HF key, ModelConfig field, default)) ----

REQUIRED = object()


def read_keys(hf: dict, table, family: str) -> dict:
    """ModelConfig fields from HF config keys; a REQUIRED key that is absent is an error naming it."""
    out = {}
    for key, field, default in table:
        value = hf.get(key)
        if value is None:
            if default is REQUIRED:
                raise ConversionError(f"{family} config.json has no {key!r}")
            value = default
        out[field] = value
    return out


def write_keys(m, table) -> dict:
    return {key: getattr(m, field) for key, field, _ in table}


def check_values(hf: dict, table, family: str):
    """table: (HF key, allowed values, default when absent); anything else is unsupported, named in the error."""
    for key, allowed, default in table:
        value = hf.get(key, default)
        if value not in allowed:
            raise ConversionError(f"{family}: config.json {key}={value!r} is not supported (mjax supports "
                                  f"{' or '.join(repr(a) for a in allowed)})")


def check_fixed(m, fixed: dict, family: str):
    """Export: the mjax model must have the family's fixed features (e.g. Llama: rmsnorm, swiglu, rope)."""
    for field, want in fixed.items():
        if getattr(m, field) != want:
            raise ConversionError(f"cannot write model.{field}={getattr(m, field)!r} as {family} (it needs {want!r}); "
                                  "choose another --architecture")
