/* A KV-event batch in vLLM's own layout read in one pass, for the EPP's ingestion (kvfleet/cache/events.py,
 * scan_batch; kvfleet/epp/ingest.py applies the result).
 *
 * The batch is what vLLM's ZmqEventPublisher sends (msgspec's msgpack): an array [ts, events] or
 * [ts, events, data_parallel_rank], each event a map tagged "type" (BlockStored, BlockRemoved,
 * AllBlocksCleared), fields in any order, unknown fields skipped. The scan reads only a batch it can read
 * completely and whose every event is valid with every field present (what msgspec's typed decoder of
 * events.py accepts); anything else (another engine's layout, a missing or invalid field, a truncated or
 * oversized payload, an ext type, invalid UTF-8, a duplicate field, nesting deeper than 32) declines with -1
 * and the caller reads the batch with events.py's decoder, which keeps the valid events and reports the rest.
 * So this code never has to judge a bad event: it only recognises good batches.
 *
 * Output: consecutive events of one kind and one medium merged into one operation (what the applier applies
 * as one index operation), KV_OP_WORDS uint64 words each: kind, medium offset in `buf` + 1 (0: nil), medium
 * length, first key in `keys`, key count, event count, and whether every BlockStored of it could be keyed
 * by its own hashes (block_size equal to `block_size`, token_ids covering its blocks, parent and hashes ints,
 * or with `chain_bytes` also 32-byte bytes). Keys are the hashes'
 * 64-bit form (kvfleet/cache/hashing.py's to_int64: ints modulo 2^64, bytes by their last 8, big-endian).
 *
 * Plain C with no Python API, loaded with ctypes. */
#include <stdint.h>
#include <string.h>

#define KV_OP_WORDS 7
#define KV_MAX_DEPTH 32

enum { KV_STORED = 0, KV_REMOVED = 1, KV_CLEARED = 2 };

typedef struct {
    const uint8_t *p, *end;
} kv_rd;

static int kv_need(kv_rd *r, uint64_t n) { return (uint64_t)(r->end - r->p) >= n; }

static uint64_t kv_be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

/* An integer: 1 with its value as uint64 (negatives in two's complement) and *neg set, 0 when the next value
 * is not an integer (nothing consumed), -1 when truncated. */
static int kv_int(kv_rd *r, uint64_t *v, int *neg) {
    if (!kv_need(r, 1)) return -1;
    uint8_t t = *r->p;
    *neg = 0;
    if (t <= 0x7f) { *v = t; r->p++; return 1; }
    if (t >= 0xe0) { *v = (uint64_t)(int64_t)(int8_t)t; *neg = 1; r->p++; return 1; }
    int n;
    int sign;
    switch (t) {
    case 0xcc: n = 1; sign = 0; break;
    case 0xcd: n = 2; sign = 0; break;
    case 0xce: n = 4; sign = 0; break;
    case 0xcf: n = 8; sign = 0; break;
    case 0xd0: n = 1; sign = 1; break;
    case 0xd1: n = 2; sign = 1; break;
    case 0xd2: n = 4; sign = 1; break;
    case 0xd3: n = 8; sign = 1; break;
    default: return 0;
    }
    if (!kv_need(r, 1 + (uint64_t)n)) return -1;
    uint64_t x = kv_be(r->p + 1, n);
    if (sign) {
        int shift = 64 - 8 * n;
        int64_t s = shift ? (int64_t)(x << shift) >> shift : (int64_t)x;
        *neg = s < 0;
        x = (uint64_t)s;
    }
    *v = x;
    r->p += 1 + n;
    return 1;
}

/* A length-prefixed header of one family (fix range, 8/16/32-bit forms; `w8` 0 when the family has no 8-bit
 * form): 1 with the length, 0 when the next value is of another type, -1 when truncated. */
static int kv_len(kv_rd *r, uint8_t fix_lo, uint8_t fix_hi, uint8_t w8, uint8_t w16, uint8_t w32, uint64_t *n) {
    if (!kv_need(r, 1)) return -1;
    uint8_t t = *r->p;
    int w;
    if (t >= fix_lo && t <= fix_hi) { *n = (uint64_t)(t - fix_lo); r->p++; return 1; }
    if (w8 && t == w8) w = 1;
    else if (t == w16) w = 2;
    else if (t == w32) w = 4;
    else return 0;
    if (!kv_need(r, 1 + (uint64_t)w)) return -1;
    *n = kv_be(r->p + 1, w);
    r->p += 1 + w;
    return 1;
}

static int kv_array(kv_rd *r, uint64_t *n) { return kv_len(r, 0x90, 0x9f, 0, 0xdc, 0xdd, n); }
static int kv_map(kv_rd *r, uint64_t *n) { return kv_len(r, 0x80, 0x8f, 0, 0xde, 0xdf, n); }

