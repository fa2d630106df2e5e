"""The per-request sampling seed of the seeded agent loop, its registration in verl's agent loop
registry, and canaries for the verl names it relies on."""

from __future__ import annotations

import inspect
import types
from pathlib import Path

import numpy as np

from verl_replay.integrations.verl import seeded_rollout
from verl_replay.integrations.verl.seeded_rollout import SEEDED_AGENT_LOOP, register_seeded_agent_loop, request_seed

PROMPT = [{"role": "user", "content": "12+34="}]


def test_a_request_seed_depends_on_the_run_seed_row_place_and_prompt_only():
    seed = request_seed(1, 5, 0, PROMPT)
    assert seed == request_seed(1, 5, 0, [dict(m) for m in PROMPT])  # a copy of the same prompt
    assert seed == request_seed(1, np.int64(5), np.int64(0), np.array(PROMPT, dtype=object).tolist())
    others = {request_seed(2, 5, 0, PROMPT), request_seed(1, 6, 0, PROMPT), request_seed(1, 5, 1, PROMPT)}
    others.add(request_seed(1, 5, 0, [{"role": "user", "content": "12+35="}]))
    assert seed not in others and len(others) == 4
    assert 0 <= seed < 2**63
    # the n responses of a group (session ids 0..7) draw from 8 different streams
    assert len({request_seed(1, 5, s, PROMPT) for s in range(8)}) == 8


def test_the_loop_is_registered_by_name_without_replacing_one_already_there():
    module = types.SimpleNamespace(_agent_loop_registry={"single_turn_agent": {"_target_": "verl.x.Y"}})
    register_seeded_agent_loop(module)
    target = module._agent_loop_registry[SEEDED_AGENT_LOOP]["_target_"]
    assert target == "verl_replay.integrations.verl.seeded_agent_loop.SeededSingleTurnAgentLoop"
    module._agent_loop_registry[SEEDED_AGENT_LOOP] = {"_target_": "mine"}
    register_seeded_agent_loop(module)
    assert module._agent_loop_registry[SEEDED_AGENT_LOOP] == {"_target_": "mine"}


def test_importing_verl_registers_the_seeded_loop_and_its_target_imports():
    """In every process that imports verl (the plugin), the name resolves to our class."""
    import importlib

    agent_loop = importlib.import_module(seeded_rollout.AGENT_LOOP_MODULE)
    target = agent_loop._agent_loop_registry[SEEDED_AGENT_LOOP]["_target_"]
    module_name, _, class_name = target.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    assert issubclass(cls, SingleTurnAgentLoop)


def test_verl_registers_agent_loops_as_we_do_and_passes_sampling_params_to_vllm():
    """Canaries: verl's registry (a private dict of name -> hydra target), the single-turn loop's
    ``run(sampling_params, ...)`` handing them to the server, and the vLLM server turning them into
    ``SamplingParams`` whole (where ``seed`` becomes the request's own generator)."""
    import importlib.util

    from verl.experimental.agent_loop import agent_loop
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    # read, not imported: importing vLLM's server module sets this process's root logger to ERROR
    server = Path(importlib.util.find_spec("verl.workers.rollout.vllm_rollout.vllm_async_server").origin)

    assert isinstance(agent_loop._agent_loop_registry, dict)
    assert '_agent_loop_registry[agent_name] = {"_target_": fqdn}' in inspect.getsource(agent_loop.register)
    run = inspect.signature(SingleTurnAgentLoop.run)
    assert list(run.parameters)[1] == "sampling_params"
    assert "sampling_params=sampling_params" in inspect.getsource(SingleTurnAgentLoop.run)
    assert "SamplingParams(max_tokens=max_tokens, **sampling_params)" in server.read_text()
