"""Engram n-gram memory (V41_SPEC §5): compressed tokenizer, hash layout, hashing and the gated update.

- Compressed tokenizer: tokens whose decoded text normalises alike (NFKC, NFD, strip accents,
  lowercase, whitespace runs -> one space, strip; a whitespace-only token stays one space) share an
  id; byte-fragment tokens (decode contains U+FFFD) are keyed by their raw token string.
- Multipliers: per Engram layer, `max_ngram_size` odd int64s from
  `numpy.random.default_rng(10007 * layer_id).integers(0, (int64_max // compressed_vocab) // 2) * 2 + 1`.
- Primes: per (layer, order 2..max, head) in that order, the next unused prime above
  `engram_vocab_size - 1` (never reused across the model); a layer's table has the sum of its primes
  as rows, each (order, head) column owning a range starting at the cumulative offset.
- Hash of order n at t: XOR over shifts 0..n-1 of compressed(t - shift) * multiplier[shift], mod the
  column's prime, plus its offset. A look-back that crosses the sequence start or an image position
  uses the pad token's compressed id from there on.
- Module: 24 looked-up rows -> `wkv` -> one key per residual stream + one value; a normalised
  stream/key dot product, signed-sqrt, sigmoid gate (0 at image positions); X_i += gate_i * value.
- Weights (model/formats.py): the table is stored in FP8 per 32 channels of a row, `wkv` is an FP8
  Linear, `q_weight` / `k_weight` are BF16.

Hash ids depend only on tokens, so `NgramHasher` runs once per batch (the model's forward context)
and every Engram layer reads its slice.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from flashtrain.model.config import ModelConfig
from flashtrain.model.formats import Embedding, Linear, Stored, as_trained

_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # deterministic for n < 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for any 64-bit integer."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(cfg: ModelConfig) -> list[list[list[int]]]:
    """primes[layer][order - 2][head], drawn in (layer, order, head) order, never reused."""
    seen: set[int] = set()
    out = []
    for _ in cfg.engram_layer_ids:
        per_order = []
        for _ in range(cfg.engram_max_ngram_size - 1):
            current, heads = cfg.engram_vocab_size - 1, []
            for _ in range(cfg.engram_n_heads):
                current += 1
                while not is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                heads.append(current)
            per_order.append(heads)
        out.append(per_order)
    return out


def engram_table_rows(cfg: ModelConfig) -> list[int]:
    """Rows of each Engram layer's table: the sum of that layer's primes."""
    return [sum(sum(order) for order in layer) for layer in engram_primes(cfg)]


def hash_multipliers(layer_ids: list[int], max_ngram_size: int, compressed_vocab: int) -> torch.Tensor:
    """[n_engram_layers, max_ngram_size] odd int64 multipliers."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = []
    for layer_id in layer_ids:
        rng = np.random.default_rng(10007 * layer_id)
        rows.append(rng.integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1)
    return torch.from_numpy(np.stack(rows))


