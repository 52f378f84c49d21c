"""prepare_image end to end: output contract, content hash, thread safety, sample, CLI."""

from __future__ import annotations

import dataclasses
import io
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from image_pipeline import (
    HostImage,
    ImageError,
    ImageErrorReason,
    ImageLimits,
    ImagePreparer,
    PreparedImage,
    TilingSpec,
    content_hash,
    decode,
    decode_image,
    overlap_crop,
    prepare_decoded,
    prepare_image,
    prepare_pil,
    sample_image,
    sample_image_bytes,
)
from image_pipeline.__main__ import main as cli_main


def encode(image: Image.Image, fmt: str, **params: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def drawing(width: int = 700, height: int = 500) -> Image.Image:
    image = Image.new("RGB", (width, height), (30, 90, 160))
    draw = ImageDraw.Draw(image)
    draw.ellipse([50, 60, 300, 310], fill=(240, 200, 20))
    draw.rectangle([350, 100, 650, 450], fill=(200, 30, 60))
    return image


def rotated_jpeg() -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(drawing(900, 400), "JPEG", quality=90, exif=exif.tobytes())


# ---------------------------------------------------------------- output contract


def test_prepared_image_contract() -> None:
    prepared = prepare_image(encode(drawing(), "PNG"))
    assert isinstance(prepared, PreparedImage)
    assert prepared.crops.dtype == torch.uint8
    assert prepared.crops.is_contiguous()
    assert prepared.crops.device.type == "cpu"
    assert prepared.tiling == (2, 4)
    assert prepared.num_crops == 9
    assert prepared.crops.shape == (9, 378, 378, 3)
    assert (prepared.width, prepared.height) == (700, 500)
    assert prepared.decoded_size == (500, 700)
    assert len(prepared.content_hash) == 64 and int(prepared.content_hash, 16) >= 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.tiling = (1, 1)  # type: ignore[misc]


def test_pillow_mode_crops_match_overlap_crop_of_the_decoded_image() -> None:
    data = encode(drawing(), "PNG")
    crops, tiling = overlap_crop(decode_image(data))
    prepared = prepare_image(data, resize="pillow")
    assert prepared.tiling == tiling
    np.testing.assert_array_equal(prepared.crops.numpy(), crops)


def test_orientation_sets_width_height_and_tiling() -> None:
    prepared = prepare_image(rotated_jpeg())
    assert (prepared.width, prepared.height) == (400, 900)  # upright: portrait
    assert prepared.tiling == TilingSpec().tiling_for(900, 400)


def test_custom_tiling_spec_and_limits() -> None:
    spec = TilingSpec(crop_size=224, overlap_margin=2, max_crops=4)
    prepared = prepare_image(encode(drawing(), "PNG"), tiling=spec)
    assert prepared.crops.shape[1:] == (224, 224, 3)
    assert prepared.tiling[0] * prepared.tiling[1] <= 4
    with pytest.raises(ImageError) as info:
        prepare_image(encode(drawing(), "PNG"), ImageLimits(max_image_pixels=1000))
    assert info.value.reason is ImageErrorReason.TOO_MANY_PIXELS


# ---------------------------------------------------------------- prepare_pil


def test_prepare_pil_matches_prepare_image() -> None:
    data = encode(drawing(), "PNG")
    a = prepare_image(data)
    b = prepare_pil(Image.open(io.BytesIO(data)))
    assert torch.equal(a.crops, b.crops)
    assert (a.tiling, a.content_hash, a.width, a.height) == (
        b.tiling,
        b.content_hash,
        b.width,
        b.height,
    )


def test_prepare_pil_applies_orientation_once() -> None:
    data = rotated_jpeg()
    reference = prepare_image(data, reduced_decode=False)
    # A freshly opened image still carries its EXIF orientation ...
    from_open = prepare_pil(Image.open(io.BytesIO(data)))
    # ... while decode_image's result is already upright and must not turn again.
    from_decoded = prepare_pil(decode_image(data))
    for other in (from_open, from_decoded):
        assert (other.width, other.height) == (400, 900)
        assert other.content_hash == reference.content_hash
        assert torch.equal(other.crops, reference.crops)


def test_prepare_pil_converts_modes_and_leaves_input_alone() -> None:
    grey = Image.new("I;16", (500, 400), 65535)
    prepared = prepare_pil(grey)
    assert grey.mode == "I;16"
    assert torch.all(prepared.crops == 255)


def test_prepare_pil_limits_and_types() -> None:
    with pytest.raises(ImageError) as info:
        prepare_pil(Image.new("RGB", (0, 0)))
    assert info.value.reason is ImageErrorReason.TOO_SMALL
    with pytest.raises(TypeError):
        prepare_pil(np.zeros((10, 10, 3), dtype=np.uint8))  # type: ignore[arg-type]


# ---------------------------------------------------------------- content hash


def test_same_pixels_in_different_containers_hash_the_same() -> None:
    image = drawing(320, 240)
    hashes = {
        fmt: prepare_image(encode(image, fmt, **params)).content_hash
        for fmt, params in [
            ("PNG", {}),
            ("BMP", {}),
            ("TIFF", {}),
            ("TIFF", {"compression": "tiff_adobe_deflate"}),
            ("WEBP", {"lossless": True}),
            ("GIF", {}),  # 4 colours: the palette keeps them exactly
        ]
    }
    assert len(set(hashes.values())) == 1, hashes
    # Alpha is dropped, so an opaque RGBA copy is the same picture.
    rgba = image.convert("RGBA")
    assert prepare_image(encode(rgba, "PNG")).content_hash == hashes["PNG"]
    # A JPEG's decoded pixels stored losslessly hash like the JPEG itself.
    jpeg = encode(image, "JPEG", quality=75)
    assert prepare_image(encode(decode_image(jpeg), "PNG")).content_hash == (
        prepare_image(jpeg).content_hash
    )
    assert prepare_pil(image).content_hash == hashes["PNG"]


def test_one_pixel_changes_the_hash() -> None:
    image = drawing(320, 240)
    changed = image.copy()
    r, g, b = changed.getpixel((17, 33))
    changed.putpixel((17, 33), (r, g, b ^ 1))
    assert prepare_pil(image).content_hash != prepare_pil(changed).content_hash


def test_same_bytes_other_shape_hash_differently() -> None:
    pixels = np.arange(2 * 6 * 3, dtype=np.uint8)
    a = Image.fromarray(pixels.reshape(2, 6, 3))
    b = Image.fromarray(pixels.reshape(3, 4, 3))
    assert a.tobytes() == b.tobytes()
    assert content_hash(a) != content_hash(b)


def test_content_hash_helper() -> None:
    image = drawing(64, 48)
    assert content_hash(image) == content_hash(image.copy())
    assert content_hash(image, (48, 64)) == content_hash(image)  # same size: not reduced
    assert content_hash(image, (96, 128)) != content_hash(image)
    with pytest.raises(ValueError):
        content_hash(image.convert("L"))


def test_digest_is_the_same_on_one_thread_or_many() -> None:
    """Pictures above the threading threshold are hashed on BLAKE3's thread pool: the same
    digest as one thread gives (BLAKE3 is a tree), for sizes either side of it."""
    import blake3

    rng = np.random.default_rng(0)
    for h, w in ((600, 800), (1200, 1500)):  # 1.4 MB (one thread) and 5.4 MB (the pool)
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        one = blake3.blake3(f"rgb8 {h}x{w}\n".encode(), max_threads=1)
        one.update(pixels.tobytes())
        assert content_hash(pixels) == one.hexdigest()


# ---------------------------------------------------------------- thread safety


def test_concurrent_calls_give_identical_results() -> None:
    inputs = [
        sample_image_bytes(),
        encode(drawing(), "PNG"),
        rotated_jpeg(),
        encode(drawing(1300, 700), "WEBP", quality=80),
        encode(Image.new("I;16", (600, 600), 30000), "TIFF"),
    ]
    expected = [prepare_image(data) for data in inputs]
    jobs = inputs * 4
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(prepare_image, jobs))
    for index, result in enumerate(results):
        reference = expected[index % len(inputs)]
        assert result.content_hash == reference.content_hash
        assert result.tiling == reference.tiling
        assert torch.equal(result.crops, reference.crops)


