"""`rl/update/roles.py` without a checkpoint: what of a trained model's state --offload-train-* sends to host memory, the
vocabulary check across the roles and the tokenizer, and a frozen model. (Loading models by role, with the model flags
checked against the checkpoint: tests/unit/test_mindspeed_flags.py, tests/dist/test_stages*.py.)"""

from types import SimpleNamespace

import pytest
import torch

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.update.roles import check_vocab, frozen, offload_parts
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


def test_the_role_factory_gives_the_critic_the_actors_lora_config(monkeypatch):
    """`RoleFactory` builds the roles from the settings alone; with LoRA the critic's adapters take the actor's
    config, which --lora-load's adapter may have set (r 4 here, where the flags alone would give r 16)."""
    from mindspeed_llm.arguments import parse_args
    from mindspeed_llm.models.lora import LoRAConfig
    from mindspeed_llm.rl.update import lora, roles

    settings = parse_args(["--stage", "trl_ppo", "--ref-model", "r", "--reward-model", "rm", "--data-path", "d",
                           "--global-batch-size", "4", "--train-iters", "1", "--lora-load", "adapter"]).settings
    adapters = LoRAConfig(r=4, alpha=8.0, dropout=0.1, target_modules=("linear_proj",), ranks={"stacked": 12})
    loaded = []

    def load_model(root, flag, given, value_head=False, trained=False, on_host=False):
        loaded.append((root, flag, value_head, trained, on_host))
        return SimpleNamespace(root=root)

    def trainable(model, given, name, flag):  # as lora.trainable picks each role's config
        config = adapters if name == "actor" else lora.run_config(given.lora)
        return SimpleNamespace(is_lora=True, config=config, settings=given)

    monkeypatch.setattr(roles, "load_model", load_model)
    monkeypatch.setattr(roles, "trainable", trainable)
    factory = roles.RoleFactory(settings)
    actor = factory.trained("r", "--ref-model", "actor")
    critic = factory.trained("rm", "--reward-model", "critic", value_head=True)
    assert actor.settings is settings
    assert critic.config == LoRAConfig(r=4, alpha=8.0, dropout=0.1, target_modules=("linear_proj",))
    assert critic.settings.optimizer is settings.optimizer and critic.settings.model is settings.model
    assert loaded == [("r", "--ref-model", False, True, False), ("rm", "--reward-model", True, True, False)]
