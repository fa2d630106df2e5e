"""Rollout overrides for the tests whose subject is a comparison of two runs token for token.

The recipes' rollout engine on CPU is verl's vLLM server on vLLM's CPU build; its sampling is not
reproducible from run to run (bf16 kernels whose reductions depend on the batch's make-up), so two
runs of the same seed part ways within a step. The tests that compare runs of the same seed (replay
off vs on, killed vs straight, ours vs verl's own entry point) therefore generate with
verl-replay's transformers rollout replica (fp32, seeded per request): their subject is the replay
and the trainer, not the engine. Every other end-to-end test runs the recipes' vLLM path.
"""

HF_ROLLOUT = ("actor_rollout_ref.rollout.name=hf",)
