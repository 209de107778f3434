"""The base classes for errors that are not bugs: what a user can cause (bad files, paths, options),
and an outage of something the product depends on.

The CLI prints either as one line: a ``UserError`` exits 2 (usage), an ``Unavailable`` exits 69
(sysexits' EX_UNAVAILABLE: retry later, nothing to fix in the command). The service maps its own
``UserError`` subclass (``paraseek.service.engine.RequestError``) to a 4xx naming the field and an
``Unavailable`` to 503 with Retry-After. Anything else is a bug and keeps its traceback.
"""

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69


class UserError(ValueError):
    """Something the user gave cannot be used as given; the message says what and where."""


class Unavailable(RuntimeError):
    """A service the command depends on (a vector database) did not answer: not the user's mistake."""