def build_compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """token id -> compressed id for a Hugging Face `tokenizers.Tokenizer` (or a transformers tokenizer
    exposing `backend_tokenizer`). Returns (lookup, compressed vocabulary size)."""
    from tokenizers import Regex, normalizers

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    sentinel = "\ue000"  # keeps a single-space token alive through Strip()
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    keys: dict[str, int] = {}
    size = backend.get_vocab_size(with_added_tokens=True)
    lookup = [0] * size
    for tid in range(size):
        text = backend.decode([tid], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(tid)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[tid] = keys.setdefault(key, len(keys))
    return lookup, len(keys)


class NgramHasher(nn.Module):
    """tokens [B, S] (+ image_mask) -> hash ids [B, S, n_engram_layers, (max_ngram-1) * n_heads].

    `token_map` is the compressed-tokenizer lookup; None means the identity map, allowed only when
    `engram_compressed_vocab_size` is null or equals `vocab_size`.
    """

    def __init__(self, cfg: ModelConfig, token_map: list[int] | torch.Tensor | None = None):
        super().__init__()
        self.max_ngram = cfg.engram_max_ngram_size
        if token_map is None:
            self.compressed_vocab = cfg.vocab_size
            self.token_map = None
        else:
            token_map = torch.as_tensor(token_map, dtype=torch.int64, device="cpu")
            if token_map.numel() != cfg.vocab_size:
                raise ValueError(f"engram token map covers {token_map.numel()} ids but model.vocab_size="
                                 f"{cfg.vocab_size}; rebuild it from the model's tokenizer")
            self.compressed_vocab = int(token_map.max()) + 1
        want = cfg.engram_compressed_vocab_size
        self.map_error = None
        if want is not None and want != self.compressed_vocab:
            self.map_error = (
                f"model.engram_compressed_vocab_size={want} but the engram token map has "
                f"{self.compressed_vocab} ids ({'identity map' if token_map is None else 'given map'}); pass "
                f"token_map=build_compressed_token_map(tokenizer)[0] for this tokenizer, or set "
                f"model.engram_compressed_vocab_size=null to take the size from the map")
        primes = engram_primes(cfg)
        flat = [[p for order in layer for p in order] for layer in primes]
        offsets = [np.cumsum([0] + sizes[:-1]) for sizes in flat]
        # column c of a layer belongs to order 2 + c // n_heads; values kept on the CPU for reset_buffers
        self._buffer_values = {
            "primes": torch.tensor(flat, dtype=torch.int64, device="cpu"),
            "offsets": torch.tensor(np.array(offsets), dtype=torch.int64, device="cpu"),
            "multipliers": hash_multipliers(cfg.engram_layer_ids, self.max_ngram, self.compressed_vocab),
        }
        if token_map is not None:
            self._buffer_values["token_map"] = token_map
        for name, value in self._buffer_values.items():
            self.register_buffer(name, value.clone(), persistent=False)
        self.pad_id = cfg.engram_pad_id
        # the pad token's compressed id, fixed at construction (no host read of the map per batch)
        self.pad_value = int(cfg.engram_pad_id if token_map is None else token_map[cfg.engram_pad_id])
        self.n_heads = cfg.engram_n_heads

    def reset_buffers(self) -> None:
        """Token map, primes, offsets and multipliers again (after materialising a meta-device model)."""
        for name, value in self._buffer_values.items():
            getattr(self, name).copy_(value)

    def forward(self, tokens: torch.Tensor, image_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.map_error:
            raise ValueError(self.map_error)
        comp = tokens if self.token_map is None else self.token_map[tokens]
        pad = self.pad_value
        B, S = tokens.shape
        dead = torch.zeros_like(tokens, dtype=torch.bool) if image_mask is None else image_mask
        pos = torch.arange(S, device=tokens.device)
        blocked = torch.zeros_like(dead)
        shifted = []
        for shift in range(self.max_ngram):
            src = (pos - shift).clamp_min(0)
            blocked = blocked | (pos < shift) | dead[:, src]
            shifted.append(torch.where(blocked, pad, comp[:, src]))
        toks = torch.stack(shifted, dim=-1)  # [B, S, max_ngram]
        products = toks.unsqueeze(2) * self.multipliers  # [B, S, n_layers, max_ngram]
        rolling, cols = products[..., 0], []
        for order in range(2, self.max_ngram + 1):
            rolling = torch.bitwise_xor(rolling, products[..., order - 1])
            lo = (order - 2) * self.n_heads
            cols.append(rolling.unsqueeze(-1) % self.primes[:, lo:lo + self.n_heads])
        return torch.cat(cols, dim=-1) + self.offsets


class Engram(nn.Module):
    STORED = {"q_weight": Stored.BF16, "k_weight": Stored.BF16}

    def __init__(self, cfg: ModelConfig, layer_id: int, table_rows: int):
        super().__init__()
        self.layer_id = layer_id
        self.index = cfg.engram_layer_ids.index(layer_id)
        self.dim, self.hc = cfg.dim, cfg.n_streams
        self.eps = cfg.norm_eps
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.embed = Embedding(table_rows, cfg.engram_head_dim, cfg, Stored.FP8_ROWS)
        self.wkv = Linear(n_cols * cfg.engram_head_dim, cfg.dim * (self.hc + 1), cfg, Stored.FP8)
        self.q_weight = nn.Parameter(torch.ones(self.hc, cfg.dim))
        self.k_weight = nn.Parameter(torch.ones(self.hc, cfg.dim))
        self.qat = cfg.qat
        # rows_of(table, hash_ids, request) -> looked-up rows, and rows_of.request(hash_ids): set by
        # parallel/engram_shard.py when the table is row-sharded over ranks (this module then holds rows
        # [embed.row_offset, + embed.num_embeddings)); the request is made before the layer runs
        self.rows_of = None

    def request(self, hash_ids: torch.Tensor):
        """Start fetching this layer's rows for `hash_ids` (ids depend only on tokens, so the stage asks
        before its first block runs); None when the table is local."""
        return None if self.rows_of is None else self.rows_of.request(hash_ids)

    def forward(self, h: torch.Tensor, hash_ids: torch.Tensor, image_mask: torch.Tensor | None,
                request=None) -> torch.Tensor:
        """h [B, S, n, D]; hash_ids [B, S, n_cols] for this layer -> updated h."""
        if self.rows_of is None:
            rows = self.embed(hash_ids)
        else:
            rows = self.embed.rows(self.rows_of(self.embed.weight, hash_ids, request))
        kv = self.wkv(rows.flatten(-2))
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        x = h.float()
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        q, k = (as_trained(getattr(self, n), self.STORED[n], self.qat).float() for n in ("q_weight", "k_weight"))
        dot = (x * (q * k) * key).sum(-1) * rstd * self.dim ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if image_mask is not None:
            gate = gate.masked_fill(image_mask.unsqueeze(-1), 0.0)
        return (x + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)
