"""mjax: Megatron-style large-model training in JAX. `import mjax` stays light; heavy parts load on first use."""

__all__ = ["load_pretrained"]


def __getattr__(name):
    if name == "load_pretrained":  # mjax.load_pretrained(path) -> (model, config); see mjax.convert.pretrained
        from mjax.convert.pretrained import load_pretrained  # noqa: PLC0415

        return load_pretrained
    raise AttributeError(f"module 'mjax' has no attribute {name!r}")
