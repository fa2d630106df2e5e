"""HFBackend on a tiny local Llama model (CPU)."""

from __future__ import annotations

import pytest
import torch

from verl_replay.generation import Generation, GenerationBackend, make_backend
from verl_replay.generation.hf import HFBackend

CHAT = [{"role": "user", "content": "count the rows"}]
PROMPTS = ["the cat sat", CHAT, "a dog ran in the park and the cat"]


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> HFBackend:
    return HFBackend(str(tiny_model_dir), batch_size=4)


def test_shapes_n_samples_and_fields(backend: HFBackend) -> None:
    out = backend.generate(PROMPTS, n=3, temperature=1.0, top_p=0.95, max_new_tokens=7, seed=0)
    assert isinstance(backend, GenerationBackend)
    assert len(out) == len(PROMPTS) and all(len(samples) == 3 for samples in out)
    for samples in out:
        for g in samples:
            assert isinstance(g, Generation)
            assert 1 <= g.num_tokens == len(g.token_ids) <= 7
            assert g.text == backend.tokenizer.decode(list(g.token_ids), skip_special_tokens=True)
            assert g.logprobs is None
            if g.finish_reason == "length":
                assert g.num_tokens == 7 and backend.tokenizer.eos_token_id not in g.token_ids
            else:
                assert g.finish_reason == "stop" and g.token_ids[-1] == backend.tokenizer.eos_token_id
                assert backend.tokenizer.eos_token_id not in g.token_ids[:-1]


def test_deterministic_for_a_seed_and_leaves_global_rng_alone(backend: HFBackend) -> None:
    kwargs = dict(n=4, temperature=1.0, top_p=1.0, max_new_tokens=6)
    rng_before = torch.get_rng_state()
    a = backend.generate(PROMPTS, seed=11, **kwargs)
    b = backend.generate(PROMPTS, seed=11, **kwargs)
    c = backend.generate(PROMPTS, seed=12, **kwargs)
    torch.testing.assert_close(torch.get_rng_state(), rng_before)
    assert a == b
    assert [g.token_ids for s in a for g in s] != [g.token_ids for s in c for g in s]
    # Samples of one prompt differ from each other (sampling, not n copies of one draw).
    assert len({g.token_ids for g in a[2]}) > 1


def test_model_defaults_do_not_leak_into_sampling(backend: HFBackend) -> None:
    # The saved generation_config has top_k=3 and repetition_penalty=1.3; with 27 tokens and
    # top_k off, 24 samples of 6 tokens use far more than 3 distinct first tokens.
    out = backend.generate(["the"], n=24, temperature=1.0, top_p=1.0, max_new_tokens=1, seed=3)
    assert len({g.token_ids[0] for g in out[0]}) > 3
    assert backend.model.generation_config.top_k in (None, 50)  # the saved defaults were dropped
    assert backend.model.generation_config.repetition_penalty in (None, 1.0)
    assert not backend.model.training
    assert not any(p.requires_grad for p in backend.model.parameters())


def test_greedy_is_seed_independent_and_padding_invariant(tiny_model_dir) -> None:
    single = HFBackend(str(tiny_model_dir), batch_size=1)
    batched = HFBackend(str(tiny_model_dir), batch_size=8)
    alone = single.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=8, seed=0)
    together = batched.generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=8, seed=99)
    # Left padding + attention mask: a short prompt batched with a long one decodes the same.
    assert [s[0].token_ids for s in alone] == [s[0].token_ids for s in together]
    twice = batched.generate(PROMPTS[:1], n=2, temperature=0.0, max_new_tokens=8, seed=5)
    assert twice[0][0] == twice[0][1] == alone[0][0]


def test_stops_at_eos_per_row(stopper_model_dir, stop_trigger: str) -> None:
    backend = HFBackend(str(stopper_model_dir), batch_size=8)
    tok = backend.tokenizer
    out = backend.generate(
        [f"the cat sat on the {stop_trigger}", "the cat sat on"], n=2, temperature=1.0, max_new_tokens=5, seed=0
    )
    for g in out[0]:  # prompt ends with the trigger: EOS immediately, nothing after it
        assert g.token_ids == (tok.eos_token_id,)
        assert g.text == "" and g.finish_reason == "stop"
    trigger = tok.convert_tokens_to_ids(stop_trigger)
    for g in out[1]:  # EOS is impossible here: runs to the length limit, no padding included
        assert g.finish_reason == "length" and g.num_tokens == 5
        assert tok.eos_token_id not in g.token_ids and trigger not in g.token_ids
        assert tok.pad_token_id not in g.token_ids or g.token_ids.count(tok.pad_token_id) < 5


def test_logprobs_are_raw_model_logprobs_of_chosen_tokens(backend: HFBackend) -> None:
    out = backend.generate(PROMPTS[:2], n=2, temperature=0.7, top_p=0.9, max_new_tokens=5, seed=4, logprobs=True)
    prompt_ids = backend.encode(PROMPTS[:2])
    for ids, samples in zip(prompt_ids, out, strict=True):
        for g in samples:
            assert g.logprobs is not None and len(g.logprobs) == g.num_tokens
            full = torch.tensor([ids + list(g.token_ids)])  # [1, P+T], no padding
            with torch.no_grad():
                logits = backend.model(full).logits[0].float()  # [P+T, V]
            logp = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)  # [T, V], predicts each new token
            expected = logp.gather(1, torch.tensor(g.token_ids).unsqueeze(1)).squeeze(1)  # [T]
            torch.testing.assert_close(torch.tensor(g.logprobs), expected)


