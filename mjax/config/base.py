"""What every config section is built from: the error type and the field helper."""

import dataclasses


class ConfigError(ValueError):
    """A configuration mistake; the message names the flag to change."""


def field(default, flag: str | None = None, help: str = ""):
    """A config field; `flag` is a short Megatron-style alias of its dotted flag name."""
    meta = {"help": help}
    if flag:
        meta["flag"] = flag
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)
