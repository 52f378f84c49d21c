"""Moondream 3's segmentation refiner: a coarse segment (the decoded box and path) and the
picture -> a refined segment, as the model author's engine refines it.

1. The coarse path is filled at the picture's size (refiner_masks.coarse_mask); the picture
   and that mask are cropped to the box widened by a quarter on each side.
2. The crop is resized to the tower's crop size (bilinear; the mask nearest), normalized as
   the tower's inputs are, and run once through the vision tower: its final features and its
   residual stream after block ``early_layer`` (8).
3. Five rounds of the head (refiner_head.py): the hypothesis of highest predicted IoU, through
   a sigmoid, is the next round's mask.
4. The last mask, resized back to the crop (bilinear) and kept above one half, is pasted into
   the picture, cleaned (small holes and islands, a closing) and traced into a path and a box
   (refiner_masks.trace). Its raster is the result's mask.

An empty mask at any stage (or one that traces to nothing) keeps the coarse segment: `refine`
returns None. The head's weights are ``model.pt``'s ``"head"`` (`load_head`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from decoding.segment_output import SegmentResult, rle_encode
from vlm_server.models.common.graphed_call import GraphedCall
from vlm_server.models.moondream3 import refiner_masks
from vlm_server.models.moondream3.refiner_head import RefinerHead

if TYPE_CHECKING:
    from vlm_server.models.interface import SegmentRefine
    from vlm_server.models.moondream3.model import Moondream3Model

ITERATIONS = 5
EARLY_LAYER = 8
# (crops [1, 3, S, S] normalized to [-1, 1]) -> (final, early) features [1, grid^2, enc_dim]
Features = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# `refiner_masks.finish_window`'s signature: (window, area, open edges, origin, size)
Finish = Callable[..., tuple[np.ndarray, refiner_masks.Traced | None]]


def load_head(path: str | Path, head: RefinerHead | None = None) -> RefinerHead:
    """The head of a refiner file (a dict whose ``"head"`` is the state dict, or the state
    dict itself), checked tensor by tensor against the head's layout."""
    head = head or RefinerHead()
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("head"), dict):
        state = state["head"]
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a refiner file (no 'head' state dict)")
    want = head.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing[:5]}, unexpected {unexpected[:5]}")
    for name, t in want.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(
                f"{path}: tensor {name} has shape {list(state[name].shape)}, "
                f"the head expects {list(t.shape)}"
            )
    head.load_state_dict(state)
    return head.eval()


def save_head(head: RefinerHead, path: str | Path) -> None:
    """Write ``head`` as the released file is laid out (``{"head": state_dict}``)."""
    torch.save({"head": head.state_dict()}, path)


def resize_nearest(mask: np.ndarray, height: int, width: int) -> np.ndarray:
    """OpenCV's nearest resize of a mask: each output pixel takes source index
    floor(i * scale)."""
    h, w = mask.shape
    ys = np.minimum((np.arange(height) * (h / height)).astype(np.int64), h - 1)
    xs = np.minimum((np.arange(width) * (w / width)).astype(np.int64), w - 1)
    return mask[ys][:, xs]


