// Weight-streaming matrix-vector kernels for batch-1 decode on CPU (built by kernels/native.py).
//
// Decode reads every weight once per token; the only goal here is to stream W [N, K] (row-major,
// PyTorch's [out, in]) at close to the memory bandwidth while computing T <= 8 dot products
// per row (T tokens: one decode step, or a short speculative verification). Each weight byte is
// loaded once into registers and used for all T tokens; the activations (T x K, a few KB) stay
// in L1; W is read strictly front to back (see dot_row).
//
// Fusions that save a separate pass (and a Python-level op) per layer:
//   - residual: y = x W^T + r (attention output and MLP down projections);
//   - SwiGLU: W = [gate; up] (2F rows), y[j] = silu(g_j) * u_j;
//   - a whole run of decoder layers in one call (sb_layers, below).
//
// Accumulation is fp32 (like oneDNN/MKL); bf16 weights/activations are multiplied exactly and the
// output rounded to nearest-even. Threads: OpenMP over rows; this library links the same libgomp
// soname as PyTorch, so it shares PyTorch's runtime (the caller passes torch's thread count).
//
// What runs where (chosen at compile time by -march=native; sb_has_avx512 reports the first):
//   - AVX-512F (e.g. AMD Zen 4, Intel Skylake-SP and later): 16-lane dot_row for fp32 weights;
//     bf16 weights with one vdpbf16ps per 32 pairs where AVX512-BF16 exists, else widened by
//     shift/mask; vectorised exp; 16-key transposed attention scores for many query rows.
//   - AVX2 + FMA without AVX-512 (e.g. AMD Zen 2/3, Intel Haswell to Comet Lake): the same
//     design with 8-lane vectors (bf16 widened by shift/mask 16 at a time), tuned separately
//     (partial sums, prefetch distance) on an AVX2-only AMD EPYC.
//   - anything else: scalar loops that the compiler vectorises (`omp simd`), one token at a time.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <omp.h>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__)
#define SB_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define SB_AVX2 1
#endif

namespace {

constexpr int kMaxT = 8;

// Scratch buffers of the layer kernels: 64-byte aligned (a cache line; the weights, PyTorch
// tensors, are too) and kept across calls, per thread and use. They were std::vectors, which
// glibc aligns to 16 bytes only: whether a call's activations happened to start on a cache line
// decided whether the x loads of dot_row split lines, and a 4-8-token forward of SmolLM2-135M
// took 25 / 37 ms instead of 13 / 22 ms (4 / 8 tokens, AVX2 host; 1 token unaffected) -- by
// heap history, so timings flipped between the two levels within one process and differed
// between processes. Every user writes the whole range it reads.
enum ScratchUse { kXin, kQkv, kAtt, kAct, kGate, kUp, kExp, kProbs, kPart, kPrep, kScratchUses };
constexpr uintptr_t kLine = 64;

template <typename V>
V* scratch(ScratchUse use, long n) {
    thread_local std::vector<char> bufs[kScratchUses];
    std::vector<char>& b = bufs[use];
    const size_t bytes = static_cast<size_t>(n) * sizeof(V) + kLine;
    if (b.size() < bytes) b.resize(bytes);
    const uintptr_t p = reinterpret_cast<uintptr_t>(b.data());
    return reinterpret_cast<V*>((p + kLine - 1) & ~(kLine - 1));
}

inline float bf16_to_f32(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (NaN kept quiet)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// out[t] = W[row] . x[t] for one row of K weights, read front to back. One sequential stream
// per core is what the hardware prefetchers handle best: blocking several rows (R interleaved
// streams, even with software prefetch) streamed ~20% slower on the AVX-512 machine. U partial
// sums per token keep enough independent FMA chains in flight when T is small. AVX2 (8 lanes)
// measured best with the same U as AVX-512 at T = 1 (4: 8 made the per-row reduction cost more
// than it saved on 576-wide rows) but U = 2 up to T = 4 (T = 3: +50% over 1).
template <int T>
constexpr int partial_sums() {
#if defined(SB_AVX2)
    return T == 1 ? 4 : (T <= 4 ? 2 : 1);
#else
    return T == 1 ? 4 : (T == 2 ? 2 : 1);
#endif
}

// Software prefetch this far ahead of the loads (bytes; the next rows once near a row's end).
// AVX-512 machine (AMD EPYC, 1 core): +15% over the hardware prefetchers alone (~30 -> ~35 GB/s
// vs ~40 GB/s for a plain sequential read); 1-8 KB all helped; 4 KB was the best measured.
// AVX2 machine (AMD EPYC Zen 3, 16-18 GB/s plain sequential read per core, where any software
// prefetch slows that plain read down): over all the weights of SmolLM2's 30 layers, 1 KB was
// the best distance for bf16 at every T (T = 1: 15 GB/s, vs 13.7 without, 12.5 with 4 KB) and
// for fp32 from T = 2; fp32 at T = 1 streamed best 256 B ahead (17.5 GB/s, vs 15 with 1 KB).
template <int T, typename W>
constexpr long prefetch_bytes() {
#if defined(SB_AVX2)
    return sizeof(W) == 4 && T == 1 ? 256 : 1024;
#else
    return 4096;
#endif
}

template <int T, typename W>
inline void prefetch_ahead(const W* p) {
#if defined(SB_AVX512) || defined(SB_AVX2)
    _mm_prefetch(reinterpret_cast<const char*>(p) + prefetch_bytes<T, W>(), _MM_HINT_T0);
#else
    (void)p;
#endif
}

#if defined(__AVX512F__)
template <int T>
inline void dot_row(const float* w, long K, const float* x, long xs, float out[T]) {
    constexpr int U = partial_sums<T>();
    __m512 acc[U][T];
    for (int u = 0; u < U; ++u)
        for (int t = 0; t < T; ++t) acc[u][t] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 16 * U <= K; k += 16 * U)
        for (int u = 0; u < U; ++u) {
            prefetch_ahead<T>(w + k + 16 * u);
            const __m512 wv = _mm512_loadu_ps(w + k + 16 * u);
            for (int t = 0; t < T; ++t)
                acc[u][t] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + t * xs + k + 16 * u), acc[u][t]);
        }
    for (; k < K; k += 16) {
        const __mmask16 m = K - k >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
        const __m512 wv = _mm512_maskz_loadu_ps(m, w + k);
        for (int t = 0; t < T; ++t)
            acc[0][t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + t * xs + k), acc[0][t]);
    }
    for (int t = 0; t < T; ++t) {
        for (int u = 1; u < U; ++u) acc[0][t] = _mm512_add_ps(acc[0][t], acc[u][t]);
        out[t] = _mm512_reduce_add_ps(acc[0][t]);
    }
}

