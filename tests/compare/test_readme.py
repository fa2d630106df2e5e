"""verl_replay.compare.readme: the README's headline numbers come from the committed comparisons."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from verl_replay.compare import readme

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = re.compile(r"[+-]\d+(?:\.\d+)? \[[+-]\d+(?:\.\d+)?, [+-]\d+(?:\.\d+)?\]")


def test_the_readmes_generated_blocks_agree_with_the_committed_comparisons():
    assert readme.update_readme(ROOT / "README.md", ROOT / "docs" / "comparison", check=True), (
        "README.md's generated numbers differ from docs/comparison/*/comparison.json: "
        "run python -m verl_replay.compare.readme"
    )


def test_every_interval_and_standard_error_the_readme_quotes_is_in_a_comparison():
    documents = [readme.load_comparison(p.parent.name) for p in sorted((ROOT / "docs" / "comparison").glob("*/*.json"))]
    known = readme.quoted_numbers(documents)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quoted = INTERVAL.findall(text)
    assert len(quoted) >= 10  # the table's and the prose's
    assert [q for q in quoted if q not in known] == []
    for se in re.findall(r"(\d+\.\d) standard errors", text):
        assert se in known, se


def test_the_blocks_follow_the_json(tmp_path):
    """A changed comparison changes the README's table and sentence; --check notices first."""
    root = tmp_path / "comparison"
    for profile in ("arith", "shapes"):
        shutil.copytree(ROOT / "docs" / "comparison" / profile, root / profile)
    document = json.loads((root / "arith" / "comparison.json").read_text())
    for arm in document["comparisons"][0]["arms"]:
        if arm["name"] == "grpo_matched":
            for run in arm["runs"].values():
                run["final_mean"] += 0.1  # every seed ends 10 points higher
                run["val_curve"][-1]["mean"] += 0.1
    (root / "arith" / "comparison.json").write_text(json.dumps(document))
    page = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", page)
    assert not readme.update_readme(page, root, check=True)
    assert page.read_text() == (ROOT / "README.md").read_text()  # --check writes nothing
    assert not readme.update_readme(page, root)
    text = page.read_text()
    assert "| GRPO on-policy b64 | 3 | 85.6% | +43.3 [+38.3, +48.2] | – | 0 |" in text
    assert "by +43.3 points in 60 steps while its random-reward control falls by 32.2<!--" in text
    assert readme.update_readme(page, root, check=True)


def test_a_readme_without_a_block_is_refused(tmp_path):
    page = tmp_path / "README.md"
    page.write_text("# no generated blocks\n")
    with pytest.raises(ValueError, match="lacks the generated block"):
        readme.update_readme(page, ROOT / "docs" / "comparison", check=True)
