"""The token store: prepared once on the cluster (real Ray Data), identical whatever the
parallelism, never used half-written, keyed by what changes its tokens; the global order
as a pure function; each rank reading exactly its rows; and the same per-step losses at
1, 2 and 3 workers, across a kill and a resume at another worker count."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from chaos import final_lineage
from conftest import make_job, metric_history

from raytrain.data import GlobalOrder, rank_slice
from raytrain.data.batches import GlobalBatches
from raytrain.data.order import Stream
from raytrain.data.prepare import ensure_store
from raytrain.data.sources import owned_lines
from raytrain.data.store import MANIFEST, TokenStore
from raytrain.errors import JobError
from raytrain.job.plan import RunPlan
from raytrain.rundir.checkpoints import DataPosition


# ---------------------------------------------------------------- pure: order, slices, line ownership
def test_a_blend_feeds_each_source_its_weight_within_one_row_whatever_the_prefix():
    stream = Stream([100, 40], [3, 1], seed=0, shuffle=True, window_rows=64)
    sources, epochs, rows = stream.at(np.arange(4000))
    counts = np.cumsum(sources == 1)
    assert np.abs(counts - np.arange(1, 4001) * 0.25).max() <= 1  # 3:1 at every prefix, give or take one row
    small = rows[sources == 1]  # the small source repeats, epoch after epoch, each epoch a permutation
    assert sorted(small[:40]) == list(range(40)) and epochs[sources == 1][40] == 1
    again = Stream([100, 40], [3, 1], seed=0, shuffle=True, window_rows=64)
    assert np.array_equal(again.at(np.arange(2000, 2100))[2], rows[2000:2100])  # a fresh reader seeks: the same rows


def test_each_epoch_is_a_different_permutation_that_depends_only_on_seed_and_epoch():
    order = GlobalOrder(rows=1000, seed=7, shuffle=True, window_rows=256)
    epochs, rows = order.rows_at(np.arange(0, 2000))
    assert (epochs[:1000] == 0).all() and (epochs[1000:] == 1).all()
    assert sorted(rows[:1000]) == list(range(1000)) and sorted(rows[1000:]) == list(range(1000))
    assert not np.array_equal(rows[:1000], rows[1000:])
    again = GlobalOrder(rows=1000, seed=7, shuffle=True, window_rows=256)
    seek = again.rows_at(np.arange(1500, 1600))[1]  # a fresh reader seeks without walking
    assert np.array_equal(seek, rows[1500:1600])
    assert not np.array_equal(GlobalOrder(1000, 8, True, 256).rows_at(np.arange(1000))[1], rows[:1000])
    assert np.array_equal(GlobalOrder(1000, 7, False, 256).rows_at(np.arange(1000))[1], np.arange(1000))


@pytest.mark.parametrize("global_batch", [8, 9, 512])
def test_rank_slices_tile_the_global_batch_at_any_worker_count(global_batch):
    for world in range(1, min(global_batch, 64) + 1):
        slices = [rank_slice(global_batch, world, r) for r in range(world)]
        assert slices[0][0] == 0 and slices[-1][1] == global_batch
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
        sizes = {stop - start for start, stop in slices}
        assert sizes <= {global_batch // world, -(-global_batch // world)}


def test_jsonl_units_own_every_line_once_wherever_the_boundaries_fall(tmp_path):
    # U+2028 inside a string is data; an empty line and a last line without \n are rows too.
    text = '{"text": "a\u2028b"}\n{"text": "c"}\n\n{"text": "dd\\n"}\r\n{"text": "last"}'.encode()
    path = tmp_path / "rows.jsonl"
    path.write_bytes(text)
    fs = pafs.LocalFileSystem()
    with fs.open_input_file(str(path)) as f:
        for unit in range(1, len(text) + 2):
            lines = [
                line
                for a in range(0, len(text), unit)
                for line in owned_lines(f, a, min(a + unit, len(text)), len(text))
            ]
            assert lines == text.split(b"\n"), unit


def test_a_malformed_json_array_is_named_with_its_byte_position(tmp_path):
    from raytrain.data.sources import list_sources, plan_units, read_unit

    (tmp_path / "rows.json").write_text('[{"instruction": "a", "output": "b"},\n {"instruction": "c" "output": "d"}]')
    fs = pafs.LocalFileSystem()
    [unit] = plan_units(fs, list_sources(fs, str(tmp_path)), 1 << 20)
    assert unit.kind == "array"  # a .json file starting with "[": one JSON array, not JSON Lines
    with pytest.raises(ValueError, match=r"rows.json: not a valid JSON array \(Expecting ',' delimiter at byte 59\)"):
        list(read_unit(fs, unit))


def test_a_json_array_is_cut_into_units_at_its_own_commas_that_depend_on_the_file_alone(tmp_path, monkeypatch):
    from raytrain.data import sources

    # Strings holding commas, brackets, escaped quotes and non-ASCII text, and nested values: only
    # the commas between the array's own elements may cut it.
    rows = [
        {
            "instruction": f'q{i}, "quoted" ]}},[{{ caf\u00e9 \\',
            "output": "a" * (i % 7),
            "history": [["x,]", "y"]] * (i % 3),
        }
        for i in range(60)
    ]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=1, ensure_ascii=False))
    fs, size = pafs.LocalFileSystem(), path.stat().st_size
    plans = []
    for chunk in (5, 64, 1 << 20):  # how the scan reads the file must not matter
        monkeypatch.setattr(sources, "CHUNK", chunk)
        units = list(sources.array_units(fs, str(path), 500))
        assert units[0].start == 0 and units[-1].stop == size and len(units) > 5
        assert all(
            a.stop + 1 == b.start and path.read_bytes()[a.stop : b.start] == b"," for a, b in zip(units, units[1:])
        )
        assert [r for u in units for r in sources.read_unit(fs, u)] == rows
        plans.append(units)
    assert plans[0] == plans[1] == plans[2]
    # Cut or whole, a broken array is named at the same byte: a trailing comma, then a missing one.
    for broken, why in (
        (b"[1, 2, 3,]", "Expecting value at byte 9"),
        (b'[{"a": 1} {"b": 2}]', "Expecting ',' delimiter at byte 10"),
    ):
        path.write_bytes(broken)
        for step in (1, 100):
            with pytest.raises(ValueError, match=f"rows.json: not a valid JSON array \\({why}\\)"):
                [r for u in sources.array_units(fs, str(path), step) for r in sources.read_unit(fs, u)]


def test_bad_rows_of_a_json_array_in_several_units_are_named_by_their_row_in_the_file(assets, tmp_path):
    rows = [
        {"instruction": f"what color is the fox {i}?", "input": "", "output": "the fox is red."} for i in range(200)
    ]
    for n in (7, 95, 190):  # 1-based row numbers
        rows[n - 1]["output"] = n
    path = tmp_path / "alpaca.json"
    path.write_text(json.dumps(rows, indent=1))
    spec = make_job(assets, tmp_path / "runs", data={"path": str(path), "format": "alpaca", "bad_rows": "skip"})
    store = ensure_store(spec, unit_bytes=2048)  # a few KiB: prepared in this process, no Ray
    assert store.shards > 5 and store.manifest["docs"] == 197
    assert store.manifest["bad_examples"] == [
        f"{path} row {n}: column 'output' (the response) must be a string, got int" for n in (7, 95, 190)
    ]


@pytest.mark.parametrize("vocab", [300, 100_000])  # 2-byte and 4-byte words
@pytest.mark.parametrize("shape", ["packed", "padded", "pairs"])
def test_the_compact_store_reads_back_exactly_the_padded_rows_packing_lays_out(tmp_path, vocab, shape):
    """2-4 bytes a token on disk, labels and positions from two flag bits and the index: what
    `read` returns is, plane for plane, what the padded three-plane layout held."""
    from raytrain.data.records import IGNORE, pack, pad_rows
    from raytrain.data.store import token_dtype
    from raytrain.data.store_writer import shard_rows, write_manifest, write_shard

    rng, seq_len, pad = np.random.default_rng(1), 16, 7
    docs = []
    for _ in range(40):
        n = int(rng.integers(1, seq_len + 1 if shape != "packed" else 40))
        ids = rng.integers(0, vocab, n).tolist()
        head = int(rng.integers(0, n))  # a prompt that is not trained
        docs.append((ids, [IGNORE] * head + ids[head:]))
    if shape == "pairs":
        docs = [(docs[i], docs[i + 1]) for i in range(0, 40, 2)]
        chosen, rejected = pad_rows([c for c, _ in docs], seq_len, pad), pad_rows([r for _, r in docs], seq_len, pad)
        want = np.stack([*chosen, *rejected], axis=1)
    else:
        want = np.stack((pack if shape == "packed" else pad_rows)(docs, seq_len, pad), axis=1)
    fs, rows = pafs.LocalFileSystem(), shard_rows(docs, seq_len, shape == "packed", shape == "pairs")
    key = "k" * 20
    store_dir = tmp_path / key
    store_dir.mkdir()
    dtype = token_dtype(vocab)
    entries, first = [], 0
    for index, part in enumerate((rows[:7], rows[7:])):  # two shards: a read spans both
        entries.append({**write_shard(fs, str(store_dir), f"part-{index:06d}", part, dtype), "first_row": first})
        first += len(part)
    write_manifest(
        fs,
        str(store_dir),
        {
            "key": key,
            "rows": first,
            "seq_len": seq_len,
            "pad_id": pad,
            "bad_rows": 0,
            "shards": entries,
            "sources": [],
            "sequences_per_row": 1 + (shape == "pairs"),
            "token_dtype": dtype.name,
        },
    )
    store = TokenStore.open(str(store_dir))
    order = rng.permutation(first)
    assert np.array_equal(store.read(order), want[order])
    tokens = sum(len(i) for d in (docs if shape != "pairs" else [s for p in docs for s in p]) for i, _ in [d])
    on_disk = sum(p.stat().st_size for p in store_dir.glob("part-*"))
    assert on_disk <= tokens * dtype.itemsize + first * (16 + 12 * (1 + (shape == "pairs")) + 8) + 8 * 2

    # A token changed on disk: refused by the reader, naming the file, before the row is used.
    shard = store_dir / "part-000001.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 1
    shard.write_bytes(bytes(data))
    fresh = TokenStore.open(str(store_dir))
    assert np.array_equal(fresh.read(np.arange(7)), want[:7])  # the other shard is fine
    with pytest.raises(
        JobError,
        match=r"refusing the token store .*: part-000001.bin was changed after it was prepared "
        r"\(row 0's tokens are not the signed ones\)",
    ):
        fresh.read(np.array([7]))
    index = store_dir / "part-000000.idx"
    index.write_bytes(index.read_bytes()[:-1])  # a truncated index
    with pytest.raises(JobError, match=r"part-000000.idx was changed after it was prepared"):
        TokenStore.open(str(store_dir)).read(np.array([0]))


# ---------------------------------------------------------------- the shard table: read by block, not at open
def _write_store(folder: Path, shards: int, empty: set[int] = frozenset(), rows_per_shard: int = 2):
    """A tiny store of `shards` shards (`empty`: of no rows) of short padded rows, written as a
    prepare writes it; (its uri, the shards' entries, each row's token ids)."""
    from raytrain.data.store import token_dtype
    from raytrain.data.store_writer import shard_rows, write_manifest, write_shard

    fs, dtype, key, rng = pafs.LocalFileSystem(), token_dtype(300), "t" * 20, np.random.default_rng(len(empty))
    store_dir = folder / key
    store_dir.mkdir(parents=True)
    entries, ids, first = [], [], 0
    for i in range(shards):
        docs = [(t, t) for t in (rng.integers(0, 300, 5).tolist() for _ in range(0 if i in empty else rows_per_shard))]
        part = shard_rows(docs, 8, False, False)
        entries.append({**write_shard(fs, str(store_dir), f"part-{i:06d}", part, dtype), "first_row": first})
        ids += [t for t, _ in docs]
        first += len(part)
    write_manifest(
        fs,
        str(store_dir),
        {
            "key": key,
            "rows": first,
            "seq_len": 8,
            "pad_id": 0,
            "bad_rows": 0,
            "shards": entries,
            "sources": [],
            "sequences_per_row": 1,
            "token_dtype": dtype.name,
        },
    )
    return str(store_dir), entries, np.array(ids)


def _process_reads() -> int:
    """Bytes this process has read through read(2) and the like: what the kernel counted, not the store."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_a_rank_reads_as_much_at_open_for_ten_times_the_shards_and_one_table_block_for_a_row(tmp_path, monkeypatch):
    from raytrain.data import store as store_module
    from raytrain.data import store_writer

    read, opened = {}, {}
    for shards in (8, 80):
        uri, _, _ = _write_store(tmp_path / f"of-{shards}", shards)
        before = _process_reads()
        opened[shards] = TokenStore.open(uri)
        read[shards] = _process_reads() - before
    assert read[80] <= 1.2 * read[8], read  # the manifest does not list the shards
    for shards, store in opened.items():
        assert store.shards == shards and store.read_counters.open_bytes == Path(store.path, MANIFEST).stat().st_size

    monkeypatch.setattr(store_writer, "TABLE_BLOCK", 16)  # 80 shards: 5 blocks of the table
    # Shards of no rows on both sides of two block boundaries: a row is in the last shard starting at or before it.
    uri, entries, ids = _write_store(tmp_path / "blocks", 80, empty={15, 16, 47, 48})
    store = TokenStore.open(uri)
    assert store.manifest["shard_table"]["block_shards"] == 16 and "shards" not in store.manifest
    record, directory = store_module.RECORD.itemsize, 5 * store_module.BLOCK_ENTRY.itemsize
    assert Path(uri, store_module.TABLE).stat().st_size == 80 * record + directory
    counters = store.read_counters
    row = entries[40]["first_row"] + 1  # in block 2
    assert np.array_equal(store.read(np.array([row]))[0, 0, :5], ids[row])
    assert counters.table_bytes == directory + 16 * record  # the directory once, then the row's block only
    store.read(np.array([entries[33]["first_row"]]))  # the same block: nothing more from the table
    assert counters.table_bytes == directory + 16 * record
    store.read(np.array([entries[79]["first_row"]]))  # the last block: one more block
    assert counters.table_bytes == directory + 32 * record
    assert counters.bytes >= counters.table_bytes  # the table is part of what the store read

    monkeypatch.setattr(store_module, "OPEN_FILES", 4)  # 80 shards read through 4 open files at most
    order = np.random.default_rng(0).permutation(store.rows)  # every row, across the empty shards and blocks
    assert np.array_equal(store.read(order)[:, 0, :5], ids[order])
    assert len(store._files) <= 4  # a long run over many shards does not keep a descriptor for each
    assert [store.shard(i) for i in range(80)] == entries  # what the manifest listed before


