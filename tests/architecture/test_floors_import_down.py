"""The package's floors (DESIGN.md): imports only point down, never up."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "funcshard"

# module prefix -> floor; the longest matching prefix wins
FLOORS = {
    "_src": 0,
    "_src.errors": 0,
    "_src.tree": 1,
    "pytree": 1,
    "_src.runtime": 2,
    "process": 2,
    "_src.collectives": 3,
    "lax": 3,
    "_src.shard_map": 4,
    "_src.arrays": 4,
    "_src.autodiff": 4,
    "random": 5,
    "extend": 5,
    "optim": 5,
    "checkpoint": 5,
    "ops": 6,
    "pipeline": 7,
    "nn": 7,  # modules as pure functions: on the TP ops and FSDP gathers of ops/, so above them (beside pipeline)
    "models": 8,
    "__init__": 9,  # the public API: re-exports floors 0-7 (and models, ops, checkpoint on first use)
    "job": 10,  # built on the public API only (``import funcshard as fs``), so above the package's root
    "__main__": 10,
}


def _floor(mod: str) -> int:
    best = None
    for prefix, floor in FLOORS.items():
        if mod == prefix or mod.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, floor)
    assert best is not None, (
        f"module funcshard.{mod} has no floor in tests/architecture/test_floors_import_down.py; add it"
    )
    return best[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(parts: list[str]) -> bool:
    return bool(parts) and (ROOT.joinpath(*parts).with_suffix(".py").is_file() or ROOT.joinpath(*parts).is_dir())


def _named(base: list[str], name: str) -> str:
    """What ``from <base> import <name>`` depends on: the module ``name`` if it is one, else ``base`` itself
    (``__init__`` for the top-level package, so ``from funcshard import P`` is an import of ``funcshard``)."""
    if _is_module([*base, name]):
        return ".".join([*base, name])
    return ".".join(base) or "__init__"


def _imports(path: Path, mod: str) -> list[str]:
    """Every package module ``path`` imports: at module level, inside functions, and under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    pkg = mod.split(".")[:-1] if not path.name == "__init__.py" else mod.split(".")
    if path.name == "__init__.py" and mod == "__init__":
        pkg = []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
            target = ".".join([*base, node.module] if node.module else base)
            if node.module is None:
                out.extend(_named(base, a.name) for a in node.names)
            elif target:
                out.append(target)
        elif isinstance(node, ast.ImportFrom) and node.module == "funcshard":
            out.extend(_named([], a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("funcshard."):
            out.append(node.module.removeprefix("funcshard."))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "funcshard":
                    out.append("__init__")
                elif a.name.startswith("funcshard."):
                    out.append(a.name.removeprefix("funcshard."))
    return out


def test_imports_point_down() -> None:
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module_name(path)
        floor = _floor(mod)
        for target in sorted(set(_imports(path, mod))):
            if target and _floor(target) > floor:
                upward.append(f"funcshard.{mod} (floor {floor}) imports funcshard.{target} (floor {_floor(target)})")
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def test_only_backend_imports_torch_distributed() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        mod = _module_name(path)
        if mod.startswith("_src.runtime.backends"):
            continue
        text = path.read_text()
        if mod == "checkpoint" or mod.startswith("checkpoint."):  # the checkpoint layer may use DCP, nothing else
            text = re.sub(r"torch\.distributed\.checkpoint", "DCP", text)
        if re.search(r"^\s*(import|from)\s+torch\.distributed", text, re.M):
            offenders.append(mod)
    assert not offenders, f"torch.distributed used outside the backend: {offenders}"


def _graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports: function-level imports and imports for annotations only
    (under ``if TYPE_CHECKING:``) count too, so no circle hides behind either."""
    mods = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        deps = set()
        for target in _imports(path, mod):
            # "from . import lax" names a module; "from ._spec import P" names one too (its prefix)
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != mod:
                deps.add(target)
        graph[mod] = deps
    return graph


def test_no_import_circle() -> None:
    graph = _graph()
    # a package imports its own modules (its __init__ re-exports them): that edge is no circle
    for mod, deps in graph.items():
        graph[mod] = {d for d in deps if not (d.startswith(mod + ".") or mod.startswith(d + "."))}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


#: every spelling that reads or writes a tensor's vma tag by hand: the attribute's name or constant, ``getattr`` /
#: ``setattr`` / ``delattr`` / ``hasattr`` with it, and a tensor's ``__dict__`` read, written, updated or popped
TAG_FORMS = re.compile(
    r"_fs_vma|\bTAG_ATTR\b|\b_ATTR\b|__dict__\s*(\[|\.\s*(update|pop|get|setdefault|clear)\b)"
    r"|\b(get|set|del|has)attr\([^)]*\b(TAG_ATTR|_ATTR)\b"
)


def test_vma_tags_are_read_and_written_only_in_collectives() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).as_posix().startswith("_src/collectives/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if TAG_FORMS.search(line):
                offenders.append(f"funcshard/{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, (
        "vma tags touched outside funcshard/_src/collectives/ (use the functions of its vma module):\n"
        + ("\n".join(offenders))
    )


def test_tag_forms_regex_sees_every_spelling() -> None:
    for line in (
        "setattr(t, TAG_ATTR, v)",
        "v = getattr(t, TAG_ATTR, None)",
        "t.__dict__.update(s.__dict__)",
        "t.__dict__.pop(TAG_ATTR, None)",
        "t.__dict__[k] = v",
        "x._fs_vma = v",
    ):
        assert TAG_FORMS.search(line), line
    assert not TAG_FORMS.search("setattr(_scope, self.name, self.on)")


def test_one_fast_path_predicate() -> None:
    """torch's "is a torch.func transform active?" is asked through ``transforms_active`` (runtime/context.py,
    re-exported by ``funcshard.extend``), nowhere spelled out again."""
    offenders = [
        _module_name(path)
        for path in sorted(ROOT.rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != "_src/runtime/context.py"
        and "_are_functorch_transforms_active" in path.read_text()
    ]
    assert not offenders, f"modules asking torch directly (use transforms_active): {offenders}"


#: the packages above the core, which reach it only through ``funcshard.extend`` and the public modules
ABOVE_CORE = ("ops", "models", "nn", "optim", "pipeline", "checkpoint", "job")


def test_packages_above_the_core_use_the_door() -> None:
    """``ops``, ``models``, ``optim``, ``pipeline``, ``checkpoint`` and ``job`` import nothing from ``funcshard._src``
    (relative or absolute, at module or function level), no private module or name of another package: only
    ``funcshard.extend``, the public modules (``funcshard.lax``, ``pytree``, ``random``, ...) and each other."""
    offenders = []
    for pkg in ABOVE_CORE:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            mod = _module_name(path)
            parts = mod.split(".")
            base_pkg = parts if path.name == "__init__.py" else parts[:-1]
            where = f"funcshard/{path.relative_to(ROOT)}"
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    targets = [
                        (a.name.removeprefix("funcshard."), []) for a in node.names if a.name.startswith("funcshard.")
                    ]
                elif isinstance(node, ast.ImportFrom) and node.level:
                    base = base_pkg[: len(base_pkg) - (node.level - 1)] if node.level > 1 else base_pkg
                    names = [a.name for a in node.names]
                    target = ".".join([*base, node.module] if node.module else base)
                    targets = (
                        [(target, names)] if node.module else [(".".join([*base, n]).strip("."), []) for n in names]
                    )
                    if not node.module and not base:  # from the root: public names only
                        targets = [(n, []) for n in names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("funcshard"):
                    target = node.module.removeprefix("funcshard").removeprefix(".")
                    names = [a.name for a in node.names]
                    targets = [(target, names)] if target else [(n, []) for n in names]
                else:
                    continue
                for target, names in targets:
                    own = target == pkg or target.startswith(pkg + ".")
                    steps = target.split(".")
                    if steps[0] == "_src" or (not own and any(_private(p) for p in steps)):
                        offenders.append(f"{where}:{node.lineno}: {target}")
                    elif not own and any(_private(n) for n in names):
                        offenders.append(f"{where}:{node.lineno}: {target} import {', '.join(names)}")
    assert not offenders, "imports past the door (use funcshard.extend or the public API):\n" + "\n".join(offenders)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_job_imports_only_public_names() -> None:
    """The train job (``funcshard/job/``) is built on funcshard's public API: no private module or name of the
    library, by import or attribute (``fs._x``); relative imports stay in the job, or name a public subpackage."""
    offenders = []
    for path in sorted((ROOT / "job").rglob("*.py")):
        where = f"funcshard/{path.relative_to(ROOT)}"
        tree = ast.parse(path.read_text())
        aliases = set()  # local names bound to funcshard modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "funcshard" or a.name.startswith("funcshard."):
                        aliases.add(a.asname or a.name.split(".")[0])
                        if any(_private(p) for p in a.name.split(".")):
                            offenders.append(f"{where}:{node.lineno}: import {a.name}")
            elif isinstance(node, ast.ImportFrom):
                names = [a.name for a in node.names]
                mod = node.module or ""
                if node.level == 0 and (mod == "funcshard" or mod.startswith("funcshard.")):
                    aliases.update(a.asname or a.name for a in node.names)
                    bad = any(_private(p) for p in mod.split(".")) or any(_private(n) for n in names)
                elif node.level >= 1:  # resolved against the file's package
                    pkg = ["funcshard", *path.relative_to(ROOT).parent.parts]
                    base = pkg[: len(pkg) - (node.level - 1)]
                    target = [*base, *(mod.split(".") if mod else [])]
                    if target[:2] == ["funcshard", "job"]:  # a module of the job itself
                        bad = any(_private(n) for n in names)
                    else:  # leaving the job: only "from <funcshard> import <public subpackage>"
                        bad = target != ["funcshard"] or any(_private(n) for n in names)
                else:
                    continue
                if bad:
                    offenders.append(f"{where}:{node.lineno}: from {'.' * node.level}{mod} import {', '.join(names)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if isinstance(node.value, ast.Name) and node.value.id in aliases:
                    offenders.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offenders, "the job reaches into funcshard's private names:\n" + "\n".join(offenders)


def test_no_module_imports_a_private_name() -> None:
    """``from .x import _y`` nowhere in the package: a helper shared across modules has a plain name (in a
    private module); importing a private *module* (``from . import _prims``) is how the library is built."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.module is None or node.module == "__future__":
                continue
            if node.level == 0 and not node.module.startswith("funcshard"):
                continue
            bad = [a.name for a in node.names if _private(a.name)]
            if bad:
                where = f"funcshard/{path.relative_to(ROOT)}:{node.lineno}"
                offenders.append(f"{where}: from {'.' * node.level}{node.module} import {', '.join(bad)}")
    assert not offenders, "private names imported across modules:\n" + "\n".join(offenders)


MAX_FUNCTION_LINES = 80


def test_no_function_longer_than_80_lines() -> None:
    """Every function under ``funcshard/`` (kernels too) fits in 80 lines, counted from its ``def`` line to its
    last line."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    offenders.append(f"funcshard/{path.relative_to(ROOT)}:{node.lineno} {node.name} {length}")
    assert not offenders, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


BACKENDS = "_src.runtime.backends"  # the backends and their registry: the one place that knows them by name
BACKEND_NAMES = frozenset({"sim", "dist", "dtensor", "abstract"})
REGISTRY_USERS = {"_src.runtime.mesh"}  # the one module that asks the registry; the rest ask the mesh


def _outside_backends() -> list[tuple[str, Path]]:
    mods = [(_module_name(p), p) for p in sorted(ROOT.rglob("*.py"))]
    return [(m, p) for m, p in mods if not (m == BACKENDS or m.startswith(BACKENDS + "."))]


def _names_a_backend(node: ast.AST) -> bool:
    """A string constant that is a backend's name, or a tuple / list / set of values holding one."""
    if isinstance(node, ast.Constant):
        return node.value in BACKEND_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_backend(e) for e in node.elts)
    return False


