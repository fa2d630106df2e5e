"""vLLM extensions: plugins vLLM itself loads (vllm.general_plugins), no verl imports."""
