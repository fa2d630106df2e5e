"""Image rows in the group buffer: pictures stored once per group (PNG), multi_modal_inputs and
M-RoPE position ids rebuilt with verl's agent-loop code and the tiny image model's real processor."""

from __future__ import annotations

import importlib
import io

import pytest
import torch

from verl_replay.integrations.verl import multimodal as mm
from verl_replay.integrations.verl.rows import GroupNotReplayable, group_to_rows, rows_to_group


@pytest.fixture(scope="module")
def image_task():
    from verl_replay.data.tiny_tasks import build_tiny_task

    return build_tiny_task("image")


@pytest.fixture(scope="module")
def rebuilder(image_task):
    from verl.utils import hf_processor, hf_tokenizer

    from verl_replay.integrations.verl.vl_processor import allow_vl_processor_without_torchvision

    allow_vl_processor_without_torchvision()
    return mm.MultimodalRebuilder(hf_processor(str(image_task.model_dir)), hf_tokenizer(str(image_task.model_dir)))


def _picture(count: int = 2):
    import random

    from PIL import Image

    from verl_replay.data.tiny_tasks import square_image

    return Image.open(io.BytesIO(square_image(count, random.Random(count)))).convert("RGB")


def _fresh_rows(rebuilder, n: int = 3):
    """Rows as verl's agent loop writes them for an image prompt: expanded image tokens, the
    processor's pixel values of the prompt's picture, (4, L) M-RoPE position ids."""
    from test_rows import fresh_row

    picture = _picture()
    tok = rebuilder.tokenizer
    tokens = rebuilder.processor.image_processor(images=[picture])["image_grid_thw"].prod() // 4
    text = "<|im_start|>user\n<|vision_start|>" + "<|image_pad|>" * int(tokens) + "<|vision_end|>How many?<|im_end|>\n"
    prompt = tok.encode(text + "<|im_start|>assistant\n", add_special_tokens=False)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": "How many?"}]}
    ]
    images = rebuilder.images(messages)
    rows = []
    for session in range(n):
        row = fresh_row(prompt, [30 + session, 31, 32], session, acc=float(session == 0), advantage=0.5, score=1.0)
        row["raw_prompt"] = row["prompt"] = messages  # verl's dataset: the same parts in both fields
        row["multi_modal_inputs"], row["position_ids"] = rebuilder.rebuild(row["input_ids"], images)
        rows.append(row)
    return rows


def test_image_groups_store_each_picture_once_and_replay_the_same_inputs(rebuilder):
    rows = _fresh_rows(rebuilder)
    positions = rows[0]["position_ids"]
    assert positions.shape == (4, rows[0]["input_ids"].numel())
    # M-RoPE from the image grid: the image tokens' (h, w) rows are not the text index
    assert not torch.equal(positions[2], positions[0])
    stored_rows, pictures = mm.store_media(rows, rebuilder)
    assert len(pictures) == 1 and all("multi_modal_inputs" not in r and "position_ids" not in r for r in stored_rows)
    assert all(not mm.image_parts(r["prompt"])[0].get("image") for r in stored_rows)  # no picture left in a field
    group = rows_to_group(stored_rows, anchor_field="old_log_probs")
    meta = group.meta
    meta["shared"][mm.IMAGES_META] = pictures
    group.meta = meta
    assert mm.stored_images(group.meta) == 1
    replayed = mm.restore_media(group_to_rows(group, uid="r", global_steps=2), rebuilder)
    for fresh, again in zip(rows, replayed, strict=True):
        assert mm.same_inputs(again["multi_modal_inputs"], fresh["multi_modal_inputs"])
        assert torch.equal(again["position_ids"], fresh["position_ids"])
        assert mm.IMAGES_META not in again
    for field in ("raw_prompt", "prompt"):
        picture = replayed[0][field][0]["content"][0]["image"]
        assert list(picture.getdata()) == list(_picture().getdata())  # PNG is lossless


def test_buffer_memory_per_image_group_is_the_picture_not_the_pixel_values(rebuilder):
    rows = _fresh_rows(rebuilder, n=4)
    stored_rows, pictures = mm.store_media(rows, rebuilder)
    group = rows_to_group(stored_rows, anchor_field="old_log_probs")
    meta = group.meta
    meta["shared"][mm.IMAGES_META] = pictures
    group.meta = meta
    text_group = rows_to_group(
        [
            {k: v for k, v in r.items() if k != "multi_modal_inputs"}
            | {
                "position_ids": torch.arange(r["input_ids"].numel()),
                "raw_prompt": [{"role": "user", "content": "How many?"}],
                "prompt": [{"role": "user", "content": "How many?"}],
            }
            for r in rows
        ],
        anchor_field="old_log_probs",
    )
    per_row_pixels = sum(mm.pixel_bytes(r["multi_modal_inputs"]) for r in rows)
    image_cost = group.nbytes - text_group.nbytes
    print(f"image group: {group.nbytes} B stored ({image_cost} B for its picture), pixel values: {per_row_pixels} B")
    assert image_cost < 2 * pictures[0].numel() + 200
    assert group.nbytes < per_row_pixels / 20


