"""Fixes of verl 0.9.1 bugs on the recipes' path: each applies, and each has a canary."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_replay.integrations.verl import verl_fixes


@pytest.mark.parametrize("module_name, attribute", verl_fixes.PRIVATE_API_PATCHES)
def test_patched_names_exist_in_pinned_verl(module_name, attribute):
    assert hasattr(importlib.import_module(module_name), attribute), f"verl moved {module_name}.{attribute}"


def test_separate_async_logger_takes_flush_after_import():
    module = importlib.import_module(verl_fixes.SEPARATE_ASYNC_MODULE)  # the plugin ran on `import verl`
    assert isinstance(module.logger, verl_fixes.FlushTolerantLogger)
    module.logger.info("split placement: %s", "ok", flush=True)  # what verl's _setup does; raised before


def test_canary_verl_still_logs_with_flush():
    """If verl stops passing flush= to its logger, the fix can go."""
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    assert "flush=True" in inspect.getsource(PPOTrainerSeparateAsync._setup), (
        "verl's separate_async _setup no longer logs with flush=True: remove verl_fixes.tolerate_flush_keyword"
    )
    plain = logging.getLogger("verl_replay.canary")
    plain.setLevel(logging.INFO)  # the standard logger rejects flush= once the record is built
    with pytest.raises(TypeError, match="flush"):
        plain.info("x", flush=True)


def test_fix_is_applied_in_a_fresh_process_that_only_imports_verl():
    code = (
        "import verl, logging\n"
        "from verl.trainer.ppo.v1 import trainer_separate_async as m\n"
        "m.logger.info('x', flush=True)\n"
        "print(type(m.logger).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "FlushTolerantLogger"


def _positions(lengths, leading_ragged: bool):
    import torch
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = [torch.arange(n).expand(4, n).clone() + i for i, n in enumerate(lengths)]
    if leading_ragged:  # how TransferQueue returns rows of one length: [B, j, L], each j = 4
        return rows, torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return rows, list_of_dict_to_tensordict([{"position_ids": r} for r in rows])["position_ids"]  # [B, 4, j]


def _transfer_queue_batch(lengths):
    """position_ids and input_ids packed as TransferQueue packs them, after a Ray call's pickle."""
    import pickle

    import torch
    from tensordict import TensorDict
    from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

    pack = AsyncSimpleStorageManager._pack_field_values
    rows = [torch.arange(n).expand(4, n).clone() + 100 * i for i, n in enumerate(lengths)]
    data = TensorDict(
        {"position_ids": pack(rows), "input_ids": pack([torch.arange(n) for n in lengths])}, batch_size=len(lengths)
    )
    return rows, pickle.loads(pickle.dumps(data.consolidate()))


@pytest.mark.parametrize(
    "lengths",
    [(38,) * 8, (38, 37, 38), (5,), (4,), (8, 8), (16,) * 4, (1, 1, 1, 1), (23,) * 2],
    ids=["8_equal", "mixed", "one_row", "one_row_of_4", "square_2x8", "square_4x16", "four_of_1", "2_equal"],
)
def test_position_fix_gives_verls_layout_for_every_transfer_queue_batch(lengths):
    """Whatever layout TransferQueue stored (rows of one length: ragged in the leading dimension), the
    fixed tensor has verl's: the rows that went in, values [4, sum L] (what the packed path reads)."""
    import torch

    rows, data = _transfer_queue_batch(lengths)
    verl_fixes.fix_3d_position_ids_by_layout(data)
    fixed = data["position_ids"]
    assert fixed._ragged_idx == 2
    assert all(torch.equal(a, b) for a, b in zip(fixed.unbind(), rows, strict=True))
    assert torch.equal(fixed.values(), torch.cat(rows, dim=1))  # prepare_model_inputs: values().unsqueeze(1)
    assert torch.nested.to_padded_tensor(fixed, 0, output_size=(len(rows), 4, max(lengths))).shape[1] == 4