inline __mmask32 mask32(long n) { return n >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << n) - 1u); }

#if defined(__AVX512BF16__)
// bf16 with AVX512-BF16: one instruction multiplies 32 bf16 weight/activation pairs exactly and
// adds them to 16 fp32 lanes; x is the raw bf16 activations here (see prepare_input).
template <int T>
inline void dot_row(const uint16_t* w, long K, const float* xraw, long xs, float out[T]) {
    constexpr int U = partial_sums<T>();
    const uint16_t* x = reinterpret_cast<const uint16_t*>(xraw);
    __m512 acc[U][T];
    for (int u = 0; u < U; ++u)
        for (int t = 0; t < T; ++t) acc[u][t] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 * U <= K; k += 32 * U)
        for (int u = 0; u < U; ++u) {
            prefetch_ahead<T>(w + k + 32 * u);
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k + 32 * u);
            for (int t = 0; t < T; ++t)
                acc[u][t] = _mm512_dpbf16_ps(acc[u][t], wv, (__m512bh)_mm512_loadu_si512(x + t * xs + k + 32 * u));
        }
    for (; k < K; k += 32) {
        const __mmask32 m = mask32(K - k);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
        for (int t = 0; t < T; ++t)
            acc[0][t] = _mm512_dpbf16_ps(acc[0][t], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * xs + k));
    }
    for (int t = 0; t < T; ++t) {
        for (int u = 1; u < U; ++u) acc[0][t] = _mm512_add_ps(acc[0][t], acc[u][t]);
        out[t] = _mm512_reduce_add_ps(acc[0][t]);
    }
}
#else
// bf16 on AVX-512 without BF16 instructions: 32 weights per load, widened without shuffles (the
// even elements are the low halves of the 32-bit lanes: shift left 16; the odd ones the high
// halves: mask), against x laid out per 32-chunk as 16 evens then 16 odds (prepare_input).
constexpr long kBf16Chunk = 32;  // weights per load
template <int T>
inline void dot_row(const uint16_t* w, long K, const float* x, long xs, float out[T]) {
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    __m512 even[T], odd[T];
    for (int t = 0; t < T; ++t) even[t] = odd[t] = _mm512_setzero_ps();
    for (long k = 0; k < K; k += 32) {
        prefetch_ahead<T>(w + k);
        const __m512i raw = K - k >= 32 ? _mm512_loadu_si512(w + k) : _mm512_maskz_loadu_epi16(mask32(K - k), w + k);
        const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
        const __m512 wo = _mm512_castsi512_ps(_mm512_and_si512(raw, hi));
        for (int t = 0; t < T; ++t) {
            even[t] = _mm512_fmadd_ps(we, _mm512_loadu_ps(x + t * xs + k), even[t]);
            odd[t] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(x + t * xs + k + 16), odd[t]);
        }
    }
    for (int t = 0; t < T; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(even[t], odd[t]));
}
#endif
#elif defined(SB_AVX2)
// AVX2 + FMA (e.g. AMD Zen 2/3 without AVX-512): the same design with 8-lane vectors.
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256i first_lanes(long n) {  // lanes [0, n) set (all for n >= 8)
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int T>
inline void dot_row(const float* w, long K, const float* x, long xs, float out[T]) {
    constexpr int U = partial_sums<T>();
    constexpr int V = U < 2 ? 2 : U;  // vectors per step: at least a 64-byte line (one prefetch)
    __m256 acc[U][T];
    for (int u = 0; u < U; ++u)
        for (int t = 0; t < T; ++t) acc[u][t] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 * V <= K; k += 8 * V)
        for (int v = 0; v < V; ++v) {
            if (v % 2 == 0) prefetch_ahead<T>(w + k + 8 * v);
            const __m256 wv = _mm256_loadu_ps(w + k + 8 * v);
            for (int t = 0; t < T; ++t)
                acc[v % U][t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * xs + k + 8 * v), acc[v % U][t]);
        }
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = _mm256_loadu_ps(w + k);
        for (int t = 0; t < T; ++t) acc[0][t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * xs + k), acc[0][t]);
    }
    if (k < K) {  // masked loads: nothing past the row (or past x) is read
        const __m256i m = first_lanes(K - k);
        const __m256 wv = _mm256_maskload_ps(w + k, m);
        for (int t = 0; t < T; ++t)
            acc[0][t] = _mm256_fmadd_ps(wv, _mm256_maskload_ps(x + t * xs + k, m), acc[0][t]);
    }
    for (int t = 0; t < T; ++t) {
        for (int u = 1; u < U; ++u) acc[0][t] = _mm256_add_ps(acc[0][t], acc[u][t]);
        out[t] = hsum(acc[0][t]);
    }
}

