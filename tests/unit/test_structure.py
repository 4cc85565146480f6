"""The import structure of `mindspeed_llm/`: no circle between modules, no import from a lower layer to a higher one.

Read from the source with `ast` (nothing is imported). An edge A -> B is an `import` / `from ... import` in module A
that names module B of the package; relative imports are resolved against A's package. `from pkg import name`
is an edge to `pkg.name` when that is a module, else to `pkg` (its `__init__.py`). The package `__init__.py` that
Python runs before a submodule is not an edge: every package face imports its own submodules, so counting it would
make each package a circle with itself.

Module-level and function-local imports:
- the circle check reads module-level imports only (an `import` at module level, in a class body, under `if` /
  `try`). A function-local import runs when the function is called, after every module involved has finished
  loading, so it cannot make a partially initialised module; the code uses them on purpose (the stage registry in
  `rl/stages/__init__.py` imports a stage on first use, `patches/__init__.py` imports its patch modules when the
  patches are applied, and megatron-core or transformers are kept out of `--help`). With function-local imports
  added there is exactly one loop, the patch registry's (`patches/__init__.py` imports `patches/cpu.py` ... inside
  `_load_patch_modules`, and each patch module imports `register` from the package); `test_function_local_loops`
  pins that.
- the layer check reads both: a function-local import still says that the lower module knows the higher one.
  `importlib.import_module` by name (the stage registry, the patch targets) is not read.

The layers, bottom to top, are written below (`LAYERS`); they follow the floors of farm-studio's drawing
(`farm-studio look`) and docs/architecture.md. A module may import its own layer and the layers below it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mindspeed_llm"

# Bottom to top. A module belongs to the layer of the longest prefix that names it (a prefix is a module or a
# package with everything under it). Every module of the package must be in one layer.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("leaf utilities", (
        "mindspeed_llm",  # the top package's empty face
        "mindspeed_llm.errors", "mindspeed_llm.files", "mindspeed_llm.forward_state", "mindspeed_llm.expert_layout",
        "mindspeed_llm.compat_flags", "mindspeed_llm.kernels", "mindspeed_llm.registry",
    )),
    ("megatron patches", ("mindspeed_llm.patches",)),
    ("device and process groups", ("mindspeed_llm.device", "mindspeed_llm.distributed")),
    ("models", ("mindspeed_llm.models",)),
    ("checkpoint, data, inference", ("mindspeed_llm.checkpoint", "mindspeed_llm.data", "mindspeed_llm.inference")),
    ("rl core", (
        "mindspeed_llm.rl",  # the rl package's empty face
        "mindspeed_llm.rl.core_algos", "mindspeed_llm.rl.metrics", "mindspeed_llm.rl.settings",
        "mindspeed_llm.rl.model_settings",
        "mindspeed_llm.rl.verifiers", "mindspeed_llm.rl.experience", "mindspeed_llm.rl.logprobs",
        "mindspeed_llm.rl.tools",
    )),
    # the models of a stage and how they are trained (roles, LoRA, MoE, recompute, the micro-batch plan, the passes,
    # the losses and the PPO loop, megatron's schedule, the trained model and its state): below the rollouts,
    # scoring and evaluation that run the models
    # async_rl: the actor's weights leave the trainers for the generator ranks (placement, resharding, streaming)
    ("rl update", ("mindspeed_llm.rl.update", "mindspeed_llm.rl.async_rl")),
    # how an iteration's samples are made: the sample generators, the schedules, and what observes their output
    # (records, dump, replay): above the models they run, below scoring and evaluation
    ("rl rollouts", ("mindspeed_llm.rl.rollouts",)),
    ("rl plumbing", (
        "mindspeed_llm.rl.scoring", "mindspeed_llm.rl.evaluation", "mindspeed_llm.rl.startup",
        "mindspeed_llm.rl.profiling", "mindspeed_llm.rl.judge", "mindspeed_llm.rl.distillation",
    )),
    ("rl stages", ("mindspeed_llm.rl.stages",)),
    ("outer loop", ("mindspeed_llm.rl.trainer", "mindspeed_llm.rl.preflight")),
    ("command line and entry points", (
        "mindspeed_llm.argument_ranges", "mindspeed_llm.arguments", "mindspeed_llm.run_config", "mindspeed_llm.demo",
    )),
]

# The one loop that function-local imports close (see the module docstring).
EXPECTED_FUNCTION_LOCAL_LOOPS = [{"mindspeed_llm.patches"} | {
    f"mindspeed_llm.patches.{name}" for name in
    ("cpu", "fused_ops", "inference", "initialization", "mla", "moe", "optimizer", "recompute", "rotary",
     "sequence_parallel")
}]

MAX_FILE_LINES = 600
# The RL package's files are held tighter: a file over it holds two jobs, split by job rather than grown.
MAX_RL_FILE_LINES = 450
RL_PACKAGE = PACKAGE / "rl"
# Files over MAX_RL_FILE_LINES whose split by job is under way in another branch of the same change; the test fails
# once such a file is under the limit, so that it leaves this list with its split.
RL_SPLITS_UNDER_WAY = ()
MAX_FUNCTION_LINES = 120


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules(package: Path = PACKAGE) -> Dict[str, Path]:
    return {module_name(path): path for path in sorted(package.rglob("*.py"))}


def _targets(node, module: str, is_package: bool, modules: Dict[str, Path]) -> List[str]:
    """The package's modules that one import statement names."""
    found = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:  # `import a.b.c` of a package-less name: its longest module
                name = name.rpartition(".")[0]
            if name:
                found.append(name)
        return found
    if node.level:  # relative: `from . import x` in a.b.c is a.b.x; in the package a.b it is a.b.x too
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        base_name = ".".join(base + ([node.module] if node.module else []))
    else:
        base_name = node.module or ""
    if base_name != PACKAGE.name and not base_name.startswith(PACKAGE.name + "."):
        return found
    for alias in node.names:
        sub = f"{base_name}.{alias.name}"
        if sub in modules:
            found.append(sub)
        elif base_name in modules:
            found.append(base_name)
    return found


