"""Qwen-Image-Edit's ``Qwen2VLProcessor`` on a machine without torchvision.

A Qwen-Image-Edit checkpoint's ``processor/`` holds the tokenizer, the image processor's and the video
processor's configs. ``Qwen2VLProcessor.from_pretrained`` builds all three, and the video processor
(``Qwen2VLVideoProcessor``) requires torchvision, so ``QwenImageEditPipeline.from_pretrained`` fails
without it (the CPU build of torch has no matching torchvision on the package index). The pipeline
never passes videos: where torchvision is absent, the processor is built here from the checkpoint's
tokenizer and image processor (``AutoImageProcessor`` picks its PIL backend) with no video processor,
and handed to ``from_pretrained`` as a component. With torchvision, the checkpoint loads as it is.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
from transformers.utils import is_torchvision_available


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with ``video_processor=None``: transformers checks every sub-processor's
    class, and None is no video processor (without torchvision the check cannot even look the class
    up); images and text are processed by the parent class unchanged."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def processor_without_video(path: Path) -> dict:
    """``{"processor": ...}`` to pass to ``from_pretrained`` where torchvision is absent and the
    checkpoint at ``path`` has a processor; ``{}`` otherwise (the pipeline loads its own)."""
    folder = path / "processor"
    if is_torchvision_available() or not folder.is_dir():
        return {}
    processor = ImageOnlyQwen2VLProcessor(
        image_processor=AutoImageProcessor.from_pretrained(folder),
        tokenizer=AutoTokenizer.from_pretrained(folder),
        video_processor=None,
    )
    return {"processor": processor}
