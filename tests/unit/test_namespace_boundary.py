"""The argparse Namespace stops in `arguments/`: the stages, the trainer's loop, the batch plan, the rollout
strategies and model building (roles, LoRA, MoE, recompute) read the typed parts of `rl/settings.py` and
`rl/model_settings.py`, so an option (an estimator's, a loop's, a model's) is one flag and one field, and what a
stage reads is written in its types. Megatron's global args are never set: `models.build_model` hands megatron its
TransformerConfig field by field.

The walk (ast) looks at every function parameter named `args` / `model_args` and at `self.args` in these modules.
Allowed uses of such a name: reading `.settings` (the typed parts), and passing it on where the whole command line
is the thing (`WHOLE_COMMAND_LINE`). Anything else -- `args.kl_coef`, `getattr(args, ...)`, storing it,
passing it elsewhere -- is a read of the Namespace and fails here. The stages (every module of `rl/stages/`) see no
Namespace at all: they are built from the typed settings (`STAGES[name](settings, tokenizer, build)`), so there
even `args.settings` is a read, and a stage refuses anything but a `Settings` when built.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mindspeed_llm"

# every module of the stages' package, a new one included
STAGE_MODULES = tuple(sorted(p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "rl" / "stages").glob("*.py")))
# every module of rl/: the stages, the loop, the rollouts, the update side (model building included), a new one too
CHECKED = tuple(sorted(p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "rl").rglob("*.py")))
# The one place in rl/ that reads the Namespace on purpose: the typed parts made from the checked flags, which
# `arguments.validate_args` calls (`settings.from_args`).
GLUE = {("rl/settings.py", "_part"), ("rl/settings.py", "from_args")}
NAMESPACE_NAMES = ("args", "model_args")
# Calls that may receive the Namespace: none (the stages are built from the settings; the startup report reads
# `settings.startup`).
WHOLE_COMMAND_LINE = frozenset()
# Reads that are known and owned elsewhere, by (module, function): what each of its reads says. They go when their
# owner types them; each must still be found (a stale entry fails too), so the list only shrinks.
PENDING = {}  # (module, function) -> what its reads say: known reads owned elsewhere, until typed (none left)


def _callee(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Subscript):  # STAGES[name](...)
        return f"{ast.unparse(func.value)}[]"
    return ast.unparse(func)


def namespace_reads(source: str, allowed=WHOLE_COMMAND_LINE, typed_parts_allowed: bool = True):
    """[(qualified function name, what it does with the Namespace)] of a module's source; `typed_parts_allowed`
    False: reading `.settings` off it is one too (a stage's module)."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name])
                continue
            visit(child, scope)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        a = node.args
        names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs) if p.arg in NAMESPACE_NAMES}
        for use in ast.walk(node):
            if isinstance(use, ast.Attribute) and use.attr == "args" and ast.unparse(use.value) == "self":
                found.append((".".join(scope), f"self.args at line {use.lineno}"))
            if not (isinstance(use, ast.Name) and use.id in names and isinstance(use.ctx, ast.Load)):
                continue
            parent = parents[use]
            if isinstance(parent, ast.Attribute):
                if parent.attr != "settings" or not typed_parts_allowed:
                    found.append((".".join(scope), f"{use.id}.{parent.attr} at line {use.lineno}"))
                continue
            call = parents[parent] if isinstance(parent, ast.keyword) else parent
            if isinstance(call, ast.Call) and call.func is not use and _callee(call) in allowed:
                continue
            what = f"passed to {_callee(call)}" if isinstance(call, ast.Call) else type(parent).__name__
            found.append((".".join(scope), f"{use.id} {what} at line {use.lineno}"))

    visit(tree, [])
    return found


def _reads():
    reads = {}
    for relative in CHECKED:
        source = (PACKAGE / relative).read_text()
        stage = relative in STAGE_MODULES
        for function, what in namespace_reads(source, frozenset() if stage else WHOLE_COMMAND_LINE, not stage):
            reads.setdefault((relative, function), []).append(what)
    return reads


def test_the_stages_loop_and_batch_plan_read_no_namespace():
    unexpected = {key: [w for w in what if key not in PENDING or PENDING[key] not in w]
                  for key, what in _reads().items()}
    unexpected = {key: what for key, what in unexpected.items() if what and key not in GLUE}
    assert unexpected == {}, "reads of the argparse Namespace outside arguments/: " + "; ".join(
        f"{path} {function}: {', '.join(what)}" for (path, function), what in unexpected.items())


