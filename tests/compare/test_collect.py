"""Reading a run's metrics.jsonl / config.yaml / eval results into the comparison's numbers."""

from __future__ import annotations

import json

import pytest

from verl_replay.compare.collect import (
    RunResultError,
    borrow_step0,
    collect_run,
    read_metrics,
    read_run_metrics,
    starting_model,
    time_split,
    val_curve,
)


def _write_run(tmp_path, lines, *, prompts=4, n=4, eval_doc=None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in lines))
    (run / "config.yaml").write_text(
        f"data:\n  train_batch_size: {prompts}\nactor_rollout_ref:\n  rollout:\n    n: {n}\n"
    )
    if eval_doc is not None:
        (run / "eval").mkdir()
        (run / "eval" / "results.json").write_text(json.dumps(eval_doc))
    return run


def _val(mean, best, src="tiny_math", n=2):
    return {
        f"val-core/{src}/acc/mean@{n}": mean,
        f"val-core/{src}/acc/best@{n}/mean": best,
        f"val-core/{src}/acc/best@{n}/std": 0.1,
        f"val-aux/{src}/score/mean@{n}": 9.0,
    }


def test_collect_run_hand_computed(tmp_path):
    lines = [
        (0, _val(0.1, 0.2)),
        (
            1,
            {
                "timing_s/step": 2.0,
                "replay/scanned": 0,
                "replay/candidates": 0,
                "replay/acceptance_rate": 0.0,
                "replay/token_share": 0.0,
                "replay/accepted": 0,
            },
        ),
        (
            2,
            {
                "timing_s/step": 4.0,
                "replay/scanned": 4,
                "replay/candidates": 3,
                "replay/acceptance_rate": 0.5,
                "replay/token_share": 0.3,
                "replay/accepted": 2,
                "replay/replay_kl_accepted/mean": 0.002,
                **_val(0.3, 0.5),
            },
        ),
        (
            3,
            {
                "timing_s/step": 6.0,
                "replay/scanned": 2,
                "replay/candidates": 6,
                "replay/acceptance_rate": 1.0,
                "replay/token_share": 0.1,
                "replay/accepted": 2,
                "replay/replay_kl_accepted/mean": 0.004,
            },
        ),
    ]
    r = collect_run(_write_run(tmp_path, lines), expected_steps=3)
    assert r["steps"] == 3 and r["fresh_responses"] == 3 * 4 * 4
    assert r["step_time_s"] == pytest.approx(4.0) and r["step_time_s_after_first"] == pytest.approx(5.0)
    # step 1 scanned nothing: left out of the token share; acceptance is accepted over scanned
    # groups of the run, (2 + 2) / (4 + 2), not the mean of the per-step rates (0.75)
    assert r["replay_acceptance"] == pytest.approx(4 / 6) and r["replay_token_share"] == pytest.approx(0.2)
    assert r["replay_kl_accepted"] == pytest.approx(0.003)
    assert [p["step"] for p in r["val_curve"]] == [0, 2]
    assert r["final_mean"] == 0.3 and r["final_best"] == 0.5 and r["val_n"] == 2
    assert r["eval"] is None and r["elite_token_share"] is None
    # the mean over post-training evaluations leaves out step 0; no exact metric in this run
    assert r["post_mean"] == 0.3 and r["auc_mean"] == pytest.approx(0.2)
    assert r["final_exact"] is None and r["post_exact"] is None and "exact" not in r["val_curve"][0]


def test_the_exact_metric_is_read_per_evaluation_and_macro_averaged(tmp_path):
    def exact(a, b):
        return {"val-exact/tiny_arith/acc/expected": a, "val-exact/other/acc/expected": b}

    lines = [
        (0, {**_val(0.1, 0.2), **exact(0.1, 0.3)}),
        (1, {"timing_s/step": 1.0, **_val(0.3, 0.5), **exact(0.25, 0.35)}),
        (2, {"timing_s/step": 1.0, **_val(0.4, 0.6), **exact(0.45, 0.55)}),
    ]
    r = collect_run(_write_run(tmp_path, lines), expected_steps=2)
    assert [p["exact"] for p in r["val_curve"]] == pytest.approx([0.2, 0.3, 0.5])
    assert r["final_exact"] == pytest.approx(0.5) and r["post_exact"] == pytest.approx(0.4)
    assert r["post_mean"] == pytest.approx(0.35)


