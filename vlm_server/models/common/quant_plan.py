"""Which weights a load asks for (``--weights``), decided before anything is read: the
checkpoint's own format (a ``vlm quantize`` directory's, else 16-bit), the flag, what the
family serves and what the device runs. Each refusal is one line naming the flag."""

from __future__ import annotations

from pathlib import Path

import torch

from vlm_server.models.capabilities import CapabilityError, check_weights
from vlm_server.models.common import quant_gemm
from vlm_server.models.common.quant_load import QuantRequest
from vlm_server.models.interface import Formats
from vlm_server.models.quant.files import read_quantized, stored_format
from vlm_server.models.quant.formats import QuantFormat, weight_format


def request(
    family: str,
    formats: Formats,
    path: Path | None,
    weights: str | None,
    group_size: int,
    device: torch.device | str,
) -> QuantRequest | None:
    """What the family's loader is asked for (None: 16-bit weights as the checkpoint has
    them) when ``weights`` (None: the checkpoint's own) is asked of the checkpoint at ``path``
    (None: a model built in memory) on ``device``. A quantized checkpoint's tensors are read
    here (on the host); a 16-bit one's are the family's to read."""
    stored = stored_format(path) if path is not None else None
    if stored is not None and weights not in (None, stored.name):
        raise CapabilityError(
            f"--weights {weights}: {path} holds {stored.name} weights (written by vlm quantize) "
            "and is served as they are: leave --weights out, or point --model at the 16-bit "
            "checkpoint"
        )
    name = stored.name if stored is not None else weights
    if name is None or name == "bf16":
        return None
    if weights is None and name not in formats.quantized:  # the checkpoint's own format
        raise CapabilityError(
            f"--model {path}: it holds {name} weights, which the {family} family is not "
            f"served in (it serves {', '.join(['bf16', *formats.quantized])})"
        )
    check_weights(formats, family, name)
    if name == "fp8":  # the experts' format, the family's own loader's (no linear swapped)
        return None
    if stored is None:
        fmt = weight_format(name, group_size)
        check_device(fmt, device, stored=False)
        return QuantRequest(fmt)
    check_device(stored, device, stored=True)
    assert path is not None
    return QuantRequest(stored, read_quantized(path))


def vision_request(
    family: str,
    formats: Formats,
    vision_weights: str,
    group_size: int,
    device: torch.device | str,
    quant: QuantRequest | None,
) -> QuantFormat | None:
    """The format the vision tower's linears are quantized to at load (None: exact, as the
    checkpoint holds them) for ``--vision-weights`` beside the decoder's request ``quant``.
    Refused in one line naming the flag: a format the family does not declare, a tower a
    ``vlm quantize --vision`` directory holds quantized already, what the device cannot run."""
    if vision_weights == "exact":
        return None
    flag = f"--vision-weights {vision_weights}"
    if vision_weights not in formats.vision_quantized:
        served = ", ".join(["exact", *formats.vision_quantized])
        raise CapabilityError(f"{flag}: the {family} family serves its vision tower {served}")
    stored = quant.stored if quant is not None else None
    if stored is not None and any(name.startswith("vision.") for name in stored.quantized):
        raise CapabilityError(
            f"{flag}: the checkpoint holds its vision tower in {stored.fmt.name} already "
            "(vlm quantize --vision), served as it is: leave --vision-weights out"
        )
    fmt = weight_format(vision_weights, group_size)
    check_device(fmt, device, stored=False, flag=flag)
    return fmt


def check_device(
    fmt: QuantFormat, device: torch.device | str, stored: bool, flag: str | None = None
) -> None:
    """Refuse a format whose products ``device`` cannot run: on CUDA they are Triton kernels,
    which take INT4 in groups of `quant_gemm.GROUP` columns only. ``flag``: the one asking
    (default: ``--weights``, or ``--model`` for a stored format)."""
    if torch.device(device).type != "cuda":
        return  # the plain path: dequantize, then the 16-bit product
    if not quant_gemm.AVAILABLE:
        raise CapabilityError(
            f"{flag or '--weights ' + fmt.name}: its products on CUDA are Triton kernels, and "
            "Triton is not installed"
        )
    if fmt.group_size not in (0, quant_gemm.GROUP):
        flag = flag or ("--model" if stored else "--weights int4")
        raise CapabilityError(
            f"{flag}: INT4 groups of {fmt.group_size} columns; the CUDA kernels take "
            f"{quant_gemm.GROUP} (vlm quantize --group-size {quant_gemm.GROUP})"
        )