def test_a_changed_or_missing_shard_table_and_an_older_store_are_refused_with_the_file_named(tmp_path, monkeypatch):
    from raytrain.data import store as store_module
    from raytrain.data import store_writer

    monkeypatch.setattr(store_writer, "TABLE_BLOCK", 16)
    uri, entries, ids = _write_store(tmp_path, 40)  # 3 blocks: 16, 16 and 8 shards
    table = Path(uri, store_module.TABLE)
    signed, record = table.read_bytes(), store_module.RECORD.itemsize
    changed = bytearray(signed)
    changed[19 * record + 30] ^= 1  # shard 19's .idx sha256, in block 1
    table.write_bytes(bytes(changed))
    store = TokenStore.open(uri)  # open reads the manifest only
    row = entries[3]["first_row"]
    assert np.array_equal(store.read(np.array([row]))[0, 0, :5], ids[row])  # block 0 is fine
    refused = (
        r"refusing the token store .*: shards.tbl was changed after it was prepared \(block 1 \(shards 16 to 31\)'s "
        r"sha256 is not the signed one\)"
    )
    with pytest.raises(JobError, match=refused):
        store.read(np.array([entries[17]["first_row"]]))  # shard 17: in the changed block, not the changed record
    with pytest.raises(JobError, match=refused):
        TokenStore.open(uri).shard(19)

    changed = bytearray(signed)
    changed[-3] ^= 1  # the block directory
    table.write_bytes(bytes(changed))
    with pytest.raises(JobError, match=r"shards.tbl was changed after it was prepared \(its block directory's sha256"):
        TokenStore.open(uri).read(np.array([0]))
    table.unlink()
    with pytest.raises(JobError, match=r"refusing the token store .*: shards.tbl is missing"):
        TokenStore.open(uri).read(np.array([0]))
    table.write_bytes(signed)
    assert np.array_equal(TokenStore.open(uri).read(np.arange(4))[:, 0, :5], ids[:4])

    manifest = json.loads(Path(uri, MANIFEST).read_text())  # a store of format 4: its shards listed in the manifest
    Path(uri, MANIFEST).write_text(json.dumps({**manifest, "format_version": 4, "shards": entries}))
    with pytest.raises(
        JobError,
        match=r"written by an older raytrain \(store format 4, this one reads 5\)\. Delete the "
        r"folder .* to prepare it in the new format",
    ):
        TokenStore.open(uri)


