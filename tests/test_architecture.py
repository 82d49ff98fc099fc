"""The package's shape: layered imports without circles, no module reaching into another's privates,
a written check contract, and a README checks table generated from the registry."""
import ast
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "guard")

# Lower layers never import higher ones. Within a layer any import is fine as long as there is no circle.
LAYERS = [
    {"findings", "record", "config", "tensors", "hooks", "_frames", "_dist", "meter", "callstack", "_modules", "_procs", "_weak"},
    {"checks", "report"},
    {"staging", "router", "watched", "compiled", "wiring", "session"},
    {"wrap", "__init__", "__main__", "pytest_plugin", "_autostart", "integrations"},
]


def _modules():
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
                with open(path, encoding="utf-8") as fh:
                    out[name] = (path, ast.parse(fh.read(), path))
    return out


MODULES = _modules()


def _is_package(name):
    return MODULES[name][0].endswith("__init__.py")


def _type_checking_nodes(tree):
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return skip


def _imports(name):
    """(imported guard module, imported names, node) for every import in `name` outside TYPE_CHECKING."""
    path, tree = MODULES[name]
    skip = _type_checking_nodes(tree)
    pkg = name if _is_package(name) else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "guard":
                    yield a.name, [], node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "guard":
                continue
            names = [a.name for a in node.names]
            subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in MODULES]
            if subs:
                for s in subs:
                    yield s, [], node
                rest = [n for n in names if f"{mod}.{n}" not in MODULES]
                if rest:
                    yield mod, rest, node
            else:
                yield mod, names, node


def _layer(name):
    part = name.split(".")[1] if "." in name else "__init__"
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    raise AssertionError(f"{name} is in no layer of LAYERS; add it")


def test_imports_go_down_the_layers_only():
    wrong = []
    for name in MODULES:
        for target, _, node in _imports(name):
            if target in MODULES and target != "guard" and _layer(target) > _layer(name):
                wrong.append(f"{name}:{node.lineno} imports {target}")
    assert wrong == []


def test_no_import_circle():
    graph = {name: {t for t, _, _ in _imports(name) if t in MODULES and t != name} for name in MODULES}
    for name in graph:  # a module's package is imported first: `guard.checks.x` needs `guard.checks`
        graph[name].discard("guard")
    state, cycles = {}, []

    def visit(n, stack):
        state[n] = 1
        for m in graph[n]:
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert cycles == []


def _own_privates(tree):
    """Private names a module defines: top-level names, class members, attributes it assigns."""
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.alias):
            own.add(node.asname or node.name.split(".")[0])
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    return {n for n in own if n.startswith("_") and not n.startswith("__")}


def _private(n):
    return n.startswith("_") and not (n.startswith("__") and n.endswith("__"))


def test_no_module_touches_another_modules_private_names():
    owns = {name: _own_privates(tree) for name, (_, tree) in MODULES.items()}
    everywhere = set().union(*owns.values())
    wrong = []
    for name, (path, tree) in MODULES.items():
        mine = owns[name]
        for target, names, node in _imports(name):
            for n in names:
                if _private(n):
                    wrong.append(f"{name}:{node.lineno} imports {n} from {target}")
        for node in ast.walk(tree):
            attr = None
            if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                attr = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
                attr = node.args[1].value
            # a private name that another guard module defines and this one does not (torch's own are not ours)
            if attr and _private(attr) and attr not in mine and attr in everywhere:
                wrong.append(f"{name}:{node.lineno} uses .{attr}")
    assert wrong == []


def test_session_is_small():
    with open(os.path.join(ROOT, "session.py"), encoding="utf-8") as fh:
        assert len(fh.read().splitlines()) < 550


def test_misspelt_handler_is_an_error_at_class_creation():
    from guard.checks.base import Check

    with pytest.raises(TypeError, match=r"on_forwad handles no event \(did you mean on_forward\?\)"):
        type("Bad", (Check,), {"name": "bad-handler", "kinds": {}, "on_forwad": lambda self, *a: None})


def test_kinds_must_be_declared_with_severity_and_description():
    from guard.checks import registry
    from guard.checks.base import Check

    registry()

    with pytest.raises(TypeError, match=r"kinds must be a dict"):
        type("Bad", (Check,), {"name": "bad-kinds", "kinds": ("nonfinite-grad",)})
    with pytest.raises(TypeError, match=r"severity 'fatal'"):
        type("Bad", (Check,), {"name": "bad-severity", "kinds": {"new-kind": ("fatal", "x")}})
    with pytest.raises(TypeError, match=r"one kind has one severity"):
        type("Bad", (Check,), {"name": "bad-clash", "kinds": {"nonfinite-grad": ("info", "x")}})


def test_kinds_vocabulary_is_generated_from_the_checks():
    from guard.checks import registry
    from guard.findings import KINDS, severity_of

    declared = {k: v for c in registry().values() for k, v in c.kinds.items()}
    assert dict(KINDS) == declared
    assert severity_of("nonfinite-grad") == "error" and severity_of("sigmoid-before-bce") == "info"


def test_each_check_file_is_named_after_its_check():
    from guard.checks import registry

    for name, cls in registry().items():
        assert cls.__module__ == "guard.checks." + name.replace("-", "_"), (name, cls.__module__)


def test_readme_checks_table_is_current():
    from guard.checks import readme_table

    with open(os.path.join(os.path.dirname(ROOT), "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    m = re.search(r"<!-- checks-table:start -->\n(.*?)<!-- checks-table:end -->", text, re.S)
    assert m, "README.md lacks the checks-table markers"
    assert m.group(1) == readme_table(), "README checks table is stale: run python -m guard.checks --readme-table"
