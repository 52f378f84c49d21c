"""Pixel normalization to [-1, 1] (spec section 2, "Preprocessing")."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["normalize_crops"]


def normalize_crops(
    crops: torch.Tensor | np.ndarray,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Turn uint8 crops ``[N, H, W, 3]`` into normalized ``[N, 3, H, W]`` in ``dtype``.

    The order of operations is the reference's: cast to ``dtype`` first, then
    ``/255``, ``-0.5``, ``/0.5``, each rounded in ``dtype``. In bfloat16 this gives
    different values than normalizing in float32 and casting at the end, and the
    model was trained on these.

    Only torch operations are used, so a CUDA input (or ``device="cuda"``) is
    normalized on the GPU. The uint8 data is moved before the cast, which is the
    cheapest thing to send. The input is never modified.

    Args:
        crops: uint8 tensor or array ``[N, H, W, 3]``.
        dtype: floating point result type (bfloat16, float16, float32, ...).
        device: where to compute and return the result; default: where ``crops`` is.
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating point torch dtype, got {dtype!r}")
    if isinstance(crops, np.ndarray):
        if crops.dtype != np.uint8:
            raise TypeError(f"crops must be uint8, got {crops.dtype}")
        # torch.from_numpy shares memory and warns on read-only arrays; copy those.
        tensor = torch.from_numpy(np.require(crops, requirements=["C", "W"]))
    elif isinstance(crops, torch.Tensor):
        tensor = crops
    else:
        raise TypeError(f"crops must be a torch.Tensor or numpy array, got {type(crops).__name__}")
    if tensor.dtype != torch.uint8:
        raise TypeError(f"crops must be uint8, got {tensor.dtype}")
    if tensor.ndim != 4 or tensor.shape[-1] != 3:
        raise ValueError(f"crops must have shape [N, H, W, 3], got {list(tensor.shape)}")

    if device is not None:
        tensor = tensor.to(device)
    if tensor.is_cuda:
        # Crops made on a decode thread's stream are read on this one: tell the caching
        # allocator, so their memory is not reused before this read has run.
        tensor.record_stream(torch.cuda.current_stream(tensor.device))
    out = tensor.permute(0, 3, 1, 2).to(dtype, memory_format=torch.contiguous_format)
    out.div_(255).sub_(0.5).div_(0.5)
    return out
