"""The GPU JPEG path of the preparer: which pictures take it, orientation, fallback, digest.

On the CPU the decoder is a stand-in that decodes with simplejpeg (bit-identical to the host
path), so the crops of both paths must be equal and every difference is the orchestration's.
The tests marked ``gpu`` run torchvision's nvJPEG itself.
"""

from __future__ import annotations

import io
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import blake3
import numpy as np
import pytest
import simplejpeg
import torch
from PIL import Image, ImageOps

from image_pipeline import (
    DecodeBudget,
    ImageError,
    ImageErrorReason,
    ImageLimits,
    ImagePreparer,
    PreparedImage,
    content_hash,
    decode,
    gpu_jpeg,
)
from image_pipeline.decode import read_header
from image_pipeline.gpu_jpeg import (
    GpuDecodeError,
    decode_upright,
    encoded_digest,
    gpu_decodable,
    gpu_decoder,
    nvimgcodec_decoder,
    orient_tensor,
    torchvision_decoder,
)
from image_pipeline.jpeg import orient
from tests.support.jpegs import HostDecoder, encode, oriented_jpeg, photo

R = ImageErrorReason


def gpu_and_host(
    min_pixels: int, decoder: HostDecoder, **kwargs: object
) -> tuple[ImagePreparer, ImagePreparer]:
    """A preparer with the stand-in GPU decoder, and one decoding everything on the host at
    full size (the GPU path never decodes at reduced scale)."""
    gpu = ImagePreparer(
        gpu_decode_min_pixels=min_pixels, gpu_decoder=decoder, reduced_decode=False, **kwargs
    )
    host = ImagePreparer(reduced_decode=False, **kwargs)
    return gpu, host


def assert_same_crops(a: PreparedImage, b: PreparedImage) -> None:
    assert a.tiling == b.tiling
    assert (a.width, a.height, a.decoded_size) == (b.width, b.height, b.decoded_size)
    assert torch.equal(a.crops, b.crops)


def pillow_upright(data: bytes) -> np.ndarray:
    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))


# ---------------------------------------------------------------- which pictures go


def test_below_the_threshold_host_at_and_above_gpu() -> None:
    data = encode(photo(200, 150))
    host = ImagePreparer(reduced_decode=False).prepare(data)
    for min_pixels, on_gpu in [(200 * 150 + 1, False), (200 * 150, True), (1, True)]:
        decoder = HostDecoder()
        gpu, _ = gpu_and_host(min_pixels, decoder)
        prepared = gpu.prepare(data)
        assert decoder.calls == int(on_gpu), min_pixels
        assert_same_crops(prepared, host)
        expected = encoded_digest(data, (150, 200)) if on_gpu else host.content_hash
        assert prepared.content_hash == expected


def test_zero_turns_the_gpu_path_off_even_with_a_decoder() -> None:
    decoder = HostDecoder()
    preparer = ImagePreparer(gpu_decode_min_pixels=0, gpu_decoder=decoder)
    assert preparer.gpu_decoder is None
    preparer.prepare(encode(photo(64, 48)))
    assert decoder.calls == 0


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_threshold_is_validated(value: object) -> None:
    with pytest.raises((ValueError, TypeError), match="gpu_decode_min_pixels"):
        ImagePreparer(gpu_decode_min_pixels=value)  # type: ignore[arg-type]


def test_no_gpu_decoder_on_a_cpu_device_unless_one_is_given() -> None:
    assert ImagePreparer(gpu_decode_min_pixels=1).gpu_decoder is None
    decoder = HostDecoder()
    assert ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=decoder).gpu_decoder is decoder


@pytest.mark.parametrize(
    ("fmt", "params"),
    [("PNG", {}), ("WEBP", {"lossless": True}), ("BMP", {}), ("TIFF", {}), ("GIF", {})],
)
def test_other_formats_never_take_the_gpu_path(fmt: str, params: dict) -> None:
    data = encode(photo(120, 80), fmt, **params)
    decoder = HostDecoder()
    gpu, host = gpu_and_host(1, decoder)
    assert_same_crops(gpu.prepare(data), host.prepare(data))
    assert gpu.prepare(data).content_hash == host.prepare(data).content_hash
    assert decoder.calls == 0


