"""plot_replay_dynamics.py on a log written by the real buffer over 30 synthetic steps."""

from __future__ import annotations

import importlib.util
import json
import struct
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from verl_replay.headroom_drift.buffer import HeadroomDriftBuffer, ReplayGroup
from verl_replay.headroom_drift.events import ReplayEventLog, fresh_record

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot_replay_dynamics.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("plot_replay_dynamics", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _group(gen: torch.Generator) -> ReplayGroup:
    n = 4
    lengths = torch.randint(1, 6, (n,), generator=gen)
    L = int(lengths.sum())
    correct = torch.tensor([True, False, bool(torch.rand(1, generator=gen) > 0.5), False])
    adv = torch.where(correct, 1.0, -1.0)
    # spread initial Headroom: sharp (near 0) vs diffuse log-probs per group
    sharp = float(torch.rand(1, generator=gen)) * 3
    return ReplayGroup(
        prompt_ids=torch.arange(3),
        response_ids=torch.randint(0, 50, (L,), generator=gen),
        response_lengths=lengths,
        response_mask=torch.ones(L, dtype=torch.bool),
        gen_log_probs=-sharp * torch.rand(L, generator=gen),
        advantages=adv,
        correct=correct,
        scores=correct.float(),
    )


def _scorer(step: int):
    def score(groups):
        out = []
        for g in groups:
            gen = torch.Generator().manual_seed(g.group_id * 7_919 + step)
            scale = 0.05 * (1 + (g.group_id + step) % 6)  # drift grows with some groups
            out.append(g.gen_log_probs + scale * torch.randn(g.num_tokens, generator=gen))
        return out

    return score


@pytest.fixture()
def logged_run(tmp_path):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        buf = HeadroomDriftBuffer(capacity=40, k_rep=3, tau=0.17, scan_chunk_groups=4, max_scan_groups=12)
        path = tmp_path / "runs" / "x" / "replay_events.jsonl"
        groups: list[ReplayGroup] = []
        results = []
        with ReplayEventLog(path) as log:
            for step in range(30):
                res = buf.select(step, _scorer(step))
                log.log_selection(res)
                fresh = [_group(gen) for _ in range(4)]
                # split placement: generated one version behind the weights the step started from
                adm = buf.admit(fresh, step, generated_versions=[step - 2] * len(fresh))
                log.log_admit(adm)
                log.write(fresh_record(step=step, age=[1] * 4, drift=[0.02 + 0.01 * i for i in range(4)]))
                log.log_step(step, {**res.stats, "ingress": adm["ingress"]})
                groups += [g for g in fresh if g.group_id >= 0]
                results.append(res)
        yield path, groups, results
    finally:
        torch.set_num_threads(old)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, ctype = struct.unpack(">I4s", data[8:16])
    assert ctype == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100
    assert zlib.crc32(data[12:29]) == struct.unpack(">I", data[29:33])[0]  # IHDR CRC
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82"


def test_plots_and_tables_match_direct_computation(logged_run, tmp_path):
    path, groups, results = logged_run
    mod = _load_script()
    out = tmp_path / "plots"
    tables = mod.main(["--events", str(path), "--out-dir", str(out)])
    for name in mod.PLOTS.values():
        _assert_png(out / name)
    assert (out / "tables.json").exists()

    # (a) deciles from the in-memory groups: lifetime replay_count is kept on the object
    assert len(groups) == 120 and sum(g.replay_count for g in groups) > 0
    h = np.array([g.headroom_ref for g in groups])
    ids = np.array([g.group_id for g in groups])
    order = np.lexsort((ids, h))
    rc = np.array([g.replay_count for g in groups])[order]
    dec = (10 * np.arange(len(groups))) // len(groups)
    rows = tables["deciles"]
    assert [r["decile"] for r in rows] == list(range(1, 11))
    for d, row in enumerate(rows):
        sel = rc[dec == d]
        assert row["groups"] == len(sel) == 12
        assert row["mean_replays"] == pytest.approx(sel.mean())
        assert row["p_replayed"] == pytest.approx((sel > 0).mean())
        assert row["headroom_min"] == pytest.approx(h[order][dec == d].min())
    # the ranking favours high initial Headroom: top decile replayed more than the bottom one
    assert rows[-1]["mean_replays"] > rows[0]["mean_replays"]

    # (b) acceptance vs age from the selection results
    scans, acc = Counter(), Counter()
    for res in results:
        for r in res.records:
            scans[r.age] += 1
            acc[r.age] += r.accepted
    assert [r["age"] for r in tables["age"]] == sorted(scans)
    for row in tables["age"]:
        assert row["scans"] == scans[row["age"]]
        assert row["acceptance_rate"] == pytest.approx(acc[row["age"]] / scans[row["age"]])
    assert 0 < sum(acc.values()) < sum(scans.values())

    assert min(scans) >= 2  # admitted one version stale, scanned at least a step later
    assert tables["fresh_age"] == [{"age": 1, "groups": 4 * 30}]

    # (c) scan depth / accepted per step from the stats
    assert [r["step"] for r in tables["steps"]] == list(range(30))
    for row, res in zip(tables["steps"], results, strict=True):
        assert row["scan_depth"] == res.stats["scan_depth"]
        assert row["accepted"] == len(res.groups)

    # (d) drift per step from the selection results, the floor from the fresh records
    by_step = {row["step"]: row for row in tables["drift"]}
    assert sorted(by_step) == list(range(30))
    for res in results:
        row = by_step[res.step]
        assert row["drift_accepted"] == [r.drift for r in res.records if r.accepted]
        assert row["drift_rejected"] == [r.drift for r in res.records if not r.accepted]
        assert row["floor_p50"] == pytest.approx(0.035) and row["floor_p90"] == pytest.approx(0.047)


def test_completed_only_and_empty_log(logged_run, tmp_path):
    path, groups, _ = logged_run
    mod = _load_script()
    tables = mod.main(["--events", str(path), "--out-dir", str(tmp_path / "a"), "--completed-only"])
    evicted = [g for g in groups if g.group_id < 120 - 40]  # capacity 40: oldest 80 evicted
    assert sum(r["groups"] for r in tables["deciles"]) == len(evicted)
    assert sum(r["mean_replays"] * r["groups"] for r in tables["deciles"]) == pytest.approx(
        sum(g.replay_count for g in evicted)
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    t = mod.main(["--events", str(empty), "--out-dir", str(tmp_path / "b")])
    assert t == {"deciles": [], "age": [], "fresh_age": [], "steps": [], "drift": []}
    assert json.loads((tmp_path / "b" / "tables.json").read_text())["settings"] == {
        "strategy": None,
        "tau": None,
        "k_rep": None,
    }
    for name in mod.PLOTS.values():
        _assert_png(tmp_path / "b" / name)


def _integral(values) -> bool:
    return all(float(v).is_integer() for v in values)


def test_plots_show_counts_integer_ticks_and_the_runs_settings(logged_run, tmp_path):
    path, _, _ = logged_run
    (path.parent / "config.yaml").write_text(
        "run_dir: x\nreplay:\n  strategy: headroom_drift\n  tau: 0.17\n  k_rep: 3\n  capacity: 40\n"
    )
    mod = _load_script()
    events = mod.read_events(path)
    tables = mod.compute_tables(events)
    settings = mod.run_settings(path)
    assert settings == {"strategy": "headroom_drift", "tau": 0.17, "k_rep": 3}
    label = mod.settings_label(settings)
    assert label == " (headroom_drift, tau=0.17, K_rep=3)"
    assert mod.settings_label({"strategy": "naive", "tau": 0.05, "k_rep": 2}) == " (naive, K_rep=2)"
    assert mod.settings_label(mod.run_settings(path, tau=0.5, k_rep=7)) == " (headroom_drift, tau=0.5, K_rep=7)"

    deciles = mod.plot_deciles(tables["deciles"], tmp_path / "d.png", False, label)
    ax = deciles.axes[0]
    assert ax.get_title().endswith("(headroom_drift, tau=0.17, K_rep=3)")
    assert [t.get_text() for t in ax.texts] == [f"n={r['groups']}" for r in tables["deciles"]] == ["n=12"] * 10

    age = mod.plot_age(tables["age"], tmp_path / "a.png", label)
    rate_ax, counts_ax = age.axes
    assert _integral(rate_ax.get_xticks()) and _integral(counts_ax.get_yticks())
    heights = [patch.get_height() for patch in counts_ax.patches]
    assert heights == [r["scans"] for r in tables["age"]]  # the scans behind every rate
    assert rate_ax.get_title().endswith("(headroom_drift, tau=0.17, K_rep=3)")

    steps = mod.plot_steps(tables["steps"], tmp_path / "s.png", label, settings["k_rep"])
    ax = steps.axes[0]
    assert _integral(ax.get_xticks()) and _integral(ax.get_yticks())
    assert "K_rep = 3" in [line.get_label() for line in ax.get_lines()]

    age = mod.plot_age(tables["age"], tmp_path / "a2.png", label, tables["fresh_age"])
    assert "fresh groups" in age.axes[0].get_legend_handles_labels()[1]
    drift = mod.plot_drift(tables["drift"], tmp_path / "f.png", label, settings["tau"])
    ax = drift.axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines["tau = 0.17"].get_ydata()) == {0.17}
    assert list(lines["drift floor (fresh p50)"].get_ydata()) == pytest.approx([0.035] * 30)
    assert ax.get_title().endswith("(headroom_drift, tau=0.17, K_rep=3)")

    mod.main(["--events", str(path), "--out-dir", str(tmp_path / "plots")])
    assert json.loads((tmp_path / "plots" / "tables.json").read_text())["settings"]["tau"] == 0.17


def test_the_naive_baseline_gets_no_drift_plot(logged_run, tmp_path):
    path, _, _ = logged_run
    (path.parent / "config.yaml").write_text("replay:\n  strategy: naive\n  k_rep: 3\n")
    mod = _load_script()
    out = tmp_path / "naive"
    mod.main(["--events", str(path), "--out-dir", str(out)])
    assert not (out / mod.PLOTS["drift"]).exists() and (out / mod.PLOTS["steps"]).exists()


def test_the_drift_plots_title_names_only_what_it_draws(logged_run, tmp_path):
    """A sync run's log has no fresh drifts: its plot draws no floor and its title names none."""
    path, _, _ = logged_run
    mod = _load_script()
    rows = mod.drift_table(mod.read_events(path))
    assert mod.plot_drift(rows, tmp_path / "both.png", tau=0.17).axes[0].get_title() == (
        "Policy Drift of the scanned groups against tau and the drift floor"
    )
    no_floor = [{**row, "floor_p50": None, "floor_p90": None} for row in rows]
    ax = mod.plot_drift(no_floor, tmp_path / "sync.png", tau=0.17).axes[0]
    assert ax.get_title() == "Policy Drift of the scanned groups against tau"
    assert "drift floor (fresh p50)" not in [line.get_label() for line in ax.get_lines()]
    assert mod.plot_drift(no_floor, tmp_path / "none.png").axes[0].get_title() == "Policy Drift of the scanned groups"


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "nonexistent.jsonl", "nonexistent.jsonl: not found"),
        (lambda d: d, "is a folder, not a file"),
        (lambda d: _write(d / "bad.jsonl", "not json\n"), "bad.jsonl:1: malformed event record"),
        (lambda d: _write(d / "other.jsonl", '{"step": 1, "data": {}}\n'), "not a replay event record"),
        (lambda d: _write(d / "bin.jsonl", b"\xff\xfe\x00\n"), "not a text file"),
    ],
)
def test_a_bad_input_is_one_line_and_exit_code_2(tmp_path, make, message):
    import subprocess
    import sys

    events = make(tmp_path)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--events", str(events), "--out-dir", str(tmp_path / "plots")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("plot_replay_dynamics: error: ") and message in lines[0], lines


def test_an_unreadable_config_and_an_unwritable_out_dir_are_one_line(logged_run, tmp_path, capsys):
    path, _, _ = logged_run
    mod = _load_script()
    (path.parent / "config.yaml").write_text("replay: [unclosed\n")
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--events", str(path), "--out-dir", str(tmp_path / "plots")])
    assert exit_.value.code == 2
    assert "config.yaml: not a YAML config" in capsys.readouterr().err
    (path.parent / "config.yaml").unlink()
    blocker = _write(tmp_path / "a_file", "")
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--events", str(path), "--out-dir", str(blocker / "plots")])
    err = capsys.readouterr().err.splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "lies under a file, not a folder" in err[0], err


def _write(path: Path, content) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path
