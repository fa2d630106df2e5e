"""Image rows in the group buffer: stored once per group as PNG bytes, rebuilt on replay.

A fresh image row, as verl's agent loop writes it, carries the prompt's messages with the
decoded pictures (``raw_prompt``), the processor's ``multi_modal_inputs`` (``pixel_values``: one
float32 row of 3 x 2 x 16 x 16 values per 16-pixel patch, ``image_grid_thw``,
``images_seqlens``) and M-RoPE ``position_ids`` of shape (4, L) built from the image grid. Kept per
row, the pixel values alone would be ~98 KB per row for a 64 x 64 picture. The buffer keeps the
group's pictures once, as PNG bytes (``IMAGES_META``), and the prompt's messages with image parts
that name the picture by index; a replayed row gets its ``multi_modal_inputs`` and position ids
again from verl's own agent-loop code (``AgentLoopWorker._compute_multi_modal_inputs`` /
``_compute_position_ids``) over the same pictures and tokens, so it is the row the agent loop
would build. At ingress the rebuild is checked against the fresh row (exact equality), so a
group is only stored when its replay is exact.

Videos and audio are refused at ingress (one line: the row's ``multi_modal_inputs`` names them):
their frames and sampling metadata are not kept.

``process_multi_modal_info_without_torchvision`` is verl's ``RLHFDataset._process_multi_modal_info``
for hosts without torchvision (the CPU stack): ``qwen_vl_utils`` imports torchvision at module top,
although its image path does not use it. Images are resized exactly as ``qwen_vl_utils.fetch_image``
resizes them; a video still needs torchvision.
"""

from __future__ import annotations

import io
import math
from types import SimpleNamespace
from typing import Any, Mapping, Optional, Sequence

import torch

from verl_replay.integrations.verl.rows import GroupNotReplayable

# verl names this module relies on (module, dotted attribute): private, checked by canaries.
VERL_CONTACT_POINTS: tuple[tuple[str, str], ...] = (
    ("verl.experimental.agent_loop.agent_loop", "AgentLoopWorker._compute_multi_modal_inputs"),
    ("verl.experimental.agent_loop.agent_loop", "AgentLoopWorker._compute_position_ids"),
    ("verl.utils.dataset.rl_dataset", "RLHFDataset._process_multi_modal_info"),
    ("verl.utils.dataset.rl_dataset", "RLHFDataset._extract_audio_info"),
)
# Group metadata key: the prompt's pictures as PNG bytes (uint8 tensors), in prompt order.
IMAGES_META = "__images__"
# An image part of a stored prompt names its picture: {"type": "image", IMAGE_INDEX: i}.
IMAGE_INDEX = "__image_index__"
# multi_modal_inputs keys that only videos / audio produce (not replayable: their data is not kept).
VIDEO_AUDIO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "input_features", "audio_features")
# qwen_vl_utils' image bounds, in merged patches (IMAGE_MIN_TOKEN_NUM / IMAGE_MAX_TOKEN_NUM)
_MIN_TOKENS, _MAX_TOKENS, _SPATIAL_MERGE = 4, 16384, 2


def _pil(value: Any) -> Any:
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value))
    if isinstance(value, Mapping) and "bytes" in value:
        return Image.open(io.BytesIO(value["bytes"]))
    if isinstance(value, str):
        return Image.open(value[7:] if value.startswith("file://") else value)
    raise ValueError(f"image part holds a {type(value).__name__}; expected a PIL image, PNG/JPEG bytes or a path")


def image_parts(messages: Any) -> list[dict[str, Any]]:
    """The image parts of chat messages, in order (none for a value that is not a message list)."""
    if not isinstance(messages, (list, tuple)):
        return []
    parts = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            parts.extend(p for p in content if isinstance(p, Mapping) and p.get("type") in ("image", "image_url"))
    return parts


def has_video_or_audio(messages: Any) -> bool:
    for message in messages or []:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            isinstance(p, Mapping) and p.get("type") in ("video", "audio") for p in content
        ):
            return True
    return False


def png_bytes(image: Any) -> bytes:
    out = io.BytesIO()
    _pil(image).save(out, format="PNG")
    return out.getvalue()


def _part_image(part: Mapping[str, Any]) -> Any:
    for key in ("image", "bytes", "image_url"):
        if part.get(key) is not None:
            return _pil(part[key])
    raise ValueError("an image part holds no image ('image', 'bytes' or 'image_url')")


def compact_prompt(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """(messages whose image parts name their picture by index, the pictures as PNG uint8 tensors)."""
    pngs: list[torch.Tensor] = []
    out = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in ("image", "image_url"):
                    data = png_bytes(_part_image(part))
                    extra = {k: v for k, v in part.items() if k not in ("image", "bytes", "image_url", "type")}
                    parts.append({"type": "image", IMAGE_INDEX: len(pngs), **extra})
                    pngs.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).clone())
                else:
                    parts.append(part)
            message["content"] = parts
        out.append(message)
    return out, pngs


