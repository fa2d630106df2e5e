"""Let transformers load Qwen3.5's ``Qwen3VLProcessor`` on a host without torchvision.

Qwen3.5 checkpoints (the tiny ones of ``verl_replay.data.tiny_assets`` too) ship a
``Qwen3VLProcessor``: an image processor, the tokenizer and a video processor. transformers
builds it only with its video processor, and without torchvision both the video-processor
registry entry of ``qwen3_5`` and the base class the processor checks its parts against are
placeholders, so ``AutoProcessor.from_pretrained`` raises. verl catches that, warns once and
carries on without a processor: the model is then fed 1-D position ids instead of M-RoPE's
(4, L) ones and prompts go through the text chat path, i.e. a different program from the one
Qwen3.5-4B runs on the GPU stack (where vLLM brings torchvision). The CPU stack has no
torchvision: PyPI's wheels for our torch are CUDA builds that do not load against the CPU torch.

``allow_vl_processor_without_torchvision`` registers transformers' real ``Qwen3VLVideoProcessor``
for the Qwen3.5 configs (public ``AutoVideoProcessor.register``) and points the processor's class
check at the real ``BaseVideoProcessor`` (the private ``processing_utils.transformers_module``).
Text and image rows never call the video processor, so they are processed exactly as with
torchvision; a video still needs torchvision and fails inside the video processor. With
torchvision installed it does nothing. Imports transformers only (no verl), so tests and tools
that load a tiny checkpoint can call it too; verl's CPU support installs it in every process.
"""

from __future__ import annotations

# (module, attribute) of the transformers private name this module rebinds.
PRIVATE_API_PATCHES: tuple[tuple[str, str], ...] = (("transformers.processing_utils", "transformers_module"),)

_installed = False


class TransformersApiChanged(RuntimeError):
    """A transformers name this module relies on has moved: the pinned transformers range changed."""


def torchvision_available() -> bool:
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


def allow_vl_processor_without_torchvision() -> bool:
    """Make ``AutoProcessor`` build Qwen3.5's processor without torchvision; idempotent.

    Returns True when it changed transformers (torchvision missing), False when not needed."""
    global _installed
    if _installed:
        return True
    if torchvision_available():
        return False
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, processing_utils
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_processing_utils import BaseVideoProcessor

    namespace = getattr(processing_utils, "transformers_module", None)
    if namespace is None:
        raise TransformersApiChanged(
            "verl_replay loads Qwen3.5's processor without torchvision by rebinding "
            "transformers.processing_utils.transformers_module.BaseVideoProcessor, which this transformers "
            "version does not have; install torchvision or update verl_replay/integrations/verl/vl_processor.py."
        )
    for config_class in (Qwen3_5Config, Qwen3_5MoeConfig):
        AutoVideoProcessor.register(config_class, Qwen3VLVideoProcessor, exist_ok=True)
    # The processor checks each part with isinstance against the class of this name, which is a
    # torchvision placeholder here; the real class imports and constructs without torchvision.
    namespace.BaseVideoProcessor = BaseVideoProcessor
    _installed = True
    return True
