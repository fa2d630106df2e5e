"""``python -m verl_replay.compare --from-json``: a stored comparison reported again, nothing rerun."""

from __future__ import annotations

import json

import pytest

from verl_replay.compare.__main__ import main


def _stored_run(final: float, steps: int = 4) -> dict:
    # what a document written before the paired statistics holds: no fresh responses per point,
    # no mean over evaluations
    curve = [{"step": s, "mean": v, "best": v, "n": 2} for s, v in ((0, 0.1), (2, 0.2), (4, final))]
    return {
        "final_mean": final,
        "final_best": final,
        "fresh_responses": 32 * steps,
        "steps": steps,
        "val_curve": curve,
        "val_n": 2,
    }


def _stored_document() -> dict:
    arms = []
    for name, finals in (("grpo_matched", {1: 0.2, 2: 0.4}), ("headroom_drift", {1: 0.3, 2: 0.6})):
        arms.append(
            {
                "name": name,
                "label": name,
                "recipe": f"{name}.sh",
                "fresh_prompts_per_step": 8,
                "runs": {str(seed): _stored_run(v) for seed, v in finals.items()},
            }
        )
    return {
        "schema_version": 1,
        "profile": "tiny",
        "steps": {"headroom_drift": 4},
        "comparisons": [{"comparison": "headroom_drift", "arms": arms}],
    }


def test_from_json_adds_paired_differences_and_every_run(tmp_path, capsys):
    stored = tmp_path / "comparison.json"
    stored.write_text(json.dumps(_stored_document()))
    out = tmp_path / "again"
    assert main(["--from-json", str(stored), "--out", str(out)]) == 0
    doc = json.loads((out / "comparison.json").read_text())
    hd = doc["comparisons"][0]["arms"][1]
    # per seed 0.3 - 0.2 and 0.6 - 0.4: mean 0.15; the mean over the two post-training evaluations
    # (step 2 equal in both arms) moves by half of that: (0.05 + 0.1) / 2
    assert hd["paired"]["final_mean"]["mean"] == pytest.approx(0.15)
    assert hd["paired"]["post_mean"]["mean"] == pytest.approx(0.075)
    assert hd["paired"]["final_mean"]["n"] == 2 and hd["paired"]["final_mean"]["low"] is not None
    runs = {(r["arm"], r["seed"]): r["points"] for r in doc["runs"]}
    assert sorted(runs) == [("grpo_matched", 1), ("grpo_matched", 2), ("headroom_drift", 1), ("headroom_drift", 2)]
    # 32 fresh responses per global step (128 over 4 steps)
    assert [(p["step"], p["fresh_responses"]) for p in runs[("headroom_drift", 2)]] == [(0, 0), (2, 64), (4, 128)]
    assert "Paired by seed" in (out / "table.md").read_text() and "Paired by seed" in capsys.readouterr().out
    assert json.loads(stored.read_text())["schema_version"] == 1  # the stored document is left as it was


def test_from_json_refuses_what_is_not_a_comparison(tmp_path, capsys):
    bad = tmp_path / "comparison.json"
    bad.write_text('{"profile": "tiny"}')
    assert main(["--from-json", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--from-json" in err[0] and "not a comparison document" in err[0]
