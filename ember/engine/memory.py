"""Handing freed memory back to the OS.

glibc keeps freed blocks in its heaps for reuse, and a big free one in the middle of a heap
stays resident for the process's life. Two moments free a lot: the end of loading (float32
dequantized copies, the GGUF's metadata) and the end of a burst of requests (activations of
large batches, finished requests). An idle `ember serve` measured 2.40 GB resident without
the first, 1.94 GB with it. While loading, every large block gets a
mapping of its own, so that weights and the temporaries freed between them never share a heap
(an engine measured 1618-1620 MiB resident so, 1622-1641 MiB without). Elsewhere than glibc
this does nothing.

The KV cache is zeros the OS hands out as they are first written (lazy_zeros), later
advised as transparent huge pages (advise_huge_pages): decode attention reads each request's
blocks scattered over the cache, a TLB miss per 4 KiB page otherwise. An idle engine then
faults the rest of it in, a huge page at a time (fault_in), so that serving does not.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import torch

MADV_DONTNEED = 4               # madvise's advice numbers (Linux)
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
HUGE_PAGE = 2 << 20
PAGE = 4096
M_TRIM_THRESHOLD = -1           # mallopt's parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
LOADING_THRESHOLD = 128 << 10   # glibc's initial threshold, held while loading
RUNNING_THRESHOLD = 32 << 20    # the ceiling glibc's adaptive threshold reaches on 64-bit
# Free memory at a heap's top is handed back once it exceeds this. Setting the mmap threshold
# by hand freezes this one at glibc's 128 KiB, so each step's big activations (a 512-token
# chunk's gate/up output is 3-6 MB) were handed back and faulted in again on every step: int8
# prompt matmuls ran at 0.5-0.9 instead of 1.2-1.6 TOP/s. Twice the mmap threshold, as
# glibc's adaptive rule sets it; idle engines still hand everything back (return_free_memory).
RUNNING_TRIM_THRESHOLD = 2 * RUNNING_THRESHOLD
TRIM_EVERY = 8 << 20            # move_to_huge_pages hands old tensors back in steps of this


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def return_free_memory() -> None:
    """Give the allocator's free pages back to the OS (a few ms; call it when idle)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextmanager
def _malloc_options(during: dict[int, int], after: dict[int, int]) -> Iterator[None]:
    """mallopt's `during` options meanwhile, its `after` ones at the end (no-ops without
    glibc)."""
    libc = _libc()
    for option, value in during.items() if libc is not None else ():
        libc.mallopt(option, value)
    try:
        yield
    finally:
        for option, value in after.items() if libc is not None else ():
            libc.mallopt(option, value)


def large_blocks_mapped_alone() -> AbstractContextManager[None]:
    """Meanwhile, blocks of 128 KiB or more get their own mappings (unmapped when freed);
    after, blocks up to 32 MiB come from the heaps again, as glibc's adaptive threshold has
    them once a process has freed a large block, and up to 64 MiB free at a heap's top stay
    there for the next step."""
    return _malloc_options({M_MMAP_THRESHOLD: LOADING_THRESHOLD},
                           {M_MMAP_THRESHOLD: RUNNING_THRESHOLD,
                            M_TRIM_THRESHOLD: RUNNING_TRIM_THRESHOLD})


@contextmanager
def temporaries_from_the_heaps() -> Iterator[None]:
    """Inside large_blocks_mapped_alone, blocks up to 32 MiB come from the heaps again
    meanwhile: for work that makes many short-lived temporaries, each of which would
    otherwise be a fresh mapping whose pages fault in on first touch (the int4 quantizer
    took 6x its time so, 13 s of a cold load of the default model). Their freed pages go
    back to the OS at the end."""
    with _malloc_options({M_MMAP_THRESHOLD: RUNNING_THRESHOLD},
                         {M_MMAP_THRESHOLD: LOADING_THRESHOLD}):
        yield
    return_free_memory()


def _advise_huge_pages(buffer: torch.Tensor) -> int:
    """Advise the whole huge pages inside `buffer` (CPU, not yet touched) as huge-page
    material; returns the offset of the first one (0 where there is none, or no madvise)."""
    libc = _libc()
    if buffer.device.type != "cpu" or libc is None or not hasattr(libc, "madvise"):
        return 0
    start = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (buffer.data_ptr() + buffer.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return 0
    libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                 ctypes.c_int(MADV_HUGEPAGE))   # advice only: a refusal changes nothing
    return start - buffer.data_ptr()