// bf16 weights: 16 per load, widened without shuffles as in the AVX-512 path (evens: shift left
// 16; odds: mask the high halves), against x laid out per 16-chunk as 8 evens then 8 odds
// (prepare_input). The 2 half-vectors of a chunk go to different partial sums where there are.
constexpr long kBf16Chunk = 16;  // weights per load
template <int T>
inline void dot_row(const uint16_t* w, long K, const float* x, long xs, float out[T]) {
    constexpr int U = partial_sums<T>();
    constexpr int C = U < 4 ? 2 : U / 2;  // 16-weight chunks per step (>= a 64-byte line)
    const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    __m256 acc[U][T];
    for (int u = 0; u < U; ++u)
        for (int t = 0; t < T; ++t) acc[u][t] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 16 * C <= K; k += 16 * C)
        for (int c = 0; c < C; ++c) {
            if (c % 2 == 0) prefetch_ahead<T>(w + k + 16 * c);
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 16 * c));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
            for (int t = 0; t < T; ++t) {
                const float* xt = x + t * xs + k + 16 * c;
                acc[2 * c % U][t] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xt), acc[2 * c % U][t]);
                acc[(2 * c + 1) % U][t] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xt + 8), acc[(2 * c + 1) % U][t]);
            }
        }
    for (; k < K; k += 16) {  // x is zero-padded to a multiple of 16; the weights are copied
        alignas(32) uint16_t tail[16] = {};
        const uint16_t* wk = w + k;
        if (K - k < 16) {
            std::memcpy(tail, w + k, (K - k) * sizeof(uint16_t));
            wk = tail;
        }
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wk));
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, hi));
        for (int t = 0; t < T; ++t) {
            acc[0][t] = _mm256_fmadd_ps(we, _mm256_loadu_ps(x + t * xs + k), acc[0][t]);
            acc[0][t] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(x + t * xs + k + 8), acc[0][t]);
        }
    }
    for (int t = 0; t < T; ++t) {
        for (int u = 1; u < U; ++u) acc[0][t] = _mm256_add_ps(acc[0][t], acc[u][t]);
        out[t] = hsum(acc[0][t]);
    }
}
#else
// Portable fallback (no AVX-512 or AVX2+FMA): the compiler vectorises the reduction.
template <typename W>
inline float widen(W v) { return static_cast<float>(v); }
template <>
inline float widen<uint16_t>(uint16_t v) { return bf16_to_f32(v); }

template <int T, typename W>
inline void dot_row(const W* w, long K, const float* x, long xs, float out[T]) {
    for (int t = 0; t < T; ++t) {
        float acc = 0.f;
        const float* xt = x + t * xs;
#pragma omp simd reduction(+ : acc)
        for (long k = 0; k < K; ++k) acc += widen<W>(w[k]) * xt[k];
        out[t] = acc;
    }
}
#endif

template <typename A>
inline float load_act(const A* p, long i) {
    if constexpr (sizeof(A) == 2) return bf16_to_f32(p[i]); else return p[i];
}
template <typename A>
inline void store_act(A* p, long i, float v) {
    if constexpr (sizeof(A) == 2) p[i] = f32_to_bf16(v); else p[i] = v;
}

// exp over n floats in place. AVX-512 and AVX2: 2^(x log2 e) by range reduction (n = round(x
// log2 e), r = x - n ln 2 in two steps), a degree-6 Taylor polynomial on |r| <= ln2/2 (relative
// error < 2e-7, about 2 ulp) and 2^n (scalef; AVX2: exponent bits); inputs are clamped to
// [-104, 88.7], so below -104 (also -inf) give 0 and large ones stay finite. Scalar expf
// costs ~0.3 ms per token (AVX-512 machine; SwiGLU over 30 x 1536 rows + softmax).
inline void exp_inplace(float* x, long n) {
    long i = 0;
#if defined(__AVX512F__)
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2_hi = _mm512_set1_ps(0.693359375f),
                 ln2_lo = _mm512_set1_ps(-2.12194440e-4f), lo = _mm512_set1_ps(-104.f),
                 hi = _mm512_set1_ps(88.7f);
    const float c[7] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1u);
        __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_maskz_loadu_ps(m, x + i), lo), hi);
        const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(k, ln2_hi, v);
        r = _mm512_fnmadd_ps(k, ln2_lo, r);
        __m512 p = _mm512_set1_ps(c[6]);
        for (int j = 5; j >= 0; --j) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[j]));
        _mm512_mask_storeu_ps(x + i, m, _mm512_scalef_ps(p, k));
    }
