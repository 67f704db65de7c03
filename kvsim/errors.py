"""The one error type for bad input: the CLI prints it on one line and exits with 2."""
from __future__ import annotations


class InputError(Exception):
    """Bad user input, located: `source` is a file (or 'command line'), `field` a key,
    column or line, and the message says what is allowed."""

    def __init__(self, source: str, field: str, message: str):
        super().__init__(f"{source}: {field}: {message}")
        self.source, self.field, self.message = source, field, message
