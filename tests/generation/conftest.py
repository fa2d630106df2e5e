"""Tiny local model + tokenizer (no hub): a WordLevel tokenizer and a 2-layer Llama, hidden 32.

Llama rather than Qwen2: for ``model_type == "qwen2"`` transformers 5.9's AutoTokenizer swaps a
saved generic tokenizer for ``Qwen2Tokenizer`` (Qwen's byte-level pre-tokenizer), which would not
load our WordLevel tokenizer as saved.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SPECIAL_TOKENS = ["<pad>", "<unk>", "<eos>", "<|user|>", "<|assistant|>"]
SENTENCES = [
    "the cat sat on the mat",
    "select name from singer where age is large",
    "a dog ran in the park",
    "count the rows of the table",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STOP_TRIGGER = "mat"  # in the "stopper" model, EOS follows this token and nothing else


def build_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def _config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config(tokenizer))
    # Hub-style sampling defaults the backend must override (top-k 3 would make samples collapse).
    model.generation_config = GenerationConfig(
        do_sample=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        top_k=3,
        repetition_penalty=1.3,
    )
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def stopper_model_dir(tmp_path_factory) -> Path:
    """A model whose next-token logits depend only on the current token: after STOP_TRIGGER the
    EOS logit is huge; after any other token EOS and STOP_TRIGGER are impossible.

    Attention and MLP outputs are zeroed, so the final hidden state is the token's embedding;
    embedding dimension 0 is +1 for STOP_TRIGGER and -1 for every other token, and the lm_head
    rows of EOS / STOP_TRIGGER read that dimension with large positive weights.
    """
    import torch
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("stopper_llama")
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(path)
    torch.manual_seed(1)
    model = LlamaForCausalLM(_config(tokenizer))
    trigger = tokenizer.convert_tokens_to_ids(STOP_TRIGGER)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed[:, 0] = -1.0
        embed[trigger, 0] = 1.0
        head = model.lm_head.weight
        head[eos] = 0.0
        head[eos, 0] = 20.0
        head[trigger] = 0.0
        head[trigger, 0] = 10.0
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer_factory():
    """``build_tokenizer`` (tests import nothing from conftest under --import-mode=importlib)."""
    return build_tokenizer


@pytest.fixture(scope="session")
def stop_trigger() -> str:
    return STOP_TRIGGER


@pytest.fixture(scope="module", autouse=True)
def _single_torch_thread():
    """Hidden size 32 gains nothing from intra-op threads, and on a shared 2-core machine they
    oversubscribe the CPU (10x slower generate under load)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
