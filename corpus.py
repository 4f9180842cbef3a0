"""The corpus people train on, at any size the disk holds: prepared once into token shards
(flat uint16/uint32 files, memory-mappable as nanoGPT's and Megatron's are), read a batch's
rows at a time.

    sources = parse_sources(["books/:0.7", "web.jsonl:0.3"])        # --data PATH[:WEIGHT] ...
    index = prepare(sources, "models/qwen", "runs/13_data", text_field="text")   # every core; resumable
    data = Reader(index, context=2048, batch=16, seed=0)
    x, y = data.batch_of(step)                  # step's global batch: depends on (seed, step) alone
    x, y = data.batch_of(step, rows=range(4, 8))   # a data rank's rows only: it reads nothing else
    x, y = data.held_out(k)                     # the k-th of the fixed evaluation batches

Inputs (each a file or a folder of them): text (.txt, .md, .rst, .py, ... any UTF-8 file: each
file a document), JSON lines (.jsonl, .json: each line's ``text_field`` a document), either
compressed whole (.gz, .bz2, .xz; .zst with the zstandard package: read as it
decompresses, one unit a file), Parquet
(.parquet: each row's ``text_field``), and a folder ``datasets``' save_to_disk wrote (its arrow
files: each row's ``text_field``; of a folder of several splits, a DatasetDict or datasets'
cache of a loaded dataset: its train split, or its only one); several mixed by weight.
Documents are kept apart by the tokenizer's end-of-text token after each.

Preparation (prepare): the sources are cut into work units of about UNIT_BYTES (a text or
JSON-lines file at line ends, a text's line longer than SCAN_BYTES before a space, a
Parquet file by row groups, an arrow file by record batches; small files together),
tokenized by a pool of processes (by default one per two cores, each its tokenizer's batch
encoding on its two; fewer than POOL_UNITS units, or one process, in this process, the
batch encoding's own threads on every core), each unit written as one memory-mappable
shard (uint16 where the vocabulary fits, else uint32) by atomic rename, with its size, a
digest and what it was made of in a sidecar; the index (index.json) last. A killed
preparation continues where it stopped (the units done are kept, where made of the same
pieces); two preparations of the same corpus never run at once (a lock file: the second
waits, then finds it done). Memory stays bounded whatever the corpus and its files: a
process holds one tokenizer call's text (CALL_CHARS; a long text in parts of PART_CHARS
cut at line ends, or spaces in a longer line; a unit's rows read ROWS_READ at a time, its
tokens written as each call returns), and one record whole (a JSON line, a row). The
folder is named by the tokenizer's files and the sources (paths, sizes, times) and the
text field.

Reading (Reader): each source's tokens are its shards end to end; its last HELD_FRACTION is
held out, cut at a document's end (whole documents; a source with no document ends inside
it is cut there). Step i's global batch: ``batch`` sequences of context + 1 tokens, each from
a source drawn by weight and a start drawn uniformly in its training tokens, by a generator
seeded with (seed, i): O(batch) per step whatever the corpus, the same after a resume and on
any number of data ranks (each reads only its rows). The evaluation batches are drawn alike
from the held-out tokens, seeded with (seed, k): the same every time.
"""
import contextlib
import fcntl
import hashlib
import io
import json
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np

UNIT_BYTES = 8 << 20       # a work unit's text: a process holds one (and its tokens)
POOL_UNITS = 4             # fewer units to prepare: in this process (measured: docs/13)
CALL_CHARS = 256 << 10     # text a tokenizer call takes (a call's memory grows with its longest text:
PART_CHARS = 32 << 10      # ~600 MB for one 1 MB string, measured), a long text in parts of PART_CHARS
SCAN_BYTES = 1 << 20       # read at a time looking for where a piece of a file may end (a line end, a space)
HELD_FRACTION = 0.05       # each source's tail, whole documents, held out for evaluation
VERSION = 2                # of the folder's layout: a new one prepares anew (2: an arrow file in units)
ROWS_READ = 256            # a Parquet row group's or an arrow batch's rows read at a time
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text", ".py", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".tex",
                 ".html", ".csv", ".tsv", ".xml", ".yaml", ".yml", ".toml", ".ini", ".cfg")
KINDS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSED = (".gz", ".bz2", ".xz", ".zst")   # a text or JSON-lines file in them (x.jsonl.gz, x.txt.zst)


def kind_of(f: Path, given=False) -> str | None:
    """A file's kind by its name (a compressed one by the name inside: x.jsonl.gz is JSON
    lines; x.tar.gz, or any other, none); a file given by name is text unless it says
    otherwise."""
    zipped = f.suffix.lower() in COMPRESSED
    suffix = Path(f.name[:-len(f.suffix)]).suffix.lower() if zipped else f.suffix.lower()
    kind = KINDS.get(suffix) or ("text" if suffix in TEXT_SUFFIXES else None)
    if zipped and kind not in ("text", "jsonl"):   # (x.tar.gz, x.parquet.gz: none; x.gz given by name: text)
        return "text" if given and not suffix else None
    return kind or ("text" if given else None)


