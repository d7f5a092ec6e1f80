"""`ember models inspect FILE`: what a GGUF file holds and whether ember can run it.

Reads the header only (metadata and the tensor table); no tensor is dequantized.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType as QType

from ember.errors import EmberError, ModelLoadError
from ember.quant.formats import KERNELS, PLAIN, can_dequantize
from ember.weights.gguf import ARCHITECTURES, ROPE_FREQS, GGUFFile, hf_name
from ember.weights.gguf_archs import ROPE_FACTORS


@dataclass(frozen=True)
class TypeUsage:
    """The tensors stored in one ggml type."""
    qtype: str
    num_tensors: int
    num_params: int
    num_bytes: int


@dataclass(frozen=True)
class ModelReport:
    path: str
    file_bytes: int
    architecture: str | None
    name: str | None
    num_params: int
    types: tuple[TypeUsage, ...]     # most bytes first
    context_length: int | None
    has_chat_template: bool
    linear_bits: int | None          # bits of the type holding most decoder weights
    linear_packing: str | None       # what `--quantization auto` packs them in (on a CPU)
    runnable: bool
    reasons: tuple[str, ...]         # why ember cannot run it (empty when it can)
    notes: tuple[str, ...]           # what loads, but slowly


def inspect_gguf(path: Path) -> ModelReport:
    """The report of one .gguf file; a file that is not GGUF is a ModelLoadError."""
    if not Path(path).is_file():
        raise ModelLoadError(f"{path} is not a file; pass the path of a .gguf file")
    file = GGUFFile(Path(path))
    tensors = [t for t in file.raw_tensors if t.name != ROPE_FREQS]
    arch = file.metadata.get("general.architecture")
    reasons = _type_reasons(file) + _arch_reasons(file, arch)
    context = file.metadata.get(f"{arch}.context_length")
    return ModelReport(
        path=str(path), file_bytes=Path(path).stat().st_size, architecture=arch,
        name=file.metadata.get("general.name"),
        num_params=sum(int(t.n_elements) for t in tensors), types=_type_usage(file),
        context_length=int(context) if context is not None else None,
        has_chat_template=bool(file.metadata.get("tokenizer.chat_template")),
        linear_bits=file.linear_bits(), linear_packing=file.linear_packing(),
        runnable=not reasons, reasons=tuple(reasons),
        notes=tuple(_slow_types(file)))


def _type_usage(file: GGUFFile) -> tuple[TypeUsage, ...]:
    count, params, size = Counter(), Counter(), Counter()
    for t in file.raw_tensors:
        name = t.tensor_type.name
        count[name] += 1
        params[name] += int(t.n_elements)
        size[name] += int(t.n_bytes)
    return tuple(TypeUsage(name, count[name], params[name], size[name])
                 for name, _ in size.most_common())


def _by_type(file: GGUFFile, keep: Callable[[QType], bool]) -> dict[str, list[str]]:
    """ggml type name -> names of the tensors of that type for which keep(type) holds."""
    out: dict[str, list[str]] = defaultdict(list)
    for t in file.raw_tensors:
        if keep(t.tensor_type):
            out[t.tensor_type.name].append(t.name)
    return out


def _type_reasons(file: GGUFFile) -> list[str]:
    return [f"{_some(names)} use{'s' if len(names) == 1 else ''} ggml type {qtype}, which "
            "ember cannot dequantize; convert the file to a K-quant (Q4_K_M, Q6_K) or Q8_0"
            for qtype, names in _by_type(file, lambda q: not can_dequantize(q)).items()]


def _slow_types(file: GGUFFile) -> list[str]:
    slow = _by_type(file, lambda q: can_dequantize(q) and q not in KERNELS and q not in PLAIN)
    return [f"{_some(names)} in ggml type {qtype} load through the gguf package's numpy "
            "code, about 10x slower than ember's own kernels" for qtype, names in slow.items()]


def _arch_reasons(file: GGUFFile, arch: str | None) -> list[str]:
    if arch not in ARCHITECTURES:
        return [f"architecture {arch!r} is not supported; ember runs GGUF architectures "
                f"{', '.join(ARCHITECTURES)}"]
    unknown = [t.name for t in file.raw_tensors
               if t.name not in (ROPE_FREQS, *ROPE_FACTORS) and hf_name(t.name, arch) is None]
    if unknown:
        return [f"{_some(unknown)} {'is' if len(unknown) == 1 else 'are'} not part of the "
                f"{arch} layout ember runs (extensions beyond the architectures in the README "
                "are not supported)"]
    try:
        file.model_config()
    except EmberError as e:
        return [e.message]
    return []


def _some(names: list[str]) -> str:
    """'tensor a' / '3 tensors (a, b, ...)'."""
    if len(names) == 1:
        return f"tensor {names[0]}"
    shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
    return f"{len(names)} tensors ({shown})"


def format_report(report: ModelReport) -> str:
    """The report as the lines `ember models inspect` prints."""
    total = sum(u.num_bytes for u in report.types) or 1
    lines = [
        f"file            {report.path} ({report.file_bytes / 2**20:.1f} MiB)",
        f"name            {report.name or '-'}",
        f"architecture    {report.architecture or '-'}",
        f"parameters      {report.num_params:,} ({report.num_params / 1e9:.2f} B)",
        f"bits per weight {8 * total / max(report.num_params, 1):.2f}",
        f"context length  {report.context_length or '-'}",
        f"chat template   {'yes' if report.has_chat_template else 'no'}",
        "tensor types    type      tensors      parameters       MiB   share",
    ]
    for u in report.types:
        lines.append(f"                {u.qtype:8s} {u.num_tensors:8d} {u.num_params:15,d} "
                     f"{u.num_bytes / 2**20:9.1f} {100 * u.num_bytes / total:6.1f}%")
    auto = report.linear_packing or "none"
    lines.append(f"packed decode   --quantization auto: {auto} (CPU, bfloat16)")
    lines.append(f"ember can run   {'yes' if report.runnable else 'no'}")
    lines += [f"  - {reason}" for reason in report.reasons]
    lines += [f"  note: {note}" for note in report.notes]
    return "\n".join(lines)
