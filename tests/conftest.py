"""Shared fixtures. Nothing is downloaded: assets are built locally from a seed."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Shared test helpers (``load_tolerant``) import by name from any test folder. Appended, not
# prepended: the test folders (data/, eval/, ...) must never shadow an installed module.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)

from xdist_units import make_scheduler, write_end_to_end_ids  # noqa: E402 - needs the path above

# A verl run on CPU keeps ~1.2 of 2 cores busy (its Ray processes start one after the other, each
# importing torch and verl) and takes ~4 GiB: two test workers overlap the runs' idle halves.
MAX_TEST_WORKERS = 2
GIB_PER_TEST_WORKER = 6


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pytest.ini): at most two workers, fewer on a small machine;
    ``VERL_REPLAY_TEST_WORKERS=N`` sets N (0 runs every test in the pytest process)."""
    import psutil

    if os.environ.get("VERL_REPLAY_TEST_WORKERS"):
        return int(os.environ["VERL_REPLAY_TEST_WORKERS"])
    by_memory = int(psutil.virtual_memory().total / 2**30) // GIB_PER_TEST_WORKER
    return max(1, min(MAX_TEST_WORKERS, os.cpu_count() or 1, by_memory))


# A verl run on the CPU stack (a dozen Ray processes importing torch 2.11, plus vLLM's server, engine
# and worker) takes ~6-7 GiB, more at its peaks; two at once reached 22.4 of 24 GiB and Ray's memory
# monitor killed workers. Below this much memory the end-to-end tests run one after the other.
GIB_FOR_CONCURRENT_RUNS = 40


_UNITS_FOLDER = pytest.StashKey[Path]()


def _small_machine() -> bool:
    import psutil

    return psutil.virtual_memory().total / 2**30 < GIB_FOR_CONCURRENT_RUNS


def pytest_collection_modifyitems(config, items) -> None:
    """End-to-end files first, longest first (their module's ``E2E_SECONDS``: what the file took on
    2 cores), the order within a file kept. A worker on a small machine tells the controller which
    tests are end-to-end: they become one unit of work (``xdist_units``)."""

    def order(item) -> tuple[int, float]:
        if item.get_closest_marker("e2e") is None:
            return (1, 0.0)
        return (0, -float(getattr(item.module, "E2E_SECONDS", 0)))

    items.sort(key=order)
    units = getattr(config, "workerinput", {}).get("verl_replay_units")
    if units and _small_machine():
        write_end_to_end_ids(Path(units), [item.nodeid for item in items if item.get_closest_marker("e2e")])


def _make_units_folder(config) -> None:
    if _is_controller(config) and config.getoption("dist", "no") == "loadfile":
        config.stash[_UNITS_FOLDER] = Path(tempfile.mkdtemp(prefix="verl-replay-xdist-"))


