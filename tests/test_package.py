import subprocess
import sys

import verl_replay


def test_import_is_light():
    """``import verl_replay`` must not pull in verl, ray or torch (public names resolve lazily)."""
    code = (
        "import sys, verl_replay; "
        "print(sorted(m for m in ('verl', 'ray', 'torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_every_public_name_resolves():
    for name in verl_replay.__all__:
        assert getattr(verl_replay, name) is not None, name


def _imports_of(module: str, path) -> set[str]:
    """Every verl_replay module ``module`` names in an import, at any level (lazy, TYPE_CHECKING)."""
    import ast

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _module_graph() -> dict[str, set[str]]:
    from pathlib import Path

    root = Path(verl_replay.__file__).parent
    paths = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        paths[name.removesuffix(".__init__")] = path
    return {m: {t for t in _imports_of(m, p) if t in paths and t != m} for m, p in paths.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_cycle_finder_sees_a_cycle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_modules():
    """Modules depend one way: a lazy or TYPE_CHECKING import back is still a cycle."""
    graph = _module_graph()
    assert "verl_replay.data.tiny_assets" in graph["verl_replay.data.__main__"]  # the walk sees lazy imports
    assert _cycles(graph) == []


def test_math_domain_is_a_package_like_sql():
    import verl_replay.math as math_domain

    assert math_domain.MathKeywordLabeler.__module__ == "verl_replay.math.descriptor"
    for name in math_domain.__all__:
        assert getattr(math_domain, name) is not None, name


def test_readme_setup_commands_are_the_ones_ci_runs():
    """.ci/run copies the README's two commands; a change to one must reach the other."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text(encoding="utf-8")
    ci = [
        line
        for line in (repo / ".ci" / "run").read_text(encoding="utf-8").splitlines()
        if line.startswith(("bash scripts/install_cpu.sh", ". .venv"))
    ]
    assert ci == [
        "bash scripts/install_cpu.sh",
        ". .venv/bin/activate && ruff check . && ruff format --check . && python -m pytest",
    ]
    assert f"{ci[0]} && . .venv/bin/activate && python -m verl_replay.main" in readme and ci[1] in readme
    for link in (
        "docs/headroom_drift.md",
        "docs/elite_replay.md",
        "docs/metrics.md",
        "docs/settings.md",
        "docs/running.md",
    ):
        assert f"]({link}" in readme and (repo / link).is_file(), link
    assert "shared/SPEC.md" not in readme
    for paper in ("https://arxiv.org/abs/2609.03941", "https://arxiv.org/abs/2610.22290"):
        assert paper in readme, paper  # both papers named and linked


def test_no_file_cites_the_internal_spec_sections():
    """Docs, code and messages define what they use in their own words: a user of the repository
    has no SPEC document to look sections up in."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    citation = re.compile(r"\bSPEC\b(?!IAL)|§")
    cited = []
    for name in files:
        path = repo / name
        if path.suffix in (".png", ".parquet") or not path.is_file() or name == "tests/test_package.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if citation.search(line):
                cited.append(f"{name}:{number}: {line.strip()}")
    assert not cited, "\n".join(cited)