def _rgb_by_component_ids(jpeg: bytes) -> bytes:
    """``jpeg`` without its JFIF segment and with components 1, 2, 3 renamed R, G, B (in the
    frame and scan headers): libjpeg then reads the channels as plain RGB."""
    assert jpeg[2:4] == b"\xff\xe0"  # JFIF APP0 right after SOI
    data = bytearray(jpeg[:2] + jpeg[4 + int.from_bytes(jpeg[4:6], "big") :])
    rename = {1: ord("R"), 2: ord("G"), 3: ord("B")}
    i = 2
    while i < len(data):
        marker, length = data[i + 1], int.from_bytes(data[i + 2 : i + 4], "big")
        if marker == 0xC0:  # SOF0: id, sampling, table per component from byte 10
            for k in range(data[i + 9]):
                data[i + 10 + 3 * k] = rename[data[i + 10 + 3 * k]]
        elif marker == 0xDA:  # SOS: id, tables per component from byte 5; then the scan
            for k in range(data[i + 4]):
                data[i + 5 + 2 * k] = rename[data[i + 5 + 2 * k]]
            break
        i += 2 + length
    return bytes(data)


def test_cmyk_and_rgb_jpegs_stay_on_the_host() -> None:
    cmyk = encode(photo(96, 64).convert("CMYK"))
    # An Adobe APP14 segment with transform 0: three plain RGB channels, not YCbCr.
    plain = encode(photo(96, 64))
    app14 = b"Adobe" + b"\x00\x64" + b"\x00\x00" + b"\x00\x00" + b"\x00"
    adobe_rgb = plain[:2] + b"\xff\xee" + (len(app14) + 2).to_bytes(2, "big") + app14 + plain[2:]
    assert read_header(adobe_rgb).image.info.get("adobe_transform") == 0
    # No marker, components named R, G, B: libjpeg reads plain RGB too (other colours).
    named_rgb = _rgb_by_component_ids(plain)
    assert decode(named_rgb).pixels.tolist() != decode(plain).pixels.tolist()
    assert gpu_decodable(read_header(plain))
    for data in (cmyk, adobe_rgb, named_rgb):
        assert not gpu_decodable(read_header(data))
        decoder = HostDecoder()
        gpu, host = gpu_and_host(1, decoder)
        assert_same_crops(gpu.prepare(data), host.prepare(data))
        assert decoder.calls == 0


def test_mpo_takes_the_gpu_path() -> None:
    data = encode(photo(96, 64), "MPO", save_all=True, append_images=[photo(96, 64, seed=1)])
    assert Image.open(io.BytesIO(data)).format == "MPO"
    decoder = HostDecoder()
    gpu, host = gpu_and_host(1, decoder)
    assert_same_crops(gpu.prepare(data), host.prepare(data))
    assert decoder.calls == 1


@pytest.mark.parametrize("grey_as_one_plane", [True, False])
def test_grey_jpeg_comes_out_rgb(grey_as_one_plane: bool) -> None:
    data = encode(photo(150, 100, mode="L"))
    decoder = HostDecoder(grey_as_one_plane=grey_as_one_plane)
    gpu, host = gpu_and_host(1, decoder)
    prepared = gpu.prepare(data)
    assert decoder.calls == 1 and prepared.crops.shape[-1] == 3
    assert_same_crops(prepared, host.prepare(data))


def test_large_jpeg_is_decoded_at_full_size_with_the_original_tiling() -> None:
    data = encode(photo(2600, 1300), quality=80)
    decoder = HostDecoder()
    gpu = ImagePreparer(gpu_decode_min_pixels=1_000_000, gpu_decoder=decoder)  # reduced on
    reduced = ImagePreparer().prepare(data)
    prepared = gpu.prepare(data)
    assert decoder.calls == 1
    assert reduced.decoded_size == (650, 1300)  # the host path would halve it
    assert prepared.decoded_size == (1300, 2600) and prepared.tiling == reduced.tiling
    assert_same_crops(prepared, ImagePreparer(reduced_decode=False).prepare(data))


