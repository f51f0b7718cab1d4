"""Megatron-LM's command-line spelling, translated to mjax flags before absl parses them.

`--tensor-model-parallel-size 2` becomes `--tp=2`, `--recompute-activations` becomes `--remat_policy=selective`,
any `--foo-bar` that names an mjax flag `--foo_bar`, a Megatron `--no-foo-bar` the absl `--nofoo_bar`, and
`--data-path 0.3 a 0.7 b` (several values) one `--data_path="0.3 a 0.7 b"`. Megatron flags with no mjax meaning
are left alone, so absl reports them as unknown (the CLI names the closest mjax flag).
"""

# Megatron name (underscores) -> (mjax flag, value map or fixed value). A value map maps Megatron's spellings of
# the value to mjax's (others pass through lower-cased); a fixed value is for Megatron switches without a value.
RENAMED = {
    "tensor_model_parallel_size": ("tp", None),
    "pipeline_model_parallel_size": ("pp", None),
    "context_parallel_size": ("cp", None),
    "expert_model_parallel_size": ("ep", None),
    "num_virtual_stages_per_pipeline_rank": ("vpp", None),
    "recompute_granularity": ("remat_policy", None),
    "recompute_activations": ("remat_policy", "selective"),
    "swiglu": ("activation", "swiglu"),
    "disable_bias_linear": ("add_bias_linear", "false"),
    "use_rope_scaling": ("rope_scaling", "llama3"),
    "rotary_scaling_factor": ("rope_scaling_factor", None),
    "finetune": ("load_params_only", "true"),
    "cross_entropy_loss_fusion": ("cross_entropy_impl", "fused"),
    "attention_backend": ("attention_impl", {"flash": "pallas", "fused": "cudnn", "unfused": "xla", "local": "xla"}),
    "normalization": ("normalization", {"rmsnorm": "rmsnorm", "layernorm": "layernorm"}),
    "position_embedding_type": ("position_embedding_type", {"learned_absolute": "learned"}),
    "lr_decay_style": ("lr_decay_style", None),
    "tokenizer_type": ("tokenizer_type", None),
}
# Switches that only restate what other flags already say: accepted, and checked to mean what they claim (the
# switch -> the flags, alias and dotted name, that set the field it implies).
IMPLIED = {"group_query_attention": ("num_query_groups", "model.num_query_groups")}
MULTI_VALUE = {"data_path", "hierarchical_context_parallel_sizes"}  # Megatron takes these as several space-separated values
LOWERCASE = {"remat_policy", "normalization", "position_embedding_type", "lr_decay_style", "attention_impl"}


def _split(token: str) -> tuple[str, str | None]:
    name, eq, value = token[2:].partition("=")
    return name, (value if eq else None)


def _values(argv: list[str], i: int, many: bool) -> tuple[str | None, int]:
    """The value tokens after position i (one, or all up to the next flag when `many`) and the next position."""
    values = []
    while i < len(argv) and not argv[i].startswith("--") and (many or not values):
        values.append(argv[i])
        i += 1
    return (" ".join(values) if values else None), i


def translate(argv: list[str], is_flag, is_bool) -> tuple[list[str], list[str]]:
    """(argv with Megatron spellings replaced, the IMPLIED switches seen). is_flag(name) / is_bool(name) tell
    whether an mjax flag of that name exists and whether it is a boolean."""
    out, implied, i = list(argv[:1]), [], 1
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--") or token == "--":
            out.append(token)
            continue
        name, value = _split(token)
        under = name.replace("-", "_")
        if under in IMPLIED:
            implied.append(under)
        elif under in RENAMED:
            target, mapping = RENAMED[under]
            if isinstance(mapping, str):  # a switch: its value is fixed
                out.append(f"--{target}={mapping}")
                continue
            if value is None and not is_bool(target):
                value, i = _values(argv, i, many=False)
            if value is not None:
                value = value.lower() if target in LOWERCASE else value
                value = (mapping or {}).get(value, value)
            out.append(f"--{target}" + ("" if value is None else f"={value}"))
        elif under.startswith("no_") and not is_flag(under) and is_flag(under[3:]) and is_bool(under[3:]):
            out.append(f"--no{under[3:]}")
        elif under in MULTI_VALUE and value is None:
            value, i = _values(argv, i, many=True)
            out.append(f"--{under}" + ("" if value is None else f"={value}"))
        elif under != name and is_flag(under):  # a hyphenated mjax flag
            out.append(f"--{under}" + ("" if value is None else f"={value}"))
        else:
            out.append(token)
    return out, implied