def import_graph(modules: Dict[str, Path]) -> Tuple[Dict[str, Set[str]], Dict[str, Set[str]]]:
    """(module-level edges, function-local edges), each module -> the package modules it imports."""
    top: Dict[str, Set[str]] = {name: set() for name in modules}
    local: Dict[str, Set[str]] = {name: set() for name in modules}

    for name, path in modules.items():
        is_package = path.name == "__init__.py"

        def visit(node, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, name, is_package, modules):
                        if target != name:
                            (local if in_function else top)[name].add(target)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return top, local


def circles(graph: Dict[str, Set[str]]) -> List[Set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[Set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for number, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = number, len(prefix)
    return best


def upward_imports(edges: Dict[str, Set[str]]) -> List[str]:
    """'A (layer) -> B (layer)' for every import from a lower layer to a higher one."""
    found = []
    for source in sorted(edges):
        for target in sorted(edges[source]):
            if layer_of(target) > layer_of(source):
                found.append(f"{source} ({LAYERS[layer_of(source)][0]}) -> {target} ({LAYERS[layer_of(target)][0]})")
    return found


@pytest.fixture(scope="module")
def graph():
    modules = package_modules()
    top, local = import_graph(modules)
    return modules, top, local


def test_every_module_has_a_layer(graph):
    modules, _, _ = graph
    assert [m for m in modules if layer_of(m) < 0] == [], "add the module to a layer of LAYERS"


def test_no_circle_between_modules(graph):
    _, top, _ = graph
    assert [sorted(c) for c in circles(top)] == [], "module-level imports that form a circle"


def test_function_local_loops(graph):
    """Function-local imports close exactly the patch registry's loop (imported when the patches are applied)."""
    _, top, local = graph
    combined = {m: top[m] | local[m] for m in top}
    assert sorted(map(sorted, circles(combined))) == sorted(map(sorted, EXPECTED_FUNCTION_LOCAL_LOOPS))


def test_no_import_from_a_lower_layer_to_a_higher_one(graph):
    _, top, local = graph
    assert upward_imports(top) == [], "module-level imports that run up the layers"
    assert upward_imports(local) == [], "function-local imports that run up the layers"


def test_the_checks_catch_a_planted_circle_and_upward_import(graph):
    """The checks themselves: an import planted into a copy of the graph is found."""
    _, top, _ = graph
    planted = {m: set(t) for m, t in top.items()}
    planted["mindspeed_llm.errors"].add("mindspeed_llm.rl.trainer")  # leaf -> outer loop: both a circle and up
    assert circles(planted), "the planted circle was not found"
    assert "mindspeed_llm.errors (leaf utilities) -> mindspeed_llm.rl.trainer (outer loop)" in upward_imports(planted)


def _function_lengths(path: Path) -> List[Tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.append((f"{node.name}:{node.lineno}", node.end_lineno - start + 1))
    return found


def long_files(limit: int = MAX_FILE_LINES, package: Path = PACKAGE) -> List[str]:
    found = []
    for name, path in package_modules(package).items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > limit:
            found.append(f"{path.relative_to(ROOT).as_posix()}: {lines} lines")
    return found


def long_functions() -> List[str]:
    found = []
    for name, path in package_modules().items():
        for function, lines in _function_lengths(path):
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}::{function}: {lines} lines")
    return found


def test_no_library_file_over_600_lines():
    assert long_files() == [], "split the file by what its parts do"


def test_no_rl_file_over_450_lines():
    long = long_files(MAX_RL_FILE_LINES, RL_PACKAGE)
    assert [f for f in long if f.split(":")[0] not in RL_SPLITS_UNDER_WAY] == [], "split the file by what its parts do"
    assert [f for f in RL_SPLITS_UNDER_WAY if not any(hit.startswith(f + ":") for hit in long)] == [], \
        "the file is split: take it off RL_SPLITS_UNDER_WAY"


def test_no_function_over_120_lines():
    assert long_functions() == [], "split the function into named steps"


def plain_dict_registries(modules: Dict[str, Path]) -> List[str]:
    """'module.NAME' for every module-level dict that serves as a registry outside `mindspeed_llm.registry.Registry`:
    a dict literal whose values are all class names (`{"hermes": HermesParser}`), or an empty one a function of the
    same module fills by key (a decorator's `NAME[key] = fn`)."""
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        dicts = {}
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
                getattr(node, "target", None) if isinstance(node, ast.AnnAssign) else None
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Dict):
                dicts[target.id] = node.value
        filled = {t.value.id for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for a in ast.walk(f) if isinstance(a, ast.Assign) for t in a.targets
                  if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
        for name, value in dicts.items():
            of_classes = value.values and all(isinstance(v, ast.Name) and v.id[:1].isupper() and not v.id.isupper()
                                              for v in value.values)
            # a private dict a function fills is a cache (`_CACHE`, `_BUILT`), not a registry
            if of_classes or (not value.keys and name in filled and not name.startswith("_")):
                found.append(f"{module}.{name}")
    return found


def test_one_registry_idiom(tmp_path):
    """Every registry is a `mindspeed_llm.registry.Registry` (decorated or assigned entries, lazy imports), not a
    plain dict: the check finds both kinds planted into a module."""
    assert plain_dict_registries(package_modules()) == [], "make it a mindspeed_llm.registry.Registry"
    planted = tmp_path / "planted.py"
    planted.write_text('PARSERS = {"hermes": HermesParser}\nHOOKS = {}\n_CACHE = {}\n\n\ndef hook(fn):\n'
                       '    HOOKS[fn.__name__] = _CACHE[fn] = fn\n', encoding="utf-8")
    assert plain_dict_registries({"mindspeed_llm.planted": planted}) == [
        "mindspeed_llm.planted.PARSERS", "mindspeed_llm.planted.HOOKS"]


def imports_of_tests(path: Path) -> List[str]:
    """'file:line module' for every import of the test tree (`tests`, `tests.*`) in `path`, at any depth."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [f"{path.name}:{node.lineno} {n}" for n in names if n == "tests" or n.startswith("tests.")]
    return found


def test_device_scripts_import_no_test_module(tmp_path):
    """The device scripts (`scripts/*.py`, run on a GPU / NPU machine) and the package import nothing of `tests/`:
    what they need lives in the package or the script. The check finds a planted import."""
    files = sorted((ROOT / "scripts").glob("*.py")) + sorted(package_modules().values())
    assert [hit for path in files for hit in imports_of_tests(path)] == []
    planted = tmp_path / "planted.py"
    planted.write_text("def check():\n    from tests.helpers import npu_stand_in\n", encoding="utf-8")
    assert imports_of_tests(planted) == ["planted.py:2 tests.helpers"]


ARCHITECTURE_PAGE = ROOT / "docs" / "architecture.md"
_CODE_SPAN = re.compile(r"`([^`]+)`")


def _spans(line: str) -> List[str]:
    """The inline-code spans of `line`, a brace list expanded (`rl/stages/{grpo,trl_ppo}.py` is two paths)."""
    out = []
    for span in _CODE_SPAN.findall(line):
        todo = [span.strip()]
        while todo:
            text = todo.pop()
            brace = re.search(r"\{([^{}]*)\}", text)
            if brace is None:
                out.append(text)
            else:
                todo += [text[:brace.start()] + alt + text[brace.end():] for alt in brace.group(1).split(",")]
    return out


def unlisted_modules(page: str, modules: Dict[str, Path], package: Path = PACKAGE) -> List[str]:
    """The modules (paths under `package`) that no line of `page` names: a line names `rl/tools/config.py` with the
    span `rl/tools/config.py`, or with `config.py` beside a span of its folder (`rl/tools/...`), as the page's tables
    list a folder's files; a package's `__init__.py` with a span of its folder. The top package's face needs none."""
    lines = [_spans(line) for line in page.splitlines()]
    missing = []
    for path in sorted(modules.values()):
        rel = path.relative_to(package).as_posix()
        folder, _, name = rel.rpartition("/")
        folder = f"{folder}/" if folder else ""
        if rel == "__init__.py":
            continue
        for spans in lines:
            in_folder = not folder or any(s.startswith(folder) for s in spans)
            if name == "__init__.py":
                if in_folder:
                    break
            elif any(s == rel or s.endswith("/" + rel) for s in spans) or (
                    in_folder and any(s == name or s.endswith("/" + name) for s in spans)):
                break
        else:
            missing.append(rel)
    return missing


def test_the_architecture_page_lists_every_module(tmp_path):
    """docs/architecture.md names every module of the package (a new module is a line of the page); the check finds
    a module planted into a copy of the package."""
    page = ARCHITECTURE_PAGE.read_text(encoding="utf-8")
    assert unlisted_modules(page, package_modules()) == [], "add the module to docs/architecture.md"
    planted = tmp_path / "mindspeed_llm"
    (planted / "rl").mkdir(parents=True)
    for rel in ("__init__.py", "rl/__init__.py", "rl/trainer.py", "rl/planted_module.py"):
        (planted / rel).write_text("", encoding="utf-8")
    modules = {str(path): path for path in planted.rglob("*.py")}
    assert unlisted_modules(page, modules, planted) == ["rl/planted_module.py"]
