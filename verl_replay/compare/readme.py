"""The README's headline numbers, generated from the committed comparisons.

    python -m verl_replay.compare.readme            # rewrite the generated parts of README.md
    python -m verl_replay.compare.readme --check    # exit 1 if they differ from the comparisons

``README.md`` quotes the committed comparisons (``docs/comparison/<profile>/comparison.json``) in
blocks between ``<!-- generated: NAME ... -->`` and ``<!-- end generated: NAME -->``; this module
renders every block from the documents (aggregated again with today's statistics, as
``python -m verl_replay.compare --from-json`` does), so a new comparison changes the README with
one command instead of by hand. ``tests/compare/test_readme.py`` checks that the README's blocks
and every interval its prose quotes come from the documents.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from verl_replay._files import atomic_write_text
from verl_replay.compare.report import _fmt_gain, _fmt_paired, reaggregate

__all__ = ["BLOCKS", "load_comparison", "quoted_numbers", "render_blocks", "update_readme"]

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
COMPARISONS = REPO / "docs" / "comparison"

_BLOCK = re.compile(
    r"(?P<head><!-- generated: (?P<name>[\w-]+) [^>]*-->)(?P<body>.*?)(?P<tail><!-- end generated: (?P=name) -->)",
    re.DOTALL,
)
_SEEDS = re.compile(r" \(\d+ seeds?\)")


def load_comparison(profile: str, root: Path = COMPARISONS) -> dict[str, Any]:
    """``root/<profile>/comparison.json``, aggregated again (one comparison per profile)."""
    return reaggregate(json.loads((root / profile / "comparison.json").read_text(encoding="utf-8")))


def _arms(document: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(document["comparisons"][0]["arms"])


def _control(arm: Mapping[str, Any]) -> bool:
    return "control" in arm["name"]


def _gain(arm: Mapping[str, Any]) -> str:
    """``+33.3 [+28.3, +38.2]``: the gain in points with its 95% interval (seeds in their column)."""
    return _SEEDS.sub("", _fmt_paired(arm.get("gain") or {}))


def _pct(stat: Mapping[str, Any]) -> str:
    return "–" if stat.get("mean") is None else f"{100 * stat['mean']:.1f}%"


def _primary(comparison: Mapping[str, Any]) -> tuple[str, str]:
    """(result key, short title) of the comparison's primary metric."""
    key = comparison["primary_metric"]["key"]
    n = comparison["val_n"]
    return key, "exact accuracy" if key == "post_exact" else f"Mean@{n}"