#elif defined(SB_AVX2)
    // no scalef: 2^k (k in [-150, 128]) as two factors 2^(k/2) 2^(k - k/2), each a normal float
    // built in the exponent bits, so that results below FLT_MIN round to subnormals (or 0) once.
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2_hi = _mm256_set1_ps(0.693359375f),
                 ln2_lo = _mm256_set1_ps(-2.12194440e-4f), lo = _mm256_set1_ps(-104.f),
                 hi = _mm256_set1_ps(88.7f);
    const __m256i bias = _mm256_set1_epi32(127);
    const float c[7] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(x + i), lo), hi);  // NaN, -inf -> -104
        const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 r = _mm256_fnmadd_ps(k, ln2_hi, v);
        r = _mm256_fnmadd_ps(k, ln2_lo, r);
        __m256 p = _mm256_set1_ps(c[6]);
        for (int j = 5; j >= 0; --j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[j]));
        const __m256i ki = _mm256_cvtps_epi32(k), k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
        const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
        const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_mul_ps(p, s1), s2));
    }
#endif
    for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// Threads only for large matrices (the LM head). Every OpenMP region ends in a barrier that
// waits for all its threads: when another job occupies a core, each wait lasts until the
// scheduler runs our descheduled thread again, and ~120 regions per token (one per layer GEMV)
// made 2-thread decode ~40x slower than 1 thread on this shared 2-core machine (oneDNN's
// per-GEMV regions behave the same way). One region per token bounds that damage.
constexpr long kParallelMinBytes = 16l << 20;

// y[t][n] = sum_k x[t][k] W[n][k] (+ res[t][n]); res/y in activation type A (row stride N).
// Threads take contiguous row ranges: each still streams its part of W front to back.
template <typename W, typename A, int T>
void linear_t(const float* xf, long xs, const W* w, const A* res, A* y, long N, long K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (threads > 1 && N * K * static_cast<long>(sizeof(W)) >= kParallelMinBytes)
    for (long n = 0; n < N; ++n) {
        float out[T];
        dot_row<T>(w + n * K, K, xf, xs, out);
        for (int t = 0; t < T; ++t) {
            float v = out[t];
            if (res) v += load_act(res, t * N + n);
            store_act(y, t * N + n, v);
        }
    }
}

// w = [gate (F rows); up (F rows)], y[t][j] = silu(gate_j . x_t) * (up_j . x_t).
template <typename W, typename A, int T>
void swiglu_t(const float* xf, long xs, const W* w, A* y, long F, long K, int threads) {
    float* gate = scratch<float>(kGate, T * F);  // [T, F] each
    float* up = scratch<float>(kUp, T * F);
    float* e = scratch<float>(kExp, T * F);
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (threads > 1 && 2 * F * K * static_cast<long>(sizeof(W)) >= kParallelMinBytes)
    for (long j = 0; j < F; ++j) {
        float g[T], u[T];
        dot_row<T>(w + j * K, K, xf, xs, g);
        dot_row<T>(w + (F + j) * K, K, xf, xs, u);
        for (int t = 0; t < T; ++t) {
            gate[t * F + j] = g[t];
            e[t * F + j] = -g[t];
            up[t * F + j] = u[t];
        }
    }
    exp_inplace(e, T * F);
    for (long i = 0; i < T * F; ++i) store_act(y, i, gate[i] / (1.f + e[i]) * up[i]);  // silu(g) * u
}

// The activations as fp32 rows for dot_row; returns the row stride. fp32: x itself. bf16: with
// AVX512-BF16 x itself; with AVX-512F (AVX2) per 32 (16)-element chunk, the 16 (8) even elements
// then the 16 (8) odd ones (matching the shuffle-free widening of the weights), zero-padded to
// a multiple of the chunk; otherwise plain fp32.
template <typename A>
long prepare_input(const A* x, long T, long K, const float** xf) {
    if constexpr (sizeof(A) == 4) {
        *xf = reinterpret_cast<const float*>(x);
        return K;
    } else {
#if defined(__AVX512BF16__)
        (void)T;
        *xf = reinterpret_cast<const float*>(x);  // dot_block reads the bf16 pairs directly
        return K;
#elif defined(SB_AVX512) || defined(SB_AVX2)
        constexpr long C = kBf16Chunk;
        const long kp = (K + C - 1) / C * C;
        float* buf = scratch<float>(kPrep, T * kp);
        std::fill(buf, buf + T * kp, 0.f);
        for (long t = 0; t < T; ++t)
            for (long k = 0; k < K; ++k)
                buf[t * kp + (k / C) * C + (k % 2) * (C / 2) + (k % C) / 2] = bf16_to_f32(x[t * K + k]);
        *xf = buf;
        return kp;
#else
        float* buf = scratch<float>(kPrep, T * K);
        for (long i = 0; i < T * K; ++i) buf[i] = bf16_to_f32(x[i]);
        *xf = buf;
        return K;
#endif
    }
}

