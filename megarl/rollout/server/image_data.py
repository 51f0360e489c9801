"""SGLang's `image_data` on /generate: which images belong to which prompt, and what each string holds.

Shapes (SGLang's GenerateReqInput normalisation): for a single prompt, one image or a list of the
prompt's images; for a batch, one list per prompt (an entry may also be one image, or null / []
for a prompt without images), or a single image that every prompt shows. The n samples of a
prompt share its images. Each image is a string: base64 of an encoded image (PNG, JPEG, ...), a
`data:image/...;base64,...` URL, or a path of a file on the server's machine; http(s) URLs are
refused (this server fetches nothing). The engine decodes, processes and places the images
(GenerationEngine.attach_images); errors name the prompt and the image.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from megarl.rollout.engine.protocol import InvalidRequest

_MAX_PATH = 4096  # longer strings are base64 (a path this long is none)
_MODALITIES = (None, "image", "multi-images")


def image_lists(raw, count: int, single: bool) -> list[list]:
    """Each prompt's image_data entries (strings, not yet checked), in prompt order."""
    if raw is None or raw == [] or raw == [None]:
        return [[] for _ in range(count)]
    if single:
        return [_entries(raw)]
    if not isinstance(raw, list):
        return [[raw] for _ in range(count)]  # one image shown to every prompt, as in SGLang
    if len(raw) != count:
        raise InvalidRequest(
            f"image_data has {len(raw)} entries for {count} prompts: give one list of images per prompt "
            "([] or null for a prompt without images)"
        )
    return [_entries(entry) for entry in raw]


def _entries(value) -> list:
    if value is None or value == [None]:
        return []
    return list(value) if isinstance(value, list) else [value]


def image_names(prompt: int, count: int, single: bool) -> list[str]:
    """How errors name a prompt's images: the field path, the prompt's and the image's index."""
    if single:
        return [f"image_data[{k}] (prompt 0, image {k})" for k in range(count)]
    return [f"image_data[{prompt}][{k}] (prompt {prompt}, image {k})" for k in range(count)]


def image_source(entry, where: str) -> bytes | str:
    """The encoded bytes of a base64 string or data URL, or the path of a file; InvalidRequest
    naming `where` for anything else."""
    if not isinstance(entry, str) or not entry:
        raise InvalidRequest(
            f"{where}: an image is a non-empty string (base64, a data: URL or a file path), got {type(entry).__name__}"
        )
    if entry.startswith(("http://", "https://")):
        raise InvalidRequest(
            f"{where}: this server does not fetch URLs; send the image itself as base64 or a data: URL"
        )
    if entry.startswith("data:"):
        header, comma, payload = entry.partition(",")
        if not comma or not header.endswith(";base64"):
            raise InvalidRequest(f"{where}: a data URL must look like data:image/png;base64,<base64>")
        return _b64(payload, where)
    if len(entry) <= _MAX_PATH and "\n" not in entry and Path(entry).is_file():
        return entry
    return _b64(entry, where)


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(
            f"{where}: neither valid base64, a data: URL nor an existing file path ({text[:40]!r}...)"
        ) from None


def check_modalities(raw) -> None:
    """SGLang's `modalities` hint, which image_data implies here: images only."""
    values = raw if isinstance(raw, list) else [raw]
    bad = [v for v in values if v not in _MODALITIES]
    if bad:
        raise InvalidRequest(
            f"modalities={raw!r:.80}: this engine takes images only ('image', 'multi-images'); "
            f"{bad[0]!r} is not supported"
        )


def attach(engine, prompts: list[list[int]], raw, single: bool, fields: list[str]) -> list:
    """Expand each prompt's pads and process its images (GenerationEngine.attach_images): the
    prompts are replaced by their expanded ids; returns each prompt's images (None: none)."""
    lists = image_lists(raw, len(prompts), single)
    attached = []
    for i, entries in enumerate(lists):
        names = image_names(i, len(entries), single)
        sources = [image_source(entry, name) for entry, name in zip(entries, names)]
        prompt = fields[i] if single else f"{fields[i]} (prompt {i})"
        prompts[i], images = engine.attach_images(prompts[i], sources, prompt, names)
        attached.append(images)
    return attached
