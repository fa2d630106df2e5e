"""The Ray TaskRunner for ``verl_replay.main``: verl's ``TaskRunnerV1`` with our trainer class.

verl's runner picks the trainer from its registry by ``trainer.v1.trainer_mode``, and the mode
string is read all over verl (``trainer_mode != "sync"``), so our trainers cannot register under
new mode names. This runner does what ``TaskRunnerV1.run`` does, resolving the trainer through
``replay_trainer_class(mode)`` instead; the agent loop manager is built by verl's own code.
verl's runner pprints the whole config (~950 lines); this one does so only with ``verbose=true``
(the driver writes the same config to ``<run_dir>/config.yaml``). ``metrics.jsonl`` is written
by :mod:`~verl_replay.integrations.verl.metrics_file` (whole lines) instead of verl's file logger.
Before it starts TransferQueue it makes sure no other run's queue lives on the Ray cluster
(:func:`wait_for_free_transfer_queue`): runs that join one cluster one after the other are safe,
two at once are refused. When training ends it stops the rollout's agent loop workers before it
closes TransferQueue (:func:`stop_agent_loop_workers`).
"""

from __future__ import annotations

import time
from pprint import pprint

import ray
from omegaconf import DictConfig, OmegaConf

# TransferQueue's controller: one named actor per Ray cluster (transfer_queue.interface.init). A
# second run's ``tq.init`` on the same cluster does not fail: it attaches to the first run's queue,
# and the two trainers then read each other's batches.
TQ_CONTROLLER_NAME, TQ_NAMESPACE = "TransferQueueController", "transfer_queue"
# A finished run's controller is killed as it ends (tq.close, or Ray when its driver exits); the
# next run on the same cluster waits this long for it before refusing to start.
TQ_RELEASE_TIMEOUT_S = 60.0


def wait_for_free_transfer_queue(timeout_s: float = TQ_RELEASE_TIMEOUT_S, poll_s: float = 0.5) -> None:
    """Return once no TransferQueue controller is alive on this Ray cluster; raise if one stays."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get_actor(TQ_CONTROLLER_NAME, namespace=TQ_NAMESPACE)
        except ValueError:  # no live actor holds the name
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"this Ray cluster already runs a TransferQueue (actor {TQ_CONTROLLER_NAME!r} in namespace "
                f"{TQ_NAMESPACE!r}, still alive after {timeout_s:.0f} s): another verl run is using the cluster. "
                "TransferQueue is one per Ray cluster, so two runs on it would read each other's batches: run one "
                "job at a time on a cluster, or give each run its own (without RAY_ADDRESS a run starts its own)"
            )
        time.sleep(poll_s)


def stop_agent_loop_workers(agent_loop_manager: object) -> int:
    """Kill the agent loop workers of a finished run; return how many.

    separate_async generates ahead of training, so when ``fit`` returns the workers still run
    rollouts for steps that will never come. Left alive, they put those rollouts into a
    TransferQueue that ``tq.close`` is tearing down, or ask a vLLM server the cluster's shutdown
    has killed, and log each failure as ``Error in _run_prompt`` with a traceback: noise that
    reads like a lost rollout. Killed first, they end without a word; nothing they held was
    going to be trained on.
    """
    workers = list(getattr(agent_loop_manager, "agent_loop_workers", None) or [])
    for worker in workers:
        ray.kill(worker, no_restart=True)
    return len(workers)


@ray.remote
class ReplayTaskRunner:
    def __init__(self) -> None:
        self.config = None
        self.trainer = None
        self.agent_loop_manager = None

    def _init_agent_loop_manager(self) -> None:
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ
        from verl.utils.import_utils import load_class_from_fqn

        manager_fqn = self.config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
        manager_cls = load_class_from_fqn(manager_fqn, "AgentLoopManager") if manager_fqn else AgentLoopManagerTQ
        self.agent_loop_manager = manager_cls.create(
            config=self.config,
            llm_client=self.trainer.get_llm_client(),
            teacher_client=self.trainer.get_teacher_client(),
            reward_loop_worker_handles=self.trainer.get_reward_handles(),
        )

    def run(self, config: DictConfig) -> None:
        import transfer_queue as tq
        from verl.utils.logging_utils import configure_verl_logging

        from verl_replay.integrations.verl.metrics_file import install_whole_line_file_logger
        from verl_replay.integrations.verl.trainer import replay_trainer_class

        configure_verl_logging()
        install_whole_line_file_logger()  # metrics.jsonl: whole lines, appended
        trainer_cls = replay_trainer_class(config.trainer.v1.trainer_mode)
        config.transfer_queue.enable = True
        if config.get("verbose", False):
            pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        self.config = config

        wait_for_free_transfer_queue()
        tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = trainer_cls(config=config)
            self.trainer.init()
            self._init_agent_loop_manager()
            self.trainer.fit(self.agent_loop_manager)
            succeeded = True
        finally:
            try:
                if self.agent_loop_manager is not None:
                    stop_agent_loop_workers(self.agent_loop_manager)
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()
