"""What verl_replay.generation.vllm states about vLLM 0.24, checked against the installed vLLM
(skipped unless the GPU stack is installed: pip install -e ".[gpu,test]")."""

from __future__ import annotations

import inspect

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (GPU stack only)")


def test_canary_prefix_caching_is_off_by_default_for_hybrid_models() -> None:
    from vllm.config.model import ModelConfig
    from vllm.engine.arg_utils import EngineArgs

    source = inspect.getsource(ModelConfig)
    start = source.index("def is_prefix_caching_supported")
    body = source[start : source.index("\n    @", start)]
    hybrid = body.index('attn_type == "hybrid"')
    assert "return False" in body[hybrid : hybrid + 300]  # the docstring's claim for Qwen3.5
    defaults = inspect.getsource(EngineArgs)
    assert "default_prefix_caching = model_config.is_prefix_caching_supported" in defaults
    assert "self.enable_prefix_caching = default_prefix_caching" in defaults


def test_canary_engine_exposes_max_model_len() -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    assert "self.model_config = vllm_config.model_config" in inspect.getsource(LLMEngine.__init__)
    assert "self.llm_engine = LLMEngine.from_engine_args" in inspect.getsource(vllm.LLM.__init__)


def test_canary_qwen3_5_is_registered() -> None:
    assert "Qwen3_5ForConditionalGeneration" in vllm.ModelRegistry.get_supported_archs()