/* Well-formed UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF). */
static int kv_utf8(const uint8_t *s, uint64_t n) {
    uint64_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        if (c < 0x80) { i++; continue; }
        int k;
        uint32_t cp;
        if (c >= 0xc2 && c <= 0xdf) { k = 1; cp = c & 0x1f; }
        else if (c >= 0xe0 && c <= 0xef) { k = 2; cp = c & 0x0f; }
        else if (c >= 0xf0 && c <= 0xf4) { k = 3; cp = c & 0x07; }
        else return 0;
        if (n - i <= (uint64_t)k) return 0;
        for (int j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if ((k == 2 && (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff))) || (k == 3 && (cp < 0x10000 || cp > 0x10ffff)))
            return 0;
        i += (uint64_t)k + 1;
    }
    return 1;
}

/* A string's bytes, not checked: 1, 0 when the next value is not a string, -1 when truncated. */
static int kv_str_raw(kv_rd *r, const uint8_t **s, uint64_t *n) {
    int k = kv_len(r, 0xa0, 0xbf, 0xd9, 0xda, 0xdb, n);
    if (k != 1) return k;
    if (!kv_need(r, *n)) return -1;
    *s = r->p;
    r->p += *n;
    return 1;
}

/* A string of valid UTF-8: as kv_str_raw, -1 also when invalid (a name compared with an ASCII literal needs
 * no check: it is valid when it matches). */
static int kv_str(kv_rd *r, const uint8_t **s, uint64_t *n) {
    int k = kv_str_raw(r, s, n);
    return k == 1 && !kv_utf8(*s, *n) ? -1 : k;
}

static int kv_bin(kv_rd *r, const uint8_t **s, uint64_t *n) {
    int k = kv_len(r, 1, 0, 0xc4, 0xc5, 0xc6, n); /* no fix range: fix_lo > fix_hi */
    if (k != 1) return k;
    if (!kv_need(r, *n)) return -1;
    *s = r->p;
    r->p += *n;
    return 1;
}

static int kv_nil(kv_rd *r) {
    if (kv_need(r, 1) && *r->p == 0xc0) { r->p++; return 1; }
    return 0;
}

/* Skip one value of any type but ext (0: declined). */
static int kv_skip(kv_rd *r, int depth) {
    if (depth > KV_MAX_DEPTH || !kv_need(r, 1)) return 0;
    uint8_t t = *r->p;
    uint64_t n, v;
    int neg;
    const uint8_t *s;
    if (t == 0xc0 || t == 0xc2 || t == 0xc3) { r->p++; return 1; }
    if (t == 0xca || t == 0xcb) {
        uint64_t w = t == 0xca ? 4 : 8;
        if (!kv_need(r, 1 + w)) return 0;
        r->p += 1 + w;
        return 1;
    }
    int k = kv_int(r, &v, &neg);
    if (k) return k == 1;
    k = kv_str(r, &s, &n);
    if (k) return k == 1;
    k = kv_bin(r, &s, &n);
    if (k) return k == 1;
    k = kv_array(r, &n);
    if (k == 1) {
        for (uint64_t i = 0; i < n; i++)
            if (!kv_skip(r, depth + 1)) return 0;
        return 1;
    }
    if (k) return 0;
    k = kv_map(r, &n);
    if (k == 1) {
        for (uint64_t i = 0; i < 2 * n; i++)
            if (!kv_skip(r, depth + 1)) return 0;
        return 1;
    }
    return 0; /* ext types, reserved 0xc1, truncation */
}

/* A block hash: an int (any sign, modulo 2^64) or bytes (their last 8, big-endian). *is_bytes32 tells a
 * 32-byte bytes hash. 1, or 0 when declined. */
static int kv_hash(kv_rd *r, uint64_t *key, int *is_int, int *is_bytes32) {
    uint64_t v, n;
    int neg;
    const uint8_t *s;
    int k = kv_int(r, &v, &neg);
    if (k) {
        if (k != 1) return 0;
        *key = v;
        *is_int = 1;
        *is_bytes32 = 0;
        return 1;
    }
    k = kv_bin(r, &s, &n);
    if (k != 1) return 0;
    int m = n < 8 ? (int)n : 8;
    *key = kv_be(s + n - (uint64_t)m, m);
    *is_int = 0;
    *is_bytes32 = n == 32;
    return 1;
}

/* `n` token ids, each an int in [0, 2^32) (1), else 0. The hot loop of a step's batch: one branch per id
 * for the encodings msgpack gives such ints (fixint, uint8, uint16, uint32; uint64 or a signed form when
 * the encoder chose one, checked by kv_int). */