# ---------------------------------------------------------------- the store on a real cluster
def _tokens_hash(store: TokenStore) -> str:
    digest = hashlib.sha256()
    for shard in _entries(store):
        with store.fs.open_input_file(f"{store.path}/{shard['file']}.bin") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _entries(store: TokenStore) -> list[dict]:
    return [store.shard(i) for i in range(store.shards)]


def test_store_is_the_same_whatever_the_parallelism_and_each_rank_reads_only_its_rows(
    ray_address, assets, tmp_path, monkeypatch
):
    from raytrain.data import prepare

    # 0.4 MB: one plain Ray task, unit after unit (prepare.py: the tokenizer never loads in the driver)
    one = ensure_store(make_job(assets, tmp_path / "a"), unit_bytes=16_384)
    assert one.shards > 4
    monkeypatch.setattr(prepare, "LOCAL_BYTES", 0)  # as a big dataset: a Ray Data task per unit, 4 at a time
    four = ensure_store(make_job(assets, tmp_path / "b"), unit_bytes=16_384, concurrency=4)
    assert one.key == four.key and one.manifest["shard_table"] == four.manifest["shard_table"]
    assert _entries(one) == _entries(four)
    assert _tokens_hash(one) == _tokens_hash(four)
    assert one.manifest["docs"] == 4000 and one.bad_rows == 0  # every source row is in it

    spec = make_job(assets, tmp_path / "a", training={"global_batch_size": 10, "micro_batch_size": 2})

    def reader(rank: int, world: int, position=DataPosition()) -> GlobalBatches:
        stream = Stream([one.rows], [1.0], seed=0, shuffle=True, window_rows=64)
        return GlobalBatches([TokenStore.open(one.uri)], stream, RunPlan.of(spec), rank, world, position, one.key)

    whole = reader(0, 1)
    ranks = [reader(r, 3) for r in range(3)]
    for _ in range(3):
        batch, parts = next(whole), [next(r) for r in ranks]
        assert [s for p in parts for s in p.sample_ids] == batch.sample_ids
        assert [len(p.micro_batches) for p in parts] == [2, 2, 2]  # 4, 3, 3 rows: the same forward count
    for r in ranks:
        r.close()
    # 3 steps and the prefetched 4th: exactly its slices (4, 3, 3 rows), nothing read to skip or discard
    assert [r.stores[0].read_counters.rows for r in ranks] == [16, 12, 12]
    resumed = reader(0, 1, whole.position)  # a resume seeks to its position
    assert next(resumed).sample_ids == next(whole).sample_ids