def test_no_backend_name_is_compared_outside_the_backends() -> None:
    """Backends declare, the rest asks: no ``mesh.backend == "sim"`` (nor ``!=``, ``in ("sim", ...)``, ``match``)
    outside ``runtime/backends/``. Ask ``mesh.is_multiprocess``, a capability of ``mesh.backend_impl`` or of the
    device handle, or a process question of the mesh (``mesh.process_index()``, ...); ``mesh.backend`` may be read
    to print it."""
    offenders = []
    for _, path in _outside_backends():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"funcshard/{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                backend_attr = any(isinstance(s, ast.Attribute) and s.attr == "backend" for s in sides)
                if backend_attr or any(_names_a_backend(s) for s in sides):
                    offenders.append(f"{where}: {ast.unparse(node)}")
            elif isinstance(node, ast.Match) and any(
                isinstance(c.pattern, ast.MatchValue) and _names_a_backend(c.pattern.value) for c in node.cases
            ):
                offenders.append(f"{where}: match on a backend name")
    assert not offenders, (
        "backend names compared outside funcshard/_src/runtime/backends/ (ask the mesh or the backend's declared "
        "capabilities instead: mesh.is_multiprocess, mesh.backend_impl.<capability>, dev.<capability>, "
        "mesh.process_index(), ...):\n" + "\n".join(offenders)
    )


