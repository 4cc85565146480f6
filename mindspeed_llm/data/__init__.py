"""Data layer: preprocessing raw instruction data and the prompt dataset the RL stages read.

* :mod:`~mindspeed_llm.data.preprocess`   -- ``preprocess_data.py`` (flags, workers, YAML configs)
* :mod:`~mindspeed_llm.data.handlers`     -- handler registry (``--handler-name``), ``--map-keys``
* :mod:`~mindspeed_llm.data.templates`    -- chat templates (``--prompt-type``), configs/model/templates.json
* :mod:`~mindspeed_llm.data.writer`       -- output file scheme (indexed datasets + manifest)
* :mod:`~mindspeed_llm.data.prompt_dataset` -- :class:`PromptDataset`, :class:`PromptSampler`,
  :class:`PromptDataLoader`

Importing this package loads neither torch nor transformers nor megatron; they are imported
when a dataset is written or read.
"""
from mindspeed_llm.data.errors import (
    DataError,
    DatasetNotFoundError,
    InputFormatError,
    MissingColumnError,
    NotEnoughPromptsError,
    OutputExistsError,
    OutputWriteError,
    UnknownNameError,
)
from mindspeed_llm.data.handlers import HANDLERS, IGNORE_INDEX, get_handler_class, register_handler
from mindspeed_llm.data.prompt_dataset import PromptDataLoader, PromptDataset, PromptSampler
from mindspeed_llm.data.templates import ChatTemplate, get_template, load_templates

__all__ = [
    "ChatTemplate", "DataError", "DatasetNotFoundError", "HANDLERS", "IGNORE_INDEX", "InputFormatError",
    "MissingColumnError", "NotEnoughPromptsError", "OutputExistsError", "OutputWriteError", "PromptDataLoader",
    "PromptDataset",
    "PromptSampler", "UnknownNameError", "get_handler_class", "get_template", "load_templates",
    "register_handler",
]
