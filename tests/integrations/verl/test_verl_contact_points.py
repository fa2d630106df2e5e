"""Canaries for every verl name the trainer integration relies on (verl 0.9.1).

The replay trainers override verl's stage methods and read a few of its attributes; none of them
is public API. If a verl upgrade renames, re-signs or reorders one, these fail with the name.
"""

from __future__ import annotations

import inspect

import pytest

from verl_replay.integrations.verl.trainer import ReplaySeparateAsyncTrainer, ReplaySyncTrainer

# stage method -> the parameters our override receives (after self)
OVERRIDDEN_HOOKS = {
    "step": ["metrics", "timing_raw"],
    "_balance_batch": ["batch", "metrics", "logging_prefix", "keep_minibatch"],
    "_compute_old_log_prob": ["batch", "metrics"],
    "_compute_advantage": ["batch", "metrics"],
    "_update_actor": ["batch", "metrics"],
    "_compute_metrics": ["batch", "metrics", "timing_raw", "global_steps", "epoch"],
    "_get_required_batch_multiple": ["dp_size"],
    "_save_checkpoint": [],
    "_load_checkpoint": [],
    "_init_tokenizer": [],
    "_init_resource_pool_mgr": [],
    "_setup": [],
    "_validate": [],
}


@pytest.mark.parametrize("trainer_cls", [ReplaySyncTrainer, ReplaySeparateAsyncTrainer])
@pytest.mark.parametrize("name", sorted(OVERRIDDEN_HOOKS))
def test_overridden_hooks_exist_with_our_signature(trainer_cls, name):
    verl_cls = trainer_cls.__mro__[2]  # (ours, ReplayTrainerMixin, verl's class, ...)
    assert verl_cls.__module__.startswith("verl."), verl_cls
    method = getattr(verl_cls, name, None)
    assert method is not None, f"verl's {verl_cls.__name__}.{name} is gone: update verl_replay's trainer hooks"
    params = [p for p in inspect.signature(method).parameters if p != "self"]
    assert params == OVERRIDDEN_HOOKS[name], f"{verl_cls.__name__}.{name}{params}: verl changed its signature"


def test_step_runs_rounds_of_step_once_with_local_trigger_step():
    """Replay's per-global-step semantics rest on this: step() loops parameter_sync_step rounds,
    numbering them in local_trigger_step, and merges their metrics with MetricsAggregator."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    source = inspect.getsource(PPOTrainer.step)
    for needle in (
        "for trigger_idx in range(self.parameter_sync_step)",
        "self.local_trigger_step = trigger_idx",
        "self._step_once(",
        "MetricsAggregator()",
    ):
        assert needle in source, f"verl's PPOTrainer.step no longer has {needle!r}"


def test_step_once_stage_order():
    """Injection happens in _balance_batch, before old log-probs, advantages and the update."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    source = inspect.getsource(PPOTrainer._step_once)
    stages = [
        "self.replay_buffer.sample(",
        "self._balance_batch(",
        "self._compute_old_log_prob(",
        "self._compute_ref_log_prob(",
        "self._compute_advantage(",
        "self._update_actor(",
    ]
    positions = [source.find(stage) for stage in stages]
    assert -1 not in positions and positions == sorted(positions), dict(zip(stages, positions, strict=True))


