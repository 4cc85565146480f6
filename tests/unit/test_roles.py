"""`rl/roles.py` without a checkpoint: what of a trained model's state --offload-train-* sends to host memory, the
vocabulary check across the roles and the tokenizer, and a frozen model. (Loading models by role, with the model flags
checked against the checkpoint: tests/unit/test_mindspeed_flags.py, tests/dist/test_stages*.py.)"""

from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.roles import check_vocab, frozen, offload_parts
from mindspeed_llm.rl.settings import OffloadSettings


@pytest.mark.parametrize("flags,name,parts", [
    ({}, "actor", ()),
    ({"offload_train_optimizer": True}, "actor", ("moments",)),
    ({"offload_train_grad": True, "offload_train_param": True}, "actor", ("grads", "masters")),
    # the critic's weights do not generate: they wait in host memory too
    ({"offload_train_param": True}, "critic", ("masters", "weights")),
    ({"offload_train_optimizer": True, "offload_train_grad": True, "offload_train_param": True}, "critic",
     ("moments", "grads", "masters", "weights")),
])
def test_offload_parts_by_flag_and_role(flags, name, parts):
    assert offload_parts(OffloadSettings(**flags), name) == parts


class _Model:
    def __init__(self, vocab_size):
        self.model_spec = SimpleNamespace(vocab_size=vocab_size)


class _Tokenizer:
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size


def test_check_vocab_names_the_roles_that_disagree_and_a_tokenizer_too_large():
    check_vocab({"actor": _Model(256), "reference": _Model(256), "reward": None}, _Tokenizer(256))
    check_vocab({"actor": _Model(256)}, _Tokenizer(250))  # a padded vocabulary holds a smaller tokenizer
    with pytest.raises(ArgumentError, match=r"disagree on vocabulary size \(actor=256, reward=128\)"):
        check_vocab({"actor": _Model(256), "reward": _Model(128)}, _Tokenizer(128))
    with pytest.raises(ArgumentError, match="the tokenizer has 257 tokens but the model's vocabulary has 256"):
        check_vocab({"actor": _Model(256)}, _Tokenizer(257))


def test_frozen_is_in_eval_mode_without_gradients():
    model = frozen(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)))
    assert not model.training and not any(p.requires_grad for p in model.parameters())
