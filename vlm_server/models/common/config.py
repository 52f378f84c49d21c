"""The configuration of the blocks both Moondream families share: the vision tower (the same
SigLIP-like tower, crops and image prefix) and the region heads' sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionConfig:
    """SigLIP-like vision tower plus the projection into the text model's width."""

    enc_dim: int = 1152
    enc_n_layers: int = 27
    enc_n_heads: int = 16
    enc_ff_dim: int = 4304
    in_channels: int = 3
    crop_size: int = 378
    patch_size: int = 14
    overlap_margin: int = 4  # in patches
    max_crops: int = 12
    proj_inner_dim: int = 8192
    proj_out_dim: int = 2048

    def __post_init__(self) -> None:
        if self.enc_dim % self.enc_n_heads:
            raise ValueError("vision enc_dim must be divisible by enc_n_heads")
        if self.crop_size % self.patch_size:
            raise ValueError("vision crop_size must be a multiple of patch_size")
        if 2 * self.overlap_margin >= self.grid_size:
            raise ValueError("vision overlap_margin leaves no usable window")

    @property
    def grid_size(self) -> int:
        """Patches per crop side (27 for 378/14)."""
        return self.crop_size // self.patch_size

    @property
    def n_patches(self) -> int:
        return self.grid_size * self.grid_size

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.patch_size * self.patch_size

    @property
    def head_dim(self) -> int:
        return self.enc_dim // self.enc_n_heads


@dataclass(frozen=True)
class RegionConfig:
    """Coordinate and size heads: Fourier-feature encoders, and decoders to value bins."""

    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048

    def __post_init__(self) -> None:
        if self.coord_feat_dim % 2 or self.size_feat_dim % 4:
            raise ValueError("region feature dims must split into cos|sin halves")
        if self.size_out_dim != 2 * self.coord_out_dim:
            raise ValueError("region size_out_dim must be 2 x coord_out_dim (width, height)")
