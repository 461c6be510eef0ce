"""Image file access for the DataKit: header-only size reads for planning, full loads for encoding.

Both functions agree on orientation: :func:`load_image` shows the image upright by its EXIF ``Orientation``
(as ``transformers.image_utils.load_image`` does), and :func:`read_image_size` swaps width and height for the
orientations that rotate by 90/270 degrees. Both read the orientation from the same header-only place, by one
helper, so they agree by construction. That agreement is what lets a recipe's ``measure`` (sizes only)
predict exactly what ``encode`` (pixels) will produce, so a whole epoch is planned without decoding an image.

Failures are :class:`MLLMRecordError` s whose message starts with the path and whose ``reason`` says what went
wrong: ``missing_image``, ``decompression_bomb`` (Pillow's pixel limit, checked when the file is opened, so both
functions see it), else ``unreadable_image`` for a header and ``corrupt_image`` for pixels. A path may name a
member of a tar shard (``members.py``), read in place.
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from mvp_engine.kit.mllm.data.members import open_media
from mvp_engine.kit.mllm.data.sources import MLLMRecordError

_EXIF_ORIENTATION = 0x0112
# EXIF orientation -> the transpose that shows the image upright (the table ImageOps.exif_transpose uses).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_SIDES = {5, 6, 7, 8}
# Pillow raises these for unreadable, truncated or oversized images; none of them should escape bare.
_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def read_image_size(path: str | os.PathLike) -> tuple[int, int]:
    """``(width, height)`` of the image as :func:`load_image` returns it, from the file header only."""
    try:
        with Image.open(open_media(path)) as image:
            width, height = image.size
            orientation = _header_orientation(image)
    except _IMAGE_ERRORS as exc:
        raise _image_error(path, "read image header", exc, "unreadable_image") from None
    if orientation in _SWAPS_SIDES:
        width, height = height, width
    return width, height


def load_image(path: str | os.PathLike) -> Image.Image:
    """The image fully decoded as RGB, EXIF rotation applied, the file closed.

    Transparent images are composited over white, not stripped of alpha: dropping alpha exposes whatever
    colour the transparent pixels happen to hold (often black), which is not what the image shows. 16-bit
    greyscale is scaled to 8 bits (Pillow's own conversion clips it at 255, turning almost every pixel white).
    """
    try:
        with Image.open(open_media(path)) as image:
            orientation = _header_orientation(image)
            image.load()
            if image.mode == "I" or image.mode.startswith("I;16"):
                image = _scaled_to_8_bit(image)
            if orientation in _UPRIGHT:
                image = image.transpose(_UPRIGHT[orientation])
            if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
                rgba = image.convert("RGBA")
                background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
                return Image.alpha_composite(background, rgba).convert("RGB")
            return image.convert("RGB")
    except _IMAGE_ERRORS as exc:
        raise _image_error(path, "load image", exc, "corrupt_image") from None


def _image_error(path: str | os.PathLike, action: str, exc: Exception, reason: str) -> MLLMRecordError:
    """The error for an image Pillow refused; a missing file and a decompression bomb keep their own reasons."""
    if isinstance(exc, FileNotFoundError):
        reason = "missing_image"
    elif isinstance(exc, Image.DecompressionBombError):
        reason = "decompression_bomb"
    return MLLMRecordError(f"{os.fspath(path)}: cannot {action}: {exc}", reason)


def _scaled_to_8_bit(image: Image.Image) -> Image.Image:
    """Greyscale ``L`` from 16-bit values (``I;16*``, or ``I`` as Pillow decodes 16-bit PGM), by their high byte."""
    values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535) >> 8
    return Image.fromarray(values.astype(np.uint8))


def _header_orientation(image: Image.Image) -> int:
    """EXIF orientation known once the file is opened, without decoding pixels.

    ``Image.getexif()`` would decode a whole PNG to look for a late ``eXIf`` chunk, so the EXIF block already
    parsed from the header (JPEG APP1, WebP, an early PNG chunk) is used instead; TIFF keeps it in its tags.
    """
    raw = image.info.get("exif")
    if raw:
        exif = Image.Exif()
        exif.load(raw)
    elif image.format == "TIFF":
        exif = image.getexif()
    else:
        return 1
    orientation = exif.get(_EXIF_ORIENTATION, 1)
    return orientation if isinstance(orientation, int) else 1