def test_a_validation_with_only_the_exact_metric_is_a_point_without_sampled_values(tmp_path):
    """sampled_val=ends: verl samples before training and at the last step; in between only the
    exact metric. The post-training exact mean reads every point, the sampled numbers the ends."""
    lines = [
        (0, {**_val(0.1, 0.2), "val-exact/tiny_arith/acc/expected": 0.15}),
        (1, {"timing_s/step": 1.0, "val-exact/tiny_arith/acc/expected": 0.3}),
        (2, {"timing_s/step": 1.0, **_val(0.4, 0.6), "val-exact/tiny_arith/acc/expected": 0.5}),
    ]
    r = collect_run(_write_run(tmp_path, lines), expected_steps=2)
    assert [(p["step"], p["mean"], p["exact"]) for p in r["val_curve"]] == [
        (0, 0.1, 0.15),
        (1, None, 0.3),
        (2, 0.4, 0.5),
    ]
    assert r["post_exact"] == pytest.approx(0.4) and r["final_exact"] == 0.5
    assert r["final_mean"] == 0.4 and r["post_mean"] == 0.4 and r["val_n"] == 2


def test_a_run_without_its_own_evaluation_before_training_borrows_its_seeds():
    source = {"val_curve": [{"step": 0, "mean": 0.4, "exact": 0.42}, {"step": 10, "mean": 0.6}]}
    result = {"val_curve": [{"step": 10, "mean": 0.5}, {"step": 20, "mean": 0.7}], "auc_mean": 0.6}
    assert borrow_step0(result, source, "grpo_matched")
    assert result["val_curve"][0] == {"step": 0, "mean": 0.4, "exact": 0.42, "shared_from": "grpo_matched"}
    assert result["auc_mean"] == pytest.approx((0.4 + 0.5 + 0.7) / 3)
    assert source["val_curve"][0] == {"step": 0, "mean": 0.4, "exact": 0.42}  # the source is left as it was
    assert not borrow_step0(result, source, "grpo_matched")  # it has one now
    assert not borrow_step0({"val_curve": [{"step": 10, "mean": 0.5}]}, {"val_curve": source["val_curve"][1:]}, "x")


def test_naive_replay_has_no_replay_kl(tmp_path):
    """Naive replay never scores its groups: no KL key in its metrics, None in the comparison."""
    lines = [
        (
            1,
            {
                "timing_s/step": 2.0,
                "replay/scanned": 0,
                "replay/candidates": 0,
                "replay/acceptance_rate": 0.0,
                "replay/token_share": 0.0,
                "replay/accepted": 0,
            },
        ),
        (
            2,
            {
                "timing_s/step": 2.0,
                "replay/scanned": 2,
                "replay/candidates": 2,
                "replay/acceptance_rate": 1.0,
                "replay/token_share": 0.25,
                "replay/accepted": 2,
                **_val(0.3, 0.5),
            },
        ),
    ]
    r = collect_run(_write_run(tmp_path, lines), expected_steps=2)
    assert r["replay_kl_accepted"] is None and r["replay_token_share"] == pytest.approx(0.25)


def test_macro_average_over_data_sources_and_eval(tmp_path):
    data = {**_val(0.2, 0.4, "a"), **_val(0.4, 0.8, "b"), "timing_s/step": 1.0}
    doc = {"averages": {"macro": {"pass@1": 0.25, "pass@4": 0.5, "distinct_strategies": 1.5, "mean@n": 0.25}}}
    r = collect_run(_write_run(tmp_path, [(1, data)], eval_doc=doc))
    assert r["final_mean"] == pytest.approx(0.3) and r["final_best"] == pytest.approx(0.6)
    assert r["eval"] == {"pass@1": 0.25, "pass@4": 0.5, "distinct_strategies": 1.5, "mean@n": 0.25}


def test_resumed_step_replaces_earlier_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "data": {"a": 1}}\n{"step": 2, "data": {"a": 2}}\n{"step": 2, "data": {"a": 3}}\n')
    assert read_metrics(path) == [(1, {"a": 1}), (2, {"a": 3})]
    assert val_curve(read_metrics(path)) == []


