"""The host allocator of CPU workers: mimalloc, preloaded, unless the user chose otherwise.

A CPU worker's tensors are host memory. glibc's malloc keeps most of what a step frees: after a
32 MiB block is freed it raises its mmap threshold to 32 MiB, and every smaller tensor after it
comes from per-thread heaps it never gives back, so a worker's resident memory grows step after
step. A fixed threshold gives it back, for page faults on fresh memory every step (a full
fine-tune's step 1.56x as long).
mimalloc reuses what a step freed for the next step, across threads, without giving it back and
faulting it in again: on the SmolLM2-135M shape (benchmarks/RESULTS.md, "Host memory") a worker's
step peak is a third lower and flat from step 2 on, at glibc's speed or better.

`MIMALLOC_PURGE_DELAY=-1`: never hand freed pages back. mimalloc's default (10 ms) returns them
between a step's phases and costs 30% on a LoRA step; a worker's resident memory is then its
high-water mark, which is what a node must hold anyway.

GPU workers keep glibc and get none of these variables, the submitter's included (their steps
allocate little host memory, and nothing here was measured on one). On CPU workers the submitter's
own choice wins: any of the glibc variables below, an `LD_PRELOAD`, or
`RAYTRAIN_HOST_ALLOCATOR=glibc` leaves the workers on what they set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib import metadata

GLIBC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
CHOICE_ENV = "RAYTRAIN_HOST_ALLOCATOR"  # "glibc" keeps glibc's malloc on CPU workers too
CHOICES = ("mimalloc", "glibc")  # the first is the default
LIBRARY = "cmeel.prefix/lib/libmimalloc.so.3"  # where the cmeel-mimalloc wheel puts it in site-packages
SETTINGS = {"MIMALLOC_PURGE_DELAY": "-1"}


def mimalloc_path() -> str | None:
    """The preloadable libmimalloc of this Python environment (the cmeel-mimalloc dependency), or None."""
    try:
        path = metadata.distribution("cmeel-mimalloc").locate_file(LIBRARY)
    except metadata.PackageNotFoundError:
        return None
    return str(path) if os.path.isfile(path) else None


def problems(environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(field, value, fix) of an allocator choice that cannot be carried out, for validate."""
    choice = environ.get(CHOICE_ENV)
    if choice is not None and choice not in CHOICES:
        return [
            (
                CHOICE_ENV,
                repr(choice),
                "the CPU workers' host allocator is mimalloc (the default) or glibc: "
                f"set {CHOICE_ENV} to one of them, or unset it",
            )
        ]
    return []


def worker_env(use_gpu: bool, submitted: Mapping[str, str]) -> dict[str, str]:
    """The allocator variables of the train workers' runtime_env, given the submitter's environment.
    The workers of one cluster share the driver's image (k8s/Dockerfile, cluster/*.yaml), so the
    driver's path to the library is theirs; a worker on a node without it runs on glibc (ld.so says
    so in its log) and `raytrain.host_allocator` names both."""
    if use_gpu:  # nothing of the submitter's allocator choice either: it is for CPU workers (README)
        return {}
    chosen = {k: v for k, v in submitted.items() if k in (*GLIBC_ENV, "LD_PRELOAD") or k.startswith("MIMALLOC_")}
    if submitted.get(CHOICE_ENV) == "glibc" or set(chosen) & {*GLIBC_ENV, "LD_PRELOAD"}:
        return chosen
    path = mimalloc_path()
    return {**SETTINGS, **chosen, "LD_PRELOAD": path} if path else chosen


def in_use() -> str:
    """Which allocator this process runs, read from its own mappings (what was asked may not have taken)."""
    try:
        with open("/proc/self/maps") as f:
            return "mimalloc" if any("libmimalloc" in line for line in f) else "glibc"
    except OSError:
        return "unknown"
