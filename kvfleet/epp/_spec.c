/* The picker's speculative entries, compiled: (block key, pod slot) -> the lease of the pick that recorded
 * it, and the leases' expiry, served flag and entry count, for kvfleet/epp/speculative.py (the rules it
 * serves are documented there and in kvfleet/epp/index.py).
 *
 * One store is one malloc'd spec_t (spec_new / spec_free):
 *   table   open addressing, linear probing, a power-of-two capacity: keys uint64, pods uint16 (EMPTY and
 *           DELETED mark free positions), lease uint32. Rebuilt at load <= 0.5 of the live entries (so
 *           grown, or shrunk after many deletions) when live plus deleted positions would pass 0.7 of it.
 *   leases  expiry double, owned int32 (entries naming the lease), served uint8, gen uint32. A lease whose
 *           last entry goes (dropped, expired, or taken over by a later pick of the same key) is freed and
 *           its generation bumped, so a handle the caller kept (id, gen) no longer reaches it: reads of it
 *           answer 0 and writes are ignored.
 * 20-37 bytes per entry, where Python's key -> {pod: lease} dicts took about 320.
 *
 * Plain C with no Python API, built into the same library as _probe.c and loaded with ctypes. Not
 * thread-safe: the caller serialises every call on one store (index.py's speculative lock).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EMPTY 0xFFFFu
#define DELETED 0xFFFEu
#define PHI 0x9E3779B97F4A7C15ull
#define MIN_CAP 1024

typedef struct {
    uint64_t *keys;
    uint16_t *pods;
    uint32_t *lease;
    int64_t cap, live, deleted;
    double *expiry;
    int32_t *owned;
    uint8_t *served;
    uint32_t *gen;
    uint32_t *freed; /* a stack of free lease ids */
    int64_t nlease, lcap, nfreed;
} spec_t;

static int alloc_table(spec_t *s, int64_t cap) {
    s->keys = malloc((size_t)cap * sizeof(uint64_t));
    s->pods = malloc((size_t)cap * sizeof(uint16_t));
    s->lease = malloc((size_t)cap * sizeof(uint32_t));
    if (!s->keys || !s->pods || !s->lease) {
        free(s->keys), free(s->pods), free(s->lease);
        return -1;
    }
    memset(s->pods, 0xFF, (size_t)cap * sizeof(uint16_t));
    s->cap = cap;
    s->live = s->deleted = 0;
    return 0;
}

void spec_free(spec_t *s) {
    if (!s) return;
    free(s->keys), free(s->pods), free(s->lease);
    free(s->expiry), free(s->owned), free(s->served), free(s->gen), free(s->freed);
    free(s);
}

spec_t *spec_new(void) {
    spec_t *s = calloc(1, sizeof(spec_t));
    if (!s || alloc_table(s, MIN_CAP)) {
        free(s);
        return NULL;
    }
    return s;
}

static inline int64_t home(const spec_t *s, uint64_t key, uint16_t pod) {
    uint64_t x = key ^ ((uint64_t)(pod + 1) * 0xD6E8FEB86659FD93ull);
    x ^= x >> 29;
    return (int64_t)((x * PHI) >> (64 - __builtin_ctzll((uint64_t)s->cap)));
}

/* Position of (key, pod), or -1. */
static inline int64_t find1(const spec_t *s, uint64_t key, uint16_t pod) {
    int64_t wrap = s->cap - 1, at = home(s, key, pod);
    for (int64_t i = 0; i <= wrap; i++, at = (at + 1) & wrap) {
        uint16_t p = s->pods[at];
        if (p == EMPTY) return -1;
        if (p == pod && s->keys[at] == key) return at;
    }
    return -1;
}

/* Position of (key, pod) if held (*found = 1), else where to insert it: the first deleted position on its
 * probe path, or the empty one that ends it. The table always has an empty position (load <= 0.7). */
static inline int64_t slot_for(const spec_t *s, uint64_t key, uint16_t pod, int *found) {
    int64_t wrap = s->cap - 1, at = home(s, key, pod), tomb = -1;
    for (;; at = (at + 1) & wrap) {
        uint16_t p = s->pods[at];
        if (p == EMPTY) {
            *found = 0;
            return tomb >= 0 ? tomb : at;
        }
        if (p == DELETED) {
            if (tomb < 0) tomb = at;
        } else if (p == pod && s->keys[at] == key) {
            *found = 1;
            return at;
        }
    }
}