# ---------------------------------------------------------------- orientation


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_tensor_equals_jpeg_orient(orientation: int) -> None:
    pixels = np.random.default_rng(orientation).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    expected = orient(pixels, orientation)
    for given in (torch.from_numpy(pixels), torch.from_numpy(pixels).permute(2, 0, 1)):
        hwc = given if given.shape[-1] == 3 else given.permute(1, 2, 0)
        out = orient_tensor(hwc, orientation)
        assert out.is_contiguous() and out.dtype == torch.uint8
        np.testing.assert_array_equal(out.numpy(), expected)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_gpu_path_orientation_equals_exif_transpose(orientation: int) -> None:
    data = oriented_jpeg(orientation)
    header = read_header(data)
    upright = decode_upright(HostDecoder(), data, torch.device("cpu"), header)
    np.testing.assert_array_equal(upright.numpy(), pillow_upright(data))
    decoder = HostDecoder()
    gpu, host = gpu_and_host(1, decoder)
    prepared = gpu.prepare(data)
    assert decoder.calls == 1
    assert (prepared.height, prepared.width) == upright.shape[:2] == header.size
    assert_same_crops(prepared, host.prepare(data))


# ---------------------------------------------------------------- fallback


def test_a_failing_decoder_falls_back_to_the_host_result() -> None:
    data = oriented_jpeg(6, 300, 200)
    decoder = HostDecoder(fail=True)
    gpu, host = gpu_and_host(1, decoder)
    a, b = gpu.prepare(data), host.prepare(data)
    assert decoder.calls == 1
    assert_same_crops(a, b)
    assert a.content_hash == b.content_hash  # the host path's pixel digest


def wrong_shape(data: bytes, device: torch.device) -> torch.Tensor:
    return torch.zeros((3, 8, 8), dtype=torch.uint8)


def wrong_dtype(data: bytes, device: torch.device) -> torch.Tensor:
    planes = torch.from_numpy(simplejpeg.decode_jpeg(data)).permute(2, 0, 1)
    return planes.to(torch.int16)


@pytest.mark.parametrize("decoder", [wrong_shape, wrong_dtype])
def test_output_unlike_the_header_falls_back(
    decoder: Callable[[bytes, torch.device], torch.Tensor],
) -> None:
    data = encode(photo(120, 90))
    header = read_header(data)
    with pytest.raises(GpuDecodeError):
        decode_upright(decoder, data, torch.device("cpu"), header)
    gpu = ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=decoder)
    assert_same_crops(gpu.prepare(data), ImagePreparer().prepare(data))


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[: len(d) // 2],  # truncated
        lambda d: d[:200] + b"\xff\xd9",  # ends in the middle of the header segments
    ],
    ids=["truncated", "cut_short"],
)
def test_corrupt_jpeg_gets_the_host_paths_error(damage: Callable[[bytes], bytes]) -> None:
    data = damage(encode(photo(300, 200)))
    with pytest.raises(ImageError) as host_error:
        ImagePreparer().prepare(data)
    for decoder in (HostDecoder(fail=True), HostDecoder()):  # refused, or simplejpeg raises
        with pytest.raises(ImageError) as gpu_error:
            ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=decoder).prepare(data)
        assert gpu_error.value.reason is host_error.value.reason
        assert gpu_error.value.message == host_error.value.message


