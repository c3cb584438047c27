/* The EPP index's hash table, compiled: probes of the (block key, pod slot) table, its inserts, and the
 * per-pod longest-prefix search of kvfleet/epp/index.py (the table's layout: kvfleet/epp/table.py). The
 * home position of a pair (home() below) is computed here only.
 *
 * Plain C with no Python API: loaded with ctypes (kvfleet/epp/probe.py), so building it needs a C compiler
 * and nothing else (no Python headers). kv_insert, kv_add and kv_remove are the writers (called under the
 * index's write lock); each publishes an entry by writing its pod slot last (release store), and readers
 * load a slot before its key (acquire load), so readers need no lock. The caller holds references to every
 * array for the duration of a call and releases the GIL (ctypes does).
 *
 * kv_match follows the decision rules documented in index.py exactly:
 *   - small prompts (blocks x pods <= the walk budget): every (position, pod) probed, each prefix cut at
 *     its first missing block, each block weighted by its best tier;
 *   - otherwise a SEARCH_FANOUT-ary search per pod for the longest prefix held (and per tier boundary),
 *     then the verifying walk over the found prefixes when their total is within the budget.
 */
#include <stdint.h>

#define EMPTY 0xFFFFu
#define DELETED 0xFFFEu
#define FANOUT 8
#define AHEAD 8 /* a walk's probes started ahead of the one it reads */
#define PHI 0x9E3779B97F4A7C15ull

typedef struct {
    const uint64_t *keys;
    const uint16_t *pods;
    const uint8_t *mask;
    const uint64_t *mix; /* a random word per pod slot */
    int64_t wrap;        /* capacity - 1 */
    unsigned shift;      /* 64 - log2(capacity) */
} table_t;

/* Home position of (key, slot): Fibonacci hashing of key ^ a random word per slot, after folding the key's
 * high bits down (block keys may be small or sequential integers: tests, simulations). */
static inline int64_t home(const table_t *t, uint64_t key, uint16_t slot) {
    uint64_t x = key ^ t->mix[slot];
    x ^= x >> 29;
    return (int64_t)((x * PHI) >> t->shift);
}

static inline int64_t find1(const table_t *t, uint64_t key, uint16_t slot) {
    int64_t pos = home(t, key, slot);
    for (int64_t i = 0; i <= t->wrap; i++) {
        int64_t at = (pos + i) & t->wrap;
        uint16_t p = __atomic_load_n(&t->pods[at], __ATOMIC_ACQUIRE);
        if (p == EMPTY) return -1;
        if (p == slot && t->keys[at] == key) return at;
    }
    return -1;
}

static inline int mask_at(const table_t *t, uint64_t key, uint16_t slot) {
    int64_t at = find1(t, key, slot);
    return at < 0 ? 0 : t->mask[at];
}

/* Start loading the lines (key, slot)'s probe reads first: a search issues its FANOUT - 1 probes, or a match
 * its first probe per pod, before it reads any, so their cache misses overlap instead of adding up. */
static inline void prefetch1(const table_t *t, uint64_t key, uint16_t slot) {
    int64_t at = home(t, key, slot);
    __builtin_prefetch(&t->pods[at]);
    __builtin_prefetch(&t->keys[at]);
    __builtin_prefetch(&t->mask[at]);
}

static inline int best_rank(int m) { return m ? __builtin_ctz((unsigned)m) : -1; }

/* Insert one (key, slot) pair known to be absent, with tier mask m, in the first free position (never used,
 * or deleted) from its home; the caller keeps the load below 1. Returns 1 if it reused a deleted position. */
static inline int insert1(uint64_t *tkeys, uint16_t *tpods, uint8_t *tmask, const table_t *t, uint64_t key,
                          uint16_t slot, uint8_t m) {
    int64_t at = home(t, key, slot);
    while (tpods[at] < DELETED) at = (at + 1) & t->wrap;
    int reused = tpods[at] == DELETED;
    tkeys[at] = key;
    tmask[at] = m;
    __atomic_store_n(&tpods[at], slot, __ATOMIC_RELEASE); /* last: publishes the entry */
    return reused;
}

/* Insert (key, slot) pairs known to be absent and distinct (insert1 each). Returns how many deleted
 * positions were reused. */
int64_t kv_insert(uint64_t *tkeys, uint16_t *tpods, uint8_t *tmask, const uint64_t *mix, int64_t wrap,
                  int shift, const uint64_t *keys, const uint16_t *slots, const uint8_t *masks, int64_t n) {
    table_t t = {tkeys, tpods, tmask, mix, wrap, (unsigned)shift};
    int64_t reused = 0;
    for (int64_t i = 0; i < n; i++) reused += insert1(tkeys, tpods, tmask, &t, keys[i], slots[i], masks[i]);
    return reused;
}

/* How many of keys[0..n) pod slot `slot` does not hold (a repeated key counts each time): an upper bound of
 * what kv_add inserts, for the caller's load check. */
