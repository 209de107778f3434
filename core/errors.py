"""The one base class for errors a user can cause (bad files, bad paths, bad options).

The CLI prints them as one line and exits 2; the service maps its own subclass
(``service.engine.RequestError``) to a 4xx naming the field. Anything else is a bug and keeps its
traceback.
"""


class UserError(ValueError):
    """Something the user gave cannot be used as given; the message says what and where."""