#define SB_DISPATCH_T(CALL)                 \
    switch (T) {                            \
        case 1: CALL(1); break;             \
        case 2: CALL(2); break;             \
        case 3: CALL(3); break;             \
        case 4: CALL(4); break;             \
        case 5: CALL(5); break;             \
        case 6: CALL(6); break;             \
        case 7: CALL(7); break;             \
        default: CALL(8); break;            \
    }

template <typename W, typename A>
int linear_any(const void* x, const void* w, const void* res, void* y, long T, long N, long K, int threads) {
    if (T < 1 || T > kMaxT) return 1;
    const float* xf = nullptr;
    const long xs = prepare_input(static_cast<const A*>(x), T, K, &xf);
    const W* wp = static_cast<const W*>(w);
    const A* rp = static_cast<const A*>(res);
    A* yp = static_cast<A*>(y);
#define SB_LINEAR(TT) linear_t<W, A, TT>(xf, xs, wp, rp, yp, N, K, threads)
    SB_DISPATCH_T(SB_LINEAR)
#undef SB_LINEAR
    return 0;
}

template <typename W, typename A>
int swiglu_any(const void* x, const void* w, void* y, long T, long F, long K, int threads) {
    if (T < 1 || T > kMaxT) return 1;
    const float* xf = nullptr;
    const long xs = prepare_input(static_cast<const A*>(x), T, K, &xf);
    const W* wp = static_cast<const W*>(w);
    A* yp = static_cast<A*>(y);
#define SB_SWIGLU(TT) swiglu_t<W, A, TT>(xf, xs, wp, yp, F, K, threads)
    SB_DISPATCH_T(SB_SWIGLU)
#undef SB_SWIGLU
    return 0;
}


// ------------------------------------------------------------------------------------------
// A whole decoder layer (and a run of layers) for T <= 8 tokens at batch 1, in one call: the
// same computation as real/model.py's TransformerBlock op by op (RMSNorm, fused QKV, RoPE,
// KV-cache write, grouped-query attention over cache slots [0, S), output projection +
// residual, RMSNorm, SwiGLU, down projection + residual), without the ~20 PyTorch dispatches
// per layer that otherwise cost more than the weight streaming of a 135M model.
// The residual stream stays fp32 across the layers of one call; GEMV inputs are rounded to the
// weights' dtype (as the op-by-op path does); K/V are stored in the cache's dtype and read back
// from it, as the op-by-op path does.

struct LayerPtrs {  // kernels/native.py: _LayerPtrs
    const void* attn_norm;
    const void* wqkv;
    const void* wo;
    const void* ffn_norm;
    const void* w13;
    const void* w2;
    void* k_cache;  // [n_kv_heads, max_seq, head_dim] of batch row 0
    void* v_cache;
};

struct LayerDims {  // kernels/native.py: _LayerDims
    long dim, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq;
    int dtype;        // weights, activations, RoPE tables: 0 fp32, 1 bf16
    int cache_dtype;  // 0 fp32, 1 bf16
    float eps;
};

// Tensor parallelism (real/tp.py): a rank holds some of each layer's heads (n_heads, n_kv_heads
// are its own) and a slice of the FFN (ffn_dim is its own), so the output and down projections
// give partial sums. ``fn`` sums buf [n] over the ranks in place (the residual is added after,
// so it is counted once); it returns 0, or non-zero to abort the call with that code.
// fn == nullptr: a single rank, the projections add the residual directly.
typedef int (*AllReduceFn)(float* buf, long n, void* ctx);
struct AllReduce {
    AllReduceFn fn;
    void* ctx;
};

// y [T, N] = x W^T summed over the ranks, then added to the residual h (in place)
template <typename W, int T>
int project_add(const AllReduce& ar, const float* xf, long xs, const W* w, float* h, long N, long K,
                int threads) {
    if (ar.fn == nullptr) {
        linear_t<W, float, T>(xf, xs, w, h, h, N, K, threads);
        return 0;
    }
    float* part = scratch<float>(kPart, T * N);
    linear_t<W, float, T>(xf, xs, w, nullptr, part, N, K, threads);
    if (const int rc = ar.fn(part, T * N, ar.ctx)) return rc;
    for (long i = 0; i < T * N; ++i) h[i] += part[i];
    return 0;
}

template <typename A>
inline void load_row(const void* p, long off, long n, float* out) {
    const A* a = static_cast<const A*>(p) + off;
    for (long i = 0; i < n; ++i) out[i] = load_act(a, i);
}
inline void load_any(int dtype, const void* p, long off, long n, float* out) {
    if (dtype == 0) load_row<float>(p, off, n, out); else load_row<uint16_t>(p, off, n, out);
}
inline void store_any(int dtype, void* p, long off, long n, const float* in) {
    if (dtype == 0) {
        std::memcpy(static_cast<float*>(p) + off, in, n * sizeof(float));
    } else {
        uint16_t* a = static_cast<uint16_t*>(p) + off;
        for (long i = 0; i < n; ++i) a[i] = f32_to_bf16(in[i]);
    }
}

// out[t] = rms_norm(h[t]) * weight, in the weights' type A (the next GEMV's input)
template <typename A>
void rms_norm_rows(const float* h, const A* weight, A* out, long T, long dim, float eps) {
    for (long t = 0; t < T; ++t) {
        const float* x = h + t * dim;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (long i = 0; i < dim; ++i) ss += x[i] * x[i];
        const float scale = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
        for (long i = 0; i < dim; ++i) store_act(out, t * dim + i, x[i] * scale * load_act(weight, i));
    }
}

