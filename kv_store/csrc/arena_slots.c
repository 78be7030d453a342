/* The slot protocol of the shm KV arena (kv_store/arena_layout.py), with C11 atomics.
 *
 * Every process maps the same arena file; these functions are the only code that changes a
 * slot's state words (gen, state, key0, key1, xxh, ref) in the lock-free mode. Writers call
 * them holding the arena's flock (so one writer at a time per arena); readers call them
 * holding nothing. The orderings below are the whole correctness argument, stated in the C11
 * memory model (the compiler emits each architecture's barriers), not in x86's store order:
 *
 *   writer (begin_write)  gen = odd (relaxed); fence(release); key, state, ... (relaxed)
 *   writer (worker)       payload + entry header copied into the slot (plain stores)
 *   writer (commit)       xxh, state (relaxed); gen = odd + 1 (release)
 *   reader (read_begin)   g = gen (acquire); g even, state COMMITTED, key ours (relaxed)
 *   reader (its copy)     xxh, entry header and payload copied out (plain loads)
 *   reader (read_end)     fence(acquire); gen (relaxed) == g, else a miss
 *
 * - A reader whose first load sees commit's even g (acquire / release) sees everything written
 *   before that commit: the key, xxh and the payload bytes.
 * - A reader whose copy or key loads see any store of a later writer (which follow that
 *   writer's odd generation and release fence) sees, after its acquire fence, that odd
 *   generation or a later one: g changed, the read is a miss. This is the seqlock pattern
 *   (Linux's seqcount; Boehm, "Can seqlocks get along with programming language memory
 *   models?", MSPC 2012): the plain copies between the acquire load and the acquire fence are
 *   racy only when the read is then discarded.
 * - The copies run in other threads than begin_write/commit (the store's workers); the thread
 *   pool's hand-off (a lock release/acquire) orders them after begin_write and before commit.
 * - The atomics are lock-free (checked below), hence address-free: they work between processes
 *   that map the same file at different addresses (C11 7.17.5, note).
 *
 * Every function is tiny and called with the GIL held (ctypes.PyDLL): a GIL release per call
 * would cost more than the call.
 */
#include <stdatomic.h>
#include <stdint.h>

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free (address-free)");
_Static_assert(ATOMIC_CHAR_LOCK_FREE == 2, "8-bit atomics must be lock-free (address-free)");

enum { SLOT_FREE = 0, SLOT_WRITING = 1, SLOT_COMMITTED = 2 };

/* The slot metadata columns of one mapped arena (arena_layout.py's "slot meta"). */
typedef struct {
    _Atomic uint64_t *gen, *key0, *key1, *xxh, *stamp, *owner;
    _Atomic uint8_t *state, *ref;
} pdkv_slots;

#define LOAD(p, order) atomic_load_explicit((p), memory_order_##order)
#define STORE(p, v, order) atomic_store_explicit((p), (v), memory_order_##order)

/* The generation of `slot` if it is COMMITTED to key (d0, d1), else -1. A lock-free read
 * starts here; what the caller reads of the slot next (its xxh, header, payload) is the key's
 * if pdkv_read_end then returns 1. */
int64_t pdkv_read_begin(const pdkv_slots *s, uint64_t slot, uint64_t d0, uint64_t d1) {
    uint64_t gen = LOAD(&s->gen[slot], acquire);
    if ((gen & 1) || LOAD(&s->state[slot], relaxed) != SLOT_COMMITTED ||
        LOAD(&s->key0[slot], relaxed) != d0 || LOAD(&s->key1[slot], relaxed) != d1)
        return -1;
    return (int64_t)gen;
}

/* 1 if `slot` is still at generation `gen` after the caller's copy (then sets its reference
 * bit: a hint for the CLOCK sweep), else 0: the bytes copied may be torn, a miss. */
int pdkv_read_end(const pdkv_slots *s, uint64_t slot, uint64_t gen) {
    atomic_thread_fence(memory_order_acquire);
    if (LOAD(&s->gen[slot], relaxed) != gen)
        return 0;
    if (!LOAD(&s->ref[slot], relaxed)) /* no store (and no cache line bounced) when set */
        STORE(&s->ref[slot], 1, relaxed);
    return 1;
}

/* Mark `slot` WRITING for key (d0, d1) and `owner` (generation made odd, before any other store
 * of this claim or of the copy that follows); returns that generation. Arena lock held. */
uint64_t pdkv_begin_write(const pdkv_slots *s, uint64_t slot, uint64_t d0, uint64_t d1,
                          uint64_t owner, uint64_t stamp) {
    uint64_t gen = (LOAD(&s->gen[slot], relaxed) + 1) | 1;
    STORE(&s->gen[slot], gen, relaxed);
    atomic_thread_fence(memory_order_release);
    STORE(&s->state[slot], SLOT_WRITING, relaxed);
    STORE(&s->ref[slot], 0, relaxed);
    STORE(&s->key0[slot], d0, relaxed);
    STORE(&s->key1[slot], d1, relaxed);
    STORE(&s->owner[slot], owner, relaxed);
    STORE(&s->stamp[slot], stamp, relaxed);
    return gen;
}

/* Publish `slot` claimed at generation `gen` as COMMITTED with payload checksum `xxh`
 * (generation made even, after every store of the entry); 0 if the claim was lost meanwhile
 * (reclaimed as stale). Arena lock held. */
int pdkv_commit(const pdkv_slots *s, uint64_t slot, uint64_t gen, uint64_t xxh) {
    if (LOAD(&s->gen[slot], relaxed) != gen)
        return 0;
    STORE(&s->xxh[slot], xxh, relaxed);
    STORE(&s->state[slot], SLOT_COMMITTED, relaxed);
    STORE(&s->gen[slot], gen + 1, release);
    return 1;
}

/* Mark `slot` FREE (the generation moves on, even): a reader mid-copy misses. Arena lock held. */
void pdkv_free(const pdkv_slots *s, uint64_t slot) {
    uint64_t gen = (LOAD(&s->gen[slot], relaxed) | 1) + 1;
    STORE(&s->state[slot], SLOT_FREE, relaxed);
    STORE(&s->gen[slot], gen, release);
}

/* One CLOCK step over slots [lo, hi): writes into `out` (at most `want`) the slots a claim may
 * take (FREE, or COMMITTED with a clear reference bit), clears the reference bit of every slot
 * passed, and returns how many it found; the hand stops after the last one taken, or at hi
 * (*end). Arena lock held. */
int64_t pdkv_clock_scan(const pdkv_slots *s, uint64_t lo, uint64_t hi, int64_t want,
                        int64_t *out, uint64_t *end) {
    int64_t found = 0;
    uint64_t slot = lo;
    for (; slot < hi && found < want; slot++) {
        uint8_t state = LOAD(&s->state[slot], relaxed);
        uint8_t ref = LOAD(&s->ref[slot], relaxed);
        if (ref) /* a hit landing between the load and the store loses its bit: a hint only */
            STORE(&s->ref[slot], 0, relaxed);
        if (state == SLOT_FREE || (state == SLOT_COMMITTED && ref == 0))
            out[found++] = (int64_t)slot;
    }
    *end = slot;
    return found;
}