/* Refit the table to hold `extra` more entries: a new one at load <= 0.5 (grown or shrunk), entries moved. */
static int reserve(spec_t *s, int64_t extra) {
    if ((double)(s->live + s->deleted + extra) <= 0.7 * (double)s->cap) return 0;
    int64_t cap = MIN_CAP;
    while ((double)(s->live + extra) > 0.5 * (double)cap) cap <<= 1;
    spec_t old = *s;
    if (alloc_table(s, cap)) {
        *s = old;
        return -1;
    }
    for (int64_t i = 0; i < old.cap; i++) {
        if (old.pods[i] >= DELETED) continue;
        int found;
        int64_t at = slot_for(s, old.keys[i], old.pods[i], &found);
        s->keys[at] = old.keys[i], s->pods[at] = old.pods[i], s->lease[at] = old.lease[i];
        s->live++;
    }
    free(old.keys), free(old.pods), free(old.lease);
    return 0;
}

static inline void release(spec_t *s, uint32_t l) {
    if (--s->owned[l] == 0) {
        s->gen[l]++;
        s->freed[s->nfreed++] = l;
    }
}

/* A lease owning no entry (a new one whose spec_add stored nothing) is freed like one that lost its last. */
static inline void release_unowned(spec_t *s, uint32_t l) {
    s->owned[l] = 1;
    release(s, l);
}

static inline void delete_at(spec_t *s, int64_t at) {
    s->pods[at] = DELETED;
    s->live--;
    s->deleted++;
    release(s, s->lease[at]);
}

/* A new lease expiring at `expiry`: (gen << 32) | id, or -1 when memory runs out. It is freed again when it
 * ends a spec_add owning no entry. */
int64_t spec_lease_new(spec_t *s, double expiry) {
    uint32_t l;
    if (s->nfreed) {
        l = s->freed[--s->nfreed];
    } else {
        if (s->nlease == s->lcap) {
            int64_t n = s->lcap ? 2 * s->lcap : 1024;
            if (n > 0xFFFFFFFFll) return -1;
            double *e = realloc(s->expiry, (size_t)n * sizeof(double));
            if (e) s->expiry = e;
            int32_t *o = realloc(s->owned, (size_t)n * sizeof(int32_t));
            if (o) s->owned = o;
            uint8_t *v = realloc(s->served, (size_t)n);
            if (v) s->served = v;
            uint32_t *g = realloc(s->gen, (size_t)n * sizeof(uint32_t));
            if (g) s->gen = g;
            uint32_t *f = realloc(s->freed, (size_t)n * sizeof(uint32_t));
            if (f) s->freed = f;
            if (!e || !o || !v || !g || !f) return -1;
            memset(s->gen + s->lcap, 0, (size_t)(n - s->lcap) * sizeof(uint32_t));
            s->lcap = n;
        }
        l = (uint32_t)s->nlease++;
    }
    s->expiry[l] = expiry;
    s->owned[l] = 0;
    s->served[l] = 0;
    return ((int64_t)s->gen[l] << 32) | l;
}

static inline int live_lease(const spec_t *s, int64_t handle) {
    uint32_t l = (uint32_t)(handle & 0xFFFFFFFFll);
    return (int64_t)l < s->nlease && s->gen[l] == (uint32_t)(handle >> 32) && s->owned[l] > 0;
}

/* Entries the lease still owns (0 once freed). */
int64_t spec_lease_owned(const spec_t *s, int64_t handle) {
    return live_lease(s, handle) ? s->owned[handle & 0xFFFFFFFFll] : 0;
}

/* Set a live lease's expiry, and its served flag when `served` >= 0. */
void spec_lease_set(spec_t *s, int64_t handle, double expiry, int served) {
    if (!live_lease(s, handle)) return;
    uint32_t l = (uint32_t)(handle & 0xFFFFFFFFll);
    s->expiry[l] = expiry;
    if (served >= 0) s->served[l] = (uint8_t)served;
}

/* `pod` holds keys[0..n) under the new lease `handle` (from spec_lease_new): each entry is created or taken
 * over from the pick that held it (that lease loses it); a key repeated counts once. A lease left owning
 * nothing is freed. Returns the entries created, or -1 when memory runs out (no entry changed; the lease
 * freed). */
