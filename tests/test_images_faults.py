"""Image access faults carry the reason a bad-record report counts them under; 16-bit images load scaled."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mvp_engine.kit.mllm.data.images import load_image, read_image_size
from mvp_engine.kit.mllm.data.sources import MLLMRecordError

GRADIENT = np.array([[0, 257, 4096, 32768, 49152, 65280, 65535]], dtype=np.uint16)
EXPECTED = [0, 1, 16, 128, 192, 255, 255]  # value >> 8


def failure(reader, path: Path) -> MLLMRecordError:
    with pytest.raises(MLLMRecordError, match=f"^{re.escape(str(path))}: cannot") as info:
        reader(path)
    return info.value


def png_16_bit(path: Path, colour_type: int, pixels: np.ndarray) -> Path:
    """A 16-bit PNG written byte by byte, for layouts Pillow cannot save (greyscale + alpha)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    height, width = pixels.shape[:2]
    rows = b"".join(b"\x00" + row.astype(">u2").tobytes() for row in pixels)
    header = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )
    return path


# --- reasons -----------------------------------------------------------------------------------------------------


def test_missing_file_is_missing_image_for_both_readers(tmp_path: Path) -> None:
    for reader in (read_image_size, load_image):
        assert failure(reader, tmp_path / "missing.png").reason == "missing_image"


def test_unreadable_header_and_corrupt_pixels(tmp_path: Path) -> None:
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image at all")
    assert failure(read_image_size, junk).reason == "unreadable_image"
    assert failure(load_image, junk).reason == "corrupt_image"
    full = tmp_path / "full.png"
    Image.effect_noise((64, 64), 50).convert("RGB").save(full)
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(full.read_bytes()[:200])
    assert read_image_size(truncated) == (64, 64)
    assert failure(load_image, truncated).reason == "corrupt_image"


def test_decompression_bomb_has_its_own_reason(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "big.png"
    Image.new("RGB", (64, 64)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 4096 pixels > 2x the limit: Pillow refuses to open it
    for reader in (read_image_size, load_image):
        error = failure(reader, path)
        assert error.reason == "decompression_bomb", str(error)


# --- 16-bit images -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".png", ".tif", ".pgm"])
def test_16_bit_greyscale_is_scaled_not_clipped(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"gradient{suffix}"
    Image.fromarray(GRADIENT).save(path)  # I;16 in memory; reopened as I;16 (PNG, TIFF) or I (PGM)
    with Image.open(path) as raw:
        assert raw.mode in ("I;16", "I")
    loaded = load_image(path)
    assert loaded.mode == "RGB" and loaded.size == (GRADIENT.shape[1], 1)
    pixels = np.asarray(loaded)
    assert pixels[0, :, 0].tolist() == EXPECTED
    assert (pixels[..., 0] == pixels[..., 1]).all() and (pixels[..., 0] == pixels[..., 2]).all()


def test_big_endian_16_bit_tiff_is_scaled(tmp_path: Path) -> None:
    path = tmp_path / "big_endian.tif"
    Image.frombytes("I;16B", (GRADIENT.shape[1], 1), GRADIENT.astype(">u2").tobytes()).save(path)
    with Image.open(path) as raw:
        assert raw.mode == "I;16B"
    assert np.asarray(load_image(path))[0, :, 0].tolist() == EXPECTED


def test_32_bit_integer_image_is_read_as_16_bit_values(tmp_path: Path) -> None:
    path = tmp_path / "wide.tif"
    values = np.array([[-5, 0, 32768, 65535, 100000]], dtype=np.int32)
    Image.fromarray(values).save(path)
    with Image.open(path) as raw:
        assert raw.mode == "I"
    assert np.asarray(load_image(path))[0, :, 0].tolist() == [0, 0, 128, 255, 255]


def test_16_bit_greyscale_with_alpha_is_scaled_and_composited(tmp_path: Path) -> None:
    pixels = np.array([[[0, 65535], [32768, 65535], [65535, 65535], [0, 0]]], dtype=np.uint16)
    path = png_16_bit(tmp_path / "la16.png", 4, pixels)
    loaded = load_image(path)
    assert loaded.mode == "RGB"
    # opaque 0 / 32768 / 65535 keep their relative values; fully transparent black shows the white background
    assert np.asarray(loaded)[0, :, 0].tolist() == [0, 128, 255, 255]


def test_16_bit_rotated_image_keeps_size_agreement(tmp_path: Path) -> None:
    path = tmp_path / "rotated.png"
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.tile(GRADIENT, (3, 1))).save(path, exif=exif)
    loaded = load_image(path)
    assert loaded.size == read_image_size(path) == (3, GRADIENT.shape[1])
    assert np.asarray(loaded)[:, 0, 0].tolist() == EXPECTED  # rotated 90 degrees clockwise: the gradient runs down