// x[t] rotated in place: x * cos + roll(x, D/2) * sin_signed (the reference's rotate-half form)
inline void rope_head(float* x, const float* cos, const float* sin, long d) {
    const long half = d / 2;
    float tmp[512];
    for (long i = 0; i < d; ++i) tmp[i] = x[i];
    for (long i = 0; i < d; ++i) x[i] = tmp[i] * cos[i] + tmp[(i + half) % d] * sin[i];
}

// Grouped-query attention of T tokens over cache slots [0, S): the rep = Hq/Hkv query heads of
// a K/V head (times T tokens) share every K row loaded. D (head_dim) is a compile-time constant
// for the common sizes so that an output row lives in registers across the S keys.
template <typename C, int D>
void attend_group(const LayerDims& dm, const float* q, const C* kh, const C* vh, const long* slots,
                  const uint8_t* mask, long S, long T, long g, float* p, float* out) {
    const long hq = dm.n_heads, d = D > 0 ? D : dm.head_dim, rep = hq / dm.n_kv_heads;
    const long qkv = (hq + 2 * dm.n_kv_heads) * d, rows = rep * T;  // query rows of this K/V head
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    long s0 = 0;
#if defined(__AVX512F__)
    if (rows >= 4) {
        // Many query rows (a verification): transpose 16 keys at a time so that each query row
        // gets 16 scores from D broadcast FMAs, instead of one horizontal sum per (row, key).
        alignas(64) float kt[512 * 16];
        for (; s0 < S; s0 += 16) {
            const long nb = S - s0 < 16 ? S - s0 : 16;
            for (long j = 0; j < 16; ++j)
                for (long i = 0; i < d; ++i) kt[i * 16 + j] = j < nb ? load_act(kh + (s0 + j) * d, i) : 0.f;
            const __mmask16 m = nb == 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << nb) - 1u);
            for (long r = 0; r < rep; ++r)
                for (long t = 0; t < T; ++t) {
                    const float* qh = q + t * qkv + (g * rep + r) * d;
                    __m512 acc = _mm512_setzero_ps();
                    for (long i = 0; i < d; ++i)
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(qh[i]), _mm512_load_ps(kt + i * 16), acc);
                    _mm512_mask_storeu_ps(p + (r * T + t) * S + s0, m, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
                }
        }
    }
#elif defined(SB_AVX2)
    if (rows >= 4) {  // as above, 8 keys at a time
        alignas(32) float kt[512 * 8];
        for (; s0 < S; s0 += 8) {
            const long nb = S - s0 < 8 ? S - s0 : 8;
            for (long j = 0; j < 8; ++j)
                for (long i = 0; i < d; ++i) kt[i * 8 + j] = j < nb ? load_act(kh + (s0 + j) * d, i) : 0.f;
            const __m256i m = first_lanes(nb);
            for (long r = 0; r < rep; ++r)
                for (long t = 0; t < T; ++t) {
                    const float* qh = q + t * qkv + (g * rep + r) * d;
                    __m256 acc = _mm256_setzero_ps();
                    for (long i = 0; i < d; ++i)
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(qh[i]), _mm256_load_ps(kt + i * 8), acc);
                    _mm256_maskstore_ps(p + (r * T + t) * S + s0, m, _mm256_mul_ps(acc, _mm256_set1_ps(scale)));
                }
        }
    }
#endif
    if (s0 > 0)  // the blocked scores above: the mask now
        for (long r = 0; r < rep; ++r)
            for (long t = 0; t < T; ++t)
                for (long s = 0; s < S; ++s)
                    if (!(mask ? mask[t * S + s] != 0 : s <= slots[t])) p[(r * T + t) * S + s] = -INFINITY;
    float kv[512];
    for (long s = s0; s < S; ++s) {
        for (long i = 0; i < d; ++i) kv[i] = load_act(kh + s * d, i);
        for (long r = 0; r < rep; ++r)
            for (long t = 0; t < T; ++t) {
                const float* qh = q + t * qkv + (g * rep + r) * d;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (long i = 0; i < d; ++i) acc += qh[i] * kv[i];
                const bool keep = mask ? mask[t * S + s] != 0 : s <= slots[t];
                p[(r * T + t) * S + s] = keep ? acc * scale : -INFINITY;
            }
    }
    for (long row = 0; row < rows; ++row) {  // softmax; a row with no allowed key gives NaN, as SDPA
        float* pr = p + row * S;
        float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
        for (long s = 0; s < S; ++s) mx = pr[s] > mx ? pr[s] : mx;
#pragma omp simd
        for (long s = 0; s < S; ++s) pr[s] -= mx;
        exp_inplace(pr, S);
#pragma omp simd reduction(+ : sum)
        for (long s = 0; s < S; ++s) sum += pr[s];
        const float inv = 1.f / sum;
#pragma omp simd
        for (long s = 0; s < S; ++s) pr[s] *= inv;
    }
    for (long row = 0; row < rows; ++row) {
        const long r = row / T, t = row % T;  // once per row
        const float* pr = p + row * S;
        float o[D > 0 ? D : 512];
        for (long i = 0; i < d; ++i) o[i] = 0.f;
        for (long s = 0; s < S; ++s) {
            const float ps = pr[s];
            const C* vs = vh + s * d;
#pragma omp simd
            for (long i = 0; i < d; ++i) o[i] += ps * load_act(vs, i);
        }
        float* dst = out + t * hq * d + (g * rep + r) * d;
        for (long i = 0; i < d; ++i) dst[i] = o[i];
    }
}

