"""Ctrl-C on a real run: SIGINT to the run's process group (what a terminal sends to the foreground
job) while verl's loop trains. The run must stop within a bounded time with exit code 130 and one
line that says how to resume, leave no process of its Ray cluster behind, release its run dir, and
the line's own advice (``run_dir=...``) must resume it from its last checkpoint to the end.

The run is IID archive replay (``replay.strategy=elite_iid``, the EliteReplay paper's control arm)
on tiny SQL, so that arm trains through verl here too: its update rows are archive entries, read
back from the archive file, and the loss it backpropagated holds the replay term."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from crash import kill_tree
from replay_audit import ELITE

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 220

pytestmark = pytest.mark.e2e

RESUMED_STEPS = 2  # the resumed run trains this many steps past the last checkpoint
# The interrupted run is asked for far more steps than it is given time for: however starved the
# machine, it cannot reach its end between its first checkpoint and the signal (a 3-step run did,
# exit 0, on a loaded CI machine).
INTERRUPTED_RUN_STEPS = 50
ELITE_ROWS = 4
# `python -m verl_replay.main` with SIGINT at Python's default handler, as a terminal's foreground
# job has it: a job started in the background of a non-interactive shell (`.ci/run &`, the way a
# loaded check gets run) inherits SIGINT ignored, and Python keeps an inherited SIG_IGN, so only
# Ray's processes in the group saw the signal (two such runs trained on to their end, exit 0).
MAIN_AS_A_TERMINAL_JOB = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('verl_replay.main', run_name='__main__', alter_sys=True)"
)


def _checkpointed_step(tracker: Path) -> int:
    """The global step of the run's latest checkpoint (verl's tracker file), 0 before the first."""
    try:
        return int(tracker.read_text().strip() or 0)
    except (FileNotFoundError, ValueError):  # not written yet, or caught mid-write
        return 0


def _sigint_disposition(pid: int) -> dict[str, bool]:
    """Whether ``pid`` (its process-wide masks in /proc) ignores, blocks or catches SIGINT."""
    masks = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("SigIgn", "SigBlk", "SigCgt"):
                masks[key] = bool(int(value.strip(), 16) >> (signal.SIGINT - 1) & 1)
    return {"ignored": masks["SigIgn"], "blocked": masks["SigBlk"], "caught": masks["SigCgt"]}


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_ctrl_c_stops_the_run_with_130_cleans_up_and_the_advice_resumes_it(
    run_main, tiny_archive, tiny_assets, tmp_path
):
    run_dir, audit = tmp_path / "outputs" / "interrupted", tmp_path / "audit"
    env = dict(os.environ, VERL_REPLAY_OUTPUT_DIR=str(tmp_path / "outputs"), PYTHONUNBUFFERED="1")
    env.pop("VERL_FILE_LOGGER_PATH", None)
    overrides = (
        "tiny_task=sql",
        "replay.strategy=elite_iid",
        f"replay.elite.archive={tiny_archive}",
        f"replay.elite.batch_size={ELITE_ROWS}",
        f"replay.audit_dir={audit}",
        "trainer.save_freq=1",
    )
    command = [sys.executable, "-c", MAIN_AS_A_TERMINAL_JOB, "trainer.experiment_name=interrupted", *overrides]
    process = subprocess.Popen(
        [*command, f"trainer.total_training_steps={INTERRUPTED_RUN_STEPS}", f"run_dir={run_dir}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a job in a terminal
    )
    latest = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    try:
        deadline = time.monotonic() + 1800  # a hang guard: a starved machine may take long to get here
        # any checkpoint will do: on a loaded machine a poll can come seconds late
        while _checkpointed_step(latest) < 1:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 1800 s"
            time.sleep(0.1)
        tree = _descendants(process.pid)
        assert tree, "the run started no process (Ray, its workers)"
        # what the run's driver does with SIGINT, and where the run is, when the signal goes out
        at_signal = {"checkpointed_step": _checkpointed_step(latest), **_sigint_disposition(process.pid)}
        assert at_signal["caught"] and not at_signal["ignored"], f"the driver does not handle SIGINT: {at_signal}"
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=300)
    except BaseException:
        kill_tree(process)
        raise
    assert process.returncode == 130, (at_signal, out, err)
    lines = err.splitlines()
    assert lines[-1] == "verl_replay: interrupted; resume with run_dir=outputs/interrupted", err
    assert "Traceback" not in out + err
    # nothing of the run's Ray cluster outlives it (checked with a grace period for their exit)
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert not [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], alive

    # what the line says to do: run_dir alone, which resumes the run as it was started after its last
    # checkpoint (here told to end RESUMED_STEPS later, where the run ends being a resume-time setting)
    saved = _checkpointed_step(latest)
    assert 1 <= saved < INTERRUPTED_RUN_STEPS, saved
    end = saved + RESUMED_STEPS
    config_before = yaml.safe_load((run_dir / "config.yaml").read_text())
    resumed = run_main(f"trainer.total_training_steps={end}", experiment="interrupted", run_dir=run_dir)
    assert "strategy=elite_iid" in resumed.output and "resuming outputs/interrupted" in resumed.output
    config_after = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config_after["trainer"].pop("total_training_steps") == end
    config_before["trainer"].pop("total_training_steps")
    assert config_after == config_before  # every other setting as the interrupted run saved it
    steps = [int(m["training/global_step"]) for m in resumed.metrics]
    assert steps == list(range(saved + 1, end + 1)), (saved, steps)
    check_archive_rows_trained(audit, tiny_archive, tiny_assets.sql_model_dir, resumed.metrics)


def check_archive_rows_trained(audit, archive, model_dir, metrics: list[dict]) -> None:
    """IID archive replay trained: every global step put ``ELITE_ROWS`` archive responses into its
    update, each one an entry of the archive file (its text, read with pyarrow), and each micro-batch
    holding them backpropagated (1 - mu) GRPO + mu x their length-normalised NLL."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    texts = set(pq.read_table(archive, columns=["text"]).column("text").to_pylist())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for m in metrics:
        assert m["replay/elite/examples"] == ELITE_ROWS and m["replay/elite/nll"] > 0, m
    records = [torch.load(path) for path in sorted(audit.glob("*.pt"))]
    trained = 0
    for record in records:
        rows = (record["replay_source"] == ELITE).nonzero().flatten().tolist()
        for row in rows:
            valid = int(record["response_mask"][row].sum())
            text = tokenizer.decode(record["responses"][row][:valid], skip_special_tokens=True)
            assert text in texts, f"an elite row that is no archive entry: {text!r}"
        terms = {k: record[k] for k in ("replay_global_step", "loss", "grpo_loss", "replay_term", "mu")}
        assert record["mu"] == 0.05 and (record["replay_term"] > 0) == bool(rows), terms
        # every micro-batch, fresh-only ones too: the GRPO part is scaled by (1 - mu) everywhere
        mixed = 0.95 * record["grpo_loss"] + 0.05 * record["replay_term"]
        assert record["loss"] == pytest.approx(mixed, rel=1e-5, abs=1e-9), terms
        trained += len(rows)
    assert any(abs(r["grpo_loss"]) > 1e-4 for r in records), "no micro-batch with a GRPO loss to check the mix on"
    assert trained >= ELITE_ROWS * len(metrics), trained