def open_text(f, mode="rb"):
    """A text or JSON-lines file's bytes, decompressed where its name says so (.gz, .bz2, .xz
    with the standard library; .zst with the zstandard package)."""
    suffix = Path(f).suffix.lower()
    if suffix == ".gz":
        import gzip
        return gzip.open(f, mode)
    if suffix == ".bz2":
        import bz2
        return bz2.open(f, mode)
    if suffix == ".xz":
        import lzma
        return lzma.open(f, mode)
    if suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise CorpusError(f"--data {f}: reading .zst needs the zstandard package (pip install zstandard), or "
                              f"decompress it (zstd -d)") from None
        return io.BufferedReader(zstandard.open(f, mode))   # (zstandard's reader has no readline: JSON lines)
    return open(f, mode)


def compressed(f) -> bool:
    return Path(f).suffix.lower() in COMPRESSED


class CorpusError(ValueError):
    """Bad input: one line saying what is wrong and what to do."""


# ---- the sources ------------------------------------------------------------------------
def parse_sources(specs, text_field="text") -> list:
    """``--data PATH[:WEIGHT]`` values -> [{"path", "weight", "files": [(kind, path)], "field"}].
    A folder takes the files under it (sorted; hidden ones and token caches aside) of the
    kinds above, or the arrow files of a ``datasets`` folder (dataset_info.json or
    state.json beside them; of a folder of several splits, the train split's: _split_of,
    "split" naming it; of a folder of files whose names say train and a held-out split,
    the train files: _train_by_name, "left_out" counting the others). CorpusError: a missing
    path, a folder with nothing readable, a weight that is not a positive number, weights
    that sum to nothing."""
    out = []
    for spec in specs:
        path, weight = spec, 1.0
        head, sep, tail = spec.rpartition(":")
        if sep and head and not Path(spec).exists():
            try:
                path, weight = head, float(tail)
            except ValueError:
                raise CorpusError(f"--data {spec}: the weight after ':' must be a number ({tail!r})") from None
            if not (weight > 0 and weight < float("inf")):
                raise CorpusError(f"--data {spec}: a weight must be a positive number")
        p = Path(path)
        if not p.exists():
            raise CorpusError(f"--data {path}: no such file or folder")
        split, left = _split_of(p), 0
        files = _files_of(p)
        if not files:
            raise CorpusError(f"--data {path}: a folder with no file to read (text or .jsonl, either also "
                              f".gz, .bz2, .xz or .zst; .parquet; or a datasets folder's .arrow files)")
        if p.is_dir() and not split:   # (a dataset's files as the Hub keeps them: train-*, test/, ...)
            named = _train_by_name(p, files)
            if named:
                split, left, files = "train", len(files) - len(named), named
        out.append({"path": str(p.resolve()), "weight": weight, "files": files, "field": text_field,
                    **({"split": split} if split else {}), **({"left_out": left} if left else {})})
    if not out:
        raise CorpusError("--data: give a text file, a folder of them, JSON lines, Parquet or a datasets folder")
    return out


def label(spec: str, source: dict) -> str:
    """``--data spec`` as a line names it: with the split read where one was chosen, and the
    files left out."""
    if not source.get("split"):
        return spec
    left = f"; {source['left_out']} other file(s) left out" if source.get("left_out") else ""
    return f"{spec} (its {source['split']} split{left})"


DATASETS_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")   # a datasets folder's metadata


def _split_of(p: Path) -> str | None:
    """The split a datasets folder of several is read for: "train", or its only one; None
    for any other input. Two layouts hold several: a DatasetDict as ``load_dataset(...)
    .save_to_disk`` writes it (dataset_dict.json beside a folder a split) and datasets' own
    cache of a loaded dataset (dataset_info.json naming its splits, NAME-SPLIT.arrow files
    beside it). Any other choice is the user's: CorpusError naming the splits."""
    if (p / DATASETS_FILES[2]).is_file():
        meta, where = p / DATASETS_FILES[2], "folder"
    elif (p / DATASETS_FILES[0]).is_file() and not (p / DATASETS_FILES[1]).exists():
        meta, where = p / DATASETS_FILES[0], "arrow file"
    else:
        return None
    try:
        splits = list(json.loads(meta.read_text()).get("splits") or [])
    except (OSError, ValueError, AttributeError, TypeError) as e:
        raise CorpusError(f"--data {meta}: not a datasets file that lists its splits ({type(e).__name__}: {e})") \
            from None
    if len(splits) < 2 and meta.name == DATASETS_FILES[0]:
        return None   # (one split, or none named: every arrow file of the folder)
    if not splits:
        raise CorpusError(f"--data {p}: its {meta.name} lists no splits")
    pick = "train" if "train" in splits else splits[0] if len(splits) == 1 else None
    if pick is None:
        one = p / splits[0] if meta.name == DATASETS_FILES[2] else next(p.glob(f"*-{splits[0]}*.arrow"), p)
        raise CorpusError(f"--data {p}: a datasets folder with the splits {', '.join(splits) or 'none'} and none "
                          f"named train: give one split's {where} (--data {one})")
    return pick


SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
               "test": ("test", "testing", "eval", "evaluation")}   # (datasets' own, for a folder of files)
