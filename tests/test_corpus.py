"""corpus.py: the corpus people have (text files and folders, JSON lines, Parquet, a datasets
folder, several mixed by weight) prepared once into memory-mapped token shards and read a
batch's rows at a time. Properties, not times: the tokens are the tokenizer's own with the
documents kept apart, a batch depends on (seed, step) alone whatever the data ranks, a rank
reads its rows and nothing more, held-out data is whole documents, a killed or damaged
preparation is finished or redone and never trained on, two preparations never run at once."""
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import corpus
from conftest import load

DOCS = [f"document {i}: " + " ".join(f"word{(i * 7 + k) % 97}" for k in range(5 + i % 40)) for i in range(400)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tokenizer folder (13's tiny model writer: a byte-level BPE trained on the text)."""
    folder = tmp_path_factory.mktemp("tok") / "model"
    load("13_train").write_tiny_model(folder, "\n".join(DOCS), 64)
    return str(folder)


def tokenizer(model):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(model)


def joined(model, docs, close=True):
    """The tokenizer's own tokens of ``docs``, each followed by its end-of-text token."""
    tok = tokenizer(model)
    out = []
    for k, d in enumerate(docs):
        out += tok(d, add_special_tokens=False)["input_ids"]
        if close or k < len(docs) - 1:
            out.append(tok.eos_token_id)
    return out


def stream(index, source=0) -> list:
    """A prepared source's tokens, its shards end to end."""
    meta = json.loads(Path(index).read_text())
    return [int(t) for u in meta["units"] if u["source"] == source
            for t in np.fromfile(Path(index).parent / f"{u['unit']}.bin", dtype=meta["dtype"])]


def write_dataset(ds: Path, docs) -> Path:
    """The layout datasets' save_to_disk writes for one Dataset (checked by hand with datasets
    3.6 and 5.2): its arrow file (a stream), dataset_info.json and state.json."""
    import pyarrow as pa
    table = pa.table({"id": list(range(len(docs))), "body": list(docs)})
    ds.mkdir(parents=True)
    with pa.OSFile(str(ds / "data-00000-of-00001.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=100)
    (ds / "dataset_info.json").write_text("{}")
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    return ds


def write_sources(root: Path) -> dict:
    """The same documents as each kind of input."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    root.mkdir(parents=True, exist_ok=True)
    (root / "one.txt").write_text(DOCS[0])
    folder = root / "texts"
    folder.mkdir()
    for i, d in enumerate(DOCS[:5]):
        (folder / f"{i:02d}.txt").write_text(d)
    (root / "docs.jsonl").write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS)))
    table = pa.table({"id": list(range(len(DOCS))), "body": DOCS})
    pq.write_table(table, root / "docs.parquet", row_group_size=150)
    ds = write_dataset(root / "dataset", DOCS)
    return {"text": root / "one.txt", "folder": folder, "jsonl": root / "docs.jsonl",
            "parquet": root / "docs.parquet", "dataset": ds}


def test_every_kind_of_input_is_the_tokenizers_own_tokens_with_documents_kept_apart(model, tmp_path):
    src = write_sources(tmp_path / "data")
    want = {"text": joined(model, DOCS[:1]), "folder": joined(model, DOCS[:5]), "jsonl": joined(model, DOCS),
            "parquet": joined(model, DOCS), "dataset": joined(model, DOCS)}
    for kind, path in src.items():
        sources = corpus.parse_sources([str(path)], text_field="body")
        corpus.check_sources(sources)
        index = corpus.prepare(sources, model, tmp_path / "cache", say=lambda line: None)
        assert stream(index) == want[kind], kind
        assert json.loads(Path(index).read_text())["dtype"] == "uint16"   # a vocabulary of 512


def test_a_datasets_folder_of_several_splits_trains_on_train_and_no_metadata_is_read_as_text(model, tmp_path):
    """What ``load_dataset(...).save_to_disk(path)`` writes, a DatasetDict (dataset_dict.json
    beside a folder a split), and datasets' own cache of a loaded dataset (dataset_info.json
    naming its splits beside NAME-SPLIT.arrow files; both layouts checked by hand with
    datasets 5.2) are their train split's rows, the source saying so ("split"); before, a
    DatasetDict's .json metadata were read as JSON lines and the folder refused ("line 1 has
    no text field"), and the cache's splits were all read, its test split trained on. Inside
    a folder of other files, the same: its rows, never its metadata. With no split named
    train, its only one; with several, a line naming them."""
    dd = tmp_path / "mixed" / "dd"
    write_dataset(dd / "train", DOCS[:6])
    write_dataset(dd / "test", DOCS[6:8])
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    mixed = dd.parent
    (mixed / "notes.txt").write_text(DOCS[9])
    (mixed / "meta.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[10:12]))
    cached = tmp_path / "cached"   # datasets' cache: every split's arrow file in one folder
    for split, docs in (("train", DOCS[12:15]), ("test", DOCS[15:16])):
        write_dataset(tmp_path / split, docs)
        (tmp_path / split / "data-00000-of-00001.arrow").rename(tmp_path / f"json-{split}.arrow")
    cached.mkdir()
    for split in ("train", "test"):
        (tmp_path / f"json-{split}.arrow").rename(cached / f"json-{split}.arrow")
    (cached / "dataset_info.json").write_text(json.dumps({"splits": {s: {"name": s} for s in ("train", "test")}}))
    for path, docs, split in ((dd, DOCS[:6], "train"), (cached, DOCS[12:15], "train"),
                              (mixed, [*DOCS[10:12], DOCS[9], *DOCS[:6]], None)):   # (walked: files, then folders)
        sources = corpus.parse_sources([str(path)], text_field="body")
        corpus.check_sources(sources)
        assert sources[0]["path"] == str(path.resolve()) and sources[0].get("split") == split
        assert not [f for _, f in sources[0]["files"] if f.endswith((".json", "json-test.arrow")) or "/dd/test/" in f]
        index = corpus.prepare(sources, model, tmp_path / "cache", say=lambda line: None)
        assert stream(index) == joined(model, docs), path
        assert Path(index).parent.name.startswith(f"{path.name}.train-" if split else "mixed-")
    for meta in ("dd/dataset_dict.json", "dd/train/state.json"):   # (a metadata file given instead of its folder)
        with pytest.raises(corpus.CorpusError, match="the metadata of a datasets folder, not text: give the folder"):
            corpus.parse_sources([str(mixed / meta)], "body")
    only = tmp_path / "only"
    write_dataset(only / "validation", DOCS[:3])
    (only / "dataset_dict.json").write_text(json.dumps({"splits": ["validation"]}))
    assert corpus.parse_sources([str(only)], "body")[0]["split"] == "validation"
    write_dataset(only / "test", DOCS[3:4])
    (only / "dataset_dict.json").write_text(json.dumps({"splits": ["validation", "test"]}))
    with pytest.raises(corpus.CorpusError, match=r"a datasets folder with the splits validation, test and none named "
                                                 r"train: give one split's folder \(--data .*only/validation\)"):
        corpus.parse_sources([str(only)], "body")


def test_a_folder_of_a_datasets_files_as_the_hub_keeps_them_trains_on_its_train_files(model, tmp_path):
    """A dataset downloaded from the Hub is a folder of files whose names say their split
    (data/train-00000-of-00002.parquet beside data/test-..., or train/ and validation/
    folders): where names say train and a held-out split, as datasets reads such a folder,
    the train files alone are read, the source saying how many others were left out;
    before, every file was, the test split and the README trained on. A folder whose
    names say no held-out split is read whole (a book called train_schedule.txt), but for
    a README.md beside records (the dataset card), never a document of them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("---\nlicense: mit\n---\n# a dataset card\n")
    for name, docs in (("train-00000-of-00002", DOCS[:5]), ("train-00001-of-00002", DOCS[5:9]),
                       ("test-00000-of-00001", DOCS[9:11])):
        pq.write_table(pa.table({"body": docs}), hub / "data" / f"{name}.parquet")
    folders = tmp_path / "folders"
    for split, docs in (("train", DOCS[20:24]), ("validation", DOCS[24:26])):
        (folders / split).mkdir(parents=True)
        (folders / split / "part.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    books = tmp_path / "books"
    books.mkdir()
    for name, doc in (("train_schedule.txt", DOCS[30]), ("war_and_peace.txt", DOCS[31])):
        (books / name).write_text(doc)
    plain = tmp_path / "plain"   # (no split in its names: every data file, its card aside)
    (plain / "data").mkdir(parents=True)
    (plain / "README.md").write_text("# a dataset card\n")
    pq.write_table(pa.table({"body": DOCS[40:43]}), plain / "data" / "00000.parquet")
    for path, docs, left in ((hub, DOCS[:9], 1), (folders, DOCS[20:24], 1), (books, DOCS[30:32], 0),
                             (plain, DOCS[40:43], 0)):
        sources = corpus.parse_sources([str(path)], "body")
        assert sources[0].get("split") == ("train" if left else None) and sources[0].get("left_out", 0) == left
        index = corpus.prepare(sources, model, tmp_path / "cache", say=lambda line: None)
        assert stream(index) == joined(model, docs), path.name
    assert [corpus._split_named(n, False) for n in ("contest.txt", "trainer.py", "c4-validation.00000-of-00008.json.gz",
                                                   "latest_train.txt")] == [None, None, "validation", "train"]


def test_compressed_text_and_json_lines_are_read_as_they_decompress(model, tmp_path, monkeypatch):
    """Corpora ship compressed (C4's .json.gz, the Pile's .jsonl.zst): text and JSON lines in
    .gz, .bz2, .xz or .zst are read through as they decompress, the tokens those of the same
    file uncompressed; a folder of them is read, an archive in it (.tar.gz) passed over, and
    one given by name refused in a line; .zst without the zstandard package, a line saying
    so. Before, a folder of .json.gz had "no file to read", and one given by name was "a
    binary file"; and with zstandard installed, JSON lines in .zst failed at their first
    line (its reader has no readline: io.UnsupportedOperation)."""
    import bz2
    import gzip
    import lzma
    import zstandard
    folder = tmp_path / "c4"
    folder.mkdir()
    lines = "".join(json.dumps({"body": d}) + "\n" for d in DOCS[:30]).encode()
    (folder / "c4-train.00000-of-00002.json.gz").write_bytes(gzip.compress(lines))
    (folder / "c4-train.00001-of-00002.jsonl.xz").write_bytes(lzma.compress(lines))
    (folder / "notes.txt.bz2").write_bytes(bz2.compress(DOCS[40].encode()))
    zst = zstandard.ZstdCompressor()   # (two frames, as a file written in parts is)
    (folder / "pile.jsonl.zst").write_bytes(zst.compress(lines[:1000]) + zst.compress(lines[1000:]))
    (folder / "story.txt.zst").write_bytes(zst.compress(DOCS[41].encode()))
    (folder / "old.tar.gz").write_bytes(gzip.compress(b"not a corpus"))
    sources = corpus.parse_sources([str(folder)], "body")
    assert [(k, Path(f).name) for k, f in sources[0]["files"]] == [
        ("jsonl", "c4-train.00000-of-00002.json.gz"), ("jsonl", "c4-train.00001-of-00002.jsonl.xz"),
        ("text", "notes.txt.bz2"), ("jsonl", "pile.jsonl.zst"), ("text", "story.txt.zst")]
    corpus.check_sources(sources)
    index = corpus.prepare(sources, model, tmp_path / "cache", say=lambda line: None)
    assert stream(index) == joined(model, [*DOCS[:30], *DOCS[:30], DOCS[40], *DOCS[:30], DOCS[41]])
    with pytest.raises(corpus.CorpusError, match="a compressed file of no kind read here .*not an archive of files"):
        corpus.parse_sources([str(folder / "old.tar.gz")], "body")
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"id": 1}\n'))
    (tmp_path / "broken.txt.gz").write_bytes(b"\x1f\x8b not gzip")
    for name, words in (("bad.jsonl.gz", "line 1 has no text field 'body'"), ("broken.txt.gz", "cannot be read as .gz")):
        with pytest.raises(corpus.CorpusError, match=words):
            corpus.check_sources(corpus.parse_sources([str(tmp_path / name)], "body"))
    monkeypatch.setitem(sys.modules, "zstandard", None)   # (as where it is not installed)
    (tmp_path / "pile.jsonl.zst").write_bytes(b"(zstd)")
    with pytest.raises(corpus.CorpusError, match=r"reading .zst needs the zstandard package \(pip install zstandard\)"):
        corpus.check_sources(corpus.parse_sources([str(tmp_path / "pile.jsonl.zst")], "body"))


def test_a_batch_depends_on_the_step_alone_and_each_data_rank_reads_only_its_rows(model, tmp_path):
    src = write_sources(tmp_path / "data")
    sources = corpus.parse_sources([f"{src['jsonl']}:0.7", f"{src['folder']}:0.3"], text_field="body")
    index = corpus.prepare(sources, model, tmp_path / "cache", say=lambda line: None)
    whole = corpus.Reader(index, 16, 8, seed=3)
    for step in (0, 5, 1000):
        x, y = whole.batch_of(step)
        assert x.shape == (8, 16) and bool((x[:, 1:] == y[:, :-1]).all())
        for dp in (2, 4):   # a run resumed on another number of data ranks: the same global batch
            parts = []
            for r in range(dp):
                reader = corpus.Reader(index, 16, 8, seed=3)
                parts.append(reader.batch_of(step, rows=range(r * 8 // dp, (r + 1) * 8 // dp)))
                assert reader.read == (8 // dp) * 17 * 2   # its rows' tokens (uint16), nothing else
            assert all(bool((a == b).all()) for a, b in zip(whole.batch_of(step), map(torch.cat, zip(*parts))))
    assert not bool((whole.batch_of(0)[0] == whole.batch_of(1)[0]).all())
    drawn = [s is whole.sources[0] for step in range(300) for s, _ in whole._draw([3, 0, step], held=False)]
    assert abs(sum(drawn) / len(drawn) - 0.7) < 0.03   # the mixture's weights


def test_held_out_data_is_whole_documents_and_the_evaluation_batches_are_the_same_every_time(model, tmp_path):
    src = write_sources(tmp_path / "data")
    index = corpus.prepare(corpus.parse_sources([str(src["jsonl"])], "body"), model, tmp_path / "c",
                           say=lambda line: None)
    reader = corpus.Reader(index, 16, 4, seed=0)
    s, tokens, eos = reader.sources[0], stream(index), tokenizer(model).eos_token_id
    assert tokens[s["train"] - 1] == eos and 0.04 < s["held"] / s["tokens"] < 0.06   # cut after a document's end
    tok = tokenizer(model)
    train_text, held_text = tok.decode(tokens[:s["train"]]), tok.decode(tokens[s["train"]:])
    held_docs = {d.split(":")[0] for d in held_text.split(tok.eos_token) if d.strip()}
    assert held_docs and not any(f"{d}:" in train_text for d in held_docs)   # no held document is trained on
    again = corpus.Reader(index, 16, 4, seed=0)
    for k in range(3):
        assert all(bool((a == b).all()) for a, b in zip(reader.held_out(k), again.held_out(k)))
        assert all(start >= s["train"] for _, start in reader._draw([0, 1, k], held=True))


def test_a_killed_preparation_continues_and_a_damaged_shard_is_prepared_again(model, tmp_path, monkeypatch):
    src = write_sources(tmp_path / "data")
    monkeypatch.setattr(corpus, "UNIT_BYTES", 4096)   # many units from a small file
    sources = corpus.parse_sources([str(src["jsonl"])], "body")
    done, real = [], corpus._tokenize_unit

    def dies_after_three(job):
        if len(done) == 3:
            raise KeyboardInterrupt   # the preparation killed mid-way
        done.append(job[1])
        return real(job)
    monkeypatch.setattr(corpus, "_tokenize_unit", dies_after_three)
    with pytest.raises(KeyboardInterrupt):
        corpus.prepare(sources, model, tmp_path / "cache", processes=1, say=lambda line: None)
    folder = corpus.corpus_folder(sources, model, tmp_path / "cache")
    assert not (folder / "index.json").exists() and len(list(folder.glob("*.bin"))) == 3
    n_units = len(corpus._units(sources))
    monkeypatch.setattr(corpus, "_tokenize_unit", lambda job: (done.append(job[1]), real(job))[1])
    done.clear()
    index = corpus.prepare(sources, model, tmp_path / "cache", processes=1, say=lambda line: None)
    assert len(done) == n_units - 3 and n_units > 5   # the rest only
    assert stream(index) == joined(model, DOCS)
    shards = sorted(folder.glob("*.bin"))
    with open(shards[1], "r+b") as f:   # truncated
        f.truncate(10)
    shards[2].write_bytes(b"\xff" * shards[2].stat().st_size)   # overwritten
    done.clear()
    index = corpus.prepare(sources, model, tmp_path / "cache", processes=1, say=lambda line: None)
    assert sorted(done) == sorted(p.stem for p in shards[1:3])   # found and prepared again, nothing else
    assert stream(index) == joined(model, DOCS)
    Path(index).unlink()   # stopped before its index, then resumed with the sources cut otherwise (as by
    monkeypatch.setattr(corpus, "UNIT_BYTES", 5000)   # another version): no shard of the old cuts is kept
    done.clear()
    index = corpus.prepare(sources, model, tmp_path / "cache", processes=1, say=lambda line: None)
    assert len(done) == len(corpus._units(sources)) and stream(index) == joined(model, DOCS)


def test_a_large_arrow_file_or_row_group_is_read_a_few_rows_at_a_time_never_whole(model, tmp_path, monkeypatch):
    """A datasets shard (500 MB by default) or a Parquet file of one row group was read whole
    into its worker, its tokens held too: 142 MB of arrow cost 1.2 GB of resident memory,
    the same in Parquet 1.6 GB (measured here). Now an arrow file is cut into units by its
    record batches (several workers share it), and a unit's rows are read ROWS_READ at a
    time and its tokens written as each call returns: the peak of a unit's Python and
    numpy allocations stays a small part of its text, and the tokens are the same."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import tracemalloc
    docs = [" ".join(DOCS[(i * 13 + k) % 400] for k in range(4)) for i in range(1500)]   # ~1 MB of text
    text = sum(len(d) for d in docs)
    pq.write_table(pa.table({"body": docs}), tmp_path / "one_group.parquet", row_group_size=10 ** 6)
    write_dataset(tmp_path / "ds", docs)   # (record batches of 100 rows)
    monkeypatch.setattr(corpus, "ROWS_READ", 16, raising=False)
    monkeypatch.setattr(corpus, "CALL_CHARS", 4 << 10)   # (a call's own transient: about 60 bytes a character)
    want = joined(model, docs)
    for path in (tmp_path / "one_group.parquet", tmp_path / "ds"):
        sources = corpus.parse_sources([str(path)], "body")
        monkeypatch.setattr(corpus, "UNIT_BYTES", 128 << 10)   # an arrow file: several units; a row group: one
        n = len(corpus._units(sources))
        assert n == 1 if path.suffix else n >= text // (128 << 10), (path.name, n)
        index = corpus.prepare(sources, model, tmp_path / "cache", processes=1, say=lambda line: None)
        assert stream(index) == want, path.name
        monkeypatch.setattr(corpus, "UNIT_BYTES", 1 << 30)   # one unit: its peak against all its text
        monkeypatch.setattr(corpus, "_digest", lambda path: "")   # (its sidecar's digest reads a fixed 2 MiB)
        tracemalloc.start()
        corpus._tokenize_unit((corpus._units(sources)[0], "u", str(tmp_path), np.uint16, "body"))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < text / 4, (path.name, peak, text)
        assert np.fromfile(tmp_path / "u.bin", dtype=np.uint16).tolist() == want, path.name


def test_a_corpus_of_one_line_is_cut_before_spaces_and_never_read_whole(model, tmp_path, monkeypatch):
    """A text with no line ends (text8 is 100 MB of one line) was one piece and one
    tokenizer call, read whole: 4 MB of it took its process to 1.1 GB, where 4 MB in lines
    took 356 MB (measured here), and the unit's cut read the line whole to find its end. Now
    a line longer than SCAN_BYTES is cut before a space, in units and in parts, plain or
    compressed, and a JSON line's text too: the tokens are the tokenizer's own of the whole
    text; a text with no space either (a script written without them) is cut between
    characters and decodes to itself. What a cut or a unit holds stays a small part of the
    text."""
    import gzip
    import tracemalloc
    words = " ".join(DOCS).replace("\n", " ")
    text = (words + " ") * 3   # ~150 KB, one line
    (tmp_path / "text8").write_text(text)
    (tmp_path / "text8.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "one.jsonl").write_text(json.dumps({"body": text}) + "\n" + json.dumps({"body": "after"}) + "\n")
    script = "字体" * 20_000   # (no space, no line end; three bytes a character)
    (tmp_path / "script.txt").write_text(script)
    for name, value in (("UNIT_BYTES", 16 << 10), ("SCAN_BYTES", 2 << 10), ("PART_CHARS", 2 << 10),
                        ("CALL_CHARS", 4 << 10)):
        monkeypatch.setattr(corpus, name, value, raising=False)
    tok = tokenizer(model)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    for name, want in (("text8", whole + [tok.eos_token_id]), ("text8.gz", whole + [tok.eos_token_id]),
                       ("one.jsonl", joined(model, [text, "after"]))):
        sources = corpus.parse_sources([str(tmp_path / name)], "body")
        index = corpus.prepare(sources, model, tmp_path / "cache", processes=1, say=lambda line: None)
        assert stream(index) == want, name
    sources = corpus.parse_sources([str(tmp_path / "text8")], "body")
    tracemalloc.start()
    units = corpus._units(sources)
    cutting = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    monkeypatch.setattr(corpus, "_digest", lambda path: "")   # (its sidecar's digest reads a fixed 2 MiB)
    corpus._tokenize_unit((units[0], "u", str(tmp_path), np.uint16, "body"))
    one_unit = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(units) >= len(text) // (16 << 10) and cutting < len(text) / 10, (len(units), cutting)
    assert one_unit < len(text) / 2, one_unit
    index = corpus.prepare(corpus.parse_sources([str(tmp_path / "script.txt")], "body"), model, tmp_path / "cache",
                           processes=1, say=lambda line: None)
    assert tok.decode(stream(index)) == script + tok.eos_token
    assert len(json.loads(Path(index).read_text())["units"]) > 2


def test_a_pool_of_processes_prepares_the_same_tokens_and_batches_as_one(model, tmp_path, monkeypatch):
    src = write_sources(tmp_path / "data")
    monkeypatch.setattr(corpus, "UNIT_BYTES", 8192)
    sources = corpus.parse_sources([str(src["jsonl"]), str(src["folder"])], "body")
    said = []
    pooled = corpus.prepare(sources, model, tmp_path / "pool", processes=2, say=said.append, every=0.0)
    alone = corpus.prepare(sources, model, tmp_path / "one", processes=1, say=lambda line: None)
    assert [stream(pooled, s) for s in (0, 1)] == [stream(alone, s) for s in (0, 1)]
    monkeypatch.setattr(corpus, "UNIT_BYTES", 1 << 20)   # the same corpus in one unit a source: the same batches
    whole = corpus.prepare(sources, model, tmp_path / "whole", processes=1, say=lambda line: None)
    assert len(json.loads(Path(whole).read_text())["units"]) == 2
    readers = [corpus.Reader(i, 16, 8, seed=1) for i in (pooled, whole)]
    for step in (0, 7):
        assert all(bool((a == b).all()) for a, b in zip(*(r.batch_of(step) for r in readers)))
    assert said[0].startswith("preparing ") and " MB/s, " in said[1] and said[-1].startswith("prepared ")


def test_two_preparations_of_one_corpus_never_run_at_once(model, tmp_path):
    import fcntl
    src = write_sources(tmp_path / "data")
    sources = corpus.parse_sources([str(src["text"])], "body")
    folder = corpus.corpus_folder(sources, model, tmp_path / "cache")
    folder.mkdir(parents=True)
    said, out = [], {}
    with open(folder / ".lock", "a+") as held:   # another preparation of it, under way
        fcntl.flock(held, fcntl.LOCK_EX)
        t = threading.Thread(target=lambda: out.update(index=corpus.prepare(sources, model, tmp_path / "cache",
                                                                            say=said.append)))
        t.start()
        for _ in range(200):
            if said:
                break
            time.sleep(0.01)
        assert said == [f"waiting for another preparation of {folder} to finish"] and not out
        fcntl.flock(held, fcntl.LOCK_UN)
    t.join(60)
    assert stream(out["index"]) == joined(model, DOCS[:1])


@pytest.mark.parametrize("case, words", [
    ("missing", "no such file or folder"),
    ("empty folder", "a folder with no file to read"),
    ("no field", "line 1 has no text field 'body' (it has ['id', 'text'])"),
    ("no column", "no column 'body' (it has ['id', 'text'])"),
    ("binary", "a binary file, not text (a NUL byte at offset 0"),
    ("not utf-8", "not UTF-8 text (byte 0xe9 at offset 3)"),
    ("weight", "the weight after ':' must be a number ('x')"),
    ("zero weight", "a weight must be a positive number"),
    ("too small", "fewer than one batch of 32 sequences of 17"),
])
def test_bad_input_is_refused_naming_the_file_and_what_to_do(model, tmp_path, case, words):
    import pyarrow as pa
    import pyarrow.parquet as pq
    f = tmp_path / "x.txt"
    spec = str(f)
    if case == "empty folder":
        (tmp_path / "e").mkdir()
        (tmp_path / "e" / "image.png").write_bytes(b"\x89PNG")
        spec = str(tmp_path / "e")
    elif case == "no field":
        f = tmp_path / "x.jsonl"
        f.write_text(json.dumps({"id": 1, "text": "a"}) + "\n")
        spec = str(f)
    elif case == "no column":
        f = tmp_path / "x.parquet"
        pq.write_table(pa.table({"id": [1], "text": ["a"]}), f)
        spec = str(f)
    elif case == "binary":
        f.write_bytes(b"\x00safetensors")
    elif case == "not utf-8":
        f.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    elif case in ("weight", "zero weight", "too small"):
        f.write_text(" ".join(DOCS[:15]) if case == "too small" else "text")
        spec = {"weight": f"{f}:x", "zero weight": f"{f}:0", "too small": str(f)}[case]
    with pytest.raises(corpus.CorpusError) as e:
        sources = corpus.parse_sources([spec], "body")
        corpus.check_sources(sources)
        corpus.Reader(corpus.prepare(sources, model, tmp_path / "cache", say=lambda line: None), 16, 32).check()
    assert words in str(e.value), str(e.value)