def test_data_without_the_end_marker_is_left_to_the_host_path() -> None:
    """A GPU decoder might fill a truncated picture in silently: it never sees one."""
    whole = encode(photo(300, 200))
    seen: list[int] = []

    def lenient(data: bytes, device: torch.device) -> torch.Tensor:
        seen.append(len(data))
        return torch.zeros((3, 200, 300), dtype=torch.uint8)

    gpu = ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=lenient)
    with pytest.raises(ImageError) as info:
        gpu.prepare(whole[: len(whole) * 3 // 4])
    assert info.value.reason is R.CORRUPT and not seen
    padded = whole + b"\x00" * 16  # bytes after the picture: decoded on the host, accepted
    assert_same_crops(gpu.prepare(padded), ImagePreparer().prepare(padded))
    assert not seen


def test_fallback_gives_the_budget_back_first() -> None:
    data = encode(photo(200, 150))
    budget = DecodeBudget(200 * 150 * 3)  # exactly one full-size decode: a nested one would hang
    decoder = HostDecoder(fail=True)
    gpu = ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=decoder, budget=budget)
    results: list[PreparedImage] = []
    worker = threading.Thread(target=lambda: results.append(gpu.prepare(data)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the host decode waited for the GPU path's share"
    (prepared,) = results
    assert decoder.calls == 1 and budget.in_flight == 0 and budget.peak == 200 * 150 * 3
    assert_same_crops(prepared, ImagePreparer().prepare(data))


# ---------------------------------------------------------------- limits before decoding


def test_limits_are_checked_before_the_decoder_is_called() -> None:
    data = encode(photo(300, 200))
    cases = [
        (ImageLimits(max_image_pixels=300 * 200 - 1), R.TOO_MANY_PIXELS),
        (ImageLimits(max_image_side=299), R.TOO_LARGE_SIDE),
        (ImageLimits(max_image_bytes=len(data) - 1), R.TOO_LARGE_BYTES),
        (ImageLimits(image_free_pixels=0, max_image_pixels_per_byte=1), R.TOO_COMPRESSED),
    ]
    for limits, reason in cases:
        decoder = HostDecoder()
        with pytest.raises(ImageError) as info:
            ImagePreparer(limits, gpu_decode_min_pixels=1, gpu_decoder=decoder).prepare(data)
        assert info.value.reason is reason and decoder.calls == 0


def test_gpu_path_reserves_the_budget_while_it_works() -> None:
    data = encode(photo(200, 150))
    budget = DecodeBudget(1 << 30)
    seen: list[int] = []

    def decoder(data: bytes, device: torch.device) -> torch.Tensor:
        seen.append(budget.in_flight)
        return HostDecoder()(data, device)

    ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=decoder, budget=budget).prepare(data)
    assert seen == [200 * 150 * 3] and budget.in_flight == 0


def test_over_budget_at_full_size_goes_to_the_host_path() -> None:
    data = encode(photo(2600, 1300), quality=80)
    budget = DecodeBudget(2600 * 1300 * 3 - 1)  # a reduced host decode fits, a full one not
    decoder = HostDecoder()
    gpu = ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=decoder, budget=budget)
    prepared = gpu.prepare(data)
    assert decoder.calls == 0 and prepared.decoded_size == (650, 1300)
    with pytest.raises(ImageError) as info:  # too large for the host path too: its error
        ImagePreparer(
            gpu_decode_min_pixels=1, gpu_decoder=decoder, budget=DecodeBudget(1000)
        ).prepare(data)
    assert info.value.reason is R.OVER_DECODE_BUDGET and decoder.calls == 0


# ---------------------------------------------------------------- digest


def test_digest_is_of_the_encoded_bytes_and_never_a_pixel_digest() -> None:
    data = oriented_jpeg(6, 300, 200)
    gpu, _ = gpu_and_host(1, HostDecoder())
    prepared = gpu.prepare(data)
    pixels = decode(data).pixels
    assert prepared.content_hash != content_hash(pixels, (300, 200))
    inner = blake3.blake3(data).digest()  # the bytes' own digest, under the picture's header
    assert prepared.content_hash == blake3.blake3(b"jpeg-gpu 300x200\n" + inner).hexdigest()
    again, _ = gpu_and_host(1, HostDecoder())
    assert again.prepare(data).content_hash == prepared.content_hash  # stable
    # Other bytes, the same pixels (an empty comment segment after the start marker).
    other = data[:2] + b"\xff\xfe\x00\x02" + data[2:]
    assert np.array_equal(decode(other).pixels, pixels)
    assert gpu.prepare(other).content_hash == encoded_digest(other, (300, 200))
    assert encoded_digest(other, (300, 200)) != prepared.content_hash


def test_concurrent_gpu_path_calls_agree() -> None:
    images = [encode(photo(160, 120, seed=k)) for k in range(4)]
    gpu, host = gpu_and_host(1, HostDecoder(), budget=DecodeBudget(200_000))
    expected = [host.prepare(d) for d in images]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(gpu.prepare, images * 4))
    for k, prepared in enumerate(got):
        assert_same_crops(prepared, expected[k % 4])