@pytest.mark.parametrize("lengths, leading_ragged", [((38,) * 8, True), ((38, 37, 38), False), ((5,), True)])
def test_position_fix_keeps_each_rows_own_shape(lengths, leading_ragged):
    """Rows cut from the fixed tensor are the rows that went in, for both storage layouts (no input_ids:
    the M-RoPE row count decides)."""
    import torch
    from tensordict import TensorDict

    rows, positions = _positions(lengths, leading_ragged)
    data = TensorDict({"position_ids": positions}, batch_size=len(rows))
    verl_fixes.fix_3d_position_ids_by_layout(data)
    fixed = data["position_ids"]
    assert fixed._ragged_idx == 2
    assert all(torch.equal(a, b) for a, b in zip(fixed.unbind(), rows, strict=True))


def test_square_storage_is_read_from_the_token_counts():
    """2 rows of 8 tokens are stored [8, 8] with offsets [0, 4, 8]: the shape alone fits both layouts
    (our earlier fix took it for ragged-last and cut (8, 4) rows); input_ids' offsets decide."""
    _, data = _transfer_queue_batch((8, 8))
    lengths = data["input_ids"].offsets().diff().tolist()
    assert verl_fixes.ragged_dim_of_3d_positions(data["position_ids"], lengths) == 1
    assert verl_fixes.ragged_dim_of_3d_positions(data["position_ids"]) == 1  # 4 position rows per row


def test_canary_verls_own_position_fix_breaks_rows_of_one_length():
    """verl forces _ragged_idx = 2, which breaks rows of one length: drop the patch once it does not."""
    import importlib.util
    from pathlib import Path

    source = Path(importlib.util.find_spec("verl.utils.tensordict_utils").origin).read_text()
    assert 'data["position_ids"]._ragged_idx = 2' in source, (
        "verl changed maybe_fix_3d_position_ids: check whether verl_fixes still needs to replace it"
    )
    _, positions = _positions((38,) * 8, leading_ragged=True)
    positions._ragged_idx = 2  # what verl's version does
    with pytest.raises(RuntimeError, match="split_with_sizes"):
        positions.unbind()


# --------------------------------------------------------------------------- the packed path, end to end

PROBE = Path(__file__).with_name("packed_path_probe.py")
# the probe process: 230 s measured on a 2-core machine shared with three other sessions, so an
# over-estimate (tests/conftest.py starts e2e files first, longest first)
E2E_SECONDS = 120
BUG_CASES = "fresh_equal_4,fresh_equal_2_square,mixed_kinds_mixed_lengths"


@pytest.fixture(scope="module")
def packed_path_report(tiny_assets):
    """verl's log-prob path (micro-batching, prepare_model_inputs, forward, outputs) on the tiny
    Qwen3.5 in a CPU worker process, packed and padded, every case of the probe plus three injected
    bugs (see packed_path_probe.py): one subprocess for the whole module."""
    env = dict(os.environ, VERL_PLATFORM="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(PROBE.parent), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(PROBE), str(tiny_assets.model_dir), "--bugs", BUG_CASES],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _probe_cases():
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl_replay_packed_path_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.CASES)


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["packed", "padded"])
@pytest.mark.parametrize("case", _probe_cases())
def test_log_probs_equal_each_row_alone(packed_path_report, case, path):
    """Equal-length shards of 1, 2, 4 and 8 rows (fresh, replayed, elite), mixed kinds and lengths,
    several dynamic and fixed-size micro-batches: every row's log-probs and entropy through verl's
    packed (use_remove_padding=True) and padded paths equal the row alone through transformers."""
    outcome = packed_path_report["ours"][case][path]
    assert outcome["ok"], outcome["error"]


@pytest.mark.e2e
def test_packed_path_runs_the_cpu_kernels(packed_path_report):
    assert packed_path_report["kernels"] == {
        "chunk_gated_delta_rule": "packed_chunk_gated_delta_rule",
        "causal_conv1d_fn": "packed_causal_conv1d",
        "attention": "packed_sdpa_attention_forward",
        "pass_packed_cu_seqlens": True,
    }


