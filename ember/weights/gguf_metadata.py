"""A GGUF file's metadata as a plain dict (numpy only, no torch: the benchmark uses it too)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType

from ember.errors import ModelLoadError


def open_reader(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({e}); check that "
                             "the download finished and the file is a .gguf model") from e


def metadata_of(reader: GGUFReader) -> dict[str, Any]:
    """Every key but the GGUF.* header fields; nested arrays (unused by ember) become None."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        nested = len(f.types) > 1 and f.types[0] == GGUFValueType.ARRAY and \
            f.types[1] == GGUFValueType.ARRAY
        out[key] = None if nested else f.contents()
    return out


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    return metadata_of(open_reader(Path(path)))