static int kv_tokens(kv_rd *r, uint64_t n) {
    const uint8_t *p = r->p, *end = r->end;
    for (uint64_t i = 0; i < n; i++) {
        if (p >= end) return 0;
        uint8_t t = *p;
        if (t <= 0x7f) { p++; continue; }
        if (t == 0xce && end - p >= 5) { p += 5; continue; }
        if (t == 0xcd && end - p >= 3) { p += 3; continue; }
        if (t == 0xcc && end - p >= 2) { p += 2; continue; }
        uint64_t v;
        int neg;
        r->p = p;
        if (kv_int(r, &v, &neg) != 1 || neg || v > 0xffffffffULL) return 0;
        p = r->p;
    }
    r->p = p;
    return 1;
}

/* `s` (`n` bytes) is the string literal `lit` */
#define KV_IS(s, n, lit) ((n) == sizeof(lit) - 1 && memcmp((s), (lit), sizeof(lit) - 1) == 0)

enum {
    F_TYPE = 1, F_HASHES = 2, F_PARENT = 4, F_TOKENS = 8, F_BSIZE = 16, F_LORA = 32, F_MEDIUM = 64,
    F_LORA_NAME = 128,
};

/* One event (a map). Appends its hashes' keys to keys[*nk...]; 1 on success, 0 declined. */
static int kv_event(kv_rd *r, int64_t block_size, int chain_bytes, uint64_t *keys, int64_t keys_cap,
                    int64_t *nk, int *kind, const uint8_t **medium, int64_t *medium_len, int *hash_key) {
    uint64_t fields;
    if (kv_map(r, &fields) != 1) return 0;
    unsigned seen = 0;
    int64_t first = *nk;
    int64_t tokens = 0;
    uint64_t bsize = 0;
    int chainable = 1; /* every hash and the parent of the type the chain continues from */
    *kind = -1;
    *medium = NULL;
    *medium_len = -1;
    for (uint64_t f = 0; f < fields; f++) {
        const uint8_t *name, *s;
        uint64_t nl, n, v;
        int neg;
        if (kv_str_raw(r, &name, &nl) != 1) return 0;
        unsigned bit = 0;
        switch (nl) { /* by length first: one comparison per field */
        case 4: bit = KV_IS(name, nl, "type") ? F_TYPE : 0; break;
        case 12: bit = KV_IS(name, nl, "block_hashes") ? F_HASHES : 0; break;
        case 17: bit = KV_IS(name, nl, "parent_block_hash") ? F_PARENT : 0; break;
        case 9: bit = KV_IS(name, nl, "token_ids") ? F_TOKENS : KV_IS(name, nl, "lora_name") ? F_LORA_NAME : 0; break;
        case 10: bit = KV_IS(name, nl, "block_size") ? F_BSIZE : 0; break;
        case 7: bit = KV_IS(name, nl, "lora_id") ? F_LORA : 0; break;
        case 6: bit = KV_IS(name, nl, "medium") ? F_MEDIUM : 0; break;
        }
        if (!bit) {
            if (!kv_utf8(name, nl) || !kv_skip(r, 2)) return 0;
            continue;
        }
        if (seen & bit) return 0;
        seen |= bit;
        switch (bit) {
        case F_TYPE:
            if (kv_str_raw(r, &s, &n) != 1) return 0;
            if (KV_IS(s, n, "BlockStored")) *kind = KV_STORED;
            else if (KV_IS(s, n, "BlockRemoved")) *kind = KV_REMOVED;
            else if (KV_IS(s, n, "AllBlocksCleared")) *kind = KV_CLEARED;
            else return 0;
            break;
        case F_HASHES:
            if (kv_array(r, &n) != 1 || n > (uint64_t)(keys_cap - *nk)) return 0;
            for (uint64_t i = 0; i < n; i++) {
                int is_int, is_b32;
                if (!kv_hash(r, &keys[*nk], &is_int, &is_b32)) return 0;
                (*nk)++;
                if (!(is_int || (chain_bytes && is_b32))) chainable = 0;
            }
            break;
        case F_PARENT:
            if (!kv_nil(r)) {
                uint64_t ignored;
                int is_int, is_b32;
                if (!kv_hash(r, &ignored, &is_int, &is_b32)) return 0;
                if (!(is_int || (chain_bytes && is_b32))) chainable = 0;
            }
            break;
        case F_TOKENS:
            if (kv_array(r, &n) != 1 || !kv_tokens(r, n)) return 0;
            tokens = (int64_t)n;
            break;
        case F_BSIZE:
            if (kv_int(r, &v, &neg) != 1 || neg || v == 0) return 0;
            bsize = v;
            break;
        case F_LORA:
            if (!kv_nil(r) && kv_int(r, &v, &neg) != 1) return 0;
            break;
        case F_MEDIUM:
            if (!kv_nil(r)) {
                if (kv_str(r, &s, &n) != 1) return 0;
                *medium = s;
                *medium_len = (int64_t)n;
            }
            break;
        case F_LORA_NAME:
            if (!kv_nil(r) && kv_str(r, &s, &n) != 1) return 0;
            break;
        }
    }
    unsigned need;
    switch (*kind) {
    case KV_STORED: need = F_HASHES | F_PARENT | F_TOKENS | F_BSIZE | F_LORA | F_MEDIUM; break;
    case KV_REMOVED: need = F_HASHES | F_MEDIUM; break;
    case KV_CLEARED: need = 0; break;
    default: return 0; /* no type */
    }
    /* a field of another event type is an unknown field to msgspec (skipped): only the needed ones count */
    if ((seen & need) != need) return 0;
    if (*kind != KV_STORED) {
        if (*kind == KV_CLEARED) *nk = first; /* its block_hashes, if any, is an unknown field */
        *hash_key = 1;
        return 1;
    }
    int64_t blocks = *nk - first;
    *hash_key = chainable && bsize == (uint64_t)block_size && tokens >= blocks * block_size;
    return 1;
}

