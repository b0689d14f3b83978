"""User-facing errors: one line, no traceback (the CLI prints `error: <message>` and exits 2)."""


class SpecbenchError(Exception):
    """Bad input or a missing resource, with a message that says what to do about it."""
