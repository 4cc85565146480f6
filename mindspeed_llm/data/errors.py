"""Exception types of the data layer.

Every problem a user can fix (bad input file, unknown name, missing column, existing output,
missing dataset) is raised as a :class:`DataError` subclass with a message that says what is
wrong and how to fix it. ``preprocess_data.py`` prints these messages without a traceback and
exits non-zero; anything else is a bug and keeps its traceback.

The exceptions take a single message argument so they pickle cleanly across worker processes.
"""


from mindspeed_llm.errors import UserError


class DataError(UserError):
    """Base class for user-fixable data problems."""


class InputFormatError(DataError):
    """An input file cannot be read (malformed JSON, unsupported extension, wrong row type)."""


class MissingColumnError(DataError):
    """A column named by ``--map-keys`` / ``--dataset-additional-keys`` is not in the data."""


class UnknownNameError(DataError):
    """An unknown handler, prompt type, tokenizer type, map-keys role or config key."""


class OutputExistsError(DataError):
    """The output prefix already holds a dataset and ``--overwrite-cache`` was not given."""


class DatasetNotFoundError(DataError):
    """A preprocessed dataset is missing or incomplete at the given prefix."""


class NotEnoughPromptsError(DataError):
    """The dataset holds fewer prompts than one global batch."""


class OutputWriteError(DataError):
    """The output cannot be written (read-only location, disk full, bad ``--output-prefix``)."""