def pytest_unconfigure(config) -> None:
    folder = config.stash.get(_UNITS_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    folder = node.config.stash.get(_UNITS_FOLDER, None)
    if folder is not None:
        node.workerinput["verl_replay_units"] = str(folder)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (pytest.ini) with the end-to-end tests of a small machine as one unit."""
    folder = config.stash.get(_UNITS_FOLDER, None)
    return None if folder is None else make_scheduler(config, log, folder)


@pytest.fixture(autouse=True)
def _one_end_to_end_run_at_a_time(request, tmp_path_factory):
    """The same rule under any other distribution (``--dist load`` given on the command line): the
    test workers take turns at end-to-end tests, a lock in their common temp dir."""
    import fcntl

    if (
        request.node.get_closest_marker("e2e") is None
        or not _small_machine()
        or not os.environ.get("PYTEST_XDIST_WORKER")
    ):
        yield
        return
    shared = tmp_path_factory.getbasetemp().parent  # the session's temp root, common to its workers
    with open(shared / "end_to_end.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------- progress
# The suite's first results come minutes in: its end-to-end runs start first and each takes minutes,
# and the tiny assets are built on first use. The controller builds the assets itself, saying so,
# and names the test a worker starts whenever the screen has shown nothing for a minute.
SILENT_SECONDS = float(os.environ.get("VERL_REPLAY_TEST_SILENT_S", "60"))
_progress = {"started": 0.0, "last_output": 0.0, "done": 0}


def _is_controller(config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", 0))


def _elapsed(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s"


def pytest_sessionstart(session) -> None:
    import time

    _progress["started"] = _progress["last_output"] = time.monotonic()


@contextlib.contextmanager
def _fds_to(handle):
    """File descriptors 1 and 2 (what C code and Python's loggers write to) into ``handle``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(handle.fileno(), 1)
        os.dup2(handle.fileno(), 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


def pytest_xdist_setupnodes(config, specs) -> None:
    """In the controller, after the session's header and before the workers start."""
    import time

    from verl_replay.data.tiny_assets import build_tiny_assets

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    reporter.write_line("tiny assets: checking the cached build (a new machine builds it once, a few minutes) ...")
    # what the build's libraries print (transformers' CPU fast-path notice) is shown only if it fails
    with tempfile.TemporaryFile("w+") as held, _fds_to(held):
        try:
            build_tiny_assets()
        except BaseException:
            held.seek(0)
            sys.__stderr__.write(held.read())
            raise
    reporter.write_line(f"tiny assets: ready ({_elapsed(time.monotonic() - _progress['started'])})")


def pytest_runtest_logreport(report) -> None:
    import time

    if report.when == "teardown":
        _progress["done"] += 1
        _progress["last_output"] = time.monotonic()


def pytest_runtest_logstart(nodeid, location) -> None:
    import time

    config = _CONFIG.get("config")
    now = time.monotonic()
    if config is None or not _is_controller(config) or now - _progress["last_output"] < SILENT_SECONDS:
        return
    _progress["last_output"] = now
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if _progress["done"]:
        reporter.write("\n")  # off the line of dots
    reporter.write_line(f"[{_elapsed(now - _progress['started'])}, {_progress['done']} done] started {nodeid}")


_CONFIG: dict = {}


def pytest_configure(config) -> None:
    _CONFIG["config"] = config
    _make_units_folder(config)


@pytest.fixture(scope="session")
def tiny_assets():
    """The tiny tokenizer, Qwen3.5 model, datasets and SQLite databases (built once per machine)."""
    from verl_replay.data.tiny_assets import build_tiny_assets

    return build_tiny_assets()


class MainRun:
    """Outcome of one ``python -m verl_replay.main`` subprocess (``output``: what the console showed)."""

    def __init__(self, run_dir, returncode: int, stdout: str, stderr: str):
        self.run_dir = run_dir  # None when the run created no folder (it stopped at start-up)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.output = stdout + stderr

    @property
    def metrics(self) -> list[dict]:
        import json

        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line)["data"] for line in path.read_text().splitlines() if line.strip()]

    @property
    def log(self) -> str:
        """verl's own output (``<run_dir>/verl.log``)."""
        return (self.run_dir / "verl.log").read_text(errors="replace")


@pytest.fixture
def run_main(tmp_path):
    """Run verl_replay.main in a subprocess with Hydra overrides, in tmp_path; outputs land under
    tmp_path/outputs. Without ``run_dir`` the run makes its own folder, found afterwards."""
    import os
    import subprocess
    import sys

    project = tmp_path / "outputs" / "verl_replay"

    def run(*overrides: str, experiment: str = "e2e", run_dir=None, timeout: int = 1800, check: bool = True) -> MainRun:
        env = dict(os.environ, VERL_REPLAY_OUTPUT_DIR=str(tmp_path / "outputs"), PYTHONUNBUFFERED="1")
        env.pop("VERL_FILE_LOGGER_PATH", None)
        command = [sys.executable, "-m", "verl_replay.main", f"trainer.experiment_name={experiment}", *overrides]
        if run_dir is not None:
            command.append(f"run_dir={run_dir}")
        before = set(project.glob(f"{experiment}-*"))
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
        if run_dir is None:
            created = sorted(set(project.glob(f"{experiment}-*")) - before)
            assert len(created) <= 1, f"one run made several folders: {created}"
            run_dir = created[0] if created else None
        outcome = MainRun(run_dir, result.returncode, result.stdout, result.stderr)
        if check and result.returncode != 0:
            log = outcome.log[-6000:] if run_dir is not None and (run_dir / "verl.log").exists() else ""
            raise AssertionError(f"verl_replay.main failed ({result.returncode}):\n{outcome.output[-3000:]}\n{log}")
        if check and run_dir is not None and (run_dir / "metrics.jsonl").exists():
            from clean_run import check_clean_run

            check_clean_run(run_dir)  # no hidden error, no lost rollout
        return outcome

    return run


@pytest.fixture
def spawn_main(tmp_path):
    """Start verl_replay.main like ``run_main`` but without waiting: the process leads a session of
    its own (the driver and the Ray cluster it starts), so a test can kill all of it."""
    import os
    import subprocess
    import sys

    def spawn(*overrides: str, experiment: str, run_dir) -> subprocess.Popen:
        env = dict(os.environ, VERL_REPLAY_OUTPUT_DIR=str(tmp_path / "outputs"), PYTHONUNBUFFERED="1")
        env.pop("VERL_FILE_LOGGER_PATH", None)
        command = [
            sys.executable,
            "-m",
            "verl_replay.main",
            f"trainer.experiment_name={experiment}",
            *overrides,
            f"run_dir={run_dir}",
        ]
        return subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    return spawn