int64_t kv_count_absent(const uint64_t *tkeys, const uint16_t *tpods, const uint64_t *mix, int64_t wrap,
                        int shift, const uint64_t *keys, int64_t n, int slot) {
    table_t t = {tkeys, tpods, 0, mix, wrap, (unsigned)shift};
    int64_t absent = 0;
    for (int64_t i = 0; i < n; i++) absent += find1(&t, keys[i], (uint16_t)slot) < 0;
    return absent;
}

/* Pod slot `slot` holds keys[0..n) in the tier of mask bit `bit`: an entry it holds gains the bit, an absent
 * key is inserted with it (insert1), so a repeated key finds the entry its first occurrence made. The caller
 * keeps the load below 1 (kv_count_absent more entries fit). out[0]: entries inserted; out[1]: entries held
 * that gained the bit; out[2]: deleted positions reused. */
void kv_add(uint64_t *tkeys, uint16_t *tpods, uint8_t *tmask, const uint64_t *mix, int64_t wrap, int shift,
            const uint64_t *keys, int64_t n, int slot, int bit, int64_t *out) {
    table_t t = {tkeys, tpods, tmask, mix, wrap, (unsigned)shift};
    uint16_t s = (uint16_t)slot;
    uint8_t b = (uint8_t)bit;
    int64_t inserted = 0, gained = 0, reused = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t at = find1(&t, keys[i], s);
        if (at >= 0) {
            if (!(tmask[at] & b)) {
                tmask[at] |= b;
                gained++;
            }
            continue;
        }
        reused += insert1(tkeys, tpods, tmask, &t, keys[i], s, b);
        inserted++;
    }
    out[0] = inserted;
    out[1] = gained;
    out[2] = reused;
}

/* Pod slot `slot` keeps only the tier bits of `keep` for keys[0..n): each entry it holds loses its other
 * bits, and one left with none is deleted (its slot marked DELETED; its key stays for readers that loaded
 * the slot before). A repeated key finds its entry already changed. out[0]: entries deleted; out[1]: entries
 * that lost mask bit `gpu_bit`. */
void kv_remove(uint64_t *tkeys, uint16_t *tpods, uint8_t *tmask, const uint64_t *mix, int64_t wrap,
               int shift, const uint64_t *keys, int64_t n, int slot, int keep, int gpu_bit, int64_t *out) {
    table_t t = {tkeys, tpods, tmask, mix, wrap, (unsigned)shift};
    uint16_t s = (uint16_t)slot;
    int64_t gone = 0, lost = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t at = find1(&t, keys[i], s);
        if (at < 0) continue;
        uint8_t before = tmask[at], m = before & (uint8_t)keep;
        lost += (before & ~m & gpu_bit) != 0;
        tmask[at] = m;
        if (!m) {
            __atomic_store_n(&tpods[at], (uint16_t)DELETED, __ATOMIC_RELEASE);
            gone++;
        }
    }
    out[0] = gone;
    out[1] = lost;
}

/* Table position of each (key, slot), -1 where absent. */
void kv_find(const uint64_t *tkeys, const uint16_t *tpods, const uint64_t *mix, int64_t wrap, int shift,
             const uint64_t *keys, const uint16_t *slots, int64_t n, int64_t *out) {
    table_t t = {tkeys, tpods, 0, mix, wrap, (unsigned)shift};
    for (int64_t i = 0; i < n; i++) out[i] = find1(&t, keys[i], slots[i]);
}

/* One pod's longest prefix of keys[0..n) held in a tier of `bits`, given block 0's mask m0 (held there);
 * m_last: the mask of block n-1, or -1 to probe it. Writes the prefix's last block's mask to *last. */
static int64_t search1(const table_t *t, const uint64_t *keys, uint16_t slot, int m0, int64_t n, int bits,
                       int m_last, int *last) {
    int64_t lo = 0, hi = n;
    *last = m0;
    if (n > 1) { /* the prompt's last block first: a repeated prompt ends the search at once */
        int m = m_last >= 0 ? m_last : mask_at(t, keys[n - 1], slot);
        if (m & bits) {
            lo = n - 1;
            *last = m;
        } else {
            hi = n - 1;
        }
    }
    while (hi - lo > 1) {
        int64_t mids[FANOUT - 1];
        int ms[FANOUT - 1];
        int64_t new_lo = lo, new_hi = hi;
        int best = -1;
        for (int j = 0; j < FANOUT - 1; j++) {
            int64_t mid = lo + ((hi - lo) * (j + 1)) / FANOUT;
            if (mid < lo + 1) mid = lo + 1;
            if (mid > hi - 1) mid = hi - 1;
            mids[j] = mid;
            prefetch1(t, keys[mid], slot);
        }
        for (int j = 0; j < FANOUT - 1; j++) {
            int64_t mid = mids[j];
            ms[j] = mask_at(t, keys[mid], slot);
            if ((ms[j] & bits) && (best < 0 || mid > mids[best])) best = j;
        }
        if (best >= 0) {
            new_lo = mids[best];
            *last = ms[best];
        }
        /* the first position above the new lower bound that is not held (a hole below it is not seen) */
        for (int j = 0; j < FANOUT - 1; j++)
            if (!(ms[j] & bits) && mids[j] > new_lo && mids[j] < new_hi) new_hi = mids[j];
        lo = new_lo;
        hi = new_hi;
    }
    return lo + 1;
}

