"""The NF4 layout rules QLoRA's base follows (raytrain/qlora.py), without torch: what `raytrain
validate` and the memory estimate read (validate never imports torch). A block is 64 weights
with one absmax scale; a group is the scales one int8 factor quantizes: QLoRA's 256 where a row
holds 256 blocks, else what divides a row's blocks, so that no block or group crosses a row and
any split into whole rows quantizes on its own."""

from __future__ import annotations

import math

BLOCK = 64  # weights a block (one absmax scale each), as QLoRA
GROUP = 256  # scales a group (one int8 quantization factor each), as QLoRA, where a row holds that many blocks


def group_size(in_features: int) -> int:
    """Scales a group for a weight of rows `in_features` long: QLoRA's 256 where a row holds 256
    blocks or a multiple, else what divides a row's blocks, so that no group crosses a row."""
    return math.gcd(GROUP, in_features // BLOCK)


def shard_problems(shapes: dict[str, tuple[int, int]], workers: int) -> list[str]:
    """Why weights of these (out, in) shapes cannot be NF4 and sharded by rows over `workers`."""
    out = []
    for name, (rows, cols) in shapes.items():
        if cols % BLOCK:
            out.append(f"{name} ({rows}x{cols}): its rows are not whole blocks of {BLOCK} weights")
        elif rows % workers:
            out.append(f"{name} ({rows}x{cols}): {rows} rows do not split evenly over {workers} workers")
    return out


def quantized_bytes(rows: int, cols: int) -> float:
    """What a weight holds in NF4: 4-bit codes, an int8 scale a block, a 2-byte factor a group."""
    n = rows * cols
    return n / 2 + n / BLOCK + 2 * n / (BLOCK * group_size(cols))
