"""The error every attention implementation raises for a call it cannot do."""


class AttentionUnsupported(ValueError):
    """The requested attention implementation cannot do this call; the message names the option to change."""
