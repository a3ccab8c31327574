// Same-host all-reduce (fp32 sum) through shared memory: flag + data, polled, no barrier
// (built by specbed_kernels/native.py's machinery, used by specbed_kernels/allreduce.py: ShmAllReduce).
//
// Why: a tensor-parallel forward of SmolLM2-135M does 60 all-reduces of a few KB; gloo's
// TCP round trip (tens of microseconds, plus wake-ups) costs more than the layers it splits.
// This is the low-latency idea of SwiftSpec §3.3 on a CPU: each rank writes its partial sum
// into its own slot of a shared buffer and then publishes the slot's sequence number; a rank
// polls the peers' sequence numbers (no barrier, no syscall on the fast path) and, once every
// slot shows the current number, sums the slots in rank order (the same order on every rank,
// so every rank gets bit-identical sums and the ranks' hidden states never drift apart).
// A wait that polls longer than spin_s sleeps on a futex instead (see wait_for).
//
// Double buffer: all-reduce number s uses the slots of phase s % 2. A rank can reach s + 2
// (the same slots again) only after seeing every peer's number s + 1, which each peer published
// after it finished reading the slots of s: consecutive calls never race, and a peer is never
// more than one call ahead. Inputs larger than a slot go through in slot-sized chunks.
//
// Layout (sb_ar_bytes): [phase 0: rank 0 slot, rank 1 slot, ...][phase 1: ...]; a slot is a
// 64-byte header (sequence number and sleeper count, alone on their cache line) + capacity floats,
// padded to 64.

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SB_PAUSE() _mm_pause()
#else
#define SB_PAUSE() ((void)0)
#endif

namespace {

constexpr long kHeader = 64;

struct Context {  // specbed_kernels/allreduce.py: _ShmContext
    char* base;        // the mapped buffer (sb_ar_bytes(world, capacity) bytes, zeroed)
    long rank, world;
    long capacity;     // floats per slot
    long seq;          // all-reduces (chunks) done by this rank
    double timeout_s;  // per wait
    double spin_s;     // poll this long before sleeping on the futex
    long failed_peer;  // set when a wait timed out
};

inline long slot_bytes(long capacity) { return kHeader + (capacity * 4 + 63) / 64 * 64; }

inline char* slot(const Context& c, long phase, long r) {
    return c.base + (phase * c.world + r) * slot_bytes(c.capacity);
}

// A slot's header: the sequence number published (32 bits: a futex word; compared for equality,
// so wrapping is harmless) and how many peers sleep on it.
inline uint32_t* flag(char* s) { return reinterpret_cast<uint32_t*>(s); }
inline uint32_t* sleepers(char* s) { return reinterpret_cast<uint32_t*>(s + 4); }
inline float* data(char* s) { return reinterpret_cast<float*>(s + kHeader); }

inline long futex(uint32_t* word, int op, uint32_t val, const timespec* timeout) {
    return syscall(SYS_futex, word, op, val, timeout, nullptr, 0);  // shared (not _PRIVATE): across processes
}

// Wait until slot s shows sequence number seq; false on timeout. Polls for spin_s (the peer is
// usually a few microseconds away on its own core); then sleeps on the flag's futex, so that a
// rank whose peer was descheduled (a shared, oversubscribed machine) gives its core away
// instead of burning its scheduler share. The publisher wakes sleepers (Dekker-style: each side
// writes its word, then reads the other's, both sequentially consistent: no lost wake-up).
bool wait_for(const Context& c, char* s, uint32_t seq) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto spin_until = start + std::chrono::duration<double>(c.spin_s);
    for (long spins = 0;; ++spins) {
        if (__atomic_load_n(flag(s), __ATOMIC_ACQUIRE) == seq) return true;
        SB_PAUSE();
        if ((spins & 63) == 63 && clock::now() > spin_until) break;
    }
    const auto deadline = start + std::chrono::duration<double>(c.timeout_s);
    const timespec nap{0, 2000000};  // 2 ms: re-check the deadline now and then
    for (;;) {
        __atomic_fetch_add(sleepers(s), 1, __ATOMIC_SEQ_CST);
        const uint32_t seen = __atomic_load_n(flag(s), __ATOMIC_SEQ_CST);
        if (seen != seq) futex(flag(s), FUTEX_WAIT, seen, &nap);  // returns at once if it changed
        __atomic_fetch_sub(sleepers(s), 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(flag(s), __ATOMIC_ACQUIRE) == seq) return true;
        if (clock::now() > deadline) return false;
    }
}

int allreduce_chunk(Context& c, float* buf, long n) {
    const uint32_t seq = static_cast<uint32_t>(++c.seq);
    const long phase = seq & 1;
    char* mine = slot(c, phase, c.rank);
    std::memcpy(data(mine), buf, n * sizeof(float));
    __atomic_store_n(flag(mine), seq, __ATOMIC_SEQ_CST);  // publishes the data written above
    if (__atomic_load_n(sleepers(mine), __ATOMIC_SEQ_CST) != 0) futex(flag(mine), FUTEX_WAKE, INT_MAX, nullptr);
    for (long r = 0; r < c.world; ++r) {
        if (r != c.rank && !wait_for(c, slot(c, phase, r), seq)) {
            c.failed_peer = r;
            return 2;
        }
    }
    const float* first = data(slot(c, phase, 0));
    for (long i = 0; i < n; ++i) buf[i] = first[i];
    for (long r = 1; r < c.world; ++r) {
        const float* part = data(slot(c, phase, r));
#pragma omp simd
        for (long i = 0; i < n; ++i) buf[i] += part[i];
    }
    return 0;
}

}  // namespace

extern "C" {
// Bytes of the shared buffer for `world` ranks with slots of `capacity` floats.
long sb_ar_bytes(long world, long capacity) { return 2 * world * slot_bytes(capacity); }

// buf [n] (fp32) summed over the ranks, in place. 0 on success; 2 if a peer did not arrive
// within the timeout (ctx->failed_peer names it). Signature of gemv.cpp's AllReduceFn.
int sb_ar_allreduce(float* buf, long n, void* ctx) {
    Context& c = *static_cast<Context*>(ctx);
    for (long off = 0; off < n; off += c.capacity) {
        const long len = n - off < c.capacity ? n - off : c.capacity;
        if (const int rc = allreduce_chunk(c, buf + off, len)) return rc;
    }
    return 0;
}
}
