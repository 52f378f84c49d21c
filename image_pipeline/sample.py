"""A small deterministic sample picture, for demos, smoke tests and CLI defaults."""

from __future__ import annotations

import functools
import io

from PIL import Image, ImageDraw

__all__ = ["SAMPLE_SIZE", "sample_image", "sample_image_bytes"]

SAMPLE_SIZE = (800, 600)  # (width, height), landscape: tiling 2x4, 9 crops


def sample_image() -> Image.Image:
    """An 800x600 RGB drawing: sky, grass, sun, a red house, a blue ball, a white sign."""
    width, height = SAMPLE_SIZE
    image = Image.new("RGB", SAMPLE_SIZE)
    draw = ImageDraw.Draw(image)
    horizon = 400
    for y in range(horizon):  # sky gradient, light towards the horizon
        t = y / horizon
        draw.line([(0, y), (width, y)], fill=(int(70 + 110 * t), int(130 + 90 * t), 235))
    draw.rectangle([0, horizon, width, height], fill=(60, 150, 60))
    draw.ellipse([620, 50, 740, 170], fill=(255, 210, 40))  # sun
    draw.rectangle([120, 260, 340, 460], fill=(190, 40, 40))  # house
    draw.polygon([(100, 260), (230, 150), (360, 260)], fill=(110, 60, 30))  # roof
    draw.rectangle([200, 360, 260, 460], fill=(80, 50, 20))  # door
    draw.rectangle([140, 290, 190, 340], fill=(200, 230, 255))  # window
    draw.ellipse([480, 430, 580, 530], fill=(30, 60, 200))  # ball
    draw.rectangle([600, 300, 760, 380], fill=(250, 250, 250), outline=(20, 20, 20), width=4)
    for k in range(3):  # "text" lines on the sign, no font needed
        draw.line([(620, 320 + 20 * k), (740 - 30 * k, 320 + 20 * k)], fill=(20, 20, 20), width=5)
    return image


@functools.cache
def sample_image_bytes() -> bytes:
    """The sample picture as JPEG bytes (about 30 KB), generated once per process."""
    buffer = io.BytesIO()
    sample_image().save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()