def restore_prompt(messages: Sequence[Mapping[str, Any]], pngs: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """The stored messages with their pictures decoded (as verl's dataset gives them: PIL + bytes)."""
    out = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, Mapping) and IMAGE_INDEX in part:
                    data = bytes(pngs[int(part[IMAGE_INDEX])].numpy().tobytes())
                    rest = {k: v for k, v in part.items() if k != IMAGE_INDEX}
                    parts.append({**rest, "bytes": data, "image": _pil(data)})
                else:
                    parts.append(part)
            message["content"] = parts
        out.append(message)
    return out


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``qwen_vl_utils.smart_resize``: (height, width) in multiples of ``factor``, the pixel count
    within [min_pixels, max_pixels], the aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fetch_image(part: Mapping[str, Any], image_patch_size: int) -> Any:
    """``qwen_vl_utils.fetch_image`` for a local image part: RGB, resized to multiples of
    patch x merge within qwen_vl_utils' pixel bounds (or the part's min/max_pixels)."""
    from PIL import Image

    image = _part_image(part)
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, (255, 255, 255))
        background.paste(image, mask=image.split()[3])
        image = background
    else:
        image = image.convert("RGB")
    factor = int(image_patch_size * _SPATIAL_MERGE)
    bounds = {"min_pixels": _MIN_TOKENS * factor**2, "max_pixels": _MAX_TOKENS * factor**2}
    if "resized_height" in part and "resized_width" in part:
        height, width = smart_resize(int(part["resized_height"]), int(part["resized_width"]), factor, **bounds)
    else:
        width, height = image.size
        bounds = {k: int(part.get(k, v)) for k, v in bounds.items()}
        height, width = smart_resize(height, width, factor, **bounds)
    return image.resize((width, height))


def vision_images(messages: Any, image_patch_size: int) -> Optional[list[Any]]:
    """The prompt's pictures as verl's dataset hands them to the agent loop (None: no image)."""
    parts = image_parts(messages)
    if not parts:
        return None
    from verl_replay.integrations.verl.vl_processor import torchvision_available

    if torchvision_available():
        from qwen_vl_utils import fetch_image as qwen_fetch_image

        return [qwen_fetch_image(dict(p), image_patch_size=image_patch_size) for p in parts]
    return [fetch_image(p, image_patch_size) for p in parts]


def process_multi_modal_info_without_torchvision(
    cls: Any, messages: list[dict], image_patch_size: int, config: Any
) -> tuple[Any, Any, Any]:
    """``RLHFDataset._process_multi_modal_info`` on a host without torchvision (images only)."""
    if has_video_or_audio(messages) and any(
        isinstance(p, Mapping) and p.get("type") == "video"
        for m in messages
        for p in (m.get("content") if isinstance(m.get("content"), list) else [])
    ):
        raise ValueError("video prompts need torchvision (qwen_vl_utils reads the frames with it); install torchvision")
    images = vision_images(messages, image_patch_size)
    return images, None, cls._extract_audio_info(messages)


# ------------------------------------------------------------------ rebuild of a replayed row


def refuse_video_audio(row: Mapping[str, Any]) -> None:
    inputs = row.get("multi_modal_inputs")
    present = [k for k in VIDEO_AUDIO_KEYS if isinstance(inputs, Mapping) and k in inputs]
    if present or has_video_or_audio(row.get("raw_prompt")):
        raise GroupNotReplayable(
            f"video/audio rows are not replayable ({', '.join(present) or 'video/audio parts in raw_prompt'}): "
            "the buffer keeps images only, not frames or audio with their sampling metadata"
        )