/* The batch in `buf` (`len` bytes). `ops` holds the result: ops[0] the batch's timestamp (a double's bits),
 * from ops[1] at most `ops_cap` operations of KV_OP_WORDS words (see the top of this file); the keys go to
 * `keys` (at most `keys_cap`; an operation's first key counts from `keys`). Returns the number of
 * operations, or -1 when declined. */
int64_t kv_scan_batch(const uint8_t *buf, int64_t len, int64_t block_size, int32_t chain_bytes, uint64_t *ops,
                      int64_t ops_cap, uint64_t *keys, int64_t keys_cap) {
    kv_rd r = {buf, buf + len};
    uint64_t parts, n_events, v;
    int neg;
    double ts;
    uint64_t *out = ops++;
    if (len <= 0 || kv_array(&r, &parts) != 1 || parts < 2 || parts > 3) return -1;
    /* ts: a float, or an int (msgspec reads an int into a float field) */
    if (!kv_need(&r, 1)) return -1;
    if (*r.p == 0xcb) {
        if (!kv_need(&r, 9)) return -1;
        uint64_t bits = kv_be(r.p + 1, 8);
        memcpy(&ts, &bits, 8);
        r.p += 9;
    } else if (*r.p == 0xca) {
        if (!kv_need(&r, 5)) return -1;
        uint32_t bits = (uint32_t)kv_be(r.p + 1, 4);
        float f;
        memcpy(&f, &bits, 4);
        ts = (double)f;
        r.p += 5;
    } else if (kv_int(&r, &v, &neg) == 1) {
        ts = neg ? (double)(int64_t)v : (double)v;
    } else {
        return -1;
    }
    memcpy(out, &ts, 8);
    if (kv_array(&r, &n_events) != 1) return -1;
    int64_t n_ops = 0, nk = 0;
    uint64_t *op = NULL;
    for (uint64_t e = 0; e < n_events; e++) {
        int kind, hash_key;
        const uint8_t *medium;
        int64_t medium_len, first = nk;
        if (!kv_event(&r, block_size, chain_bytes, keys, keys_cap, &nk, &kind, &medium, &medium_len, &hash_key))
            return -1;
        uint64_t off = medium ? (uint64_t)(medium - buf) + 1 : 0, mlen = medium ? (uint64_t)medium_len : 0;
        int same = op != NULL && kind != KV_CLEARED && op[0] == (uint64_t)kind && (op[1] == 0) == (off == 0) &&
                   (off == 0 || (op[2] == mlen && memcmp(buf + op[1] - 1, medium, (size_t)mlen) == 0));
        if (same) {
            op[4] += (uint64_t)(nk - first);
            op[5] += 1;
            op[6] &= (uint64_t)hash_key;
            continue;
        }
        if (n_ops >= ops_cap) return -1;
        op = ops + n_ops * KV_OP_WORDS;
        op[0] = (uint64_t)kind;
        op[1] = off;
        op[2] = mlen;
        op[3] = (uint64_t)first;
        op[4] = (uint64_t)(nk - first);
        op[5] = 1;
        op[6] = (uint64_t)hash_key;
        n_ops++;
    }
    if (parts == 3 && !kv_nil(&r) && kv_int(&r, &v, &neg) != 1) return -1;
    return r.p == r.end ? n_ops : -1;
}
