"""Images for LLaVA-style models: pixels from a request's image bytes, features from the model's
vision tower and projector, and their place in the prompt.

A request's images are decoded and preprocessed (the model directory's image processor) when the
request is added, on the event loop, so a bad image is refused before it is queued. Their
features are computed once, by the model's own `get_image_features` (vision tower, feature layer
and selection strategy of its config, multi-modal projector), on the engine's forward thread the
first time a prefill chunk covers one of the request's placeholders, and kept with the request:
a chunked prefill, or a prefill again after a preemption, reuses them. The forward pass writes
them over the placeholders' token embeddings (kvmesh.workers.pytorch.model_runner), as
transformers' LLaVA does, so the KV cache holds the same keys and values; decoding is unchanged.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvmesh.runtime.multimodal import decode_images
from kvmesh.runtime.types import MediaInput

__all__ = ["ImageEncoder", "RequestImages"]


class ImageEncoder:
    """Preprocessing and features of one loaded LLaVA-style `model` (its directory `path`,
    on `device` in `dtype`; kvmesh.workers.pytorch.model_runner.LoadedModel has them).

    `pixels` runs on any thread; `features` (and so the constructor) on the forward thread.
    """

    def __init__(
        self, model: Any, path: Path, device: torch.device, dtype: torch.dtype, image_token_id: int
    ) -> None:
        from PIL import Image
        from transformers import AutoImageProcessor

        self._model = model
        self._device = device
        self._dtype = dtype
        processor: Any = AutoImageProcessor
        self._processor = processor.from_pretrained(path, local_files_only=True)
        config = model.config
        self._layer = config.vision_feature_layer
        self._strategy = config.vision_feature_select_strategy
        self.image_token_id = image_token_id
        blank = self.pixels([], images=[Image.new("RGB", (32, 32))])
        self.tokens_per_image = int(self.features(blank).shape[0])
        """Placeholder tokens (feature vectors) per image."""

    def pixels(self, media: Sequence[MediaInput], *, images: Sequence[Any] = ()) -> torch.Tensor:
        """Preprocessed pixel values of `media` (decoded with Pillow) or of PIL `images`.
        InvalidRequest names an image that cannot be decoded."""
        decoded = [*images, *decode_images(media)]
        out = self._processor(images=decoded, return_tensors="pt")
        pixels: torch.Tensor = out["pixel_values"]
        return pixels

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Image features [images * tokens_per_image, hidden] (the model's dtype and device)."""
        with torch.inference_mode():
            out = self._model.model.get_image_features(
                pixel_values=pixels.to(self._device, self._dtype),
                vision_feature_layer=self._layer,
                vision_feature_select_strategy=self._strategy,
                return_dict=True,
            )
            feats: torch.Tensor = torch.cat(list(out.pooler_output), dim=0)
            return feats.to(self._dtype)


class RequestImages:
    """One request's images: placeholder positions (ascending), pixels, and features once
    computed (see the module docstring)."""

    __slots__ = ("_features", "encoder", "pixels", "positions")

    def __init__(self, encoder: ImageEncoder, positions: list[int], pixels: torch.Tensor) -> None:
        self.encoder = encoder
        self.positions = positions
        self.pixels = pixels
        self._features: torch.Tensor | None = None

    def covers(self, start: int, end: int) -> bool:
        """Whether positions [start, end) hold a placeholder."""
        i = bisect_left(self.positions, start)
        return i < len(self.positions) and self.positions[i] < end

    def span(self, start: int, end: int) -> tuple[list[int], torch.Tensor]:
        """(placeholder positions in [start, end), their feature rows); forward thread only."""
        pos = self.positions
        lo, hi = bisect_left(pos, start), bisect_left(pos, end)
        if self._features is None:
            self._features = self.encoder.features(self.pixels)
        return pos[lo:hi], self._features[lo:hi]