def arith_table(document: Mapping[str, Any]) -> str:
    """The addition profile's table: per arm the final held-out Mean@n, its gain over the run with
    a 95% interval, the primary metric paired with GRPO by seed, and the collapsed seeds
    (reference, controls, then the other arms in the comparison's order)."""
    comparison = document["comparisons"][0]
    steps = next(iter(document["settings"]["steps"].values()))
    n = comparison["val_n"]
    key, title = _primary(comparison)
    arms = _arms(document)
    ordered = arms[:1] + [a for a in arms[1:] if _control(a)] + [a for a in arms[1:] if not _control(a)]
    lines = [
        f"| arm | seeds | held-out Mean@{n}, final | gain in {steps} steps, 95% interval "
        f"| paired vs GRPO, {title} over post-training evaluations | collapsed seeds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm in ordered:
        paired = (arm.get("paired") or {}).get(key)
        cells = [
            arm["label"],
            str(len(arm["seeds"])),
            _pct(arm["summary"]["final_mean"]),
            _gain(arm),
            _SEEDS.sub("", _fmt_paired(paired)) if paired else "–",
            str(len(arm.get("collapsed_seeds") or [])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "(bN: N fresh responses a step; +rM: up to M replayed responses a step.)"]
    return "\n".join(lines)


def main_contrasts(document: Mapping[str, Any]) -> str:
    """A comparison's main contrasts, each with its interval and the smallest effect its seeds
    could detect."""
    comparison = document["comparisons"][0]
    kind = comparison["primary_metric"]["kind"]
    unit, scale, spec = (" points", 100.0, ".1f") if kind == "pct" else ("", 1.0, ".2f")
    labels = {arm["name"]: arm["label"].split(" (")[0] for arm in comparison["arms"]}
    parts = []
    for c in comparison["contrasts"]:
        if not c["main"]:
            continue
        interval = _SEEDS.sub("", _fmt_paired(c, kind))
        mde = "–" if c.get("mde") is None else format(scale * c["mde"], spec)
        parts.append(
            f"{labels[c['arm']]} - {labels[c['reference']]} {interval}{unit} over {c['n']} seeds "
            f"(smallest detectable: {mde})"
        )
    return "; ".join(parts)


def arith_tools_sentence(document: Mapping[str, Any]) -> str:
    """The Tools section's one-line summary of the addition comparison."""
    arms = _arms(document)
    grpo, control = arms[0], next(a for a in arms if _control(a))
    steps = next(iter(document["settings"]["steps"].values()))
    rise, fall = 100 * grpo["gain"]["mean"], -100 * control["gain"]["mean"]
    return (
        f"on the learnable addition profile GRPO raises held-out sampled accuracy by {rise:+.1f} points in "
        f"{steps} steps while its random-reward control falls by {fall:.1f}"
    )


# block name -> (profile, renderer)
BLOCKS = {
    "arith-table": ("arith", arith_table),
    "arith-contrasts": ("arith", main_contrasts),
    "shapes-contrasts": ("shapes", main_contrasts),
    "arith-tools": ("arith", arith_tools_sentence),
}


def render_blocks(root: Path = COMPARISONS) -> dict[str, str]:
    documents: dict[str, dict[str, Any]] = {}
    rendered = {}
    for name, (profile, render) in BLOCKS.items():
        if profile not in documents:
            documents[profile] = load_comparison(profile, root)
        rendered[name] = render(documents[profile])
    return rendered


def _fill(text: str, rendered: Mapping[str, str]) -> tuple[str, list[str]]:
    """``text`` with every block's body replaced by its rendering; the blocks found."""
    found: list[str] = []

    def body(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in rendered:
            raise ValueError(f"README block {name!r} has no renderer; known: {', '.join(rendered)}")
        found.append(name)
        inner = rendered[name]
        # a block in a table or a list spans lines; one inside a sentence stays inline
        around = "\n" if "\n" in match["body"] or "\n" in inner else ""
        return f"{match['head']}{around}{inner}{around}{match['tail']}"

    return _BLOCK.sub(body, text), found


def update_readme(readme: Path = README, root: Path = COMPARISONS, *, check: bool = False) -> bool:
    """Rewrite the generated blocks (``check``: only compare); True when the README is up to date."""
    text = readme.read_text(encoding="utf-8")
    filled, found = _fill(text, render_blocks(root))
    missing = sorted(set(BLOCKS) - set(found))
    if missing:
        raise ValueError(f"{readme} lacks the generated block(s) {', '.join(missing)}")
    if filled == text:
        return True
    if not check:
        atomic_write_text(readme, filled)
    return False


def quoted_numbers(documents: Sequence[Mapping[str, Any]]) -> set[str]:
    """Every interval (``+33.3 [+28.3, +38.2]``) and standard-error count the documents yield:
    each arm's gain, each paired difference in points or (strategies) as counts, each contrast."""
    numbers: set[str] = set()
    for document in documents:
        for comparison in document["comparisons"]:
            for arm in comparison["arms"]:
                gain = arm.get("gain") or {}
                numbers.add(_SEEDS.sub("", _fmt_paired(gain)))
                text = _fmt_gain(gain)
                if text.endswith(" SE"):
                    numbers.add(text.rsplit(", ", 1)[1].removesuffix(" SE"))
                for key, diff in (arm.get("paired") or {}).items():
                    kind = "num" if "strategies" in key else "pct"
                    numbers.add(_SEEDS.sub("", _fmt_paired(diff, kind)))
            kind = (comparison.get("primary_metric") or {}).get("kind", "pct")
            for contrast in comparison.get("contrasts") or []:
                numbers.add(_SEEDS.sub("", _fmt_paired(contrast, kind)))
    return numbers


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_replay.compare.readme", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the README is out of date")
    options = parser.parse_args(argv)
    try:
        current = update_readme(check=options.check)
    except (OSError, ValueError, KeyError) as error:
        print(f"verl_replay.compare.readme: error: {error}", file=sys.stderr)
        return 2
    if options.check and not current:
        print(
            "verl_replay.compare.readme: README.md's generated numbers differ from docs/comparison/*/comparison.json; "
            "run python -m verl_replay.compare.readme",
            file=sys.stderr,
        )
        return 1
    print("README.md: up to date" if current else "README.md: generated numbers rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
