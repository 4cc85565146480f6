"""A user's reward function, loaded from a Python file outside the package: ``--custom-reward-function PATH:NAME``
(verl's ``custom_reward_function.path`` / ``.name``; NAME defaults to verl's ``compute_score``).

PATH is a ``.py`` file, loaded by its path (``importlib``: it need not be on ``sys.path`` nor in a package), once per
process; NAME a function in it, called as verl calls it -- ``compute_score(data_source, solution_str,
ground_truth, extra_info=None, **kwargs)`` -- or in the verifiers' keyword style, ``fn(text, label, *, row,
trajectory)`` (`verifiers/calling.py` tells them apart by the parameters' names). It returns a number or a mapping
with a ``score`` (its other numeric entries are logged as ``reward/<key>/mean``). An ``async def`` function is run
to completion for each response.

It scores as one more verifier named ``custom`` (its metrics: ``custom_rewards/mean``, ``custom_rewards/failures``),
weighted by ``--custom-reward-weight`` (default 1.0) and added to the weighted verifiers and reward model
(`rl/scoring.py`): alone, it is the reward, as verl uses it. Every error -- no such file, not a ``.py`` file, a
file that does not load (a syntax error, a failing import), no NAME in it, NAME not a function, a signature the
scorer cannot fill -- is an `ArgumentError` naming the file and the fix, raised by `validate_args` before any
model is built.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Dict, Tuple

from mindspeed_llm.errors import ArgumentError
from mindspeed_llm.rl.verifiers.batch import RewardFunction
from mindspeed_llm.rl.verifiers.calling import SignatureError, call_plan

FLAG = "--custom-reward-function"
DEFAULT_NAME = "compute_score"  # verl's default custom_reward_function.name
CUSTOM = "custom"  # its name among the scores and metrics

_MODULES: Dict[str, object] = {}  # real path -> the loaded module (each file is executed once per process)


def parse_spec(spec: str, flag: str = FLAG, default_name: str = DEFAULT_NAME) -> Tuple[str, str]:
    """``PATH[:NAME]`` -> (PATH, NAME); NAME defaults to `default_name` (``compute_score``); errors name `flag`."""
    spec = str(spec).strip()
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isidentifier() and head:
        return head, tail
    if sep and not tail and head:
        raise ArgumentError(f"{flag} {spec}: the function name after ':' is empty; give PATH:NAME, e.g. "
                            f"{head}:{default_name}")
    if not spec:
        raise ArgumentError(f"{flag} needs PATH[:NAME]: a .py file and the function in it (default {default_name})")
    return spec, default_name


def _load_module(spec: str, path: str, flag: str = FLAG):
    real = os.path.realpath(path)
    if real in _MODULES:
        return _MODULES[real]
    if not os.path.exists(path):
        raise ArgumentError(f"{flag} {spec}: there is no file {path!r} (a relative path starts at the working "
                            f"directory, {os.getcwd()}); give the path of the .py file that defines the function")
    if os.path.isdir(path):
        raise ArgumentError(f"{flag} {spec}: {path} is a directory; give the .py file in it that defines the "
                            "function, PATH/FILE.py:NAME")
    if not path.endswith(".py"):
        raise ArgumentError(f"{flag} {spec}: {path} is not a Python source file (.py); the function is loaded "
                            "from a .py file by its path: give one, e.g. my_rewards.py:compute_score")
    module_name = "_custom_reward_" + hashlib.sha1(real.encode()).hexdigest()[:12]
    loader_spec = importlib.util.spec_from_file_location(module_name, real)
    if loader_spec is None or loader_spec.loader is None:
        raise ArgumentError(f"{flag} {spec}: {path} cannot be loaded as a Python module; give a .py file")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses and pickling by reference look the module up there
    try:
        loader_spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        raise ArgumentError(f"{flag} {spec}: {path} has a syntax error at line {exc.lineno}: {exc.msg}; fix the "
                            "file") from exc
    except BaseException as exc:  # noqa: BLE001 - whatever the user's module raises while it loads (SystemExit too)
        sys.modules.pop(module_name, None)
        raise ArgumentError(f"{flag} {spec}: loading {path} raised {type(exc).__name__}: {exc}; fix the file (or "
                            "install what it imports)") from exc
    _MODULES[real] = module
    return module


def load_user_function(spec: str, flag: str = FLAG, default_name: str = DEFAULT_NAME):
    """(the callable NAME of ``PATH[:NAME]``, PATH, NAME): the file loaded by its path once per process, every error
    an `ArgumentError` naming `flag`, the file and the fix (module doc). What --custom-reward-function and
    --judge-parser (`rl/judge_verdicts.py`) load their functions with."""
    path, name = parse_spec(spec, flag, default_name)
    module = _load_module(spec, path, flag)
    if not hasattr(module, name):
        functions = sorted(k for k, v in vars(module).items()
                           if inspect.isfunction(v) and v.__module__ == module.__name__ and not k.startswith("_"))
        listed = ", ".join(functions) if functions else "none"
        raise ArgumentError(f"{flag} {spec}: {path} defines no '{name}' (its functions: {listed}); name one with "
                            f"PATH:NAME (NAME defaults to {default_name})")
    fn = getattr(module, name)
    if not callable(fn):
        raise ArgumentError(f"{flag} {spec}: '{name}' in {path} is a {type(fn).__name__}, not a function; name a "
                            "function with PATH:NAME")
    return fn, path, name


def load_reward_function(spec: str) -> RewardFunction:
    """The function of ``PATH[:NAME]`` with its call plan; `ArgumentError` naming the file and the fix otherwise
    (module doc). The file is executed once per process (later calls reuse the module)."""
    fn, path, name = load_user_function(spec)
    if inspect.iscoroutinefunction(fn):
        fn = _run_to_completion(fn)
    try:
        plan = call_plan(fn, f"'{name}' in {path}")
    except SignatureError as exc:
        raise ArgumentError(f"{FLAG} {spec}: {exc}") from exc
    return RewardFunction(fn, plan)


def check_flags(spec, weight, verifier_names) -> float:
    """`validate_args`' check of --custom-reward-function / --custom-reward-weight: the function is loaded here, so
    that every error above fails before any model is built; returns the weight (1.0 when not given)."""
    if spec is None:
        raise ArgumentError("--custom-reward-weight has no effect without --custom-reward-function PATH:NAME; drop "
                            "it or give the function")
    load_reward_function(spec)
    if CUSTOM in (verifier_names or ()):
        raise ArgumentError(f"--verifier-function {CUSTOM} and {FLAG} would both score under the name '{CUSTOM}'; "
                            "register your verifier under another name")
    return 1.0 if weight is None else float(weight)


def _run_to_completion(fn):
    @functools.wraps(fn)  # keeps the signature (inspect follows __wrapped__)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run