def test_rows_whose_inputs_do_not_rebuild_are_not_stored(rebuilder):
    rows = _fresh_rows(rebuilder)
    rows[1]["multi_modal_inputs"] = dict(rows[1]["multi_modal_inputs"])
    rows[1]["multi_modal_inputs"]["pixel_values"] = rows[1]["multi_modal_inputs"]["pixel_values"] + 1e-3
    with pytest.raises(GroupNotReplayable, match="do not rebuild exactly"):
        mm.store_media(rows, rebuilder)
    rows = _fresh_rows(rebuilder)
    rows[0]["position_ids"] = torch.arange(rows[0]["input_ids"].numel()).expand(4, -1).clone()
    with pytest.raises(GroupNotReplayable, match="do not rebuild exactly"):
        mm.store_media(rows, rebuilder)
    with pytest.raises(GroupNotReplayable, match="processor"):
        mm.store_media(_fresh_rows(rebuilder), None)


def test_video_and_audio_rows_are_refused_with_the_reason(rebuilder):
    rows = _fresh_rows(rebuilder)
    rows[0]["multi_modal_inputs"] = {**rows[0]["multi_modal_inputs"], "video_grid_thw": torch.tensor([[1, 2, 2]])}
    with pytest.raises(GroupNotReplayable, match="video/audio rows are not replayable .*video_grid_thw"):
        mm.store_media(rows, rebuilder)
    rows = _fresh_rows(rebuilder)
    rows[2]["raw_prompt"] = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}]
    with pytest.raises(GroupNotReplayable, match="frames or audio"):
        mm.store_media(rows, rebuilder)


def test_text_groups_pass_unchanged(rebuilder):
    from test_rows import fresh_row

    rows = [fresh_row([5, 6], [1, 2], 0, acc=1.0, advantage=0.5, score=1.0)]
    rows[0]["multi_modal_inputs"] = {}
    assert mm.store_media(rows, rebuilder) == (rows, [])
    assert mm.restore_media(rows, None) is rows


def test_pictures_are_resized_as_qwen_vl_utils_resizes_them():
    from PIL import Image

    small = Image.new("RGBA", (50, 70), (10, 20, 30, 255))
    out = mm.fetch_image({"type": "image", "image": small}, image_patch_size=16)
    assert out.mode == "RGB" and out.size == (64, 64)  # at least 4 merged tokens: 4 * 32 * 32 pixels
    # 300 x 120 -> multiples of 32, nearest: 288 x 128 (within the bounds, aspect ratio kept)
    assert mm.fetch_image({"type": "image", "image": Image.new("RGB", (300, 120))}, 16).size == (288, 128)
    square = Image.new("RGB", (100, 100))
    assert mm.fetch_image({"type": "image", "image": square, "max_pixels": 64 * 64}, 16).size == (64, 64)
    assert mm.smart_resize(10, 10, 32, 4 * 32**2, 16384 * 32**2) == (64, 64)  # tiny pictures grow to 2 x 2 tokens
    assert mm.smart_resize(4000, 4000, 32, 4 * 32**2, 64 * 32**2) == (256, 256)  # large ones shrink to max_pixels


def test_the_dataset_reader_without_torchvision_reads_images_and_refuses_videos():
    from verl.utils.dataset.rl_dataset import RLHFDataset

    messages = [{"role": "user", "content": [{"type": "image", "image": _picture()}, {"type": "text", "text": "q"}]}]
    images, videos, audios = mm.process_multi_modal_info_without_torchvision(RLHFDataset, messages, 16, None)
    assert [im.size for im in images] == [(64, 64)] and videos is None and not audios
    video = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}]}]
    with pytest.raises(ValueError, match="video prompts need torchvision"):
        mm.process_multi_modal_info_without_torchvision(RLHFDataset, video, 16, None)


@pytest.mark.parametrize("module_name, attribute", mm.VERL_CONTACT_POINTS)
def test_verl_names_the_rebuild_relies_on_exist(module_name, attribute):
    obj = importlib.import_module(module_name)
    for part in attribute.split("."):
        assert hasattr(obj, part), (
            f"verl moved {module_name}.{attribute}: update verl_replay/integrations/verl/multimodal.py"
        )
        obj = getattr(obj, part)
