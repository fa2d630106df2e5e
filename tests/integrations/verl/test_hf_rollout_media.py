"""The hf rollout's agent-loop inputs: the tool parser's stop tokens and image prompts (no Ray).

(A file of its own next to test_hf_rollout.py: these tests need the tiny image task's model.)
"""

from __future__ import annotations

import asyncio
import io
import random

import pytest
import torch

from verl_replay.integrations.verl.hf_rollout import HFRolloutServer


def _server(model_dir) -> HFRolloutServer:
    from verl.workers.config import HFModelConfig, RolloutConfig

    from verl_replay.integrations.verl.vl_processor import allow_vl_processor_without_torchvision

    allow_vl_processor_without_torchvision()  # as verl's CPU support does in every worker
    config = RolloutConfig(name="hf", prompt_length=128, response_length=12, tensor_model_parallel_size=1)
    return HFRolloutServer(config=config, model_config=HFModelConfig(path=str(model_dir)), replica_rank=0)


@pytest.fixture(scope="module")
def image_server():
    from verl_replay.data.tiny_tasks import build_tiny_task

    return _server(build_tiny_task("image").model_dir)


def _generate(server, prompt, **kwargs):
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, **kwargs.pop("params", {})}
    return asyncio.run(server.generate(prompt_ids=prompt, sampling_params=params, request_id="r", **kwargs))


def _image_prompt(server, picture):
    tokens = int(server.model_config_processor.image_processor(images=[picture])["image_grid_thw"].prod()) // 4
    text = "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * tokens + "<|vision_end|>How many squares?"
    return server.model_config_tokenizer.encode(text + "<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def _picture():
    from PIL import Image

    from verl_replay.data.tiny_tasks import square_image

    return Image.open(io.BytesIO(square_image(3, random.Random(0)))).convert("RGB")


def test_the_tool_parsers_stop_tokens_end_a_turn(image_server):
    prompt = image_server.model_config_tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    asyncio.run(image_server.set_global_steps(5))
    free = _generate(image_server, prompt, params={"max_tokens": 10})
    assert len(free.token_ids) >= 3
    stop = free.token_ids[1]
    asyncio.run(image_server.set_global_steps(6))
    asyncio.run(image_server.set_global_steps(5))  # the same sample again
    stopped = _generate(image_server, prompt, params={"max_tokens": 10, "stop_token_ids": [stop]})
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[: first + 1]  # kept, as vLLM keeps a stop token
    torch.testing.assert_close(torch.tensor(stopped.log_probs), torch.tensor(free.log_probs[: first + 1]))


def test_image_prompts_are_sampled_with_the_pictures_and_the_actors_positions(image_server):
    """The log-probs of a sampled image answer equal a teacher-forced forward of an independently
    loaded checkpoint fed the pictures and the M-RoPE positions verl's agent loop builds."""
    from transformers import AutoModelForImageTextToText
    from verl.utils import hf_processor

    from verl_replay.integrations.verl.multimodal import MultimodalRebuilder

    picture = _picture()
    prompt = _image_prompt(image_server, picture)
    output = _generate(image_server, prompt, image_data=[picture])
    assert output.token_ids and len(output.log_probs) == len(output.token_ids)
    model_dir = image_server.model.name_or_path
    rebuilder = MultimodalRebuilder(hf_processor(model_dir), image_server.model_config_tokenizer)
    ids = torch.tensor(prompt + output.token_ids)
    inputs, positions = rebuilder.rebuild(
        ids, rebuilder.images([{"role": "user", "content": [{"type": "image", "image": picture}]}])
    )
    reference = AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        logits = reference(
            input_ids=ids[None],
            position_ids=positions[:, None, :],
            pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"],
        ).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1).gather(-1, torch.tensor(output.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(output.log_probs), expected, rtol=1e-4, atol=1e-4)
    # without the picture the answer's log-probs differ: the vision tower is in the loop
    with torch.no_grad():
        blind = reference(input_ids=ids[None], position_ids=positions[:, None, :]).logits[0, len(prompt) - 1 : -1]
    assert not torch.allclose(
        torch.log_softmax(blind.float(), dim=-1).gather(-1, torch.tensor(output.token_ids)[:, None])[:, 0], expected
    )


def test_image_prompts_whose_placeholders_do_not_match_the_pictures_are_refused(image_server):
    picture = _picture()
    prompt = _image_prompt(image_server, picture)
    image_token = image_server.model.config.image_token_id
    short = prompt[: prompt.index(image_token)] + prompt[prompt.index(image_token) + 1 :]
    with pytest.raises(ValueError, match="image tokens"):
        _generate(image_server, short, image_data=[picture])
    with pytest.raises(ValueError, match="no video or audio"):
        _generate(image_server, prompt, video_data=[object()])
