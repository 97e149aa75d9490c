"""Webdataset tar shards of tokenized documents (format: data/README.md).

A document is a list of segments: text (already tokenized, int32) or an image (encoded bytes + file
extension). In a shard, document `k` is the members `k.json` (segment layout), `k.tokens.npy` (all its
text tokens, concatenated) and `k.<i>.<ext>` (its i-th image) -- the webdataset convention of one key
per sample.

Writing goes through webdataset's `ShardWriter` (shards closed by document count and by size); reading
goes through webdataset's tar iteration (`tar_file_expander` + `group_by_keys`) over a local path or a
webdataset URL (`pipe:CMD`, `http(s)://...`, opened by `webdataset.gopen`). Readers never raise on bad
data: webdataset's error handlers feed `ReadStats` (a tar that cannot be read further: `corrupt_shards`,
by name; a sample that cannot be parsed: `bad_samples`), and the rest of a corrupt shard is skipped.
`scan_shard` checks a local shard's tar index (headers only) before training starts.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import webdataset as wds
from webdataset.gopen import gopen, gopen_schemes
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from flashtrain.config.errors import DataError

log = logging.getLogger(__name__)

# errors that mean "this tar (or the stream under it) cannot be read further"; anything else is a bug
_TAR_ERRORS = (tarfile.TarError, EOFError, OSError)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass
class Document:
    """segments: ("text", int32 array) or ("image", bytes, extension); `key`: its sample key in the shard
    (read back; the data trace names documents by it)."""

    segments: list = field(default_factory=list)
    key: str | None = None


@dataclass
class ReadStats:
    """What readers skipped (exposed to metrics): samples that could not be parsed, and the shards found
    truncated or unreadable, by name (each counted once however often it is read)."""

    bad_samples: int = 0
    corrupt: set = field(default_factory=set)

    @property
    def corrupt_shards(self) -> int:
        return len(self.corrupt)

    def as_dict(self) -> dict:
        return {"corrupt_shards": self.corrupt_shards, "bad_samples": self.bad_samples}


def url_scheme(shard: str) -> str | None:
    """The webdataset URL scheme of a shard name (`pipe`, `http`, ...), or None for a local path."""
    if shard.startswith("pipe:"):
        return "pipe"
    m = _SCHEME.match(shard)
    return m.group(1).lower() if m else None


def is_url(shard: str) -> bool:
    """A shard name webdataset opens (`pipe:CMD`, `scheme://...`) rather than a local path."""
    return url_scheme(shard) is not None


def url_schemes() -> list[str]:
    """URL schemes webdataset's opener knows (besides `pipe:`)."""
    return sorted({"file", *(k for k in gopen_schemes if not k.startswith("_") and k != "pipe")})


# ---------------------------------------------------------------------------------------------- writing

def _sample(key: str, doc: Document) -> tuple[dict, int, int]:
    """A document as a webdataset sample {"__key__", "<i>.<ext>", "json", "tokens.npy"} of bytes, with its
    text-token and image counts."""
    sample: dict = {"__key__": key}
    layout, tokens, n_img = [], [], 0
    for seg in doc.segments:
        if seg[0] == "text":
            layout.append({"text": int(len(seg[1]))})
            tokens.append(np.asarray(seg[1], dtype=np.int32))
        else:
            name = f"{n_img}.{seg[2]}"
            layout.append({"image": name})
            sample[name] = bytes(seg[1])
            n_img += 1
    buf = io.BytesIO()
    np.save(buf, np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32))
    sample["json"] = json.dumps({"segments": layout}).encode()
    sample["tokens.npy"] = buf.getvalue()
    return sample, sum(len(t) for t in tokens), n_img