int64_t spec_add(spec_t *s, const uint64_t *keys, int64_t n, uint16_t pod, int64_t handle) {
    uint32_t l = (uint32_t)(handle & 0xFFFFFFFFll);
    if (reserve(s, n)) {
        release_unowned(s, l);
        return -1;
    }
    int64_t created = 0;
    for (int64_t i = 0; i < n; i++) {
        int found;
        int64_t at = slot_for(s, keys[i], pod, &found);
        if (found) {
            if (s->lease[at] == l) continue;
            release(s, s->lease[at]);
        } else {
            if (s->pods[at] == DELETED) s->deleted--;
            s->keys[at] = keys[i];
            s->pods[at] = pod;
            s->live++;
            created++;
        }
        s->lease[at] = l;
        s->owned[l]++;
    }
    if (s->owned[l] == 0) release_unowned(s, l);
    return created;
}

/* Drop pod's entries for keys[0..n) that the lease `handle` owns (its pick's keys); returns how many. */
int64_t spec_drop(spec_t *s, const uint64_t *keys, int64_t n, uint16_t pod, int64_t handle) {
    if (!live_lease(s, handle)) return 0;
    uint32_t l = (uint32_t)(handle & 0xFFFFFFFFll);
    int64_t gone = 0;
    for (int64_t i = 0; i < n && s->gen[l] == (uint32_t)(handle >> 32); i++) {
        int64_t at = find1(s, keys[i], pod);
        if (at >= 0 && s->lease[at] == l) {
            delete_at(s, at);
            gone++;
        }
    }
    return gone;
}

/* Drop pod's entries for keys[0..n) whose lease was served; returns how many. */
int64_t spec_drop_served(spec_t *s, const uint64_t *keys, int64_t n, uint16_t pod) {
    int64_t gone = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t at = find1(s, keys[i], pod);
        if (at >= 0 && s->served[s->lease[at]]) {
            delete_at(s, at);
            gone++;
        }
    }
    return gone;
}

/* Drop every entry of pod; returns how many. */
int64_t spec_drop_pod(spec_t *s, uint16_t pod) {
    int64_t gone = 0;
    for (int64_t at = 0; at < s->cap; at++) {
        if (s->pods[at] == pod) {
            delete_at(s, at);
            gone++;
        }
    }
    return gone;
}

/* Per candidate pod (pods[j]; EMPTY: none), the prefix a live pick covers: sampled[0..m) are a prompt's keys
 * at its sample positions pos[0..m); a pod whose entry for sampled[0] is live (expiry > t) gets pos[lo] + 1
 * for the last sampled position lo its live entries reach, by binary search (one pick stores a whole prefix,
 * so "held at sampled position i" is nearly monotone in i); others get 0. Returns how many got one. */
int64_t spec_match(const spec_t *s, const uint64_t *sampled, const int64_t *pos, int64_t m,
                   const uint16_t *pods, int64_t c, double t, int64_t *out) {
    int64_t hits = 0;
    for (int64_t j = 0; j < c; j++) {
        out[j] = 0;
        uint16_t pod = pods[j];
        if (m == 0 || pod >= DELETED) continue;
        int64_t at = find1(s, sampled[0], pod);
        if (at < 0 || !(s->expiry[s->lease[at]] > t)) continue;
        int64_t lo = 0, hi = m - 1;
        while (lo < hi) {
            int64_t mid = (lo + hi + 1) / 2;
            at = find1(s, sampled[mid], pod);
            if (at >= 0 && s->expiry[s->lease[at]] > t)
                lo = mid;
            else
                hi = mid - 1;
        }
        out[j] = pos[lo] + 1;
        hits++;
    }
    return hits;
}

/* Live entries (for tests and gauges); fills up to `room` of them into keys/pods, returns the count. */
int64_t spec_entries(const spec_t *s, uint64_t *keys, uint16_t *pods, int64_t room) {
    int64_t n = 0;
    for (int64_t at = 0; at < s->cap; at++) {
        if (s->pods[at] >= DELETED) continue;
        if (n < room) keys[n] = s->keys[at], pods[n] = s->pods[at];
        n++;
    }
    return n;
}

/* Live entries and the table's bytes (capacity x 14 plus the leases'). */
void spec_stats(const spec_t *s, int64_t *out) {
    out[0] = s->live;
    out[1] = s->cap * 14 + s->lcap * 21;
}
