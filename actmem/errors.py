"""The one exception type a user can cause."""


class SpecError(ValueError):
    """A constraint on the model or the run failed.

    The message names the constraint and the numbers (``t (3) must divide heads
    (128)``); the CLI prints it as one line and exits with code 2.
    """
