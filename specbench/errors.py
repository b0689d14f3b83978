"""User-facing errors: one line, no traceback (the CLI prints `error: <message>` and exits 2)."""


class SpecbenchError(Exception):
    """Bad input or a missing resource, with a message that says what to do about it."""


class MissingResource(SpecbenchError):
    """A file or package that is not on this machine (a data loader may then try the hub)."""
