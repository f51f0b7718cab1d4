"""On-disk formats both training and conversion read: params-only checkpoints (params.py) and the step
directories of a training run (steps.py). Below both, so conversion needs no trainer."""


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted; the message names the tensor, key or architecture.
    The scripts exit with code 4 (an unusable checkpoint) on it."""


class InputError(ConversionError):
    """Bad input rather than a bad checkpoint: a path that does not exist, a flag value, an --output that already
    holds a model, a tokenizer that cannot be written. The scripts exit with code 2 on it."""


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a/b/c": leaf}."""
    out = {}
    for k, v in tree.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, path + "/"))
        else:
            out[path] = v
    return out


def unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, v in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree
