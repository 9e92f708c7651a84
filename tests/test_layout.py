"""The library's folders follow the pipeline, and each imports only the folders below it (docs/concepts.md, "Where the
code lives"): read from the source's imports (function-level ones included), nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent

ORDER = ["", "logits", "exact", "inputs", "backends", "stores", "format", "teacher", "evaluation", "training", "asyncopd", "demo", "cli"]
"""Bottom to top: "" is the package's top level (dependencies, errors, progress, threads, storage, untrusted)."""


def modules() -> dict[str, Path]:
    """Every library module by dotted name (cli/ is installed as opdcache.cli)."""
    found = {}
    for base, prefix in ((ROOT / "opdcache", "opdcache"), (ROOT / "cli", "opdcache.cli")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix] + parts)] = path
    return found


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The library modules ``name`` imports anywhere in its file (``from P import x``: the module P.x if x is one,
    else P)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("opdcache") and t != name:
                out.add(t)
    return out


def folder(name: str) -> str:
    """A module's folder in ORDER: its first component under opdcache (a top-level module's is "")."""
    parts = name.split(".")
    if len(parts) == 1:
        return ""
    return parts[1] if parts[1] in ORDER else ""


def test_every_folder_is_placed():
    assert {folder(m) for m in modules()} <= set(ORDER)
    top = sorted(m for m in modules() if folder(m) == "" and m != "opdcache")
    assert top == ["opdcache.dependencies", "opdcache.errors", "opdcache.progress", "opdcache.storage", "opdcache.threads", "opdcache.untrusted"], top


def test_no_module_imports_a_folder_above_its_own():
    known = modules()
    upward = [f"{a} -> {b}" for a, path in sorted(known.items()) for b in sorted(imports(a, path, known))
              if ORDER.index(folder(b)) > ORDER.index(folder(a))]
    assert not upward, upward


def test_no_circle_of_imports():
    known = modules()
    graph = {a: imports(a, p, known) - {"opdcache"} for a, p in known.items()}
    state: dict[str, int] = {}  # 1 on the path, 2 done
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not circles, circles


def test_concepts_names_the_current_format_and_only_the_registered_engines():
    """docs/concepts.md said format v1-v4 when v6 existed and listed `streamed` as an engine: it names the newest
    frozen snapshot and, as the engines, exactly the registry's names."""
    import re
    from pathlib import Path

    from opdcache.backends import ENGINES
    from opdcache.format.schema import FORMAT_VERSION

    text = (Path(__file__).parent.parent / "docs" / "concepts.md").read_text()
    assert f"`format-v{FORMAT_VERSION}.json`" in text
    assert (Path(__file__).parent.parent / "schemas" / f"format-v{FORMAT_VERSION}.json").is_file()
    listed = re.search(r"the engines \(`ENGINES`: ([^;)]*)", text)
    assert listed and sorted(n.strip() for n in listed.group(1).split(",")) == sorted(ENGINES)


def test_no_module_outside_the_backends_names_an_engine():
    """Engines are chosen by name only in opdcache/backends/ (``ENGINES``); every other module reads what an engine
    declares (its Capabilities): no import of an engine's module, no engine class, no test of a backend's name."""
    import ast
    import re
    from pathlib import Path

    from opdcache.backends import ENGINES

    root = Path(__file__).parent.parent
    engine_modules = set(ENGINES.values())
    classes = set()
    for module in engine_modules:
        tree = ast.parse((root / (module.replace(".", "/") + ".py")).read_text())
        classes |= {n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("Backend")}
    assert {"TransformersBackend", "ExactBackend", "VLLMBackend"} <= classes
    by_name = re.compile(r"\.backend\s*(==|!=|\bin\b|\bnot in\b)|\bbackend\s*(==|!=)\s*[\"']")
    found = []
    for path in sorted([*(root / "opdcache").rglob("*.py"), *(root / "cli").rglob("*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("opdcache/backends/"):
            continue
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in engine_modules:
                found.append(f"{rel}:{node.lineno} imports {node.module}")
            if isinstance(node, ast.ImportFrom) and node.module == "opdcache.backends":
                found += [f"{rel}:{node.lineno} imports {a.name}" for a in node.names if a.name in {m.rsplit('.', 1)[1] for m in engine_modules}]
            if isinstance(node, ast.Name) and node.id in classes:
                found.append(f"{rel}:{node.lineno} names {node.id}")
        found += [f"{rel}:{text[:m.start()].count(chr(10)) + 1} tests a backend's name" for m in by_name.finditer(text)]
    assert not found, found