class MultimodalRebuilder:
    """``multi_modal_inputs`` and position ids of a row, by verl's own agent-loop code.

    ``AgentLoopWorker._compute_multi_modal_inputs`` / ``_compute_position_ids`` read only the
    worker's ``processor`` and ``tokenizer`` (and ``_get_mm_processor_kwargs`` without explicit
    kwargs): they run here on a namespace that holds the run's processor and tokenizer."""

    def __init__(self, processor: Any, tokenizer: Any):
        if processor is None or getattr(processor, "image_processor", None) is None:
            raise GroupNotReplayable("image rows need the model's processor, and the trainer has none")
        self.processor = processor
        self.tokenizer = tokenizer
        self.image_patch_size = int(getattr(processor.image_processor, "patch_size", 14))
        self._worker = SimpleNamespace(processor=processor, tokenizer=tokenizer, _get_mm_processor_kwargs=lambda *a: {})

    def images(self, messages: Any) -> list[Any]:
        return vision_images(messages, self.image_patch_size) or []

    def rebuild(self, input_ids: torch.Tensor, images: list[Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """(multi_modal_inputs, position_ids [4, L]) of one row, as the agent loop computes them."""
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

        ids = input_ids.to(torch.int64).reshape(1, -1)
        output = SimpleNamespace(multi_modal_data={"images": images}, mm_processor_kwargs={})
        inputs = AgentLoopWorker._compute_multi_modal_inputs(self._worker, output, ids)
        positions = AgentLoopWorker._compute_position_ids(self._worker, ids, torch.ones_like(ids), inputs)
        return inputs, positions.squeeze(0)


def same_inputs(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Equal multi_modal_inputs: the same keys, each tensor of the same shape and values."""
    keys = set(a) - {"mm_token_type_ids"}
    if keys != set(b) - {"mm_token_type_ids"}:
        return False
    for key in keys:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            x, y = torch.as_tensor(x), torch.as_tensor(y)
            if x.shape != y.shape or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def pixel_bytes(inputs: Mapping[str, Any]) -> int:
    """Bytes of a row's pixel values (what storing multi_modal_inputs per row would cost)."""
    values = inputs.get("pixel_values") if isinstance(inputs, Mapping) else None
    return 0 if values is None else int(torch.as_tensor(values).numel() * torch.as_tensor(values).element_size())


# ------------------------------------------------------------------ ingress and replay of a group's rows


def store_media(
    rows: list[dict[str, Any]], rebuilder: Optional[MultimodalRebuilder]
) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """A fresh group's rows as the buffer stores them, and the prompt's pictures (PNG, once).

    Image rows lose ``multi_modal_inputs`` and ``position_ids`` (rebuilt on replay) after a check
    that the rebuild gives exactly what the agent loop wrote; their prompt names each picture by
    index. Text rows pass unchanged. Video / audio rows are refused (GroupNotReplayable)."""
    for row in rows:
        refuse_video_audio(row)
    messages = rows[0].get("raw_prompt")
    if not image_parts(messages):
        return rows, []
    if rebuilder is None:
        raise GroupNotReplayable(
            "image rows need the model's processor to be rebuilt on replay, and the trainer has none"
        )
    images = rebuilder.images(messages)
    for row in rows:
        inputs, positions = rebuilder.rebuild(torch.as_tensor(row["input_ids"]), images)
        stored = row.get("multi_modal_inputs") or {}
        if not same_inputs(inputs, stored) or not torch.equal(positions, torch.as_tensor(row["position_ids"])):
            raise GroupNotReplayable(
                "an image row's multi_modal_inputs / M-RoPE position ids do not rebuild exactly from its pictures "
                "(a custom processor or agent loop?)"
            )
    compact, pngs = compact_prompt(messages)
    # every field holding the prompt's messages (verl's dataset gives `raw_prompt` and the
    # dataset's own `prompt` column the same image parts) names the pictures by index
    message_fields = [k for k, v in rows[0].items() if k != "raw_prompt" and image_parts(v)]
    stored_rows = []
    for row in rows:
        row = {k: v for k, v in row.items() if k not in ("multi_modal_inputs", "position_ids")}
        row["raw_prompt"] = compact
        for name in message_fields:
            row[name] = compact_prompt(row[name])[0]
        stored_rows.append(row)
    return stored_rows, pngs


def restore_media(rows: list[dict[str, Any]], rebuilder: Optional[MultimodalRebuilder]) -> list[dict[str, Any]]:
    """Replayed rows of a stored group with their pictures, ``multi_modal_inputs`` and position ids
    rebuilt (rows of a text group are returned as they are)."""
    if not rows or IMAGES_META not in rows[0]:
        return rows
    if rebuilder is None:
        raise ValueError("a stored image group is replayed without the model's processor")
    pngs = rows[0][IMAGES_META]
    messages = restore_prompt(rows[0]["raw_prompt"], pngs)
    images = rebuilder.images(messages)
    message_fields = [k for k, v in rows[0].items() if k != "raw_prompt" and _names_pictures(v)]
    for row in rows:
        row.pop(IMAGES_META, None)
        row["raw_prompt"] = messages
        for name in message_fields:
            row[name] = restore_prompt(row[name], pngs)
        row["multi_modal_inputs"], row["position_ids"] = rebuilder.rebuild(torch.as_tensor(row["input_ids"]), images)
    return rows


def _names_pictures(messages: Any) -> bool:
    if not isinstance(messages, (list, tuple)):
        return False
    return any(
        isinstance(part, Mapping) and IMAGE_INDEX in part
        for message in messages
        if isinstance(message, Mapping) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def stored_images(meta: Mapping[str, Any]) -> int:
    """Pictures stored with a group (0: a text group)."""
    return len(meta.get("shared", {}).get(IMAGES_META, ()))