WORD_EDGES = "-._ 0123456789"


def _split_named(name: str, folder: bool) -> str | None:
    """The split a file's or folder's name names, as datasets reads a folder of files: its
    word at the start or between -._ , digits or spaces (a folder's also at its end or whole)."""
    name = name.lower()
    for split, words in SPLIT_WORDS.items():
        for w in words:
            at = name.find(w)
            while at >= 0:
                before = at == 0 or name[at - 1] in WORD_EDGES
                end = at + len(w)
                after = end < len(name) and name[end] in WORD_EDGES or folder and end == len(name)
                if before and after:
                    return split
                at = name.find(w, at + 1)
    return None


def _train_by_name(p: Path, files) -> list | None:
    """A folder's files as the Hub keeps a dataset's (data/train-00000-of-00002.parquet and
    data/test-...; or train/, validation/ folders): where names say train and another split
    (by folder names if any say one, else by file names, as datasets reads such a folder),
    the train files alone; None where they do not."""
    rel = [Path(f).relative_to(p.resolve()) for _, f in files]
    by_folder = [next((x for x in map(lambda d: _split_named(d, True), r.parts[:-1]) if x), None) for r in rel]
    splits = by_folder if any(by_folder) else [_split_named(r.name, False) for r in rel]
    if "train" not in splits or not {"validation", "test"} & set(splits):
        return None
    return [f for f, split in zip(files, splits) if split == "train"]


def _split_files(p: Path, split: str) -> list:
    """The arrow files of ``split`` in a datasets folder of several (_split_of)."""
    if (p / DATASETS_FILES[2]).is_file():
        if not (p / split).is_dir():
            raise CorpusError(f"--data {p}: its split {split!r} has no folder ({p / split})")
        return _files_of(p / split)
    mine = re.compile(rf"-{re.escape(split)}(-\d+-of-\d+)?\.arrow$")
    return [("arrow", str(f.resolve())) for f in sorted(p.glob("*.arrow")) if mine.search(f.name)]


def _files_of(p: Path) -> list:
    if p.is_file() and p.name in DATASETS_FILES and (p.name == DATASETS_FILES[2] or any(p.parent.glob("*.arrow"))):
        raise CorpusError(f"--data {p}: the metadata of a datasets folder, not text: give the folder ({p.parent})")
    if p.is_file():
        kind = kind_of(p, given=True)
        if kind is None:
            raise CorpusError(f"--data {p}: a compressed file of no kind read here (text or JSON lines compressed "
                              f"whole: x.txt.gz, x.jsonl.zst; not an archive of files): unpack it, and give the folder")
        return [(kind, str(p.resolve()))]
    split = _split_of(p)
    if split:   # (a DatasetDict, or datasets' cache of several splits: the one split's files)
        return _split_files(p, split)
    if any((p / n).exists() for n in DATASETS_FILES[:2]):   # datasets' save_to_disk of one Dataset
        return [("arrow", str(f.resolve())) for f in sorted(p.glob("*.arrow"))]
    found = []
    for root, dirs, names in os.walk(p):
        if Path(root) != p and any((Path(root) / n).exists() for n in DATASETS_FILES):
            found += _files_of(Path(root))   # a datasets folder inside: its rows, never its .json metadata
            dirs[:] = []
            continue
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            f = Path(root) / n
            kind = kind_of(f)
            if kind and not n.startswith(".") and ".tokens-" not in n:
                found.append((kind, str(f.resolve())))
    if any(kind != "text" for kind, _ in found):   # (records: a README.md beside them is their card, not text)
        found = [(kind, f) for kind, f in found if not (kind == "text" and Path(f).name.lower() == "readme.md")]
    return found