def test_fit_saves_after_step_and_clears_after_metrics():
    """Ingress at the end of step() comes before the checkpoint; rows stay in TransferQueue until
    _compute_metrics has read them."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    source = inspect.getsource(PPOTrainer.fit)
    order = ["self.step(metrics", "self._save_checkpoint()", "self._compute_metrics(", "tq.kv_clear("]
    positions = [source.find(needle) for needle in order]
    assert -1 not in positions and positions == sorted(positions), dict(zip(order, positions, strict=True))


def test_private_attributes_we_read():
    from verl.single_controller.base.worker import Worker
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    # bound onto the worker group as a remote call: worker_group._query_dispatch_info("actor")
    assert hasattr(Worker, "_query_dispatch_info"), "Worker._query_dispatch_info moved"
    init_source = inspect.getsource(PPOTrainer.__init__)
    assert "self.local_trigger_step = 0" in init_source and "self.parameter_sync_step" in init_source
    assert "_dispatch_info" in inspect.getsource(PPOTrainer._balance_batch)


def test_separate_async_old_log_prob_snapshot_uses_cpu_copies():
    """verl snapshots pi_old with save_model_to_cpu; cpu_support makes that snapshot a copy on CPU."""
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    source = inspect.getsource(PPOTrainerSeparateAsync._compute_old_log_prob)
    assert "save_model_to_cpu" in source and "restore_model_from_cpu" in source


def test_fit_logs_the_step_after_its_checkpoint_and_before_the_next_step():
    """The held checkpoint: fit makes ``self.logger`` before its loop, saves before it logs the step
    with ``self.logger.log(data=metrics, step=self.global_steps)``, and counts the step on only after
    that log (so the held save still sees the checkpointed step's number), returning after the last."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    source = inspect.getsource(PPOTrainer.fit)
    order = [
        "self.logger = Tracking(",
        "while current_epoch",
        "self._save_checkpoint()",
        "self._compute_metrics(",
        "self.logger.log(data=metrics, step=self.global_steps)",
        "self.global_steps += 1\n            SkipManager.set_step",
    ]
    positions = [source.find(needle) for needle in order]
    assert source.rfind("if is_last_step:") > positions[-1]  # the last step returns after its log
    assert -1 not in positions and positions == sorted(positions), dict(zip(order, positions, strict=True))
    assert source.count("self._save_checkpoint()") == 1


def test_trajectories_carry_the_weight_versions_that_generated_them():
    """Generating versions: verl's agent loop tags each trajectory with min/max_global_steps, the
    rollout servers' version counters, which the trainers set to the step just finished (version v =
    the weights after step v); verl's own staleness metric counts from the same numbering."""
    from verl.trainer.ppo.v1 import agent_loop_tq
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    agent_loop = inspect.getsource(agent_loop_tq)
    assert '"min_global_steps": field["extra_fields"].get("min_global_steps")' in agent_loop
    for method in (PPOTrainerSeparateAsync.on_step_end, PPOTrainerSeparateAsync.on_init_end):
        assert "update_weights(self.global_steps)" in inspect.getsource(method)
    assert "update_weights(self.global_steps)" in inspect.getsource(PPOTrainerSync.on_step_end)
    metrics = inspect.getsource(PPOTrainer._compute_metrics)
    assert "trajectory_staleness_worst = (global_steps - 1) - min_global_steps" in metrics


def test_the_update_runs_every_mini_batch_once_per_epoch_and_carries_extra_info():
    """replay/optimizer_steps = mini-batches x ppo_epochs; the trainer's extra_info reaches the worker's
    data as non-tensor fields (the audit's global step and round ride on it)."""
    from verl.utils import transferqueue_utils
    from verl.workers.engine_workers import TrainingWorker

    source = inspect.getsource(TrainingWorker.train_mini_batch)
    assert "epochs=epochs" in source and "self.train_batch(mini_batch_td)" in source
    assert "meta_info = copy.deepcopy(meta.extra_info)" in inspect.getsource(
        transferqueue_utils._async_meta_to_realdata
    )


def test_trackings_file_backend_is_built_from_the_module_name_we_replace():
    """install_whole_line_file_logger swaps verl.utils.tracking.FileLogger: Tracking must build its
    file backend through that module-level name, with (project_name, experiment_name)."""
    import verl.utils.tracking as tracking

    assert inspect.signature(tracking.FileLogger.__init__).parameters.keys() >= {"project_name", "experiment_name"}
    source = inspect.getsource(tracking.Tracking.__init__)
    assert 'self.logger["file"] = FileLogger(project_name, experiment_name)' in source
    assert {"log", "finish"} <= set(vars(tracking.FileLogger))


def test_forward_only_calls_return_their_metrics_as_a_non_tensor_entry():
    """The scan's worker CPU seconds ride on this: TrainingWorker.infer_batch returns a TensorDict
    whose non-tensor ``metrics`` dict the TransferQueue bridge hands back in ``extra_info``, and the
    actor's compute_log_prob returns what the training worker's infer_batch gave."""
    from verl.utils import transferqueue_utils
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    assert [p for p in inspect.signature(TrainingWorker.infer_batch).parameters if p != "self"] == ["data"]
    postprocess = inspect.getsource(TrainingWorker._postprocess_output)
    assert 'non_tensor_dict={"metrics": final_metrics}' in postprocess
    assert "output = self.actor.infer_batch(data)" in inspect.getsource(ActorRolloutRefWorker.compute_log_prob)
    bridge = inspect.getsource(transferqueue_utils)
    assert "meta_data[k] = v.data" in bridge and "meta.extra_info = meta_data" in bridge