def test_the_pending_reads_are_still_there():
    """A pending entry whose reads are gone is taken off the list (it only shrinks)."""
    reads = _reads()
    assert [key for key in PENDING if key not in reads] == []
    assert [key for key in GLUE if key not in reads] == []  # a glue entry that no longer reads goes too


@pytest.mark.parametrize("planted,needle", [
    ("if model_args.kl_coef > 0:", "model_args.kl_coef"),
    ("if getattr(model_args, 'kl_coef') > 0:", "model_args passed to getattr"),
    ("if model_args.settings.algorithm.kl_coef > 0:", "model_args.settings"),  # a stage takes the typed parts only
])
def test_a_planted_read_is_found(planted, needle):
    source = (PACKAGE / "rl/stages/grpo.py").read_text()
    original = "if self.algorithm.kl_coef > 0:"
    assert original in source and "rl/stages/grpo.py" in STAGE_MODULES
    tree = ast.parse(source.replace(original, planted))
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    init.args.args.append(ast.arg(arg="model_args"))  # the Namespace given to the stage as it once was
    reads = namespace_reads(ast.unparse(tree), frozenset(), typed_parts_allowed=False)
    assert [function for function, what in reads if needle in what] == ["GRPOStage.__init__"]


def test_the_trainer_builds_a_stage_from_the_settings_not_the_namespace():
    """`STAGES[name](args, ...)` in the trainer is a read (the stage constructor is no longer a whole-command-line
    call); the trainer's own call passes the settings."""
    source = (PACKAGE / "rl/trainer.py").read_text()
    original = "STAGES[checkpoint.stage](settings, tokenizer, roles.RoleFactory(settings))"
    assert original in source and namespace_reads(source) == []
    planted = source.replace(original, "STAGES[checkpoint.stage](args, tokenizer, roles.RoleFactory(settings))")
    assert [what.split(" at ")[0] for _, what in namespace_reads(planted)] == ["args passed to STAGES[]"]


@pytest.mark.parametrize("name", ["grpo", "trl_ppo"])
def test_a_stage_given_the_namespace_refuses_it(name):
    """A caller that still hands a stage the Namespace (with its settings on it) is told what to pass, before any
    model is built."""
    import argparse

    from mindspeed_llm.rl.settings import Settings
    from mindspeed_llm.rl.stages import STAGES

    with pytest.raises(TypeError, match=r"built from the run's typed settings \(rl/settings\.Settings\), not a "
                                        r"Namespace"):
        STAGES[name](argparse.Namespace(settings=Settings()), None, None)


def test_a_planted_self_args_is_found():
    source = (PACKAGE / "rl/trainer.py").read_text()
    original = "loop, checkpoint = settings.loop"
    assert original in source
    planted = source.replace(original, "self.args = None\n    " + original)
    assert [what.split(" at ")[0] for _, what in namespace_reads(planted)] == ["self.args"]


@pytest.mark.parametrize("module,original,planted,function", [
    ("rl/update/roles.py", "given = settings.model", "given = args.settings.model; args.params_dtype", "_checked_spec"),
    ("rl/update/recompute.py", "granularity = recompute.recompute_granularity",
     "granularity = getattr(args, 'recompute_granularity', None)", "model_options"),
    ("rl/update/moe.py", "cp = moe.context_parallel_size", "cp = args.context_parallel_size", "model_options"),
    ("rl/update/lora.py", "dropout = flags.lora_dropout", "dropout = args.lora_dropout", "run_config"),
])
def test_a_planted_read_in_model_building_is_found(module, original, planted, function):
    """Model building reads its typed parts: a Namespace read planted in it (with `args` as the function's
    parameter, as it was) is found."""
    assert module in CHECKED
    source = (PACKAGE / module).read_text()
    assert original in source and namespace_reads(source) == []
    tree = ast.parse(source.replace(original, planted))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    node.args.args.append(ast.arg(arg="args"))
    reads = namespace_reads(ast.unparse(tree))
    assert [f for f, what in reads if what.startswith("args")] == [function]