template <typename C>
void attend(const LayerDims& dm, const float* q, const C* kc, const C* vc, const long* slots,
            const uint8_t* mask, long S, long T, float* out, int threads) {
    const long hkv = dm.n_kv_heads, d = dm.head_dim, rows = dm.n_heads / hkv * T;
    (void)threads;  // single-threaded: small next to the GEMVs (see kParallelMinBytes)
    float* probs = scratch<float>(kProbs, hkv * rows * S);
    for (long g = 0; g < hkv; ++g) {
        const C* kh = kc + g * dm.max_seq * d;
        const C* vh = vc + g * dm.max_seq * d;
        float* p = probs + g * rows * S;
        if (d == 64) attend_group<C, 64>(dm, q, kh, vh, slots, mask, S, T, g, p, out);
        else if (d == 128) attend_group<C, 128>(dm, q, kh, vh, slots, mask, S, T, g, p, out);
        else attend_group<C, 0>(dm, q, kh, vh, slots, mask, S, T, g, p, out);
    }
}

template <typename W, int T>
int layer_t(const LayerDims& dm, const LayerPtrs& L, const AllReduce& ar, float* h, const long* slots,
            const float* cos, const float* sin, const uint8_t* mask, long S, int threads) {
    const long dim = dm.dim, hq = dm.n_heads, hkv = dm.n_kv_heads, d = dm.head_dim, F = dm.ffn_dim;
    const long nqkv = (hq + 2 * hkv) * d;
    W* xin = scratch<W>(kXin, T * (F > dim ? (F > hq * d ? F : hq * d) : (dim > hq * d ? dim : hq * d)));
    float* qkv = scratch<float>(kQkv, T * nqkv);
    float* att = scratch<float>(kAtt, T * hq * d);
    const float* xf = nullptr;
    long xs;

    // attention block
    rms_norm_rows<W>(h, static_cast<const W*>(L.attn_norm), xin, T, dim, dm.eps);
    xs = prepare_input<W>(xin, T, dim, &xf);
    linear_t<W, float, T>(xf, xs, static_cast<const W*>(L.wqkv), nullptr, qkv, nqkv, dim, threads);
    for (long t = 0; t < T; ++t) {
        float* row = qkv + t * nqkv;
        if constexpr (sizeof(W) == 2)  // the op-by-op path rounds the projection to bf16
            for (long i = 0; i < nqkv; ++i) row[i] = bf16_to_f32(f32_to_bf16(row[i]));
        for (long hd = 0; hd < hq + hkv; ++hd) rope_head(row + hd * d, cos + t * d, sin + t * d, d);
        for (long g = 0; g < hkv; ++g) {
            const long off = (g * dm.max_seq + slots[t]) * d;
            store_any(dm.cache_dtype, L.k_cache, off, d, row + (hq + g) * d);
            store_any(dm.cache_dtype, L.v_cache, off, d, row + (hq + hkv + g) * d);
        }
    }
    if (dm.cache_dtype == 0)
        attend<float>(dm, qkv, static_cast<const float*>(L.k_cache),
                      static_cast<const float*>(L.v_cache), slots, mask, S, T, att, threads);
    else
        attend<uint16_t>(dm, qkv, static_cast<const uint16_t*>(L.k_cache),
                         static_cast<const uint16_t*>(L.v_cache), slots, mask, S, T, att, threads);
    for (long i = 0; i < T * hq * d; ++i) store_act(xin, i, att[i]);
    xs = prepare_input<W>(xin, T, hq * d, &xf);
    if (const int rc = project_add<W, T>(ar, xf, xs, static_cast<const W*>(L.wo), h, dim, hq * d, threads))
        return rc;

    // MLP block
    rms_norm_rows<W>(h, static_cast<const W*>(L.ffn_norm), xin, T, dim, dm.eps);
    xs = prepare_input<W>(xin, T, dim, &xf);
    W* act = scratch<W>(kAct, T * F);
    swiglu_t<W, W, T>(xf, xs, static_cast<const W*>(L.w13), act, F, dim, threads);
    xs = prepare_input<W>(act, T, F, &xf);
    return project_add<W, T>(ar, xf, xs, static_cast<const W*>(L.w2), h, dim, F, threads);
}

template <typename W>
int layers_any(const LayerDims& dm, const LayerPtrs* layers, const AllReduce& ar, int n, void* hio,
               const long* slots, const void* cos_in, const void* sin_in, const uint8_t* mask, long S,
               long T, int threads) {
    if (T < 1 || T > kMaxT || dm.head_dim > 512 || dm.n_heads % dm.n_kv_heads) return 1;
    const long dim = dm.dim, d = dm.head_dim;
    std::vector<float> h(T * dim), cos(T * d), sin(T * d);
    load_any(dm.dtype, hio, 0, T * dim, h.data());
    load_any(dm.dtype, cos_in, 0, T * d, cos.data());
    load_any(dm.dtype, sin_in, 0, T * d, sin.data());
    for (int l = 0; l < n; ++l) {
        int rc = 0;
#define SB_LAYER(TT) rc = layer_t<W, TT>(dm, layers[l], ar, h.data(), slots, cos.data(), sin.data(), mask, S, threads)
        SB_DISPATCH_T(SB_LAYER)
#undef SB_LAYER
        if (rc) return rc;  // hio untouched: the caller raises (the ranks are out of step now)
    }
    store_any(dm.dtype, hio, 0, T * dim, h.data());
    return 0;
}

}  // namespace