def test_concurrent_errors_stay_typed() -> None:
    bad = [b"", b"garbage" * 9, sample_image_bytes()[:5000]] * 8
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(prepare_image, data) for data in bad]
    reasons = []
    for future in futures:
        error = future.exception()
        assert isinstance(error, ImageError)
        reasons.append(error.reason)
    assert set(reasons) == {
        ImageErrorReason.EMPTY,
        ImageErrorReason.UNSUPPORTED_FORMAT,
        ImageErrorReason.CORRUPT,
    }


@pytest.mark.parametrize("resize", ["vips", "pillow"])
@pytest.mark.parametrize(("fmt", "size"), [("JPEG", (700, 500)), ("PNG", (300, 900))])
def test_host_decode_then_crops_equal_prepare(resize: str, fmt: str, size: tuple[int, int]) -> None:
    """The two halves an engine process splits the path into give what `prepare` gives."""
    data = encode(drawing(*size), fmt)
    preparer = ImagePreparer(resize=resize)
    whole = preparer.prepare(data)
    host = preparer.decode_host(data)
    assert isinstance(host, HostImage)
    for name in ("tiling", "content_hash", "width", "height", "decoded_size", "num_crops"):
        assert getattr(host, name) == getattr(whole, name), name
    assert host.nbytes == host.pixels.nbytes and whole.nbytes == whole.crops.nbytes
    assert torch.equal(preparer.crops_of(host), whole.crops)
    allocated = []

    def alloc(shape: tuple[int, int, int]) -> np.ndarray:
        allocated.append(np.zeros(shape, np.uint8))
        return allocated[-1]

    into = preparer.decode_host(data, alloc=alloc)
    assert into.content_hash == whole.content_hash
    # A JPEG is decoded into the given array; other formats where their decoder puts them.
    assert [into.pixels is a for a in allocated] == ([True] if fmt == "JPEG" else [])