# ---------------------------------------------------------------- torchvision


def test_torchvision_decoder_says_why_it_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    # Importing them raises ImportError, whether or not they were imported before.
    monkeypatch.setitem(sys.modules, "torchvision", None)
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)
    with pytest.raises(RuntimeError, match="torchvision cannot be imported"):
        torchvision_decoder(torch.device("cuda"))
    with pytest.raises(RuntimeError, match="nvImageCodec cannot be imported"):
        nvimgcodec_decoder(torch.device("cuda"))
    # auto says why neither works; the preparer itself quietly keeps the host path.
    with pytest.raises(RuntimeError, match=r"nvImageCodec cannot .*; torchvision cannot"):
        gpu_decoder(torch.device("cuda"))
    assert ImagePreparer(device="cuda", gpu_decode_min_pixels=1).gpu_decoder is None


def test_auto_takes_the_first_decoder_that_works(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: torch.device) -> object:
        raise RuntimeError("no engines here")

    def works(device: torch.device) -> object:
        return HostDecoder()

    monkeypatch.setattr(gpu_jpeg, "nvimgcodec_decoder", broken)
    monkeypatch.setattr(gpu_jpeg, "torchvision_decoder", works)
    assert isinstance(gpu_decoder(torch.device("cuda")), HostDecoder)
    with pytest.raises(RuntimeError, match="no engines here"):
        gpu_decoder(torch.device("cuda"), "nvimgcodec")
    monkeypatch.setattr(gpu_jpeg, "nvimgcodec_decoder", works)
    monkeypatch.setattr(gpu_jpeg, "torchvision_decoder", broken)
    assert isinstance(gpu_decoder(torch.device("cuda"), "auto"), HostDecoder)
    with pytest.raises(ValueError, match="must be one of auto, nvimgcodec, torchvision"):
        gpu_decoder(torch.device("cuda"), "nvjpeg")


def _cuda_decoder(kind: str = "torchvision") -> Callable[[bytes, torch.device], torch.Tensor]:
    try:
        return gpu_decoder(torch.device("cuda"), kind)
    except RuntimeError as err:
        pytest.skip(str(err))


@pytest.fixture(params=["torchvision", "nvimgcodec"])
def cuda_decoder(request: pytest.FixtureRequest) -> Callable[[bytes, torch.device], torch.Tensor]:
    """Each GPU decoder that works here (the others skip)."""
    return _cuda_decoder(request.param)