extern "C" {
// dtype codes: 0 = fp32, 1 = bf16 (weights and activations share one dtype). Returns 0 on success.
int sb_linear(int dtype, const void* x, const void* w, const void* res, void* y, long T, long N, long K,
              int threads) {
    return dtype == 0 ? linear_any<float, float>(x, w, res, y, T, N, K, threads)
                      : linear_any<uint16_t, uint16_t>(x, w, res, y, T, N, K, threads);
}

int sb_swiglu(int dtype, const void* x, const void* w, void* y, long T, long F, long K, int threads) {
    return dtype == 0 ? swiglu_any<float, float>(x, w, y, T, F, K, threads)
                      : swiglu_any<uint16_t, uint16_t>(x, w, y, T, F, K, threads);
}

// Layers [0, n) of ``layers`` on hidden states hio [T, dim] (dims.dtype), updated in place.
// slots [T]: cache slots written; mask [T, S] (1 = attend) or null: token t sees slots <= slots[t].
// allreduce/ctx: the tensor-parallel sum (see AllReduce), or null on a single rank.
int sb_layers(const LayerDims* dims, const LayerPtrs* layers, int n, void* hio, const long* slots,
              const void* cos, const void* sin, const uint8_t* mask, long S, long T, int threads,
              AllReduceFn allreduce, void* ctx) {
    const AllReduce ar{allreduce, ctx};
    return dims->dtype == 0
               ? layers_any<float>(*dims, layers, ar, n, hio, slots, cos, sin, mask, S, T, threads)
               : layers_any<uint16_t>(*dims, layers, ar, n, hio, slots, cos, sin, mask, S, T, threads);
}

// Features of one draft token for the lookahead policies (testbed.spec.lookahead.
// draft_token_features): the k largest probabilities of softmax(x) (largest first), the entropy
// and p[token], in two passes over the logits x [n] where PyTorch needs ~8 ops and ~100 us for a
// 49k vocabulary. Pass 1: the maximum of every block of 64 (the k largest values lie in the k
// blocks with the largest maxima, so the top-k searches k * 64 values). Pass 2, in chunks:
// z = max(x - max x, -104) (so a -inf logit gives e = 0 and e z = 0, not NaN), e = exp z,
// Z = sum e, S = sum e z; entropy = log Z - S / Z. out: k + 2 floats.
int sb_token_features(const float* x, long n, long token, int k, float* out) {
    constexpr long B = 64, kChunk = 1024;
    if (n <= 0 || token < 0 || token >= n || k <= 0) return 1;
    const long nb = (n + B - 1) / B;
    std::vector<float> bmax(nb);
    float m = -INFINITY;
    for (long b = 0; b < nb; ++b) {
        const long lo = b * B, hi = std::min(n, lo + B);
        float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
        for (long i = lo; i < hi; ++i) bm = x[i] > bm ? x[i] : bm;
        bmax[b] = bm;
        m = bm > m ? bm : m;
    }
    alignas(64) float z[kChunk], e[kChunk];
    double Z = 0.0, S = 0.0;
    for (long lo = 0; lo < n; lo += kChunk) {
        const long len = std::min(kChunk, n - lo);
#pragma omp simd
        for (long i = 0; i < len; ++i) {
            const float v = x[lo + i] - m;
            z[i] = v > -104.f ? v : -104.f;
            e[i] = z[i];
        }
        exp_inplace(e, len);
        float zs = 0.f, ss = 0.f;
#pragma omp simd reduction(+ : zs, ss)
        for (long i = 0; i < len; ++i) {
            zs += e[i];
            ss += e[i] * z[i];
        }
        Z += zs;
        S += ss;
    }
    const long kk = std::min<long>(k, n), kb = std::min<long>(kk, nb);
    std::vector<long> blocks(nb);
    for (long b = 0; b < nb; ++b) blocks[b] = b;
    std::partial_sort(blocks.begin(), blocks.begin() + kb, blocks.end(),
                      [&](long a, long b) { return bmax[a] > bmax[b]; });
    std::vector<float> cand;
    cand.reserve(kb * B);
    for (long j = 0; j < kb; ++j)
        for (long i = blocks[j] * B; i < std::min(n, (blocks[j] + 1) * B); ++i) cand.push_back(x[i]);
    std::partial_sort(cand.begin(), cand.begin() + kk, cand.end(), std::greater<float>());
    for (long j = 0; j < k; ++j) out[j] = j < kk ? float(std::exp(double(cand[j]) - m) / Z) : 0.f;
    out[k] = float(std::log(Z) - S / Z);
    out[k + 1] = float(std::exp(double(x[token]) - m) / Z);
    return 0;
}

int sb_has_avx512() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
}