def test_a_torn_last_line_from_an_older_run_is_skipped_but_not_a_bad_middle_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "data": {"a": 1}}\n{"step": 2, "data": {"a"')
    assert read_metrics(path) == [(1, {"a": 1})]
    path.write_text('{"step": 1, "data": {"a"\n{"step": 2, "data": {"a": 2}}\n')
    with pytest.raises(RunResultError, match=r"m.jsonl:1"):
        read_metrics(path)


def test_errors_name_the_file(tmp_path):
    with pytest.raises(RunResultError, match="no metrics file"):
        collect_run(tmp_path)
    run = _write_run(tmp_path, [(1, {"timing_s/step": 1.0})])
    with pytest.raises(RunResultError, match="no val-core"):
        collect_run(run)
    with pytest.raises(RunResultError, match="stopped at step 1 of 5"):
        collect_run(run, expected_steps=5)
    (run / "metrics.jsonl").write_text("{not json}\n")
    with pytest.raises(RunResultError, match=r"metrics.jsonl:1"):
        collect_run(run)


def test_a_resumed_run_is_read_over_all_its_metrics_segments(tmp_path):
    # what a run resumed twice leaves: metrics.1.jsonl (first segment), metrics.2.jsonl, metrics.jsonl
    step = {"timing_s/step": 1.0}
    # the last segment resumed from step 2's checkpoint: it validated at step 2 again, then trained step 3
    run = _write_run(tmp_path, [(2, _val(0.5, 0.6)), (3, {**step, **_val(0.7, 0.9)})])
    segment = lambda lines: "".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in lines)  # noqa: E731
    (run / "metrics.1.jsonl").write_text(segment([(0, _val(0.1, 0.2)), (1, step), (2, {**step, **_val(0.3, 0.4)})]))
    (run / "metrics.2.jsonl").write_text(segment([(2, {**step, **_val(0.45, 0.6)})]))  # step 2 redone
    (run / "metrics.old.jsonl").write_text("not a segment\n")  # only numbered segments are read
    r = collect_run(run)
    assert [(p["step"], p["mean"]) for p in r["val_curve"]] == [(0, 0.1), (2, 0.5), (3, 0.7)]
    assert r["final_mean"] == pytest.approx(0.7)
    # step 2 keeps its training metrics from the segment that trained it
    assert r["steps"] == 3 and dict(read_run_metrics(run))[2]["timing_s/step"] == 1.0


def _config_with_model(path):
    return {"actor_rollout_ref": {"model": {"path": str(path)}}}


def test_starting_model_reads_the_weights_digest_from_the_task_manifest(tmp_path):
    task = tmp_path / "tiny-task"
    (task / "model").mkdir(parents=True)
    (task / "MANIFEST.json").write_text(
        json.dumps({"files": {"model/model.safetensors": "ab" * 32, "train.parquet": "cd" * 32}})
    )
    assert starting_model(_config_with_model(task / "model")) == {"path": str(task / "model"), "sha256": "ab" * 32}


def test_a_model_without_a_task_manifest_has_no_digest(tmp_path):
    (tmp_path / "hub-model").mkdir()
    assert starting_model(_config_with_model(tmp_path / "hub-model")) == {
        "path": str(tmp_path / "hub-model"),
        "sha256": None,
    }
    assert starting_model({"data": {}}) == {"path": None, "sha256": None}


def test_collect_run_records_the_starting_model(tmp_path):
    task = tmp_path / "task"
    (task / "model").mkdir(parents=True)
    (task / "MANIFEST.json").write_text(json.dumps({"files": {"model/model.safetensors": "ef" * 32}}))
    run = _write_run(tmp_path, [(0, _val(0.1, 0.2)), (1, {"timing_s/step": 1.0, **_val(0.2, 0.3)})])
    with open(run / "config.yaml", "a") as config:
        config.write(f"  model:\n    path: {task / 'model'}\n")
    assert collect_run(run)["model"] == {"path": str(task / "model"), "sha256": "ef" * 32}


def test_time_split_counts_the_untimed_validation_before_training_at_the_mean_of_the_others(tmp_path):
    lines = [
        (0, _val(0.1, 0.2)),  # verl validates before training without timing it
        (1, {"timing_s/step": 2.0, "replay/scan_forward_seconds": 0.5}),
        (2, {"timing_s/step": 3.0, "replay/scan_forward_seconds": 1.5, "timing_s/testing": 4.0, **_val(0.2, 0.3)}),
        (3, {"timing_s/step": 5.0, "replay/scan_forward_seconds": 1.0}),
        (4, {"timing_s/step": 6.0, "replay/scan_forward_seconds": 2.0, "timing_s/testing": 6.0, **_val(0.3, 0.4)}),
    ]
    r = collect_run(_write_run(tmp_path, lines), expected_steps=4)
    # three validations, two timed (4 s and 6 s): 3 x 5 s
    assert r["time"] == {"steps_s": 16.0, "scan_s": 5.0, "validation_s": 15.0}


def test_time_split_reads_every_validations_own_time_where_the_run_recorded_it(tmp_path):
    """sampled_val=ends: the first validation samples (30 s), the ones between only score (2 s);
    each reports timing_s/validation, so the first is not guessed from the others."""
    lines = [
        (0, {**_val(0.1, 0.2), "timing_s/validation": 30.0}),
        (1, {"timing_s/step": 2.0, "timing_s/testing": 2.1, "timing_s/validation": 2.0, **_val(0.2, 0.3)}),
        (2, {"timing_s/step": 3.0, "timing_s/testing": 31.0, "timing_s/validation": 30.5, **_val(0.3, 0.4)}),
    ]
    r = collect_run(_write_run(tmp_path, lines), expected_steps=2)
    assert r["time"]["validation_s"] == 62.5


def test_time_split_of_a_run_without_scan_or_timed_validation():
    metrics = [(0, _val(0.1, 0.2)), (1, {"timing_s/step": 2.0})]
    assert time_split(metrics, validations=1) == {"steps_s": 2.0, "scan_s": None, "validation_s": None}