def synthetic_photo(width: int, height: int) -> Image.Image:
    """Smooth gradients, edges and texture: what a camera JPEG holds, generated quickly."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rng = np.random.default_rng(0)
    r = 128 + 90 * np.sin(x / 97.0) * np.cos(y / 131.0)
    g = 128 + 90 * np.sin((x + y) / 211.0)
    b = np.where((x // 400 + y // 300) % 2 == 0, 60.0, 190.0)
    rgb = np.stack([r, g, b], axis=-1) + rng.normal(0, 6, (height, width, 3))
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("size", [(4000, 3000), (800, 600)], ids=["12MP", "800x600"])
def test_nvjpeg_crops_are_close_to_the_host_paths(
    size: tuple[int, int], cuda_decoder: Callable[[bytes, torch.device], torch.Tensor]
) -> None:
    data = encode(synthetic_photo(*size), quality=90)
    gpu = ImagePreparer(device="cuda", gpu_decode_min_pixels=1, gpu_decoder=cuda_decoder)
    host = ImagePreparer(device="cuda", reduced_decode=False)
    a, b = gpu.prepare(data), host.prepare(data)
    assert a.crops.is_cuda and a.content_hash == encoded_digest(data, (size[1], size[0]))
    assert a.tiling == b.tiling and a.decoded_size == b.decoded_size == (size[1], size[0])
    diff = (a.crops.int() - b.crops.int()).abs()
    print(f"{size}: crops differ by mean {diff.float().mean():.4f}, max {int(diff.max())}")
    assert diff.float().mean() < 1.0


@pytest.mark.gpu
@pytest.mark.parametrize("orientation", range(1, 9))
def test_nvjpeg_orientation_on_the_gpu(
    orientation: int, cuda_decoder: Callable[[bytes, torch.device], torch.Tensor]
) -> None:
    decoder = cuda_decoder
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(synthetic_photo(320, 200), quality=90, exif=exif.tobytes())
    upright = decode_upright(decoder, data, torch.device("cuda"), read_header(data))
    assert upright.is_cuda and upright.is_contiguous()
    expected = pillow_upright(data)
    assert tuple(upright.shape) == expected.shape
    diff = np.abs(upright.cpu().numpy().astype(int) - expected.astype(int))
    assert diff.mean() < 1.0
    # The GPU moves equal the host's exactly on the same pixels.
    stored = torch.from_numpy(simplejpeg.decode_jpeg(data)).cuda()
    np.testing.assert_array_equal(orient_tensor(stored, orientation).cpu().numpy(), expected)


def outcome(preparer: ImagePreparer, data: bytes) -> str:
    try:
        preparer.prepare(data)
    except ImageError as err:
        return err.reason.value
    return "accepted"


def test_damaged_jpegs_get_the_host_paths_outcome() -> None:
    data = encode(photo(300, 200))
    for bad in (data[: len(data) * 3 // 4], data[: len(data) * 3 // 4] + b"\xff\xd9"):
        host = outcome(ImagePreparer(), bad)
        assert (
            outcome(ImagePreparer(gpu_decode_min_pixels=1, gpu_decoder=HostDecoder()), bad) == host
        )
    assert outcome(ImagePreparer(), data[: len(data) * 3 // 4]) == "corrupt"
    assert outcome(ImagePreparer(), data[: len(data) * 3 // 4] + b"\xff\xd9") == "accepted"


@pytest.mark.gpu
def test_nvjpeg_refuses_what_the_host_path_refuses(
    cuda_decoder: Callable[[bytes, torch.device], torch.Tensor],
) -> None:
    decoder = cuda_decoder
    data = encode(synthetic_photo(640, 480), quality=90)
    gpu = ImagePreparer(device="cuda", gpu_decode_min_pixels=1, gpu_decoder=decoder)
    host = ImagePreparer(device="cuda")
    sos = data.index(b"\xff\xda")
    cases = {
        "truncated": data[: len(data) * 3 // 4],
        "truncated_with_end_marker": data[: len(data) * 3 // 4] + b"\xff\xd9",
        "no_scan": data[:sos] + b"\xff\xd9",
    }
    for name, bad in cases.items():
        # Refused with the same reason, or accepted by both (Pillow fills in a truncated
        # scan that ends with the end marker).
        assert outcome(gpu, bad) == outcome(host, bad), name


@pytest.mark.gpu
def test_nvjpeg_grey_and_cmyk() -> None:
    decoder = _cuda_decoder("torchvision")
    grey = encode(synthetic_photo(640, 480).convert("L"), quality=90)
    gpu = ImagePreparer(device="cuda", gpu_decode_min_pixels=1, gpu_decoder=decoder)
    host = ImagePreparer(device="cuda", reduced_decode=False)
    a, b = gpu.prepare(grey), host.prepare(grey)
    assert a.content_hash != b.content_hash  # it did take the GPU path
    assert (a.crops.int() - b.crops.int()).abs().float().mean() < 1.0
    cmyk = encode(synthetic_photo(640, 480).convert("CMYK"))
    assert torch.equal(gpu.prepare(cmyk).crops, host.prepare(cmyk).crops)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("size", "subsampling", "mode"),
    [
        ((4000, 3000), "4:2:0", "RGB"),
        ((800, 600), "4:2:0", "RGB"),
        ((801, 599), "4:2:2", "RGB"),
        ((640, 480), "4:4:4", "RGB"),
    ],
)
def test_hardware_decoder_is_within_one_of_libjpeg_turbo(
    size: tuple[int, int], subsampling: str, mode: str
) -> None:  # mode "L" went 163 off at 333x257: grey JPEGs stay on the host (test below)
    """The JPEG engines' pixels against the host decoder's: at most 1 apart."""
    decoder = _cuda_decoder("nvimgcodec")
    data = encode(synthetic_photo(*size).convert(mode), quality=90, subsampling=subsampling)
    got = decode_upright(decoder, data, torch.device("cuda"), read_header(data))
    want = simplejpeg.decode_jpeg(data, colorspace="RGB")
    assert tuple(got.shape) == want.shape
    diff = np.abs(got.cpu().numpy().astype(int) - want.astype(int))
    print(f"{size} {subsampling} {mode}: max {diff.max()}, mean {diff.mean():.5f}")
    assert diff.max() <= 1 and diff.mean() < 0.01


@pytest.mark.gpu
def test_hardware_decoder_reuses_its_buffer_across_sizes_and_threads() -> None:
    """Each thread's reused output buffer never leaks one picture into the next: a large, a
    small and a large picture again, from four threads at once, equal one thread's pixels."""
    decoder = _cuda_decoder("nvimgcodec")
    sizes = ((1600, 1200), (320, 200), (1200, 1600))
    pictures = [encode(synthetic_photo(w, h), quality=85) for w, h in sizes]
    device = torch.device("cuda")
    alone = [decoder(data, device).cpu() for data in pictures]

    def run(_: int) -> list[torch.Tensor]:
        with torch.cuda.stream(torch.cuda.Stream()):
            out = [decoder(data, device) for data in pictures * 2]
            torch.cuda.current_stream().synchronize()
        return [t.cpu() for t in out]

    with ThreadPoolExecutor(4) as pool:
        for result in pool.map(run, range(4)):
            for got, want in zip(result, alone * 2, strict=True):
                assert torch.equal(got, want)