def test_backends_are_reached_only_through_the_mesh() -> None:
    """Outside ``runtime/`` nothing imports ``runtime.backends`` (or one of its modules); inside ``runtime/``
    only ``runtime.mesh`` asks the registry (the package itself, never a backend's module): everything else gets a
    backend from a mesh (``mesh.backend_impl``) or from ``runtime.mesh.get_backend``."""
    offenders = []
    for mod, path in _outside_backends():
        for target in _imports(path, mod):
            if target == BACKENDS and mod in REGISTRY_USERS:
                continue
            if target == BACKENDS or target.startswith(BACKENDS + "."):
                offenders.append(f"funcshard.{mod} imports funcshard.{target}")
    assert not offenders, (
        "backend modules imported outside funcshard/_src/runtime/backends/ (only runtime.mesh may import the "
        "registry, runtime.backends; the rest ask the mesh: mesh.backend_impl, runtime.mesh.get_backend):\n"
        + "\n".join(offenders)
    )


def test_no_probe_for_optional_device_methods() -> None:
    """A device handle's optional powers are declared capabilities (``dev.inplace_sum``, ``dev.pending_results``,
    ``dev.point_to_point``, with defaults in ``DeviceHandle``), read as attributes, not probed with
    ``getattr(dev, "...", None)`` / ``hasattr(dev, "...")``."""
    probe = re.compile(r"\b(getattr|hasattr)\(\s*(ctx\.|self\.)?(dev|device|handle)\s*,\s*[\"']")
    offenders = [
        f"funcshard/{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for _, path in _outside_backends()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if probe.search(line)
    ]
    assert not offenders, "device handles probed for optional methods (declare a capability):\n" + "\n".join(offenders)


def test_package_root_holds_public_modules_and_one_private_package() -> None:
    """The package root: ``__init__.py``, ``__main__.py``, the public modules and subpackages, and ``_src/``, the
    one private package (the core); every private module lives inside it."""
    private = sorted(
        p.name
        for p in ROOT.iterdir()
        if p.name.startswith("_") and p.name not in {"__init__.py", "__main__.py", "__pycache__", "_src"}
    )
    assert not private, f"private modules at the package root (move them into funcshard/_src/): {private}"
    assert (ROOT / "_src" / "__init__.py").is_file()
