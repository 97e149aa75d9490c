"""Engram (V41_SPEC §5): primes, multipliers, hashing by hand, the gate, the compressed tokenizer."""

import dataclasses

import numpy as np
import torch

from flashtrain.model.engram import (
    Engram,
    NgramHasher,
    build_compressed_token_map,
    engram_primes,
    engram_table_rows,
    hash_multipliers,
    is_prime,
)


def test_is_prime_against_sieve():
    N = 5000
    sieve = np.ones(N, dtype=bool)
    sieve[:2] = False
    for i in range(2, int(N ** 0.5) + 1):
        sieve[i * i::i] = False
    assert [is_prime(n) for n in range(N)] == sieve.tolist()
    assert is_prime(2 ** 61 - 1) and not is_prime((2 ** 31 - 1) * (2 ** 31 + 11))


def test_flash_layout_matches_published_table_rows(flash_cfg):
    primes = engram_primes(flash_cfg)
    flat = [p for layer in primes for order in layer for p in order]
    assert len(flat) == 48 and len(set(flat)) == 48
    assert flat[:3] == [16000057, 16000079, 16000081]
    assert flat[-3:] == [16000877, 16000879, 16000889]
    assert engram_table_rows(flash_cfg) == [384006168, 384016682]


def test_flash_multipliers_match_published_values():
    m = hash_multipliers([1, 14], 4, 99092)
    assert m.tolist() == [[76632096046245, 4839876093313, 35959672319349, 73987337458391],
                          [67716810739261, 51510806800915, 30921347202721, 82619226485591]]
    assert (m % 2 == 1).all()


def test_hashes_by_hand_with_lookback_blocked_at_start_and_image(tiny_cfg):
    cfg = dataclasses.replace(tiny_cfg, engram_layer_ids=[1, 14], engram_n_heads=2, engram_max_ngram_size=4,
                              engram_vocab_size=64, engram_compressed_vocab_size=None, engram_pad_id=2)
    # a compressed map that merges a few ids: id -> id // 2 (so the compressed vocabulary is 256)
    token_map = [i // 2 for i in range(cfg.vocab_size)]
    hasher = NgramHasher(cfg, token_map)
    tokens = torch.tensor([[10, 11, 40, 41, 7, 99, 100]])
    image = torch.tensor([[False, False, False, True, False, False, False]])
    got = hasher(tokens, image)
    assert got.shape == (1, 7, 2, 3 * 2)

    primes = engram_primes(cfg)
    comp = [token_map[t] for t in tokens[0].tolist()]
    pad = token_map[2]
    for li, layer_id in enumerate([1, 14]):
        rng = np.random.default_rng(10007 * layer_id)
        bound = (np.iinfo(np.int64).max // 256) // 2
        mult = [int(v) * 2 + 1 for v in rng.integers(0, bound, size=4)]
        flat = [p for order in primes[li] for p in order]
        offsets = [sum(flat[:c]) for c in range(len(flat))]
        for t in range(7):
            # look back from t; the first blocked slot (before the start, or an image position) and
            # everything beyond it read the pad token's compressed id
            window, blocked = [], False
            for shift in range(4):
                blocked = blocked or t - shift < 0 or bool(image[0, t - shift])
                window.append(pad if blocked else comp[t - shift])
            for order in (2, 3, 4):
                h = 0
                for shift in range(order):
                    h ^= window[shift] * mult[shift]
                for head in range(2):
                    col = (order - 2) * 2 + head
                    assert got[0, t, li, col].item() == h % flat[col] + offsets[col], (layer_id, t, order, head)
    # spot-check the blocking itself: position 4 (after the image at 3) hashes like a sequence start
    assert got[0, 4, 0, 0] != got[0, 2, 0, 0]


def test_gate_is_zero_at_image_positions_and_update_by_hand(tiny_cfg):
    torch.manual_seed(0)
    cfg = tiny_cfg
    eng = Engram(cfg, layer_id=1, table_rows=engram_table_rows(cfg)[0])
    with torch.no_grad():
        eng.embed.weight.normal_()
        eng.wkv.weight.normal_(0, 0.05)
        eng.q_weight.uniform_(-1.5, 1.5)  # per-stream, per-channel: ones (the init) would hide their use
        eng.k_weight.uniform_(-1.5, 1.5)
    h = torch.randn(1, 5, 4, cfg.dim)
    ids = torch.randint(0, eng.embed.weight.shape[0], (1, 5, eng.wkv.in_features // cfg.engram_head_dim))
    image = torch.tensor([[False, True, False, True, False]])
    out = eng(h, ids, image)
    torch.testing.assert_close(out[0, 1], h[0, 1])
    torch.testing.assert_close(out[0, 3], h[0, 3])
    # a text position, literally: key_i and value from wkv, dot, signed sqrt, sigmoid
    t, D = 2, cfg.dim
    kv = eng.wkv.weight @ eng.embed.weight[ids[0, t]].flatten()
    keys, value = kv[:4 * D].view(4, D), kv[4 * D:]
    for i in range(4):
        x, k = h[0, t, i], keys[i]
        qk = eng.q_weight[i] * eng.k_weight[i]
        dot = ((x * qk * k).sum() / torch.sqrt((x * x).mean() + cfg.norm_eps)
               / torch.sqrt((k * k).mean() + cfg.norm_eps) / D ** 0.5)
        g = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
        torch.testing.assert_close(out[0, t, i], x + g * value, atol=1e-5, rtol=1e-5)


def test_compressed_token_map_merges_normalised_text():
    from tokenizers import Tokenizer, models

    vocab = {"The": 0, "the": 1, "THE": 2, " the": 3, "é": 4, "e": 5, " ": 6, "\t\n": 7, "x": 8, "Ｘ": 9}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="x"))
    lookup, size = build_compressed_token_map(tok)
    assert lookup[0] == lookup[1] == lookup[2] == lookup[3]  # case and surrounding space
    assert lookup[4] == lookup[5]  # accents stripped
    assert lookup[6] == lookup[7]  # whitespace-only tokens stay one space, and are merged together
    assert lookup[8] == lookup[9]  # NFKC folds the full-width letter
    assert len({lookup[0], lookup[4], lookup[6], lookup[8]}) == 4
    assert size == 4


def test_identity_map_refused_when_config_names_another_size(flash_cfg):
    cfg = dataclasses.replace(flash_cfg, engram_vocab_size=64)  # keep the prime search small
    hasher = NgramHasher(cfg, None)
    try:
        hasher(torch.zeros(1, 4, dtype=torch.long))
    except ValueError as e:
        assert "engram_compressed_vocab_size=99092" in str(e) and "build_compressed_token_map" in str(e)
    else:
        raise AssertionError("identity map accepted for a 99,092-id compressed vocabulary")
