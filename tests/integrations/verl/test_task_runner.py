"""The TaskRunner's guard against two runs sharing one Ray cluster's TransferQueue, on a real
local Ray, and the canary for the controller name it looks for."""

from __future__ import annotations

import inspect
import time

import pytest
import ray

from verl_replay.integrations.verl import task_runner


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class _Holder:
    def ping(self) -> bool:
        return True


def test_transfer_queue_controller_name_is_the_one_transfer_queue_registers():
    """Canary: transfer_queue registers its controller under this name and namespace; if it moves,
    the guard would look for the wrong actor."""
    from transfer_queue import interface

    source = inspect.getsource(interface.init)
    assert f'name="{task_runner.TQ_CONTROLLER_NAME}", namespace="{task_runner.TQ_NAMESPACE}"' in source


def test_a_live_controller_is_refused_and_a_released_one_is_waited_for(local_ray):
    task_runner.wait_for_free_transfer_queue(timeout_s=0.1)  # none: returns at once
    name, namespace = task_runner.TQ_CONTROLLER_NAME, task_runner.TQ_NAMESPACE
    holder = _Holder.options(name=name, namespace=namespace).remote()
    assert ray.get(holder.ping.remote())
    with pytest.raises(RuntimeError, match="another verl run is using the cluster"):
        task_runner.wait_for_free_transfer_queue(timeout_s=1.0, poll_s=0.1)
    ray.kill(holder)  # what tq.close does at the end of a run: the next run may start
    start = time.monotonic()
    task_runner.wait_for_free_transfer_queue(timeout_s=30.0, poll_s=0.1)
    assert time.monotonic() - start < 30.0


def test_agent_loop_manager_keeps_its_workers_where_the_runner_stops_them():
    """Canary: verl's AgentLoopManager holds its worker handles in ``agent_loop_workers``; the
    runner kills them there when training ends. Renamed, the stop would find no worker."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    assert "self.agent_loop_workers = []" in inspect.getsource(AgentLoopManager)


def test_a_finished_runs_agent_loop_workers_are_killed(local_ray):
    class Manager:  # what the runner reads of verl's AgentLoopManager
        agent_loop_workers = [_Holder.remote(), _Holder.remote()]

    workers = Manager.agent_loop_workers
    assert ray.get([w.ping.remote() for w in workers]) == [True, True]
    assert task_runner.stop_agent_loop_workers(Manager()) == 2
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.ping.remote(), timeout=30)
    assert task_runner.stop_agent_loop_workers(object()) == 0  # a manager without workers: nothing to stop