def text_problem(path: str) -> str | None:
    """Why a text or JSON-lines file cannot be read as UTF-8 text, or None: looked at, at its
    start and at 15 places spread over it (a gigabyte costs 16 MiB of reads; a compressed
    file at its start alone), for a NUL byte (a binary file) or bytes that are not UTF-8,
    with where and what."""
    size, chunk = os.path.getsize(path), 1 << 20
    if size == 0:
        return "the file is empty"
    try:
        with open_text(path) as f:
            for at in sorted({0, *(size * k // 16 for k in range(1, 16) if not compressed(path))}):
                if at:   # (a compressed file, read at its start alone, cannot seek)
                    f.seek(at)
                raw = f.read(chunk)
                why = _not_text(raw, at)
                if why:
                    return why
    except (OSError, EOFError, ValueError) as e:   # (a damaged or mislabeled compressed file)
        return f"cannot be read{' as ' + Path(path).suffix + ' data' if compressed(path) else ''} ({e})"
    return None


def _not_text(raw: bytes, at: int) -> str | None:
    """Why ``raw``, read at byte ``at``, is not UTF-8 text, or None."""
    if raw == b"" and at == 0:   # (a compressed file of nothing)
        return "the file is empty"
    if b"\0" in raw:
        return (f"a binary file, not text (a NUL byte at offset {at + raw.index(0):,}; it starts "
                f"{raw[:8]!r}): give a text file")
    if at:   # (a place inside a character: from the next one on)
        raw = raw[next((i for i, b in enumerate(raw[:4]) if b & 0xC0 != 0x80), 0):]
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(raw) - 3:   # (not a character the chunk's end cut)
            return (f"not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {at + e.start:,}): give a "
                    f"UTF-8 text file (iconv -t UTF-8 converts one)")
    return None


def check_sources(sources) -> None:
    """What can be checked without reading a corpus whole: every text and JSON-lines file
    UTF-8 (text_problem), a JSON-lines, Parquet or arrow file's first record has the text
    field. CorpusError naming the file."""
    for s in sources:
        for kind, f in s["files"]:
            if kind in ("text", "jsonl"):
                why = text_problem(f)
                if why and not (why == "the file is empty" and len(s["files"]) > 1):
                    raise CorpusError(f"--data {f}: {why}")
            if kind == "jsonl" and os.path.getsize(f):
                with open_text(f) as fh:
                    first = fh.readline()
                try:
                    record = json.loads(first)
                except json.JSONDecodeError as e:
                    raise CorpusError(f"--data {f}: line 1 is not JSON ({e.msg}): JSON lines hold one object a "
                                      f"line") from None
                if not isinstance(record, dict) or not isinstance(record.get(s["field"]), str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise CorpusError(f"--data {f}: line 1 has no text field {s['field']!r} (it has {keys}): give "
                                      f"--text-field")
            if kind in ("parquet", "arrow"):
                names = _columns(kind, f)
                if s["field"] not in names:
                    raise CorpusError(f"--data {f}: no column {s['field']!r} (it has {names}): give --text-field")


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
        return pyarrow
    except ImportError:
        raise CorpusError("reading Parquet or a datasets folder needs pyarrow: pip install pyarrow") from None


def _columns(kind, f) -> list:
    pa = _pyarrow()
    if kind == "parquet":
        return list(pa.parquet.ParquetFile(f).schema_arrow.names)
    with pa.memory_map(f) as m:
        return list(pa.ipc.open_stream(m).schema.names)


# ---- preparation --------------------------------------------------------------------------
def _units(sources) -> list:
    """The work units: (source, [pieces]), each piece (kind, file, where, closes): ``where``
    (start, stop) bytes of a text or JSON-lines file (cut at line ends; a text's line longer
    than SCAN_BYTES before a space: _piece_end; a compressed one whole: None), a Parquet row
    group's
    index, or (first, stop, bytes) of an arrow file's record batches, its text column's
    bytes; ``closes``: a text file's document ends with the piece (its file does). Small
    files share a unit up to UNIT_BYTES (a batch encoding of their documents together),
    large ones are cut into several (a Parquet row group larger than that stays whole: its
    rows are read ROWS_READ at a time)."""
    units = []
    for si, s in enumerate(sources):
        pieces = []
        for kind, f in s["files"]:
            if kind in ("text", "jsonl") and compressed(f):   # (no cut: read through, a line at a time)
                pieces.append((kind, f, None, True))
            elif kind in ("text", "jsonl"):
                size = os.path.getsize(f)
                cuts = [0]
                with open(f, "rb") as fh:
                    while cuts[-1] + UNIT_BYTES < size:
                        fh.seek(cuts[-1] + UNIT_BYTES)
                        cuts.append(min(_piece_end(fh, kind == "jsonl"), size))
                cuts = sorted(set(cuts + [size]))
                pieces += [(kind, f, (a, b), b == size) for a, b in zip(cuts, cuts[1:])]
            elif kind == "parquet":
                pieces += [(kind, f, g, True) for g in range(_pyarrow().parquet.ParquetFile(f).num_row_groups)]
            else:
                pieces += [(kind, f, where, True) for where in _arrow_pieces(f, s["field"])]
        unit, size = [], 0
        for piece in pieces:   # consecutive pieces of the source, up to UNIT_BYTES a unit
            if unit and size + _piece_bytes(piece) > UNIT_BYTES:
                units.append((si, unit))
                unit, size = [], 0
            unit.append(piece)
            size += _piece_bytes(piece)
        if unit:
            units.append((si, unit))
    return units


def _cut(text, at: int, window: int) -> int:
    """Where ``text`` (str, or UTF-8 bytes) may be cut at or after ``at``, so that its two
    sides tokenize as it does whole: after the first line end within ``window`` of ``at``;
    where there is none, before the first space or tab there (a word's tokens begin with the
    space before it, in byte-level BPE and SentencePiece alike); where there is neither (one
    endless word), at ``at`` itself, moved to a character's start (its tokens may then differ
    at the cut). A line or a word never makes a part longer than ``at`` + ``window``."""
    nl, blanks = ("\n", " \t") if isinstance(text, str) else (b"\n", (b" ", b"\t"))
    end = min(len(text), at + window)
    line = text.find(nl, at, end)
    if line >= 0:
        return line + 1
    blank = min((i for b in blanks if (i := text.find(b, at, end)) >= 0), default=-1)
    if blank >= 0:
        return blank
    if isinstance(text, bytes):   # (not inside a character: past its continuation bytes)
        while at < len(text) and text[at] & 0xC0 == 0x80:
            at += 1
    return min(at, len(text))


def _piece_end(fh, jsonl: bool) -> int:
    """Where a piece of a file may end, from ``fh``'s position on: a JSON line's end (the
    line read through SCAN_BYTES at a time, never whole); a text's place to cut (_cut) within
    SCAN_BYTES: a line longer than that (a corpus of one line, as text8 is) is cut before a
    space. The file's size where it ends first."""
    at = fh.tell()
    while raw := fh.read(SCAN_BYTES):
        if not jsonl:
            return at + _cut(raw, 0, len(raw))
        line = raw.find(b"\n")
        if line >= 0:
            return at + line + 1
        at += len(raw)
    return at


def _arrow_pieces(f, field) -> list:
    """An arrow file's (first, stop, bytes) runs of record batches, each up to UNIT_BYTES of
    its text column (a run of one batch where a batch is larger): the stream's batches
    walked through its memory map, no text copied."""
    pa, runs, first, size = _pyarrow(), [], 0, 0
    with pa.memory_map(f) as m:
        reader = pa.ipc.open_stream(m)
        col = reader.schema.get_field_index(field)
        k = -1
        for k, batch in enumerate(reader):
            n = batch.column(col).nbytes
            if k > first and size + n > UNIT_BYTES:
                runs.append((first, k, size))
                first, size = k, 0
            size += n
    return runs + [(first, k + 1, size)] if k >= 0 else [(0, 0, 0)]


def _piece_bytes(piece) -> int:
    kind, f, where, _ = piece
    if kind == "arrow":
        return where[2]
    if isinstance(where, tuple):
        return where[1] - where[0]
    if kind == "parquet":
        return os.path.getsize(f) // max(1, _pyarrow().parquet.ParquetFile(f).num_row_groups)
    return os.path.getsize(f)


def _unit_bytes(unit) -> int:
    return sum(_piece_bytes(p) for p in unit[1])


def _documents(piece, field):
    """The documents of a piece (a text file's part is one, closed only where the file
    ends), one at a time: a Parquet row group's or an arrow run's rows ROWS_READ at a time,
    never the piece's text whole."""
    kind, f, where, _ = piece
    if kind in ("text", "jsonl") and where is None:   # (compressed: read through, a line at a time)
        yield from _streamed(kind, f, field)
        return
    if kind in ("text", "jsonl"):
        with open(f, "rb") as fh:
            fh.seek(where[0])
            raw = fh.read(where[1] - where[0])
        if kind == "text":
            yield raw.decode("utf-8", errors="replace")
            return
        yield from _json_docs(raw.splitlines(), f, field, where[0])
        return
    pa = _pyarrow()
    if kind == "parquet":
        batches = pa.parquet.ParquetFile(f).iter_batches(ROWS_READ, row_groups=[where], columns=[field])
        for batch in batches:
            yield from (d for d in batch.column(0).to_pylist() if isinstance(d, str))
        return
    with pa.memory_map(f) as m:
        reader = pa.ipc.open_stream(m)
        col = reader.schema.get_field_index(field)
        for k, batch in enumerate(reader):
            if k >= where[1]:
                break
            for at in range(0, batch.num_rows, ROWS_READ) if k >= where[0] else ():
                yield from (d for d in batch.column(col).slice(at, ROWS_READ).to_pylist() if isinstance(d, str))


_tokenizer = None


def _start_worker(model, threads=None):
    """A process's tokenizer; ``threads``: the batch encoding's threads in a pool's process
    (the cores over the processes: more would only contend)."""
    global _tokenizer
    if threads:
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads > 1 else "false"
        os.environ["RAYON_NUM_THREADS"] = os.environ["RAYON_RS_NUM_CPUS"] = str(threads)
    import transformers
    _tokenizer = transformers.AutoTokenizer.from_pretrained(model)


def _eos(tok) -> int:
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if eos is None:
        raise CorpusError("the tokenizer has no end-of-text token (eos_token) to keep documents apart")
    return eos


def _json_docs(lines, f, field, at=None):
    """Each JSON line's text field (a line without one: CorpusError naming it; ``at``: the
    byte its piece starts at, where the file is read in pieces)."""
    for n, line in enumerate(lines):
        if line.strip():
            try:
                doc = json.loads(line)[field]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                where = f"line {n + 1}" if at is None else f"a line after byte {at:,} ({n + 1} into its piece)"
                raise CorpusError(f"--data {f}: {where} has no text field {field!r} ({type(e).__name__})") from None
            if isinstance(doc, str):
                yield doc


def _streamed(kind, f, field):
    """A compressed file's documents as it decompresses: JSON lines one a line; a text file,
    one document, in pieces of about UNIT_BYTES cut where _cut finds within SCAN_BYTES after
    (a line end; in a line longer than that, a space), never a line whole (_parts closes the
    document after the last piece)."""
    with open_text(f) as fh:
        if kind == "jsonl":
            yield from _json_docs(fh, f, field)
            return
        rest = b""
        while True:
            piece, tail = rest + fh.read(UNIT_BYTES), fh.read(SCAN_BYTES)
            cut = _cut(tail, 0, len(tail))
            if piece or tail:
                yield (piece + tail[:cut]).decode("utf-8", errors="replace")
            if not tail:
                return
            rest = tail[cut:]


def _parts(unit, field):
    """A unit's documents in parts (a long text cut at line ends: a call's memory is many
    times its longest text), each with whether the end-of-text token follows it: after
    each document, but after a text file's only where the file ends (its piece does; a
    compressed one read in pieces, after its last)."""
    for piece in unit[1]:
        docs, text = _documents(piece, field), piece[0] == "text"
        doc = next(docs, None)
        while doc is not None:
            after = next(docs, None)
            parts = _parts_of(doc, PART_CHARS)
            for k, part in enumerate(parts):
                yield part, k == len(parts) - 1 and (not text or after is None and piece[3])
            doc = after


def _tokenize_unit(job):
    """A worker's unit: its pieces' documents tokenized together (the batch encoding, calls of
    about CALL_CHARS of text), each closed by the end-of-text token (a text file's only where
    the file ends), the tokens written as each call returns (memory bounded by a call, not
    by the unit), the shard published by rename, then its sidecar (size and digest).
    Returns (unit's name, tokens, bytes of text read)."""
    unit, name, folder, dtype, field = job
    eos, tokens, batch, closes, size = _eos(_tokenizer), 0, [], [], 0
    path = Path(folder) / f"{name}.bin"
    tmp = path.with_suffix(f".bin.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        def call():
            ids = _tokenizer(batch, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            out = _join([np.asarray(x, dtype=dtype) for x in ids], eos, closes, dtype)
            f.write(out.tobytes())
            return int(out.size)
        for part, close in _parts(unit, field):
            batch.append(part)
            closes.append(close)
            size += len(part)
            if size >= CALL_CHARS:
                tokens += call()
                batch, closes, size = [], [], 0
        if batch:
            tokens += call()
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    nbytes = tokens * np.dtype(dtype).itemsize
    _atomic_json(path.with_suffix(".json"), {"tokens": tokens, "bytes": nbytes, "digest": _digest(path),
                                             "unit": _unit_key(unit)})
    return name, tokens, _unit_bytes(unit)


def _join(ids, eos, closes, dtype) -> np.ndarray:
    """Documents' tokens end to end, each followed by ``eos`` where ``closes`` says so."""
    end = np.asarray([eos], dtype=dtype)
    parts = [p for doc, close in zip(ids, closes) for p in ((doc, end) if close else (doc,))]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _parts_of(text: str, n: int) -> list:
    """``text`` in parts of ``n`` to 2 ``n`` characters, each cut where _cut finds (where its
    tokenization restarts: a line's end, else a space), or whole where it is shorter."""
    parts, at = [], 0
    while len(text) - at > n:
        cut = _cut(text, at + n, n)
        if cut >= len(text):
            break
        parts.append(text[at:cut])
        at = cut
    return parts + [text[at:]]


def _digest(path) -> str:
    """A shard's size and the sha256 of its first and last MiB: what a truncated or
    overwritten shard fails (cheap at any size)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(max(1 << 20, size - (1 << 20)))
            h.update(f.read())
    return h.hexdigest()[:16]


def _atomic_json(path, obj):
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _unit_ok(folder, name, unit=None) -> bool:
    """A unit prepared before, whole: its shard's size and digest as its sidecar says, and
    (``unit`` given) made of the same pieces: a preparation resumed with its sources cut
    otherwise (by another version) keeps none of the old cuts' shards."""
    shard, side = Path(folder) / f"{name}.bin", Path(folder) / f"{name}.json"
    try:
        meta = json.loads(side.read_text())
        return (os.path.getsize(shard) == meta["bytes"] and _digest(shard) == meta["digest"]
                and (unit is None or meta.get("unit") == _unit_key(unit)))
    except (OSError, ValueError, KeyError):
        return False


def _unit_key(unit) -> str:
    """What a unit's shard is made of: its source and pieces (files, and where in them)."""
    return hashlib.sha256(json.dumps(unit, default=str).encode()).hexdigest()[:16]


def corpus_folder(sources, model, cache) -> Path:
    """Where ``sources`` tokenized by ``model``'s tokenizer are kept: ``cache``/a name from the
    tokenizer's files, the sources (paths, weights aside; each file's size and time) and the
    text field."""
    h = hashlib.sha256(f"v{VERSION}".encode())
    for n in sorted(os.listdir(model)):
        if n.startswith(("tokenizer", "vocab", "merges", "special_tokens")):
            h.update(n.encode() + (Path(model) / n).read_bytes())
    for s in sources:
        h.update(s["field"].encode())
        for kind, f in s["files"]:
            st = os.stat(f)
            h.update(f"{kind}:{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    stem = Path(sources[0]["path"]).name + (f".{sources[0]['split']}" if sources[0].get("split") else "") + \
        (f"+{len(sources) - 1}" if len(sources) > 1 else "")
    return Path(cache) / f"{stem}-{h.hexdigest()[:12]}"


@contextlib.contextmanager
def _locked(folder, say):
    """The folder's lock, held while preparing: a second preparation of the same corpus waits
    here (saying so), then finds the index written."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another preparation of {folder} to finish")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(sources, model, cache, processes=None, say=print, every=2.0) -> str:
    """Tokenize ``sources`` (parse_sources') with ``model``'s tokenizer into token shards under ``cache`` once (every core; resumable; one preparation at a time), and
    return the index's path. A unit prepared before is kept when its shard checks out (size
    and digest), and prepared again when it does not. ``say``: where progress goes (MB of
    text done, MB/s, time left, every ``every`` seconds)."""
    folder = corpus_folder(sources, model, cache)
    index = folder / "index.json"
    if index.exists() and _index_ok(index):
        return str(index)
    with _locked(folder, say):
        if index.exists() and _index_ok(index):   # (prepared meanwhile by the one we waited for)
            return str(index)
        import transformers
        tok = transformers.AutoTokenizer.from_pretrained(model)
        eos, vocab = _eos(tok), len(tok)
        dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
        units = _units(sources)
        names = [f"{u[0]:03d}-{k:06d}" for k, u in enumerate(units)]
        todo = [(u, n, str(folder), dtype, sources[u[0]]["field"]) for u, n in zip(units, names)
                if not _unit_ok(folder, n, u)]
        total = sum(_unit_bytes(u) for u, *_ in todo)
        kept = len(units) - len(todo)
        head = (f"preparing {len(units)} units of text ({total / 1e6:,.1f} MB to tokenize"
                f"{f'; {kept} prepared before, kept' if kept else ''}) into {folder}")
        began, done, last, said = time.perf_counter(), 0, time.perf_counter(), False   # (a quick one says nothing)
        n = processes or max(1, (os.cpu_count() or 1) // 2)   # (a process per two cores: measured, docs/13)
        ctx = multiprocessing.get_context("forkserver" if sys.platform != "darwin" else "spawn")
        order = sorted(todo, key=lambda j: -_unit_bytes(j[0]))   # (the largest first: the pool ends together)
        with contextlib.ExitStack() as stack:
            if n > 1 and len(todo) >= POOL_UNITS:   # (an executor, not a Pool: a worker that dies ends it with
                n = min(n, len(todo))                # an error; a Pool would start another, and wait forever)
                pool = stack.enter_context(ProcessPoolExecutor(
                    n, mp_context=ctx, initializer=_start_worker, initargs=(model, max(1, (os.cpu_count() or 1) // n))))
                results = (f.result() for f in as_completed([pool.submit(_tokenize_unit, job) for job in order]))
            else:   # a few units, or one process: here, the batch encoding on every core (the tokenizer's
                _start_worker(model)   # threads; a pool's start costs more than it saves on a few units)
                results = map(_tokenize_unit, order)
            for _, _, read in results:
                done += read
                now = time.perf_counter()
                if now - last >= every or (said and done >= total):
                    if not said:
                        say(head)
                    rate = done / max(now - began, 1e-9)
                    say(f"  {done / 1e6:,.1f} / {total / 1e6:,.1f} MB, {rate / 1e6:,.2f} MB/s, "
                        f"{(total - done) / max(rate, 1e-9):,.0f} s left")
                    last, said = now, True
        per = [{"unit": n, "source": u[0], "tokens": json.loads((folder / f"{n}.json").read_text())["tokens"]}
               for u, n in zip(units, names)]
        _atomic_json(index, {"version": VERSION, "dtype": np.dtype(dtype).name, "eos": eos, "vocab": vocab,
                             "sources": [{k: s[k] for k in ("path", "weight", "field")} for s in sources],
                             "units": per})
        if said:
            say(f"prepared {sum(p['tokens'] for p in per):,} tokens in {time.perf_counter() - began:,.1f} s")
    return str(index)


def remove(index) -> None:
    """A prepared corpus's folder gone (one refused as too small), and its cache folder with
    it where nothing else is left there."""
    import shutil
    folder = Path(index).parent
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        folder.parent.rmdir()


def _index_ok(index) -> bool:
    try:
        meta = json.loads(Path(index).read_text())
        return meta.get("version") == VERSION and all(_unit_ok(Path(index).parent, u["unit"]) for u in meta["units"])
    except (OSError, ValueError, KeyError):
        return False


# ---- reading -------------------------------------------------------------------------------
class _Shards:
    """A source's shards, read with positioned reads (os.pread) of just the tokens asked for:
    no memory map, whose touched pages (and the kernel's read-ahead around each) would stay
    resident and grow with the corpus. A shard's file is opened when first read and kept
    open (at most FILES_KEPT at once, the least recently read closed first)."""

    FILES_KEPT = 256

    def __init__(self, paths, dtype):
        self.paths, self.dtype, self.open = paths, np.dtype(dtype), {}

    def __len__(self):
        return len(self.paths)

    def read(self, k: int, start: int, n: int) -> np.ndarray:
        """Up to ``n`` tokens of shard ``k`` from token ``start`` (fewer at its end)."""
        fd = self.open.pop(k, None)
        if fd is None:
            fd = os.open(self.paths[k], os.O_RDONLY)
            if len(self.open) >= self.FILES_KEPT:
                os.close(self.open.pop(next(iter(self.open))))
        self.open[k] = fd   # (the most recent last)
        size = self.dtype.itemsize
        return np.frombuffer(os.pread(fd, n * size, start * size), dtype=self.dtype)

    def __del__(self, close=os.close):   # (os itself may be gone at the interpreter's exit)
        for fd in self.open.values():
            close(fd)


class Reader:
    """The prepared corpus (``index``: prepare's) as step i's global batch of ``batch``
    sequences of ``context`` + 1 tokens (inputs and next tokens): each sequence from a source
    drawn by weight and a start drawn uniformly among its training tokens, by a generator
    seeded with (seed, i). Each source's last HELD_FRACTION, cut at a document's end, is
    held out: ``held_out(k)``, the k-th evaluation batch, drawn alike seeded with (seed, k).
    A batch reads its rows' tokens and nothing else, by positioned reads (``read`` counts
    the bytes). ``weights``: replace the index's (a mixture changed at resume)."""

    def __init__(self, index, context: int, batch: int, seed: int = 0, weights=None):
        self.meta = json.loads(Path(index).read_text())
        folder, self.context, self.batch, self.seed = Path(index).parent, context, batch, seed
        self.dtype, self.read = np.dtype(self.meta["dtype"]), 0
        eos = self.meta["eos"]
        self.sources = []
        for si, s in enumerate(self.meta["sources"]):
            units = [u for u in self.meta["units"] if u["source"] == si and u["tokens"]]
            shards = _Shards([folder / f"{u['unit']}.bin" for u in units], self.dtype)
            ends = np.cumsum([0] + [u["tokens"] for u in units])
            n = int(ends[-1])
            cut = self._held_cut(shards, ends, n, eos)
            self.sources.append({"shards": shards, "ends": ends, "tokens": n, "train": cut, "held": n - cut,
                                 "weight": (weights or [x["weight"] for x in self.meta["sources"]])[si]})
        w = np.array([s["weight"] for s in self.sources], dtype=np.float64)
        self.p = w / w.sum()

    @staticmethod
    def _held_cut(shards, ends, n, eos) -> int:
        """Where a source's held-out tail begins: just after the first document end at or
        after (1 - HELD_FRACTION) of its tokens (looked for in one shard at most), else there."""
        at = int(n * (1 - HELD_FRACTION))
        k = int(np.searchsorted(ends, at, side="right")) - 1
        if k < len(shards):
            tail = shards.read(k, at - int(ends[k]), int(ends[k + 1]) - at)
            hit = np.flatnonzero(tail == eos)
            if hit.size and at + int(hit[0]) + 1 < n:
                return at + int(hit[0]) + 1
        return at

    def check(self) -> None:
        """CorpusError where a source cannot give a sequence to train on and one to evaluate,
        or the corpus not one batch's tokens to train on."""
        need = self.context + 1
        for s, meta in zip(self.sources, self.meta["sources"]):
            if s["train"] < need or s["held"] < need:
                raise CorpusError(f"--data {meta['path']}: {s['tokens']:,} tokens, {s['train']:,} to train on and "
                                  f"{s['held']:,} held out; a sequence needs {need} of each: give a longer text, "
                                  f"or a smaller --context-length")
        train = sum(s["train"] for s in self.sources)
        if train < self.batch * need:
            raise CorpusError(f"--data: {train:,} tokens to train on, fewer than one batch of {self.batch} sequences "
                              f"of {need} ({self.batch * need:,}): give a longer text, or a smaller --batch-size or "
                              f"--context-length")

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.sources)

    def _tokens(self, s, start: int, n: int) -> np.ndarray:
        """n tokens of source ``s`` from ``start`` (across its shards' seams)."""
        out, ends = [], s["ends"]
        k = int(np.searchsorted(ends, start, side="right")) - 1
        while n > 0:
            piece = s["shards"].read(k, start - int(ends[k]), n)
            out.append(piece)
            self.read += piece.nbytes
            n -= len(piece)
            start += len(piece)
            k += 1
        return np.concatenate(out) if len(out) > 1 else out[0]

    def _draw(self, key, held: bool):
        """(source, start) for each of the batch's rows, from a generator seeded with ``key``."""
        rng = np.random.default_rng(key)
        which = rng.choice(len(self.sources), size=self.batch, p=self.p)
        u = rng.random(self.batch)
        out = []
        for si, x in zip(which, u):
            s = self.sources[si]
            lo, span = (s["train"], s["held"]) if held else (0, s["train"])
            out.append((s, lo + int(x * (span - self.context))))
        return out

    def _rows(self, draws, rows):
        import torch
        rows = range(self.batch) if rows is None else rows
        seq = np.stack([self._tokens(*draws[r], self.context + 1).astype(np.int64) for r in rows])
        t = torch.from_numpy(seq)
        return t[:, :-1], t[:, 1:]

    def batch_of(self, step: int, rows=None):
        """Step ``step``'s global batch (x, y), int64 [batch, context]; ``rows``: only those
        rows (a data rank's), the others not read."""
        return self._rows(self._draw([self.seed, 0, step], held=False), rows)

    def held_out(self, k: int, rows=None):
        """The k-th evaluation batch, from the held-out tokens (the same every time)."""
        return self._rows(self._draw([self.seed, 1, k], held=True), rows)
