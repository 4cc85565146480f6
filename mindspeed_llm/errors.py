"""The errors a user can fix, in one leaf module (no imports): the command-line entry points turn every
`UserError` into one line naming the flag or file and the fix, without a traceback (`posttrain_gpt.py`)."""


class UserError(Exception):
    """A mistake in the command line, the data or the checkpoints; the message names the thing and the fix."""


class ArgumentError(UserError, ValueError):
    """An invalid or inconsistent command line; the message names the flags and the fix."""
