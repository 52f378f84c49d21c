"""An image's crops on the model's device, for the image path of its prefix.

A prepared image brings its crops; a host-decoded one (`HostImage`) has them made here, on
the current (prefill) stream, through the lane's crop graphs where there are some; an image
still encoded (its prefix left the cache before its request ran) is decoded here, on the
scheduler's thread.
"""

from __future__ import annotations

import logging

import torch

from image_pipeline import EncodedImage, HostImage, ImagePreparer, PreparedImage
from image_pipeline.crop_graphs import CropGraphs
from vlm_server.engine.config import EngineConfig
from vlm_server.engine.device.streams import Device

log = logging.getLogger(__name__)


class ImageCrops:
    """Makes and uploads the crops a prefix batch's image paths read."""

    def __init__(
        self, preparer: ImagePreparer, dev: Device, cfg: EngineConfig, device: torch.device
    ) -> None:
        # Makes the crops of host-decoded images (`HostImage`), on its own device.
        self.preparer = preparer
        self.dev = dev
        self.cfg = cfg
        self.device = device  # the model's: where the image path reads the crops

    def graphs(self, capture_stream: object) -> CropGraphs | None:
        """Crop graphs of host-decoded images for one prefill lane (CUDA preparer only),
        captured on ``capture_stream`` (None: a stream of their own)."""
        cfg = self.cfg
        if not (
            self.dev.is_cuda
            and cfg.cuda_graphs
            and cfg.crop_graph_sizes
            and self.preparer.device.type == "cuda"
        ):
            return None
        return CropGraphs(
            self.preparer,
            cfg.crop_graph_sizes,
            capture_stream=capture_stream,  # type: ignore[arg-type]
        )

    def crops_of(
        self, image: PreparedImage | HostImage | EncodedImage, graphs: CropGraphs | None = None
    ) -> torch.Tensor:
        """The image's crops; a host-decoded image's are made here, queued on the current
        (prefill) stream, so they cost this thread only the staging copy and the launches.
        ``graphs``: the crop graphs of the lane it runs on."""
        if isinstance(image, EncodedImage):
            # Rare: admitted encoded because its prefix was cached, which went before the
            # request ran. Decoding here blocks this thread for the decode (the crops are
            # complete when it returns): said, since the steps wait meanwhile.
            log.info("decoding an image on the scheduler thread: its prefix left the cache")
            return self.preparer.prepare_encoded(image).crops
        if isinstance(image, HostImage):
            if graphs is not None:
                return graphs.crops(image)  # consumed below, before the next call
            return self.preparer.crops_of(image)
        return image.crops

    def on_device(self, crops: torch.Tensor) -> torch.Tensor:
        """The image preparer may have made the crops on this device already; host crops go
        up through pinned memory (a pageable source would make the copy block the host)."""
        if crops.device.type != "cpu":
            return crops.to(self.device, non_blocking=True)  # no-op on the same GPU
        if self.dev.is_cuda and not crops.is_pinned():
            crops = crops.pin_memory()
        return crops.to(self.device, non_blocking=True)