def test_a_half_written_store_is_rebuilt_a_tampered_one_refused_and_a_changed_source_gets_a_new_store(
    ray_address, assets, tmp_path
):
    data = tmp_path / "rows.jsonl"
    data.write_text((assets / "text.jsonl").read_text().splitlines(keepends=True)[0] * 50)
    spec = make_job(assets, tmp_path / "runs", data={"path": str(data)})
    store = ensure_store(spec)
    Path(store.path, MANIFEST).unlink()  # killed before its last write
    assert TokenStore.open(store.uri) is None
    rebuilt = ensure_store(spec)
    assert rebuilt.key == store.key and rebuilt.rows == store.rows
    shard = Path(store.path, store.shard(0)["file"] + ".bin")
    rows = shard.read_bytes()
    # A cut shard, or the same size with other tokens (poisoned data): nothing scans the store at
    # start (reuse is one manifest read); the rank that reads a changed row refuses it, naming the file.
    for changed in (rows[:-8], rows[:8] + bytes(8) + rows[16:]):
        shard.write_bytes(changed)
        reused = ensure_store(spec)
        with pytest.raises(
            JobError, match=f"refusing the token store .*{shard.name} was changed after it was prepared"
        ):
            reused.read(np.arange(reused.shard(0)["rows"]))
    shard.write_bytes(rows)
    signed = Path(store.path, MANIFEST).read_text()
    manifest = json.loads(signed)
    manifest["rows"] -= 1  # any edit of the manifest without the key
    Path(store.path, MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(JobError, match=f"refusing the token store {store.uri}/{MANIFEST}: its signature is wrong"):
        TokenStore.open(store.uri)
    data.write_text(data.read_text() + data.read_text().splitlines(keepends=True)[0])
    changed = ensure_store(spec)
    assert changed.key != store.key
    # Another store's valid manifest put over this one's (its shards alike, its rows other data):
    # refused for its key, which names the store it was signed for.
    Path(changed.path, MANIFEST).write_text(signed)
    with pytest.raises(
        JobError,
        match=f"refusing the token store {changed.uri}/{MANIFEST}: it is signed for key "
        f"'{store.key}', not '{changed.key}'",
    ):
        TokenStore.open(changed.uri)


# ---------------------------------------------------------------- training at 1, 2 and 3 workers
def user_datasets(folder: Path, assets: Path) -> list[dict]:
    """Four sources shaped like the demo files users bring (LLaMA-Factory's alpaca JSON array, a
    sharegpt jsonl, OpenAI messages under other key names, a parquet text file), as data.sources."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain.demo_assets import ANIMALS, COLORS, text_rows

    qa = [(f"what color is the {a}?", f"the {a} is {c}.") for a in ANIMALS for c in COLORS][:40]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "alpaca.json").write_text(
        json.dumps(
            [{"instruction": q, "input": "", "output": r, "system": "answer briefly."} for q, r in qa[:30]], indent=1
        )
    )
    (folder / "sharegpt.jsonl").write_text(
        "".join(
            json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": r}]}) + "\n"
            for q, r in qa[30:]
        )
    )
    (folder / "dialogs.jsonl").write_text(
        "".join(
            json.dumps({"dialog": [{"speaker": "user", "text": q}, {"speaker": "bot", "text": r}]}) + "\n"
            for q, r in qa[:10]
        )
    )
    pq.write_table(pa.table({"text": [r["text"] for r in text_rows(10, seed=5)]}), folder / "text.parquet")
    return [
        {"path": str(folder / "alpaca.json"), "format": "alpaca", "weight": 3},
        {"path": str(folder / "sharegpt.jsonl"), "format": "sharegpt", "weight": 1},
        {
            "path": str(folder / "dialogs.jsonl"),
            "format": "chat",
            "weight": 1,
            "columns": {"messages": "dialog"},
            "tags": {"role_tag": "speaker", "content_tag": "text", "assistant_tag": "bot"},
        },
        {"path": str(folder / "text.parquet"), "format": "text", "weight": 1},
    ]


@pytest.mark.slow
def test_a_blend_of_user_formats_trains_the_same_at_one_two_and_three_workers_across_a_kill_and_a_resize(
    ray_address, assets, tmp_path, inject_faults
):
    import torch
    from transformers import AutoModelForCausalLM

    from raytrain.data.order import HeldOut
    from raytrain.data.prepare import ensure_inputs
    from raytrain.driver import launcher
    from raytrain.errors import JobError
    from raytrain.objectives import targets_of, token_loss

    sources = user_datasets(tmp_path / "data", assets)

    def job(name, storage, workers, steps=10, samples=None, **over):
        return make_job(
            assets,
            storage,
            name=name,
            data={
                "path": None,
                "sources": sources,
                "pack": False,
                "seq_len": 48,
                "eval": {"fraction": 0.1, "every_n_steps": 5},
                "sample_log": str(samples) if samples else None,
            },
            training={"finetune": "full", "max_steps": steps},
            scaling={"num_workers": workers},
            checkpoint={"every_n_steps": 4},
            **over,
        )

    one = job("w1", tmp_path / "one", 1)
    one_run = launcher.run(one).run_id
    reference, reference_evals = metric_history(one, one_run), metric_history(one, one_run, "eval_loss")

    inject_faults([{"at": "step", "step": 6, "rank": 1, "action": "exit"}])
    three = job("resize", tmp_path / "runs", 3, failure={"max_failures": 0}, samples=tmp_path / "samples")
    with pytest.raises(Exception):
        launcher.run(three)  # rank 1 dies at step 6; the step-4 checkpoint committed
    two = job("resize", tmp_path / "runs", 2, samples=tmp_path / "samples")
    result = launcher.run(two)  # the same run directory, resumed on 2 workers
    losses = metric_history(two, result.run_id)
    assert sorted(losses) == list(range(1, 11))
    assert np.allclose([losses[s] for s in range(1, 11)], [reference[s] for s in range(1, 11)], rtol=1e-5, atol=0)

    lineage = final_lineage(tmp_path / "samples")
    assert [lineage[s]["world"] for s in range(1, 11)] == [3] * 4 + [2] * 6
    seen = [tuple(x) for s in sorted(lineage) for x in lineage[s]["samples"]]
    assert len(seen) == 80 and len(set(seen)) == 80  # a constant global batch, no row twice
    weights = np.array([3, 1, 1, 1]) / 6
    for i, share in enumerate(weights):  # every source its weight, within a row, after every global batch
        counts = np.cumsum([x[0] == i for x in seen])[7::8]
        assert np.abs(counts - share * np.arange(8, 81, 8)).max() <= 1, (i, counts)
    prepared = ensure_inputs(two)
    stores = [TokenStore.open(uri) for uri in prepared["train"]]
    for i, store in enumerate(stores):  # each source's first epoch: every training row once, no held-out row
        split = HeldOut(store.rows, 0.1)
        train, held = split.train_rows(np.arange(split.train)), split.held_rows(np.arange(split.held))
        first = sorted(x[2] for x in seen if x[0] == i and x[1] == 0)
        assert first == sorted(train.tolist())[: len(first)] and not set(first) & set(held.tolist())
        assert len(first) == min(len(train), sum(x[0] == i for x in seen))

    # eval_loss at exactly the configured steps, the same at 1 worker and after the resize, and equal
    # to the loss computed offline on the exported model over the held-out rows.
    evals = metric_history(two, result.run_id, "eval_loss")
    assert sorted(evals) == sorted(reference_evals) == [5, 10]
    assert np.allclose([evals[5], evals[10]], [reference_evals[5], reference_evals[10]], rtol=1e-5, atol=0)
    model = AutoModelForCausalLM.from_pretrained(str(Path(two.run_dir) / "final_model")).eval()
    model.config.use_cache = False
    total = tokens = 0.0
    with torch.no_grad():
        for store in stores:
            split = HeldOut(store.rows, 0.1)  # under data.eval.max_rows: every held-out row is evaluated
            held = store.read(split.held_rows(np.arange(split.held)))
            ids, labels, positions = (torch.from_numpy(a).long() for a in held.transpose(1, 0, 2))
            total += float(token_loss(model(input_ids=ids, position_ids=positions).logits, targets_of(labels)))
            tokens += int((labels[:, 1:] != -100).sum())
    assert evals[10] == pytest.approx(total / tokens, rel=1e-5)

    first_source = Path(sources[1]["path"])  # the data changes under the job: a resume is refused
    first_source.write_text(first_source.read_text() + first_source.read_text().splitlines(keepends=True)[0])
    with pytest.raises(JobError, match="the data changed under a running job"):
        launcher.run(job("resize", tmp_path / "runs", 2, steps=12))
