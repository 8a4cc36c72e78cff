"""Qwen-Image-Edit's ``Qwen2VLProcessor`` without torchvision: the tokenizer and image processor of the
checkpoint, no video processor.

Details: docs/modules.md, `digenrl.adapters.qwen_vl_processor`.
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
