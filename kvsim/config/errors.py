"""The one error type for bad input: the CLI prints it on one line and exits with 2."""

from __future__ import annotations

import re


def _one_line(text: str) -> str:
    """Control characters (a line break in a key, say) shown escaped, never raw."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], text)


class InputError(Exception):
    """Bad user input, located: `source` is a file (or 'command line'), `field` a key,
    column or line, and the message says what is allowed."""

    def __init__(self, source: str, field: str, message: str):
        source, field, message = (_one_line(str(x)) for x in (source, field, message))
        super().__init__(f"{source}: {field}: {message}")
        self.source, self.field, self.message = source, field, message

    def __reduce__(self):
        """Pickled as its three parts (a worker process hands it back: kvsim.sim.parallel)."""
        return InputError, (self.source, self.field, self.message)


def positive_number(text: str, src: str, field: str, message: str) -> float:
    """`text` as a positive finite number, else InputError(src, field, message)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):  # NaN fails the first test
        raise InputError(src, field, message)
    return value