def test_chat_template_and_prompt_encoding(backend: HFBackend, tiny_model_dir, tokenizer_factory) -> None:
    tok = backend.tokenizer
    assert backend.apply_chat_template(CHAT) == "<|user|> count the rows <|assistant|>"
    expected = tok("<|user|> count the rows <|assistant|>", add_special_tokens=False)["input_ids"]
    assert backend.encode([CHAT, "the cat"]) == [expected, tok("the cat")["input_ids"]]
    assert backend.tokenizer.padding_side == "left"

    bare_dir = tiny_model_dir.parent / "no_template"
    bare_dir.mkdir(exist_ok=True)
    tokenizer_factory(chat_template=None).save_pretrained(bare_dir)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(bare_dir)
    bare = HFBackend(str(bare_dir))
    with pytest.raises(ValueError, match="no chat template"):
        bare.generate([CHAT], n=1, max_new_tokens=2)
    assert len(bare.generate(["the cat"], n=1, max_new_tokens=2)[0]) == 1


def test_chunking_keeps_prompt_order(tiny_model_dir) -> None:
    backend = HFBackend(str(tiny_model_dir), batch_size=2)  # n=2 -> one prompt per chunk
    greedy = backend.generate(PROMPTS, n=2, temperature=0.0, max_new_tokens=6, seed=0)
    reference = HFBackend(str(tiny_model_dir), batch_size=1).generate(PROMPTS, n=1, temperature=0.0, max_new_tokens=6)
    assert [s[0].token_ids for s in greedy] == [s[0].token_ids for s in reference]
    sampled = backend.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=6, seed=8)
    assert sampled == backend.generate(PROMPTS, n=2, temperature=1.0, max_new_tokens=6, seed=8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_invalid_sampling_arguments(backend: HFBackend, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        backend.generate(["the cat"], **kwargs)


def test_single_string_is_rejected(backend: HFBackend) -> None:
    with pytest.raises(TypeError, match="list of prompts"):
        backend.generate("the cat", n=1)  # type: ignore[arg-type]


def test_factory_builds_hf_backend(tiny_model_dir) -> None:
    built = make_backend("transformers", model_path=str(tiny_model_dir), batch_size=2)
    assert isinstance(built, HFBackend) and built.batch_size == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        HFBackend(str(tiny_model_dir), dtype="float7")


def test_induction_cli_builds_a_real_hf_backend(tiny_model_dir, tmp_path) -> None:
    import json

    import yaml

    from verl_replay.sql.induce_vocabulary import main

    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("\n".join(json.dumps({"sql": f"SELECT a FROM t WHERE b = {i}"}) for i in range(3)), "utf-8")
    out = tmp_path / "vocab.yaml"
    argv = ["--seeds", str(seeds), "--out", str(out), "--backend", "hf", "--model", str(tiny_model_dir)]
    assert main(argv + ["--max-new-tokens", "3", "--temperature", "1.0"]) == 0
    data = yaml.safe_load(out.read_text("utf-8"))
    assert data["reviewed"] is False and data["induction"]["backend"] == "hf"
    assert sum(a["count"] for a in data["approaches"]) + data["induction"]["unparsed"] == 3


def test_loads_the_checkpoint_class_of_a_vision_language_model(tiny_assets) -> None:
    """Qwen3.5-4B is a Qwen3_5ForConditionalGeneration: the backend must sample from that model
    (the one verl trains and vLLM serves), not from the text-only class AutoModelForCausalLM maps
    its config to, and its log-probs must be those of a teacher-forced pass with M-RoPE positions."""
    from transformers import AutoModelForImageTextToText

    backend = HFBackend(str(tiny_assets.model_dir), batch_size=4)
    assert type(backend.model).__name__ == "Qwen3_5ForConditionalGeneration"
    prompts = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "What is 12 + 30?"}]]
    out = backend.generate(prompts, n=2, temperature=1.0, max_new_tokens=8, seed=0, logprobs=True)
    reference = AutoModelForImageTextToText.from_pretrained(tiny_assets.model_dir).eval()
    for ids, samples in zip(backend.encode(prompts), out, strict=True):
        for g in samples:
            full = torch.tensor([list(ids) + list(g.token_ids)])  # [1, P+T]
            positions = torch.arange(full.shape[1]).expand(4, 1, full.shape[1])  # text: t = h = w
            with torch.no_grad():
                logits = reference(input_ids=full, position_ids=positions).logits[0].float()  # [P+T, V]
            logp = torch.log_softmax(logits[len(ids) - 1 : -1], dim=-1)  # [T, V]
            expected = logp.gather(1, torch.tensor(g.token_ids).unsqueeze(1)).squeeze(1)  # [T]
            torch.testing.assert_close(torch.tensor(g.logprobs), expected, rtol=1e-4, atol=1e-4)


def test_loading_prints_nothing_of_transformers_and_restores_its_settings(tiny_assets) -> None:
    """The tiny Qwen3.5 on CPU made transformers warn that its fast path is not available and draw
    a weight-loading bar in every search and eval; the backend loads quietly, and transformers'
    verbosity and bars are as they were afterwards."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        from transformers.utils import logging
        from verl_replay.generation.hf import HFBackend
        logging.set_verbosity_info()
        HFBackend({str(tiny_assets.model_dir)!r}, batch_size=2)
        assert logging.get_verbosity() == logging.INFO and logging.is_progress_bar_enabled()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fast path" not in result.stderr and "Loading weights" not in result.stderr, result.stderr[-3000:]
