"""Data: prepare once into a token store, then every rank reads only its rows.

spec     the `data` section of the job YAML (formats, columns, sources, eval)
records  one source row -> token ids and labels (the format rules), packing
sources  the source files, their fingerprints, and read units that depend on the files alone
prepare  the Ray Data job that tokenizes and packs every unit into a store (driver + cluster CPUs)
store    a prepared store's format, and random reads of whole rows (store_writer: its writing, manifest last)
order    the global order, a pure function of (seed, epoch, rows); each rank's slice
batches  this rank's micro-batches of each global batch, prefetched (training workers)

Importing this package loads neither torch nor Ray: `raytrain validate` uses it.
"""

from raytrain.data.order import GlobalOrder, rank_slice
from raytrain.data.records import (
    CHAT_ROLES,
    IGNORE,
    check_record,
    encode_chat,
    encode_row,
    encode_text,
    pack,
    pad_rows,
    parse_record,
    to_value,
)
from raytrain.data.sources import FILE_EXTENSIONS

__all__ = [
    "CHAT_ROLES",
    "check_record",
    "FILE_EXTENSIONS",
    "GlobalOrder",
    "IGNORE",
    "encode_chat",
    "encode_row",
    "encode_text",
    "pack",
    "pad_rows",
    "parse_record",
    "rank_slice",
    "to_value",
]