/* The exact walk over a given prefix length per pod: cut at the first block not held, weigh each block by
 * its best tier (a held block whose mask is empty counts as missing). */
static void verify(const table_t *t, const uint64_t *keys, const uint16_t *slots, int64_t c, int64_t *length,
                   const double *w, double *weighted) {
    for (int64_t i = 0; i < c; i++) {
        double s = 0.0;
        int64_t cut = length[i];
        for (int64_t p = 0; p < length[i] && p < AHEAD; p++) prefetch1(t, keys[p], slots[i]);
        for (int64_t p = 0; p < length[i]; p++) {
            if (p + AHEAD < length[i]) prefetch1(t, keys[p + AHEAD], slots[i]);
            int r = best_rank(mask_at(t, keys[p], slots[i]));
            if (r < 0) {
                cut = p;
                break;
            }
            s += w[r];
        }
        length[i] = cut;
        weighted[i] = s;
    }
}

/* Longest held prefix of keys[0..n) for each of c pod slots: length[i] blocks, weighted[i] = sum of the
 * tier weight (w[0..nw)) of each. walk_budget: the exact walk's probe budget. scratch: 3*c int64. */
void kv_match(const uint64_t *tkeys, const uint16_t *tpods, const uint8_t *tmask, const uint64_t *mix,
              int64_t wrap, int shift, const uint64_t *keys, int64_t n, const uint16_t *slots, int64_t c,
              const double *w, int nw, int64_t walk_budget, int64_t *length, double *weighted,
              int64_t *scratch) {
    table_t t = {tkeys, tpods, tmask, mix, wrap, (unsigned)shift};
    for (int64_t i = 0; i < c; i++) {
        length[i] = 0;
        weighted[i] = 0.0;
    }
    if (n == 0 || c == 0) return;
    if (n * c <= walk_budget) { /* every (position, pod): cut at the first missing block */
        for (int64_t i = 0; i < c; i++) {
            double s = 0.0;
            int64_t p = 0;
            for (int64_t q = 0; q < n && q < AHEAD; q++) prefetch1(&t, keys[q], slots[i]);
            for (; p < n; p++) {
                if (p + AHEAD < n) prefetch1(&t, keys[p + AHEAD], slots[i]);
                int64_t at = find1(&t, keys[p], slots[i]);
                if (at < 0) break;
                int r = best_rank(t.mask[at]);
                s += r < 0 ? 0.0 : w[r];
            }
            length[i] = p;
            weighted[i] = s;
        }
        return;
    }
    int64_t *m0 = scratch, *last = scratch + c, *prev = scratch + 2 * c;
    int64_t total = 0;
    for (int64_t i = 0; i < c; i++) {
        prefetch1(&t, keys[0], slots[i]);
        prefetch1(&t, keys[n - 1], slots[i]);
    }
    for (int64_t i = 0; i < c; i++) {
        m0[i] = mask_at(&t, keys[0], slots[i]);
        if (!m0[i]) continue;
        int lm;
        length[i] = search1(&t, keys, slots[i], (int)m0[i], n, 0xFF, -1, &lm);
        last[i] = lm;
        total += length[i];
    }
    /* sum over tiers r of (L_r - L_{r-1}) * w_r, L_r the longest prefix held in tiers <= r (monotone in the
     * position): searched only for pods whose first and last blocks sit on either side of the boundary,
     * over the longest such prefix (as one batched search would) */
    for (int64_t i = 0; i < c; i++) prev[i] = 0;
    for (int r = 0; r < nw; r++) {
        int low = (1 << (r + 1)) - 1;
        int64_t mixed_n = 0;
        if (r < nw - 1)
            for (int64_t i = 0; i < c; i++)
                if (m0[i] && (m0[i] & low) && !(last[i] & low) && length[i] > mixed_n) mixed_n = length[i];
        for (int64_t i = 0; i < c; i++) {
            if (!m0[i]) continue;
            int64_t lr;
            if (r == nw - 1) {
                lr = length[i];
            } else if (!(m0[i] & low)) {
                lr = 0;
            } else if (!(last[i] & low)) {
                int lm;
                lr = search1(&t, keys, slots[i], (int)m0[i], mixed_n, low, -1, &lm);
                if (lr > length[i]) lr = length[i];
            } else {
                lr = length[i];
            }
            if (lr < prev[i]) lr = prev[i];
            weighted[i] += (double)(lr - prev[i]) * w[r];
            prev[i] = lr;
        }
    }
    if (total <= walk_budget) verify(&t, keys, slots, c, length, w, weighted);
}
