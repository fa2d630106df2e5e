"""Multi-node on a real two-node Ray cluster on this machine, through recipes/ray_cluster.sh.

The test runs exactly what recipes/README.md (Multi-node) tells a user to run: ``ray_cluster.sh
head`` and ``ray_cluster.sh worker`` (two ``ray start --block`` nodes, each with its own logical
resources), then ``ray_cluster.sh submit`` of the TINY recipe with ``NNODES=2`` as a Ray job. It
checks, from Ray's own actor table, that the training workers and the rollout servers were placed
as the composed config asks (for whatever trainer mode the TINY recipe runs), and that the job
completed its steps. The cluster is private to the test: its own ``--temp-dir`` (so
``/tmp/ray/ray_current_cluster``, which a plain ``ray.init()`` reads, is never written), free
ports, token auth off for localhost, and it is stopped in a finalizer by signalling the two
``ray start --block`` process groups the test started (never ``ray stop``, which would kill every
Ray process of the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from .test_recipes import RECIPES, REPO, run_recipe

# what this file's verl runs take on 2 cores (tests/conftest.py starts the longest first)
E2E_SECONDS = 180

pytestmark = [pytest.mark.multinode, pytest.mark.e2e]

TOTAL_STEPS = 2
RECIPE = "headroom_drift_math.sh"
# verl's worker classes that hold a placement slot: the training side (the fused actor/rollout/ref
# worker, or separate_async's actor) and the standalone rollout replicas' workers, which receive the
# weights through the checkpoint engine. (The CPU profile's hf rollout *server* actor takes no slot
# and is not pinned to its worker's node, unlike vLLM's servers: it is not a placement to check.)
TRAINING_CLASSES = ("WorkerDict", "ActorRolloutRefWorker", "DetachActorWorker")
ROLLOUT_CLASSES = ("CheckpointEngineWorker",)


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def _node_ports(ports: list[int], worker_range: tuple[int, int]) -> str:
    names = (
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
    )
    flags = [f"--{name}={port}" for name, port in zip(names, ports, strict=True)]
    flags += [
        f"--min-worker-port={worker_range[0]}",
        f"--max-worker-port={worker_range[1]}",
        "--object-store-memory=300000000",
    ]
    return " ".join(flags)


def _worker_range(start: int) -> tuple[int, int]:
    """A block of 200 ports that are free now (Ray picks its worker ports from it)."""
    for base in range(start, 60000, 211):
        probe = [base, base + 100, base + 199]
        try:
            for port in probe:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base, base + 199
        except OSError:
            continue
    raise RuntimeError("no free port block for Ray workers")


@dataclass
class Cluster:
    env: dict[str, str]
    temp_dir: Path
    dashboard: str
    processes: list[subprocess.Popen]


def _ray_cli(*args: str, env: dict[str, str], timeout: int = 60) -> subprocess.CompletedProcess:
    ray = str(Path(sys.executable).with_name("ray"))
    return subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _alive_nodes(cluster_env: dict[str, str], dashboard: str) -> list[dict]:
    result = _ray_cli("list", "nodes", "--address", dashboard, "--format", "json", "--detail", env=cluster_env)
    try:
        nodes = json.loads(result.stdout) if result.returncode == 0 else []
    except json.JSONDecodeError:  # "No resource in the cluster" while the head registers
        return []
    return [n for n in nodes if n["state"] == "ALIVE"]


def _stop(processes: list[subprocess.Popen], temp_dir: Path) -> None:
    """SIGTERM each `ray start --block` group (worker first: it drains through the live head)."""
    for proc in reversed(processes):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)  # then SIGKILL: a head on a busy machine can take minutes
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of that group still there
        except ProcessLookupError:
            pass


def _processes_mentioning(text: str) -> dict[int, str]:
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if text.encode() in cmdline and state != "Z":  # zombies are dead, only not yet reaped
            found[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
    return found


def _wait_gone(text: str, timeout: float) -> dict[int, str]:
    """Processes still mentioning ``text`` after ``timeout`` s (a SIGKILLed process takes a moment)."""
    deadline = time.monotonic() + timeout
    while (alive := _processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(1)
    return alive


def _start_node(
    kind: str,
    env: dict[str, str],
    temp_dir: Path,
    processes: list[subprocess.Popen],
    base: dict[str, str],
    dashboard: str,
    nodes: int,
    attempts: int = 3,
) -> None:
    """`ray_cluster.sh head|worker` until the cluster shows ``nodes`` live nodes. Ray gives a
    starting node a fixed 30 s to register with the GCS; on a busy machine that can expire, and
    the node then exits: start it again (up to ``attempts`` times)."""
    log = temp_dir / f"{kind}.log"
    for attempt in range(1, attempts + 1):
        proc = subprocess.Popen(
            ["bash", str(RECIPES / "ray_cluster.sh"), kind],
            env=env,
            cwd=REPO,
            stdout=open(log, "a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        processes.append(proc)
        deadline = time.monotonic() + 240
        while len(_alive_nodes(base, dashboard)) < nodes and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(2)
        if len(_alive_nodes(base, dashboard)) >= nodes:
            return
        _stop([proc], temp_dir)
        processes.remove(proc)
    raise AssertionError(f"the {kind} node did not come up in {attempts} attempts:\n{log.read_text()[-3000:]}")


@pytest.fixture
def placement(tmp_path):
    """The composed TINY NNODES=2 config as it runs inside a Ray job (RAY_ADDRESS is set there)."""
    run = run_recipe(
        RECIPE,
        {
            "TINY": "1",
            "NNODES": "2",
            "DRY_RUN": "1",
            "STAGES": "train",
            "TOTAL_STEPS": str(TOTAL_STEPS),
            "OUTPUT_DIR": str(tmp_path / "dry"),
            "RAY_ADDRESS": "127.0.0.1:1",
        },
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.config


@pytest.fixture
def cluster(placement):
    from verl_replay.integrations.verl.preflight import placement_need

    # each node offers an equal share of the GPUs the placement needs, so Ray must use both nodes
    need = placement_need(placement)
    per_node = -(-need.total // 2)
    temp_dir = Path(tempfile.mkdtemp(prefix="vrray_", dir="/tmp"))  # short: Ray's socket paths
    ports = _free_ports(16)
    base = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    base.update(
        RAY_AUTH_MODE="disabled",  # a localhost cluster of one test; real clusters keep tokens (README)
        RAY_HEAD="127.0.0.1",
        RAY_PORT=str(ports[0]),
        RAY_DASHBOARD_PORT=str(ports[1]),
        RAY_NUM_CPUS="16",
        RAY_NUM_GPUS=str(per_node),
        # the nodes' workers do a CPU run's work: at Ray's default niceness (15) a loaded machine starves them
        RAY_worker_niceness="0",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        PYTHONUNBUFFERED="1",
    )
    dashboard = f"http://127.0.0.1:{ports[1]}"
    shared_address_file = Path("/tmp/ray/ray_current_cluster")
    before = shared_address_file.read_bytes() if shared_address_file.exists() else None
    processes: list[subprocess.Popen] = []
    try:
        head_range = _worker_range(20000)
        head_env = dict(
            base,
            RAY_TEMP_DIR=str(temp_dir),
            RAY_RESOURCES='{"verl_replay_node_0": 1}',
            RAY_START_ARGS=_node_ports(ports[2:8], head_range) + f" --ray-client-server-port={ports[14]}",
        )
        _start_node("head", head_env, temp_dir, processes, base, dashboard, nodes=1)
        worker_range = _worker_range(head_range[1] + 1)
        worker_env = dict(
            base, RAY_RESOURCES='{"verl_replay_node_1": 1}', RAY_START_ARGS=_node_ports(ports[8:14], worker_range)
        )
        _start_node("worker", worker_env, temp_dir, processes, base, dashboard, nodes=2)
        yield Cluster(base, temp_dir, dashboard, processes)
    finally:
        _stop(processes, temp_dir)
        leftovers = _wait_gone(str(temp_dir), timeout=30)
        for pid in leftovers:  # started by this cluster (its session dir is in their command line)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        after = shared_address_file.read_bytes() if shared_address_file.exists() else None
        logs = {
            name: (temp_dir / name).read_text()[-1500:]
            for name in ("head.log", "worker.log")
            if (temp_dir / name).exists()
        }
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftovers, f"Ray processes of the test cluster outlived its nodes: {leftovers}\n{logs}"
        assert after == before, "the test cluster wrote /tmp/ray/ray_current_cluster"


def _expected(config: dict) -> dict[str, tuple[int, int]]:
    """role -> (workers in all, workers on each node the role uses), as the config places them."""
    trainer, rollout = config["trainer"], config["actor_rollout_ref"]["rollout"]
    t_nodes, t_per = int(trainer["nnodes"]), int(trainer["n_gpus_per_node"])
    expected = {"training": (t_nodes * t_per, t_per)}
    if trainer["v1"]["trainer_mode"] == "separate_async":  # standalone replicas: one worker per slot
        r_nodes, r_per = int(rollout["nnodes"]), int(rollout["n_gpus_per_node"])
        expected["rollout"] = (r_nodes * r_per, r_per)
    else:  # colocated: the training workers are the rollout workers too
        expected["rollout"] = (0, 0)
    return expected


def test_two_node_cluster_runs_the_tiny_recipe_as_a_ray_job(cluster, placement, tmp_path):
    # while our cluster is up, a plain ray.init() elsewhere on this machine would start its own
    # instance: no RAY_ADDRESS, and the address file it reads is not ours
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ray._private.services as s; print(s.get_ray_address_from_environment(None, None))",
        ],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.stdout.strip() == "None", probe.stdout + probe.stderr
    assert "address" not in (placement.get("ray_kwargs", {}).get("ray_init") or {})  # verl's run_ppo passes none

    out = tmp_path / "out"
    job_env = f"TINY=1 NNODES=2 STAGES=train TOTAL_STEPS={TOTAL_STEPS} OUTPUT_DIR={out} PYTHON={sys.executable}"
    submit = subprocess.run(
        ["bash", str(RECIPES / "ray_cluster.sh"), "submit", RECIPE],
        env=dict(cluster.env, JOB_ENV=job_env, JOB_ID="verl_replay_multinode_test"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert submit.returncode == 0, f"{submit.stdout[-4000:]}\n{submit.stderr[-4000:]}"
    assert "Job 'verl_replay_multinode_test' succeeded" in submit.stdout + submit.stderr

    # completed: every step logged, and the checkpoint of the last one written
    run_dir = Path(placement["run_dir"].replace(str(tmp_path / "dry"), str(out)))
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == list(range(1, TOTAL_STEPS + 1))
    assert (run_dir / "checkpoints" / f"global_step_{TOTAL_STEPS}" / "actor" / "huggingface" / "config.json").is_file()

    # placed as configured: Ray's actor table (dead actors are kept) of this job
    result = _ray_cli(
        "list",
        "actors",
        "--address",
        cluster.dashboard,
        "--format",
        "json",
        "--detail",
        "--limit",
        "10000",
        env=cluster.env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    actors = json.loads(result.stdout)
    nodes = {n["node_id"] for n in _alive_nodes(cluster.env, cluster.dashboard)}
    assert len(nodes) == 2
    per_role: dict[str, Counter] = {"training": Counter(), "rollout": Counter()}
    for actor in actors:
        name = actor["class_name"]
        if any(name.endswith(cls) for cls in TRAINING_CLASSES):
            per_role["training"][actor["node_id"]] += 1
        elif any(name.endswith(cls) for cls in ROLLOUT_CLASSES):
            per_role["rollout"][actor["node_id"]] += 1
    seen = {role: dict(counts) for role, counts in per_role.items()}
    for role, (total, per_node) in _expected(placement).items():
        counts = per_role[role]
        assert set(counts) <= nodes and sum(counts.values()) == total, (role, seen)
        assert set(counts.values()) <= {per_node}, (role, seen)
    # the placement spans both nodes (each node offers only its share of the slots)
    assert set(per_role["training"]) | set(per_role["rollout"]) == nodes, seen