def test_host_decode_refuses_what_prepare_refuses() -> None:
    preparer = ImagePreparer(limits=ImageLimits(max_image_pixels=1000))
    for data in (b"", b"garbage" * 9, sample_image_bytes()[:5000], sample_image_bytes()):
        with pytest.raises(ImageError) as host_error:
            preparer.decode_host(data)
        with pytest.raises(ImageError) as whole_error:
            preparer.prepare(data)
        assert host_error.value.reason == whole_error.value.reason


# ---------------------------------------------------------------- sample and CLI


def test_sample_image_bytes() -> None:
    data = sample_image_bytes()
    assert data[:3] == b"\xff\xd8\xff"
    assert 5_000 < len(data) < 100_000
    assert data == sample_image_bytes()
    assert sample_image().tobytes() == sample_image().tobytes()  # drawing is deterministic
    prepared = prepare_image(data)
    assert (prepared.width, prepared.height) == (800, 600)
    assert prepared.tiling == (2, 4)


def test_cli_default_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([]) == 0
    out = capsys.readouterr().out
    assert "2x4" in out and "800x600" in out
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"\xff\xd8\xff garbage")
    assert cli_main([str(garbage)]) == 1
    assert "corrupt" in capsys.readouterr().err


def test_read_only_pixels_are_cropped_without_a_non_writable_tensor() -> None:
    """Pixels mapped read-only (the engine process's shared memory) are copied before torch
    sees them, so no tensor aliases memory it must never write (torch warns once if one does)."""
    decoded = decode(sample_image_bytes())
    frozen = decoded.pixels.copy()
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the non-writable-array warning would raise here
        got = prepare_decoded(dataclasses.replace(decoded, pixels=frozen))
    want = prepare_decoded(decoded)
    assert torch.equal(got.crops, want.crops)
