"""``python -m verl_replay.preflight`` (its ``main``): the CPU profile passes, a bad override is a
usage error, the attention choice and the memory table print what the recipes read."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_replay.preflight import main


@pytest.fixture(autouse=True)
def _no_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def test_cpu_profile_passes(tmp_path: Path, capsys) -> None:
    assert main([f"run_dir={tmp_path / 'run'}", "--json", str(tmp_path / "checks.json")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[preflight] ")]
    assert lines[0].startswith("[preflight] trainer.device=cpu")
    assert any(" OK    weight sync " in line for line in lines)
    assert any(" SKIP  gpus " in line for line in lines)
    assert "0 failed" in lines[-1]
    assert '"name": "python"' in (tmp_path / "checks.json").read_text()


def test_bad_override_is_a_usage_error(capsys) -> None:
    assert main(["no_such_group=1"]) == 2
    assert "does not compose" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--fast"])
    assert exit_info.value.code == 2 and "unknown option" in capsys.readouterr().err


def test_choose_attn_prints_impl_and_packing(capsys) -> None:
    assert main(["--choose-attn", "sdpa"]) == 0
    assert capsys.readouterr().out.split() == ["sdpa", "False"]
    # auto is what a GPU host runs, whether or not flash-attn is installed here (the preflight checks it)
    assert main(["--choose-attn", "auto"]) == 0
    assert capsys.readouterr().out.split() == ["flash_attention_2", "True"]


def test_memory_table_of_a_gpu_config(capsys) -> None:
    assert (
        main(
            [
                "--memory-table",
                "platform=gpu",
                "actor_rollout_ref.model.path=/nowhere",
                "data.train_files=t",
                "data.val_files=v",
                "data.max_prompt_length=1024",
                "data.max_response_length=1024",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "the Qwen3.5-4B shape" in out and "| training | update pass | **total**" in out
