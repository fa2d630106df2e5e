"""The Ray TaskRunner for ``verl_replay.main``: verl's ``TaskRunnerV1`` with our trainer class.

verl's runner picks the trainer from its registry by ``trainer.v1.trainer_mode``, and the mode
string is read all over verl (``trainer_mode != "sync"``), so our trainers cannot register under
new mode names. This runner does what ``TaskRunnerV1.run`` does, resolving the trainer through
``replay_trainer_class(mode)`` instead; the agent loop manager is built by verl's own code.
verl's runner pprints the whole config (~950 lines); this one does so only with ``verbose=true``
(the driver writes the same config to ``<run_dir>/config.yaml``). ``metrics.jsonl`` is written
by :mod:`~verl_replay.integrations.verl.metrics_file` (whole lines) instead of verl's file logger.
"""

from __future__ import annotations

from pprint import pprint

import ray
from omegaconf import DictConfig, OmegaConf


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
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()