@pytest.mark.e2e
def test_each_injected_bug_is_caught(packed_path_report):
    """verl's own fix breaks rows of one length on both paths; our earlier (layout-only) fix left the
    packed path with position ids (4B, 1, L) for input ids (1, B*L), the reported crash, and misread
    the square storage; without the CPU kernels the packed rows leak into each other. Mixed lengths
    (verl's own layout) pass with either fix. Full attention across the packed sequences leaks
    them into each other on the packed path only."""
    bugs = packed_path_report
    crash = "The size of tensor a (3) must match the size of tensor b (16)"
    assert crash in bugs["layout_only_position_fix"]["fresh_equal_4"]["packed"]["error"]
    assert bugs["layout_only_position_fix"]["fresh_equal_4"]["padded"]["ok"]
    assert not bugs["layout_only_position_fix"]["fresh_equal_2_square"]["padded"]["ok"]
    assert "split_with_sizes" in bugs["verl_position_fix"]["fresh_equal_4"]["padded"]["error"]
    for variant in ("verl_position_fix", "layout_only_position_fix"):
        assert all(outcome["ok"] for outcome in bugs[variant]["mixed_kinds_mixed_lengths"].values())
    for case in BUG_CASES.split(","):
        for variant in ("no_cpu_kernels", "attention_across_sequences"):
            leak = bugs[variant][case]
            assert not leak["packed"]["ok"] and "not close" in leak["packed"]["error"] and leak["padded"]["ok"]


# ---------------------------------------------------------------- the colocated push's socket name

VERL_SOCKET = "ipc:///tmp/rl-colocate-zmq-01000000-replica-0-rank-0.sock"  # the first job of any cluster


def test_the_colocated_socket_is_named_after_the_cluster(monkeypatch):
    monkeypatch.setenv("RAY_RAYLET_PID", "111")
    ours = verl_fixes.socket_of_this_cluster(VERL_SOCKET)
    assert ours == "ipc:///tmp/rl-colocate-zmq-raylet111-01000000-replica-0-rank-0.sock"
    assert verl_fixes.socket_of_this_cluster(ours) == ours  # once only
    assert verl_fixes.socket_of_this_cluster("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    monkeypatch.setenv("RAY_RAYLET_PID", "222")  # another cluster on the same host
    assert verl_fixes.socket_of_this_cluster(VERL_SOCKET) != ours
    monkeypatch.delenv("RAY_RAYLET_PID")  # outside Ray: verl's name
    assert verl_fixes.socket_of_this_cluster(VERL_SOCKET) == VERL_SOCKET


class _VllmWorker:
    """What the receiver's name reads from the vLLM worker: no parallel config, local rank 0."""

    model_runner = None
    local_rank = 0


def test_the_receiver_end_is_renamed_and_verls_own_name_still_collides(monkeypatch):
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    monkeypatch.setenv("VERL_RAY_JOB_ID", "01000000")
    monkeypatch.setenv("VERL_REPLICA_RANK", "0")
    verls_own = vLLMColocateWorkerExtension._get_zmq_handle.__wrapped__
    names = {}
    for raylet in ("111", "222"):
        monkeypatch.setenv("RAY_RAYLET_PID", raylet)
        names[raylet] = vLLMColocateWorkerExtension._get_zmq_handle(_VllmWorker())
        # the canary: two clusters' first jobs get one socket from verl; once they do not, drop the fix
        assert verls_own(_VllmWorker()) == VERL_SOCKET, "verl names the colocated socket differently now"
    assert names == {
        r: verl_fixes.socket_of_this_cluster(VERL_SOCKET).replace("raylet222", f"raylet{r}") for r in names
    }


def test_the_sender_end_is_renamed_the_same_way():
    """The sender builds the receiver's name from its own Ray job id (canary: still that format), and
    its constructor is wrapped to rename it as the receiver does."""
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    assert getattr(ServerAdapter.__init__, "_verl_replay_socket_fix", False)
    source = inspect.getsource(ServerAdapter.__init__.__wrapped__)
    assert 'f"ipc:///tmp/rl-colocate-zmq-{job_id}-replica-{self.replica_rank}-rank-{local_rank}.sock"' in source, (
        "verl names the sender's socket differently now: check verl_fixes.name_sender_socket_by_cluster"
    )
