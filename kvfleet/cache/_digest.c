/* The content digest of every block of a prompt in one call: xxh3_64 (seed 0) of each row of `row` bytes
 * (a block's token ids as little-endian uint32), the digest kvfleet/cache/hashing.py chains. One C call for
 * a whole prompt instead of one Python call per block (a 220 KB prompt has 13.7 k blocks).
 *
 * Plain C with no Python API, loaded with ctypes (kvfleet/cache/digest.py). xxhash.h: native/xxhash/
 * (vendored, BSD 2-Clause; its provenance in native/xxhash/README.md). */
#include <stdint.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

void kv_digest_rows(const uint8_t *data, int64_t n, int64_t row, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = XXH3_64bits(data + i * row, (size_t)row);
}

/* The chain of kvfleet/cache/hashing.py's xxh3_64 scheme over digests already computed: s_i = P*s_{i-1} + c_i
 * (mod 2^64) from s_{-1} = `state`, and out[i] = fmix64(s_i), MurmurHash3's finaliser. The same arithmetic as
 * the module doc's prefix-sum form, which is what it replaces (one pass instead of a dozen array passes). */
static inline uint64_t kv_fmix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDULL;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ULL;
    x ^= x >> 33;
    return x;
}

#define KV_P 0x9E3779B97F4A7C15ULL

void kv_chain(const uint64_t *digests, int64_t n, uint64_t state, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        state = state * KV_P + digests[i];
        out[i] = kv_fmix64(state);
    }
}

/* One link from each of n states: out[i] = the block of digest digests[i] chained after a block whose chain
 * state is states[i] (the blocks of n different prompts, one each: a decode step's). */
void kv_chain_each(const uint64_t *digests, const uint64_t *states, int64_t n, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = kv_fmix64(states[i] * KV_P + digests[i]);
}

/* Both in one pass: the digest of each row of `row` bytes, then its link of the chain. */
void kv_digest_chain(const uint8_t *data, int64_t n, int64_t row, uint64_t state, uint64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        state = state * KV_P + XXH3_64bits(data + i * row, (size_t)row);
        out[i] = kv_fmix64(state);
    }
}