class SegmentRefiner:
    """Refines coarse segments with ``head`` over the tower's ``features`` of each crop."""

    def __init__(
        self, head: RefinerHead, features: Features, crop_size: int,
        iterations: int = ITERATIONS, finish: Finish = refiner_masks.finish_window,
        graphed: bool = False,
    ) -> None:  # fmt: skip
        """``finish``: what cleans and traces a refined window (`refiner_masks.MaskProcess`
        to keep it off this process's GIL). ``graphed`` (CUDA only): the tower pass and the
        head rounds are captured once here and replayed per crop."""
        self.head, self.features, self.finish = head, features, finish
        self.crop_size, self.iterations = crop_size, iterations
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._rounds: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = self.rounds
        if graphed and self.device.type == "cuda":
            s = crop_size
            img = torch.zeros(1, 3, s, s, device=self.device, dtype=self.dtype)
            mask = torch.zeros(1, 1, s, s, device=self.device, dtype=self.dtype)
            self._rounds = GraphedCall(self.rounds, img, mask)  # type: ignore[assignment]

    def rounds(self, img: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The device work of one crop: normalized pixels [1, 3, S, S] and the coarse mask
        [1, 1, S, S] -> the last round's mask in [0, 1] (the head's output size)."""
        final, early = self.features(img)
        m = mask
        for _ in range(self.iterations):
            logits, iou = self.head(final, early, m)
            best = logits[torch.arange(logits.shape[0], device=logits.device), iou.argmax(1)]
            m = torch.sigmoid(best)[:, None]
        return m

    @torch.no_grad()
    def refine_crop(self, crop: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """RGB crop [h, w, 3] uint8 and its coarse bool mask [h, w] -> the refined mask."""
        h, w = mask.shape
        s = self.crop_size
        img = torch.from_numpy(np.ascontiguousarray(crop)).to(self.device)
        img = img.permute(2, 0, 1)[None].float()
        img = F.interpolate(img, size=(s, s), mode="bilinear", align_corners=False)
        img = (img.round().clamp(0, 255) / 255.0 - 0.5) / 0.5  # a uint8 resize, normalized
        m = torch.from_numpy(resize_nearest(mask, s, s)).to(self.device, self.dtype)[None, None]
        m = self._rounds(img.to(self.dtype), m)
        back = F.interpolate(m.float(), size=(h, w), mode="bilinear", align_corners=False)
        # The host's mask work needs it: a wait for this thread's own stream only.
        return (back[0, 0] > 0.5).cpu().numpy()

    def refine(self, image: np.ndarray, coarse: SegmentResult) -> SegmentResult | None:
        """The refined segment of ``coarse`` on ``image`` (upright RGB [H, W, 3] uint8, which
        may be smaller than the picture: a reduced-scale decode), or None where the author's
        engine keeps the coarse one (an empty mask, or nothing traced). The refined mask
        is resized (nearest) to the coarse mask's size when the pixels were smaller."""
        if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
            raise ValueError(
                f"expected uint8 RGB pixels [H, W, 3], got {image.dtype} {image.shape}"
            )
        height, width = image.shape[:2]
        crop = refiner_masks.expand_box(coarse.box, width, height)
        x1, y1, x2, y2 = crop
        if x2 <= x1 or y2 <= y1:
            return None
        crop_mask = refiner_masks.coarse_mask(coarse.polygons, width, height, crop)
        if not crop_mask.any():
            return None
        # The mask work runs on the crop and an empty margin of 2 (the closing grows it by
        # one): the picture's other pixels stay empty, and hold no holes of their own.
        wx1, wy1 = max(0, x1 - 2), max(0, y1 - 2)
        wx2, wy2 = min(width, x2 + 2), min(height, y2 + 2)
        window = np.zeros((wy2 - wy1, wx2 - wx1), bool)
        window[y1 - wy1 : y2 - wy1, x1 - wx1 : x2 - wx1] = self.refine_crop(
            image[y1:y2, x1:x2], crop_mask
        )
        open_edges = (wy1 > 0, wy2 < height, wx1 > 0, wx2 < width)
        window, traced = self.finish(
            window, height * width, open_edges, (wx1, wy1), (width, height)
        )
        if traced is None:
            return None
        refined = np.zeros((height, width), bool)
        refined[wy1:wy2, wx1:wx2] = window
        mask_h, mask_w = coarse.mask_size
        if (mask_h, mask_w) != (height, width):
            refined = resize_nearest(refined, mask_h, mask_w)
        return replace(
            coarse,
            box=traced.box,
            path=traced.path,
            polygons=traced.polygons,
            mask_counts=rle_encode(refined),
            box_path=traced.box_path,
        )


def build_refiner(model: Moondream3Model, weights: Path) -> SegmentRefine:
    """The refiner over ``model``'s vision tower, its head from ``weights`` in the model's
    dtype and device. The head reads the residual stream after block 8, or the last block
    of a smaller test tower."""
    try:  # the tracing back into a path needs potracer (checked at start, not per answer)
        import potrace

        potracer = hasattr(potrace.Bitmap, "invert")
    except ImportError:
        potracer = False
    if not potracer:
        raise ValueError(
            "segment_refiner: needs potracer to trace refined masks "
            "(pip install 'moondream-serve[refiner]')"
        )
    vision_cfg = model.config.vision
    sized = RefinerHead(enc_dim=vision_cfg.enc_dim, grid=vision_cfg.grid_size)
    try:
        head = load_head(weights, sized)
    except ValueError as err:
        raise ValueError(f"segment_refiner: {err}") from None
    head = head.to(model.device, model.dtype)
    early = min(EARLY_LAYER, vision_cfg.enc_n_layers - 1)
    tower = model.vision

    def features(crops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tower.encode_early(crops, early)

    finish = refiner_masks.MaskProcess()  # tracing is pure Python: off the engine's GIL
    graphed = model.device.type == "cuda"
    return SegmentRefiner(
        head, features, vision_cfg.crop_size, finish=finish, graphed=graphed
    ).refine
