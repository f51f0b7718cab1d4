"""The import graph of mjax/ keeps docs/design.md's layer order: a module imports only modules of its own layer or a
lower one, and the library never imports the tooling (benchmarks/, tools/, scripts/, tests/)."""

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mjax"

# Lowest first. A module belongs to the first entry that is a prefix of its dotted name; leaves import nothing of
# mjax but each other.
LAYERS = (
    ("leaf", ("mjax.sharding", "mjax.kernels.options", "mjax.config", "mjax.logging_setup", "mjax.xla_flags")),
    ("kernels", ("mjax.kernels",)),
    ("model", ("mjax.model",)),
    ("parallel", ("mjax.parallel",)),
    ("data", ("mjax.data",)),
    ("storage", ("mjax.storage",)),
    ("train", ("mjax.train",)),
    ("plan", ("mjax.plan",)),
    ("uses", ("mjax.convert", "mjax.inference")),
    ("cli", ("mjax.cli",)),
    ("package", ("mjax",)),  # mjax/__init__.py: the top-level API (load_pretrained)
)
# What a layer may import beyond lower layers, where the design says a layer is narrower than "everything below".
NARROWER = {
    "kernels": ("leaf",),  # kernels import sharding and their option names only
    "data": ("leaf",),  # data imports config only
}
TOOLING = ("benchmarks", "tools", "scripts", "tests")


def _layer_of(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} belongs to no layer of docs/design.md: add it to LAYERS (and the doc)")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _known() -> frozenset[str]:
    """The modules of mjax/ (walked once: per file it made these tests quadratic in the package's size)."""
    return frozenset(_module_name(p) for p in PACKAGE.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports count too). `from package import module`
    counts the module, not the package (whose __init__ runs, but holds only re-exports or nothing)."""
    known = _known()
    tree, names = ast.parse(path.read_text()), set()
    package = _module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & known
            names.update(subs if len(subs) == len(node.names) else {base, *subs})
    return names


def _mjax_modules(names: set[str]) -> set[str]:
    return names & _known()


def test_no_lower_layer_imports_a_higher_one():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        mine = _layer_of(me)
        name = LAYERS[mine][0]
        allowed = {LAYERS[i][0] for i in range(mine + 1)} if name not in NARROWER else {name, *NARROWER[name]}
        for other in sorted(_mjax_modules(_imports(path))):
            theirs = LAYERS[_layer_of(other)][0]
            if theirs not in allowed:
                problems.append(f"{me} ({name}) imports {other} ({theirs})")
    assert not problems, "layer order broken:\n" + "\n".join(problems)


def test_the_library_never_imports_tooling():
    bad = [f"{_module_name(p)} imports {n}" for p in PACKAGE.rglob("*.py") for n in _imports(p)
           if n.split(".")[0] in TOOLING]
    assert not bad, "\n".join(bad)


def test_leaves_load_no_jax_where_promised():
    """Config validation and the kernels' option names import nothing heavy (checked statically: no jax, flax,
    numpy-free is not required)."""
    for module in ("mjax/kernels/options.py", *(str(p.relative_to(ROOT)) for p in (PACKAGE / "config").glob("*.py"))):
        heavy = {n for n in _imports(ROOT / module) if n.split(".")[0] in ("jax", "flax", "optax", "orbax")}
        assert not heavy, f"{module} imports {sorted(heavy)}"
