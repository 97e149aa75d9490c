"""The Engram compressed-vocabulary map of a tokenizer, saved beside it (V41_SPEC §5).

`load_or_build_engram_map(tokenizer_path)` returns the token -> compressed id lookup, building it with
`model.engram.build_compressed_token_map` the first time and caching it as `engram_map.json` next to
`tokenizer.json` (keyed by the tokenizer file's hash, so a retrained tokenizer rebuilds it).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

from tokenizers import Tokenizer

from flashtrain.model.engram import build_compressed_token_map


def load_or_build_engram_map(tokenizer_path: str | Path) -> list[int]:
    path = Path(tokenizer_path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    cache = path.with_name("engram_map.json")
    if cache.is_file():
        saved = json.loads(cache.read_text())
        if saved.get("tokenizer_sha256") == digest:
            return saved["map"]
    lookup, size = build_compressed_token_map(Tokenizer.from_file(str(path)))
    # whole or not at all: another node's rank may read it meanwhile (a shared cache, parallel/nodes.py)
    tmp = cache.with_name(f".{cache.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"tokenizer_sha256": digest, "compressed_vocab_size": size, "map": lookup}))
    os.replace(tmp, cache)
    return lookup
