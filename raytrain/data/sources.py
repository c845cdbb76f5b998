"""Source files: what they are (a fingerprint for the store key), and how they are cut
into read units that depend only on the files themselves.

A unit is what one prepare task reads, tokenizes and packs on its own:
- JSON Lines (`.jsonl`, or `.json` whose first character is not `[`): a byte range sized
  from the file's size (`lines_unit_bytes`); a unit owns every line whose first byte lies in its range (Hadoop's split
  rule), so a range boundary never cuts a row and nothing depends on how many CPUs read.
  Lines split on `\\n` only: a U+2028 inside a JSON string is data, not a line break.
- A JSON array (`.json` starting with `[`): a byte range too, cut at the array's own commas
  (`array_units`: the first top-level comma after each unit's size, found by one streaming
  scan), so a big array file is read by many tasks, and each parses only its elements.
- Parquet: one row group.
Every source is read streaming through pyarrow's filesystem (local or s3://, gs://, ...),
never whole into memory.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import asdict, dataclass
from typing import Iterator

import pyarrow.fs as pafs

FILE_EXTENSIONS = ["jsonl", "json", "parquet"]
CHUNK = 1 << 20


@dataclass(frozen=True)
class Source:
    path: str  # inside the filesystem
    size: int
    mtime_ns: int  # local mtime or the object store's Last-Modified: a rewrite changes it


@dataclass(frozen=True)
class Unit:
    file: str
    kind: str  # "lines" | "array" | "parquet"
    start: int  # byte offset (lines, array) or row group (parquet)
    stop: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def list_sources(fs: pafs.FileSystem, root: str) -> list[Source]:
    """The data files of `root` (a file, a folder searched recursively, or a glob such as
    data/train-*.jsonl), in path order."""
    if any(c in root for c in "*?["):
        base = root[: min(root.index(c) for c in "*?[" if c in root)].rsplit("/", 1)[0]
        found = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
        infos = [i for i in found if fnmatch.fnmatchcase(i.path, root)]
        if not infos:
            raise FileNotFoundError(f"data.path: nothing matches {root}")
    else:
        info = fs.get_file_info(root)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"data.path: no such file or folder: {root}")
        infos = [info] if info.type == pafs.FileType.File else fs.get_file_info(pafs.FileSelector(root, recursive=True))
    files = [i for i in infos if i.type == pafs.FileType.File and i.path.rsplit(".", 1)[-1] in FILE_EXTENSIONS]
    return sorted((Source(i.path, i.size, int(i.mtime_ns or 0)) for i in files), key=lambda s: s.path)


def is_json_array(fs: pafs.FileSystem, path: str) -> bool:
    if not path.endswith(".json"):
        return False
    with fs.open_input_file(path) as f:
        head = f.read_at(min(4096, f.size()), 0)
    return head.lstrip()[:1] == b"["


def lines_unit_bytes(size: int, unit_bytes: int) -> int:
    """A JSON Lines file's unit size: about 64 units a file (so a small file still spreads
    over the cluster's CPUs), at least 1 MiB (a task's fixed cost) and at most `unit_bytes`.
    A function of the file's size alone: never of the cluster."""
    return max(min(unit_bytes, 1 << 20), min(unit_bytes, -(-size // 64)))


def plan_units(fs: pafs.FileSystem, sources: list[Source], unit_bytes: int) -> list[Unit]:
    units: list[Unit] = []
    for s in sources:
        if s.path.endswith(".parquet"):
            import pyarrow.parquet as pq

            with fs.open_input_file(s.path) as f:
                groups = pq.ParquetFile(f).num_row_groups
            units += [Unit(s.path, "parquet", g, g + 1) for g in range(groups)]
        elif is_json_array(fs, s.path):
            units += array_units(fs, s.path, lines_unit_bytes(s.size, unit_bytes))
        else:
            step = lines_unit_bytes(s.size, unit_bytes)
            units += [Unit(s.path, "lines", a, min(a + step, s.size)) for a in range(0, max(s.size, 1), step)]
    return units


# A JSON string (its closing quote captured: absent, it runs past the chunk) or a structural character.
_ARRAY_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(")?|([][{},])', re.S)


def array_units(fs: pafs.FileSystem, path: str, step: int) -> Iterator[Unit]:
    """A JSON array file's units, in order: byte ranges between the commas that separate its
    elements, each cut at the first such comma at least `step` bytes after the last cut (the
    file alone decides). The file is scanned in chunks, tracking only strings and nesting; its
    JSON is checked where each unit is parsed (`read_unit`)."""
    with fs.open_input_file(path) as f:
        size = f.size()
        start = depth = 0
        if size > step:
            pos, carry = 0, b""  # carry: an unfinished string from the chunk before
            while pos < size:
                read = min(max(CHUNK, len(carry)), size - pos)  # a string longer than a chunk: read as much again
                chunk = carry + f.read_at(read, pos)
                base, pos, carry = pos - len(carry), pos + read, b""
                for m in _ARRAY_TOKEN.finditer(chunk):
                    char = m.group(2)
                    if char is None:  # a string: skipped whole, unless it goes on in the next chunk
                        if m.group(1) is None and pos < size:
                            carry = chunk[m.start() :]
                            break
                    elif char in b"[{":
                        depth += 1
                    elif char in b"]}":
                        depth -= 1
                    elif depth == 1 and base + m.start() - start >= step:
                        yield Unit(path, "array", start, base + m.start())
                        start = base + m.start() + 1
        yield Unit(path, "array", start, size)


def read_unit(fs: pafs.FileSystem, unit: Unit) -> Iterator[bytes | object]:
    """The unit's rows in file order: the raw bytes of each JSON Lines line, decoded objects otherwise."""
    if unit.kind == "parquet":
        import pyarrow.parquet as pq

        with fs.open_input_file(unit.file) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1024, row_groups=[unit.start]):
                yield from batch.to_pylist()
    elif unit.kind == "array":
        with fs.open_input_file(unit.file) as f:
            size = f.size()
            raw = f.read_at(unit.stop - unit.start, unit.start)
        yield from _array_elements(unit, raw, size)
    else:
        with fs.open_input_file(unit.file) as f:
            for line in owned_lines(f, unit.start, unit.stop, f.size()):
                yield line.removesuffix(b"\r")  # decoded per row: a bad byte is that row's problem


def _array_elements(unit: Unit, raw: bytes, size: int) -> list:
    """The elements of one unit of a JSON array (the first unit holds its `[`, the last its `]`,
    the others are bracketed here); a problem is named with its byte offset in the file."""
    head, tail = ("" if unit.start == 0 else "["), ("" if unit.stop == size else "]")
    try:
        text = head + raw.decode("utf-8") + tail
        rows = json.loads(text)
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{unit.file}: not a valid JSON array (not UTF-8 text: {exc.reason} at byte {unit.start + exc.start})"
        ) from None
    except json.JSONDecodeError as exc:
        at = unit.start + len(exc.doc[len(head) : max(len(head), exc.pos)].encode())
        raise ValueError(f"{unit.file}: not a valid JSON array ({exc.msg} at byte {at})") from None
    if not rows and (head or tail):  # nothing between two cuts: `[,`, `,,` or a trailing `,]`, valid once bracketed
        at = unit.start + len(raw) - len(raw.lstrip()) if not tail else unit.stop
        raise ValueError(f"{unit.file}: not a valid JSON array (Expecting value at byte {at})")
    return rows


def owned_lines(f, start: int, stop: int, size: int) -> Iterator[bytes]:
    """Lines (without `\\n`) whose first byte lies in [start, stop), read in chunks."""
    pos = 0 if start == 0 else _line_start_at_or_after(f, start, size)
    buf, base = b"", pos  # buf holds the file's bytes [base, base + len(buf))
    while pos < stop and pos < size:
        i = pos - base
        nl = buf.find(b"\n", i)
        while nl < 0 and base + len(buf) < size:
            searched = len(buf) - i
            buf, base = buf[i:] + f.read_at(min(CHUNK, size - base - len(buf)), base + len(buf)), pos
            i = 0
            nl = buf.find(b"\n", searched)
        end = nl if nl >= 0 else len(buf)
        yield buf[i:end]
        pos = base + end + 1


def _line_start_at_or_after(f, start: int, size: int) -> int:
    """The first byte >= start that begins a line (the byte after a `\\n` at start-1 or later)."""
    pos = start - 1
    while pos < size:
        chunk = f.read_at(min(CHUNK, size - pos), pos)
        nl = chunk.find(b"\n")
        if nl >= 0:
            return pos + nl + 1
        pos += len(chunk)
    return size


def sample_rows(fs: pafs.FileSystem, path: str, n: int) -> list[tuple[int, bytes | object]]:
    """(row number, row) of a file's first n rows, numbered as the prepare step numbers them."""
    if path.endswith(".parquet"):
        units = iter([Unit(path, "parquet", 0, 1)])
    elif is_json_array(fs, path):
        units = array_units(fs, path, 1 << 20)  # lazily: the first unit's rows, the next unit's if need be
    else:
        with fs.open_input_file(path) as f:
            size = f.size()
            head = f.read_at(min(size, 1 << 20), 0)
        units = iter([Unit(path, "lines", 0, len(head) if len(head) < size else head.rfind(b"\n") + 1)])
    out = []
    for unit in units:
        for row in read_unit(fs, unit):
            if len(out) == n:
                return out
            out.append((len(out) + 1, row))
    return out