@pytest.mark.gpu
def test_a_progressive_jpeg_the_engines_refuse_goes_to_the_host_path() -> None:
    decoder = _cuda_decoder("nvimgcodec")
    data = encode(synthetic_photo(640, 480), quality=90, progressive=True)
    gpu = ImagePreparer(device="cuda", gpu_decode_min_pixels=1, gpu_decoder=decoder)
    host = ImagePreparer(device="cuda", reduced_decode=False)
    a, b = gpu.prepare(data), host.prepare(data)
    # Either the engines took it (pixels within 1) or the host path did (the same crops).
    assert (a.crops.int() - b.crops.int()).abs().float().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("size", [(333, 257), (640, 480)])
def test_grey_jpegs_skip_the_hardware_decoder(size: tuple[int, int]) -> None:
    decoder = _cuda_decoder("nvimgcodec")
    grey = encode(synthetic_photo(*size).convert("L"), quality=90)
    with pytest.raises(GpuDecodeError, match="1-channel JPEGs stay on the host"):
        decode_upright(decoder, grey, torch.device("cuda"), read_header(grey))
    gpu = ImagePreparer(device="cuda", gpu_decode_min_pixels=1, gpu_decoder=decoder)
    host = ImagePreparer(device="cuda", reduced_decode=False)
    a, b = gpu.prepare(grey), host.prepare(grey)
    assert a.content_hash == b.content_hash and torch.equal(a.crops, b.crops)