def move_to_huge_pages(owners: list[tuple[torch.nn.Module, str]]) -> int:
    """Each owner's buffer `name` copied, side by side with the others, into one buffer
    advised as huge-page material, and registered back as a view of it (each old tensor is
    freed as it goes, and handed back to the OS every TRIM_EVERY bytes: one carved from a
    heap stays resident until trimmed, and a move of 107 MB so raised a process's peak by
    89 MB; memory grows by about one of them). A tensor two owners share (a
    tied embedding reads its output projection's int8 weight) is copied once and stays
    shared; owners whose buffer is None are skipped. Weights read every decode step come
    from DRAM each time; in 4 KiB pages their reads miss the TLB every page: the batch-1
    decode stack 0.92x the time with its int4 weights so, a whole step 0.97-0.98x with the
    output projection's int8 ones too. Returns the bytes moved."""
    owners = [(m, name) for m, name in owners if getattr(m, name) is not None]
    if not owners or any(getattr(m, name).device.type != "cpu" for m, name in owners):
        return 0
    # no list of the tensors themselves: it would keep every old one alive until the end
    keys = [_storage_key(getattr(m, name)) for m, name in owners]
    sizes: dict[tuple[object, ...], int] = {}   # per distinct tensor, each 64-byte aligned
    for (module, name), key in zip(owners, keys):
        sizes.setdefault(key, -(-getattr(module, name).nbytes // 64) * 64)
    arena = torch.empty(sum(sizes.values()) + HUGE_PAGE, dtype=torch.uint8)
    offset = _advise_huge_pages(arena)
    views: dict[tuple[object, ...], torch.Tensor] = {}
    unreturned = 0
    files = _file_mappings()
    for (module, name), key in zip(owners, keys):
        if key not in views:
            old = getattr(module, name)
            view = arena[offset:offset + old.nbytes].view(old.dtype).view(old.shape)
            _copy(view, old)
            _drop_file_pages(old, files)
            del old
            views[key] = view
            offset += sizes[key]
            unreturned += sizes[key]
        module.register_buffer(name, views[key])
        if unreturned >= TRIM_EVERY:  # old tensors carved from a heap stay resident until
            return_free_memory()      # trimmed: the peak would grow by all of them
            unreturned = 0
    return_free_memory()
    return sum(sizes.values())


def _file_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of files (Linux /proc/self/maps; none
    elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _drop_file_pages(t: torch.Tensor, files: list[tuple[int, int]]) -> None:
    """Where `t` (just copied elsewhere) lies in a mapping of a file (the weight cache's
    tensors are), hand the whole pages under it back: a moved weight's old pages otherwise
    stay resident beside its copy for the process's life (90 MB on the default model). A
    page touched again is read back from the file; `files` is _file_mappings()."""
    libc = _libc()
    low, high = t.data_ptr(), t.data_ptr() + t.nbytes
    if libc is None or not any(start <= low and high <= end for start, end in files):
        return
    first, last = -(-low // PAGE) * PAGE, high // PAGE * PAGE
    if last > first:
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                     ctypes.c_int(MADV_DONTNEED))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for CPU tensors of one dtype and shape, contiguous ones in one thread's
    memmove: torch splits a large copy among its threads, and their faults on fresh pages
    contend, and stall at its barrier while another process holds a core (95 MB of weights:
    0.4-2.6 s in copy_, 0.04-0.45 s so, on 2 busy cores)."""
    if src.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous():
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.nbytes)
    else:
        dst.copy_(src)


def _storage_key(t: torch.Tensor) -> tuple[object, ...]:
    """The same for two names of one tensor (or of equal views of one memory, dtype and
    all: a view of the same bytes as another dtype is copied on its own)."""
    return (t.data_ptr(), t.nbytes, t.dtype, *t.shape)


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU), side by side in one buffer advised as huge-page material,
    each 64-byte aligned: small tensors read every step (a step's LoRA factors, 4 KiB pages
    each otherwise, a TLB miss apiece) then share a few TLB entries."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return list(tensors)
    sizes = [-(-t.nbytes // 64) * 64 for t in tensors]
    arena = torch.empty(sum(sizes) + HUGE_PAGE, dtype=torch.uint8)
    offset = _advise_huge_pages(arena)
    offset += -(arena.data_ptr() + offset) % 64
    copies = []
    for t, size in zip(tensors, sizes):
        view = arena[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        copies.append(view.copy_(t))
        offset += size
    return copies


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """Zeros that cost nothing until written: on the CPU, a view of a fresh anonymous mapping
    (starting on a huge-page boundary), whose pages the OS hands out zero-filled as they are
    first touched. A page nobody wrote reads as zero, never as memory the process used before
    (a NaN left there would survive attention's zero weights: NaN * 0 is NaN). torch.zeros of
    a 1 GiB KV cache spent 2-9 s of a start on 2 busy cores faulting in every page; so, a
    block's pages fault in when a request first writes it. Elsewhere than the CPU,
    torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    try:
        mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE,
                            flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0))
    except (OSError, ValueError, TypeError):  # no anonymous mappings here: zeros the usual way
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)   # holds the mapping while it lives
    offset = -raw.data_ptr() % HUGE_PAGE
    return raw[offset:offset + num_bytes].view(dtype).view(shape)


def advise_huge_pages(tensors: list[torch.Tensor]) -> None:
    """Advise the whole huge pages inside each CPU tensor as huge-page material: pages
    touched from now on come as 2 MiB ones; those touched before stay small until the
    kernel's khugepaged merges them. Decode attention over 16-token blocks scattered through
    the cache: 8.9 -> 7.7 ms for 21 requests of 400 tokens over 30 layers on huge pages."""
    for tensor in tensors:
        _advise_huge_pages(tensor)


def fault_in(tensors: list[torch.Tensor], planes: int) -> Iterator[None]:
    """Fault in the pages of `tensors` (contiguous CPU ones; others are left), keeping what
    they hold, one huge page at a time: each next() faults in one, so an idle engine can do
    it between looks at its inbox. Each tensor is `planes` equal parts that fill from their
    starts (a KV cache's [K/V x kv_heads] planes, which blocks fill in the order of their
    ids): the first huge page of every plane comes first, then the second, as blocks are
    handed out.

    Why: a lazily mapped KV cache otherwise faults in while serving, and on huge pages a
    step that first writes past a 2 MiB line in every plane (blocks 2048, 4096, ... of the
    default model's int8 cache) zeroes 180 of them, 360 MB: decode steps of 12 ms took
    110-165 ms so. MADV_POPULATE_WRITE faults pages in as writes would, without writing; where
    the kernel lacks it (before Linux 5.14), each 4 KiB page's first byte is rewritten with
    itself (no other thread may write the tensors meanwhile)."""
    libc = _libc()
    raws = [t.view(-1).view(torch.uint8) for t in tensors
            if t.device.type == "cpu" and t.is_contiguous()]
    plane_bytes = [raw.numel() // planes for raw in raws]
    for offset in range(0, max(plane_bytes, default=0), HUGE_PAGE):
        for raw, size in zip(raws, plane_bytes):
            if offset >= size:
                continue
            for plane in range(planes):
                start = plane * size + offset
                _populate(libc, raw[start:start + min(HUGE_PAGE, size - offset)])
                yield


def _populate(libc: ctypes.CDLL | None, raw: torch.Tensor) -> None:
    """Fault in the pages under `raw` (uint8, contiguous) for writing, keeping their bytes."""
    address = raw.data_ptr() // PAGE * PAGE
    length = raw.data_ptr() + raw.numel() - address
    if libc is not None and hasattr(libc, "madvise") and libc.madvise(
            ctypes.c_void_p(address), ctypes.c_size_t(length),
            ctypes.c_int(MADV_POPULATE_WRITE)) == 0:
        return
    first = -raw.data_ptr() % PAGE   # the first byte of each page that starts inside `raw`
    for touched in (raw[:1], raw[first::PAGE]):
        touched.copy_(touched.clone())


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """lazy_zeros advised as huge-page material at once."""
    out = lazy_zeros(shape, dtype, device)
    _advise_huge_pages(out)
    return out