def write_shards(docs: Iterable[Document], out_dir: str | Path, prefix: str, docs_per_shard: int,
                 max_bytes: float | None = None) -> list[dict]:
    """Write documents into `<out_dir>/<prefix>-<n>.tar` with webdataset's ShardWriter; a shard is closed
    after `docs_per_shard` documents or once its members hold `max_bytes` bytes (None: no size limit), so
    one document may take it past `max_bytes`. Keys are the running document index (`%09d`). Returns one
    manifest entry per shard; no documents, no shard."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if docs_per_shard <= 0 or (max_bytes is not None and max_bytes <= 0):
        raise DataError(f"shard limits must be positive (docs_per_shard={docs_per_shard}, max_bytes={max_bytes})")
    pattern = str(out_dir / f"{prefix}-").replace("%", "%%") + "%05d.tar"
    entries: list[dict] = []
    writer = None
    try:
        for i, doc in enumerate(docs):
            sample, n_tokens, n_img = _sample(f"{i:09d}", doc)
            if writer is None:  # opened lazily: the writer creates its first shard at once
                # mtime 0, mode and owner as tarfile's defaults: reproducible shards, as before
                writer = wds.ShardWriter(pattern, maxcount=docs_per_shard,
                                         maxsize=float("inf") if max_bytes is None else max_bytes, verbose=0,
                                         encoder=False, mtime=0, mode=0o644, user="", group="")
            writer.write(sample)
            name = Path(writer.fname).name
            if not entries or entries[-1]["path"] != name:
                entries.append({"path": name, "documents": 0, "text_tokens": 0, "images": 0})
            entries[-1]["documents"] += 1
            entries[-1]["text_tokens"] += n_tokens
            entries[-1]["images"] += n_img
    finally:
        if writer is not None:
            writer.close()
    return entries


# ---------------------------------------------------------------------------------------------- reading

def _parse(members: dict[str, bytes]) -> Document:
    layout = json.loads(members["json"])["segments"]
    tokens = np.load(io.BytesIO(members["tokens.npy"]), allow_pickle=False).astype(np.int64)
    doc, pos = Document(), 0
    for seg in layout:
        if "text" in seg:
            n = int(seg["text"])
            if pos + n > len(tokens):
                raise ValueError("layout asks for more text tokens than the sample holds")
            doc.segments.append(("text", tokens[pos:pos + n]))
            pos += n
        else:
            name = seg["image"]
            doc.segments.append(("image", members[name], name.rsplit(".", 1)[-1]))
    return doc


def _ends_cleanly(path: str) -> bool:
    """A complete tar ends with two zero 512-byte blocks (tarfile's stream reader does not notice
    truncation on its own)."""
    try:
        size = os.path.getsize(path)
        if size < 1024 or size % 512:
            return False
        with open(path, "rb") as f:
            f.seek(size - 1024)
            return not any(f.read(1024))
    except OSError:
        return False


class _TailReader:
    """A read-only stream that counts its bytes and keeps the last 1024: the end-of-archive check of
    `_ends_cleanly` for a stream (URL) that cannot be looked at up front."""

    def __init__(self, raw):
        self.raw, self.n, self.tail = raw, 0, b""

    def read(self, size: int = -1) -> bytes:
        b = self.raw.read() if size is None or size < 0 else self.raw.read(size)
        self.n += len(b)
        self.tail = b[-1024:] if len(b) >= 1024 else (self.tail + b)[-1024:]
        return b

    def drain_and_check(self) -> bool:
        while self.read(1 << 16):
            pass
        return self.n >= 1024 and self.n % 512 == 0 and not any(self.tail)

    def close(self) -> None:
        self.raw.close()

    def __str__(self) -> str:
        return str(self.raw)


def scan_shard(path: str) -> str | None:
    """The start-up check of one local shard from its tar headers alone (each header read, the member data
    skipped by a seek; nothing decoded): None when the index walks to a clean end, else what is wrong --
    unreadable, not a tar, a member that ends past the end of the file, no end-of-archive blocks. A
    compressed tar (gzip, bzip2, xz, zstd: its index cannot be walked without decompressing it) and a URL
    are not checked (None)."""
    if is_url(path):
        return None
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")):
            return None
        members = 0
        with tarfile.open(path, mode="r:") as tar:
            for info in tar:
                members += 1
                if info.offset_data + info.size > size:
                    return (f"truncated: member {info.name!r} ends at byte {info.offset_data + info.size}, past the "
                            f"end of the file ({size} bytes)")
    except (tarfile.TarError, OSError, EOFError) as e:
        return f"not readable as a tar ({type(e).__name__}: {e})"
    if not members:
        return "an empty tar"
    if not _ends_cleanly(path):
        return f"truncated: no end-of-archive blocks ({size} bytes)"
    return None


def _reason(exn: BaseException) -> str:
    """What went wrong, in words: an exception's own message, without what webdataset appends to it (the
    stream object and the URL in its arguments, or an " @ <stream>" suffix), e.g. "truncated header";
    a KeyError names the member missing from the sample."""
    words = [a for a in exn.args if isinstance(a, str)]
    if isinstance(exn, KeyError) and words:
        return f"no member {words[0]!r}"
    text = re.sub(r" @ <.*>$", "", words[0]) if words else ""
    return text or type(exn).__name__


def _key(fname: str):
    return base_plus_ext(fname)[0]


def read_shard(path: str, stats: ReadStats, skip: int = 0) -> Iterator[Document | None]:
    """Documents of a shard (local path or webdataset URL) in order, after skipping the first `skip`
    samples. A sample that cannot be parsed yields None (counted in stats.bad_samples) so positions stay
    countable; a truncated tar (checked up front for a local file, at the end of the stream for a URL) or
    one that fails to read is counted in stats.corrupt_shards, and only its complete samples are read."""
    url = is_url(path)

    def corrupt(message: str, *args) -> None:
        """Count the shard as corrupt; say so once per shard and reader (a second read, another epoch, or the
        tar error after the up-front check: a debug line)."""
        (log.debug if path in stats.corrupt else log.warning)(message, path, *args)
        stats.corrupt.add(path)

    if not url and not _ends_cleanly(path):
        corrupt("shard %s is truncated (no end-of-archive blocks); reading its complete samples only")

    # what the tar iteration is doing, for the handlers: the member being read (None between members),
    # the key of the last member delivered, the group index of `select`
    reading: str | None = None
    last_key = select_key = None
    group = -1
    failed = False
    drop_key = None  # the sample a tar error cut short (not emitted)
    bad_keys: set = set()  # samples webdataset's grouping rejected (duplicate member): bad samples
    stream = None

    def on_tar_error(exn: Exception) -> bool:
        """webdataset handler for the tar level (open, headers, member data): count, stop the shard."""
        nonlocal failed, drop_key
        if not isinstance(exn, _TAR_ERRORS):
            raise exn
        failed = True
        # an error reading a member of the sample being grouped (or between members) cuts that sample
        # short; an error on the first member of a new sample leaves the previous one complete
        drop_key = last_key if reading is None or _key(reading) == last_key else None
        corrupt("shard %s is corrupt or truncated (%s); skipping the rest of it", _reason(exn))
        return False

    def on_bad_member(exn: Exception) -> bool:
        """webdataset handler for grouping members into samples: the sample is bad, reading goes on."""
        bad_keys.add(last_key)
        log.warning("bad member in %s: %s", path, _reason(exn))
        return True

    def on_bad_sample(key, exn: Exception) -> None:
        stats.bad_samples += 1
        log.warning("skipping bad sample %s in %s: %s", key, path, _reason(exn))

    def select(fname: str) -> bool:
        """Members of the first `skip` samples are passed over unread; a member about to be read is noted."""
        nonlocal reading, select_key, group
        key = _key(fname)
        if key is None:  # grouping ignores it too
            return False
        if key != select_key:
            select_key, group = key, group + 1
        if group < skip:
            return False
        reading = fname
        return True

    def sources():
        nonlocal stream
        try:
            stream = _TailReader(gopen(path, "rb")) if url else open(path, "rb")
        except Exception as exn:  # noqa: BLE001 - handed to the handler, which re-raises what is not I/O
            on_tar_error(exn)
            return
        yield {"url": path, "stream": stream}

    def members(files):
        nonlocal reading, last_key
        for f in files:
            reading, last_key = None, _key(f["fname"])
            yield f

    files = tar_file_expander(sources(), handler=on_tar_error, select_files=select, eof_value=None)
    samples = group_by_keys(members(files), keys=base_plus_ext, lcase=False, handler=on_bad_member)
    try:
        for sample in samples:
            key = sample["__key__"]
            if failed and key == drop_key:
                continue
            if key in bad_keys:
                on_bad_sample(key, ValueError("duplicate member name"))
                yield None
                continue
            try:
                doc = _parse(sample)
                doc.key = key
            except Exception as e:  # noqa: BLE001 - any malformed sample is skipped and counted
                on_bad_sample(key, e)
                doc = None
            yield doc
        if url and stream is not None and not failed:
            try:  # a stream that stops short of the end-of-archive blocks (or whose command fails) is corrupt
                clean = stream.drain_and_check()
                stream.close()
            except _TAR_ERRORS as exn:
                on_tar_error(exn)
            else:
                if not clean:
                    corrupt("shard %s is truncated (no end-of-archive blocks); its complete samples were read")
    finally:
        if stream is not None:
            try:
                stream.close()
            except Exception as exn:  # noqa: BLE001 - a pipe stopped early may report its exit status
                log.debug("closing %s: %s", path, exn)
