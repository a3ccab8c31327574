// Weight-streaming GEMM kernels for speculative decoding on CPU (built by specbed_kernels/native.py).
//
// A decode step or a verification multiplies T = 1..16 token rows by every weight matrix: the
// time is the weights' bytes over the memory bandwidth until the FLOPs (2 per weight per token)
// catch up with the core's FMA peak. Two things keep a T-token forward at that roofline:
//   - every weight byte is read from memory once per forward, whatever T (the panel below stays
//     in L1 while every token block uses it), and the read is one sequential stream;
//   - for T large enough to be compute bound, the FMA units are kept busy: an MR x NR register
//     tile (MR tokens x NR output features) where each weight vector loaded is used MR times and
//     each broadcast activation 2 times, with no horizontal sums (BLIS's outer-product
//     micro-kernel, with the weights as its packed B operand).
//
// Packed weights (sb_pack; specbed_kernels/native.py keeps one packed copy per weight tensor): W [N, K]
// (PyTorch's [out, in]) in panels of NR = 2 vectors of output features, each panel [K][NR],
// zero-padded to a whole panel. bf16 panels are stored so that one load widens into the panel's
// two fp32 vectors without shuffles: 32-bit lane i holds features i (low half) and VL + i (high
// half), i.e. `x << 16` and `x & 0xffff0000`. With AVX512-BF16 a panel is [K/2][NR][2] (K pairs
// adjacent) for vdpbf16ps, which multiplies 32 bf16 pairs per instruction.
// A "paired" panel (SwiGLU's [gate; up] rows) holds gate features j..j+VL in its first vector and
// the matching up features in its second, so silu(g) * u is formed from one tile.
//
// The loop: for each panel (threads split the panels of large matrices), for each K chunk of
// kChunk steps, for each block of <= MR tokens: the tile's accumulators are loaded (or zeroed),
// the chunk multiplied, the tile stored. Chunking makes the token blocks take turns on a piece of
// panel that sits in L1, so the memory stream runs throughout the forward instead of during the
// first block only. Activations are packed per block as [K][MR] fp32 (bf16 ones widened exactly;
// AVX512-BF16: [K/2][MR] bf16 pairs), a few KB.
//
// Where many rows are compute bound (8-64 rows, docs/kernels.md) the tile is not all: in a
// batched forward (16 requests x 4 tokens, bf16, AVX2) attention took ~23% of the time, its scores
// one FMA chain per (row, 8 keys) behind scalar key transposes; with 2 rows x 4 key blocks of
// chains in flight, 8 x 8 vector transposes and V loaded once for 4 rows it takes ~11%, with the
// same results bit for bit. Widening each bf16 chunk once for all blocks (into an fp32 copy in
// L1) instead of once per block measured no gain (0.86-1.05x on the layers' GEMMs at 8-64 rows,
// benchmarks/bench_gemm_rows.py): the widening is not what holds bf16 back there. With several
// token blocks, each block's walk of a chunk prefetches its own share of the next chunk, so the
// memory stream runs through every walk instead of in bursts during the first block's (paired
// against prefetching ahead of the loads in every walk: 0.90-0.97x the time at 7-8 rows, the
// same from 12 rows on; docs/kernels.md).
//
// ISAs (compile time, -march=native): AVX-512F (16 lanes, MR <= 12), AVX-512 BF16 for bf16
// weights, AVX2 + FMA (8 lanes, MR <= 6), or a portable vector-extension path (8 lanes, MR <= 6).
// Accumulation is fp32; bf16 products are exact; outputs are rounded to nearest-even.

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
#if defined(__AVX512BF16__)
#define SB_BF16DOT 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define SB_AVX2 1
#endif

namespace {

// ------------------------------------------------------------------------------ vectors
#if defined(SB_AVX512)
using vf = __m512;
constexpr int VL = 16;
constexpr int kMaxMR = 12;  // 24 accumulators + 2 weights + 1 broadcast of 32 registers
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vbcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 widen16(const uint16_t* p) {  // 16 consecutive bf16 as fp32 (exact)
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline void vwiden(const uint16_t* p, vf& lo, vf& hi) {
    const __m512i raw = _mm512_loadu_si512(p);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    hi = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#elif defined(SB_AVX2)
using vf = __m256;
constexpr int VL = 8;
constexpr int kMaxMR = 6;  // 12 accumulators + 2 weights + 1 broadcast of 16 registers
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vbcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline void vwiden(const uint16_t* p, vf& lo, vf& hi) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#else
typedef float vf __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(32)));
constexpr int VL = 8;
constexpr int kMaxMR = 6;
inline vf vzero() { return vf{}; }
inline vf vload(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf vbcast(const float* p) { return vf{} + *p; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline void vwiden(const uint16_t* p, vf& lo, vf& hi) {
    vu raw;
    std::memcpy(&raw, p, sizeof raw);
    const vu l = raw << 16, h = raw & 0xffff0000u;
    std::memcpy(&lo, &l, sizeof lo);
    std::memcpy(&hi, &h, sizeof hi);
}
#endif
#if !defined(SB_AVX512) && !defined(SB_AVX2)
inline void _mm_prefetch(const char*, int) {}
#define _MM_HINT_T0 0
#define _MM_HINT_T1 0
#endif
// Keeps a loaded weight vector in a register: without it GCC folds the load into each FMA as a
// memory operand (for tiles of 3-4 rows), loading it MR times, and the tile runs at ~45% of
// the FMA peak instead of ~85% (load ports).
#if defined(SB_AVX512) || defined(SB_AVX2)
#define SB_IN_REGISTER(v) asm volatile("" : "+x"(v))
#else
#define SB_IN_REGISTER(v) (void)0
#endif
constexpr int NR = 2 * VL;      // output features per panel
#ifndef SB_CHUNK
#define SB_CHUNK 64
#endif
#ifndef SB_PREFETCH
#if defined(SB_AVX512)  // paired whole forwards, Zen 4: 4 KB 0.93-0.99x the time of 2 KB at k = 4-8
#define SB_PREFETCH 4096
#else  // AVX2 (Zen 3): 2 KB as fast as 4 KB or faster (docs/kernels.md)
#define SB_PREFETCH 2048
#endif
#endif
constexpr long kChunk = SB_CHUNK;        // K steps per chunk (a chunk of a panel: 8 KB fp32 on AVX2)
constexpr long kPrefetch = SB_PREFETCH;  // bytes of panel prefetched ahead of the loads
#ifndef SB_PREFETCH_FAR
#if defined(SB_AVX512)
#define SB_PREFETCH_FAR 32768
#else
#define SB_PREFETCH_FAR 0
#endif
#endif
// Tiles of >= kFarMinRows rows (near the compute bound) also prefetch into L2 this far ahead (0:
// not): their loop issues the near prefetches at the FMAs' pace, too late to keep the stream
// going (paired whole forwards, Zen 4: 0.74-0.91x the time at k = 8; for 1-4 rows, memory bound,
// the extra prefetches cost 6-15 %, hence the threshold)
constexpr long kPrefetchFar = SB_PREFETCH_FAR;
#ifndef SB_FAR_MIN_ROWS
#define SB_FAR_MIN_ROWS 6
#endif
constexpr int kFarMinRows = SB_FAR_MIN_ROWS;
#ifndef SB_PF_CHUNKS
#define SB_PF_CHUNKS 1
#endif
constexpr long kPfChunks = SB_PF_CHUNKS;  // chunks ahead that several token blocks prefetch
constexpr long kMaxTokens = 64; // rows per sb_layers call (attention scratch grows with T^2)

// Scratch buffers: 64-byte aligned and kept across calls, per thread and use (the x loads of a
// tile must not split cache lines by heap accident). Every user writes the range it reads.
enum ScratchUse { kXin, kQkv, kAtt, kAct, kProbs, kPart, kPack, kValues, kKeys, kScratchUses };
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

template <typename A>
inline float load_act(const A* p, long i) {
    if constexpr (sizeof(A) == 2) return bf16_to_f32(p[i]); else return p[i];
}
template <typename A>
inline void store_act(A* p, long i, float v) {
    if constexpr (sizeof(A) == 2) p[i] = f32_to_bf16(v); else p[i] = v;
}

// ------------------------------------------------------------------------------ packing
// Elements (of the weight dtype) of a packed [N, K] matrix.
inline long packed_k(int dtype, long K) {
#if defined(SB_BF16DOT)
    return dtype == 1 ? (K + 1) / 2 * 2 : K;
#else
    (void)dtype;
    return K;
#endif
}
inline long packed_elems(int dtype, long N, long K) { return (N + NR - 1) / NR * NR * packed_k(dtype, K); }

// Source row of panel feature f (0..NR) in panel p: plain, or SwiGLU-paired over F = N / 2.
inline long source_row(bool paired, long N, long p, long f) {
    if (!paired) return p * NR + f;
    const long j = p * VL + f % VL;
    return j >= N / 2 ? -1 : (f < VL ? j : N / 2 + j);
}

template <typename W>
void pack(const W* w, bool paired, long N, long K, W* out) {
    const long np = paired ? (N / 2 + VL - 1) / VL : (N + NR - 1) / NR;
    const long kp = packed_k(sizeof(W) == 2, K);
    for (long p = 0; p < np; ++p) {
        W* dst = out + p * NR * kp;
        for (long f = 0; f < NR; ++f) {
            long r = source_row(paired, N, p, f);
            if (r >= N) r = -1;
            const W* src = r < 0 ? nullptr : w + r * K;
            for (long k = 0; k < kp; ++k) {
                const W v = (src && k < K) ? src[k] : W(0);
                long at;
                if constexpr (sizeof(W) == 4) {
                    at = k * NR + f;
                } else {
#if defined(SB_BF16DOT)
                    at = (k / 2) * 2 * NR + f * 2 + k % 2;  // [K/2][NR][2]
#else
                    at = k * NR + (f < VL ? 2 * f : 2 * (f - VL) + 1);  // lane i: (f=i, f=VL+i)
#endif
                }
                dst[at] = v;
            }
        }
    }
}

// ------------------------------------------------------------------------------ exp
// exp over n floats in place: 2^(x log2 e) by range reduction (n = round(x log2 e), r = x - n ln 2
// in two steps), a degree-6 Taylor polynomial on |r| <= ln2/2 (relative error < 2e-7) and 2^n;
// inputs clamped to [-104, 88.7] (-inf gives 0, large ones stay finite).
inline void exp_inplace(float* x, long n) {
    long i = 0;
#if defined(SB_AVX512)
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
#if defined(SB_AVX512) || defined(SB_AVX2)
    if (i < n) {  // the tail through the same vector code: a value's exp must not depend on n
        alignas(64) float tail[16] = {};
        std::memcpy(tail, x + i, (n - i) * sizeof(float));
        exp_inplace(tail, 16);
        std::memcpy(x + i, tail, (n - i) * sizeof(float));
    }
#else
    for (; i < n; ++i) x[i] = std::exp(std::min(std::max(x[i], -104.f), 88.7f));
#endif
}

// ------------------------------------------------------------------------------ micro-kernel
// The weights of one K step of a panel in two fp32 vectors: fp32 as they are, bf16 widened.
inline void load_step(const float* wk, vf& w0, vf& w1) {
    w0 = vload(wk);
    w1 = vload(wk + VL);
}
inline void load_step(const uint16_t* wk, vf& w0, vf& w1) { vwiden(wk, w0, w1); }

// The near prefetch of a tile of MR rows: into L1, or, for a forward's one block of 6-9 rows
// (whose far prefetch has already asked L2 for the line, and whose FMAs about match its reads),
// into L2 too. Paired whole forwards, Zen 4, two runs: 6, 7, 8 tokens at 0.89-0.91, 0.93-0.95,
// 0.96-0.98x the time with the near prefetch into L2; 9 at 0.99-1.00x; 10-16 tokens (10-12 rows:
// compute bound; 13-16: two blocks sharing the prefetches) 1.00-1.01x, hence the range; without
// the far prefetch (4 tokens) into L2 alone took 1.25x.
constexpr int kL2NearMaxRows = 9;
template <int MR>
inline void near_prefetch(const char* p, bool one_block) {
    if constexpr (kPrefetchFar > 0 && MR >= kFarMinRows && MR <= kL2NearMaxRows) {
        if (one_block) {
            _mm_prefetch(p, _MM_HINT_T1);
            return;
        }
    }
    _mm_prefetch(p, _MM_HINT_T0);
}

// acc (MR x NR tile, fp32, row stride NR) += x block (packed, MR tokens) times steps [k0, k1) of
// one panel. One accumulator per output: every output's sum is the same sequence over k for
// every tile height, i.e. for every number of tokens in the forward (batch invariance, see
// sequential_sum). Split accumulators would give small tiles more FMA chains (a 2-row tile:
// ~45% -> ~60% of the peak in L2) at the price of that invariance.
template <int MR, typename W>
inline void tile_steps(const W* panel, const float* xp, long k0, long k1, float* acc, bool first,
                       const char* pf, long pf_step) {
    vf c[MR][2];
    for (int m = 0; m < MR; ++m) {
        c[m][0] = first ? vzero() : vload(acc + m * NR);
        c[m][1] = first ? vzero() : vload(acc + m * NR + VL);
    }
    // a step of an AVX-512 fp32 panel is two cache lines: prefetching one per step left every
    // other line to the hardware prefetcher (a one-token forward at ~60 % of the read roofline)
    const bool two_lines = pf_step >= 128;
    const bool one_block = pf_step == NR * static_cast<long>(sizeof(W));  // gemm: a step's bytes
    for (long k = k0; k < k1; ++k) {
        const W* wk = panel + k * NR;
        near_prefetch<MR>(pf + (k - k0) * pf_step, one_block);
        if (two_lines) near_prefetch<MR>(pf + (k - k0) * pf_step + 64, one_block);
        if constexpr (kPrefetchFar > 0 && MR >= kFarMinRows) {
            _mm_prefetch(pf + (k - k0) * pf_step + kPrefetchFar, _MM_HINT_T1);
            if (two_lines) _mm_prefetch(pf + (k - k0) * pf_step + kPrefetchFar + 64, _MM_HINT_T1);
        }
        vf w0, w1;
        load_step(wk, w0, w1);
        SB_IN_REGISTER(w0);
        SB_IN_REGISTER(w1);
        for (int m = 0; m < MR; ++m) {
            const vf xb = vbcast(xp + k * MR + m);
            c[m][0] = vfma(w0, xb, c[m][0]);
            c[m][1] = vfma(w1, xb, c[m][1]);
        }
    }
    for (int m = 0; m < MR; ++m) {
        vstore(acc + m * NR, c[m][0]);
        vstore(acc + m * NR + VL, c[m][1]);
    }
}

#if defined(SB_BF16DOT)
// bf16 with AVX512-BF16: per K pair, vdpbf16ps multiplies 16 features x 2 k exactly and adds
// both products to the fp32 lanes; xp holds the block's bf16 pairs [K/2][MR] (as 32-bit words).
template <int MR>
inline void tile_pairs(const uint16_t* panel, const float* xp_, long k0, long k1, float* acc, bool first,
                       const char* pf, long pf_step) {
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(xp_);
    vf c[MR][2];
    for (int m = 0; m < MR; ++m) {
        c[m][0] = first ? vzero() : vload(acc + m * NR);
        c[m][1] = first ? vzero() : vload(acc + m * NR + VL);
    }
    // a pair step is two K steps (two cache lines): the same prefetch plan as tile_steps',
    // every line of the panel requested (one line per pair left half to the hardware prefetcher)
    const long pair_step = 2 * pf_step;
    const bool two_lines = pair_step >= 128;
    const bool one_block = pf_step == NR * static_cast<long>(sizeof(uint16_t));  // gemm: a step's bytes
    for (long j = k0 / 2; j < (k1 + 1) / 2; ++j) {  // chunk bounds are even
        const uint16_t* wk = panel + j * 2 * NR;
        const char* pj = pf + (j - k0 / 2) * pair_step;
        near_prefetch<MR>(pj, one_block);
        if (two_lines) near_prefetch<MR>(pj + 64, one_block);
        if constexpr (kPrefetchFar > 0 && MR >= kFarMinRows) {
            _mm_prefetch(pj + kPrefetchFar, _MM_HINT_T1);
            if (two_lines) _mm_prefetch(pj + kPrefetchFar + 64, _MM_HINT_T1);
        }
        __m512i w0i = _mm512_loadu_si512(wk), w1i = _mm512_loadu_si512(wk + 2 * VL);
        SB_IN_REGISTER(w0i);
        SB_IN_REGISTER(w1i);
        const __m512bh w0 = (__m512bh)w0i, w1 = (__m512bh)w1i;
        for (int m = 0; m < MR; ++m) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[j * MR + m]));
            c[m][0] = _mm512_dpbf16_ps(c[m][0], w0, xb);
            c[m][1] = _mm512_dpbf16_ps(c[m][1], w1, xb);
        }
    }
    for (int m = 0; m < MR; ++m) {
        vstore(acc + m * NR, c[m][0]);
        vstore(acc + m * NR + VL, c[m][1]);
    }
}
#endif

template <typename W>
inline void tile(int mr, const W* panel, const float* xp, long k0, long k1, float* acc, bool first,
                 const char* pf, long pf_step) {
#if defined(SB_BF16DOT)
#define SB_TILE(M)                                                                                   \
    case M:                                                                                          \
        if constexpr (sizeof(W) == 2) tile_pairs<M>(reinterpret_cast<const uint16_t*>(panel), xp, k0, k1, acc, first, pf, pf_step); \
        else tile_steps<M, W>(panel, xp, k0, k1, acc, first, pf, pf_step);                           \
        break;
#else
#define SB_TILE(M)                                          \
    case M:                                                 \
        tile_steps<M, W>(panel, xp, k0, k1, acc, first, pf, pf_step); \
        break;
#endif
    switch (mr) {
        SB_TILE(1) SB_TILE(2) SB_TILE(3) SB_TILE(4) SB_TILE(5) SB_TILE(6)
#if defined(SB_AVX512)
        SB_TILE(7) SB_TILE(8) SB_TILE(9) SB_TILE(10) SB_TILE(11) SB_TILE(12)
#endif
        default: break;
    }
#undef SB_TILE
}

// ------------------------------------------------------------------------------ GEMM
// The token blocks of T rows, as even as possible, each <= kMaxMR (T = 16 on AVX2: 6, 5, 5):
// tiles of 4-6 rows run at ~85% of the FMA peak, smaller ones lower (AVX2 host, in L2), so a
// short remainder (6 + 1) costs more than two balanced blocks (4 + 3).
struct Blocks {
    int n, start[kMaxTokens], size[kMaxTokens];
};
inline void split_tokens(long T, Blocks& b) {
    const long nb = (T + kMaxMR - 1) / kMaxMR;
    b.n = static_cast<int>(nb);
    for (long i = 0, at = 0; i < nb; ++i) {
        b.start[i] = static_cast<int>(at);
        b.size[i] = static_cast<int>(T / nb + (i < T % nb ? 1 : 0));
        at += b.size[i];
    }
}

// Activations x [T, K] (type A) packed per token block for tile(): [K][mr] fp32, or with
// AVX512-BF16 and bf16 weights [K/2][mr] bf16 pairs. Returns the packed blocks (offsets kp*start).
template <typename W, typename A>
float* pack_x(const A* x, long xs, long T, long K, long kp, const Blocks& b) {
    float* xp = scratch<float>(kPack, T * kp + 16);
    for (int i = 0; i < b.n; ++i) {
        const long t0 = b.start[i] - b.start[0], mr = b.size[i];
        float* dst = xp + t0 * kp;
#if defined(SB_BF16DOT)
        if constexpr (sizeof(W) == 2) {
            uint32_t* d = reinterpret_cast<uint32_t*>(dst);
            for (long m = 0; m < mr; ++m) {
                const A* row = x + (t0 + m) * xs;
                for (long j = 0; j < kp / 2; ++j) {
                    const uint32_t lo = 2 * j < K ? f32_to_bf16(load_act(row, 2 * j)) : 0;
                    const uint32_t hi = 2 * j + 1 < K ? f32_to_bf16(load_act(row, 2 * j + 1)) : 0;
                    d[j * mr + m] = lo | (hi << 16);
                }
            }
            continue;
        }
#endif
        for (long m = 0; m < mr; ++m) {
            const A* row = x + (t0 + m) * xs;
            for (long k = 0; k < K; ++k) {
                float v = load_act(row, k);
                if constexpr (sizeof(W) == 2 && sizeof(A) == 4) v = bf16_to_f32(f32_to_bf16(v));
                dst[k * mr + m] = v;
            }
            for (long k = K; k < kp; ++k) dst[k * mr + m] = 0.f;
        }
    }
    return xp;
}

// Threads only for large matrices (the LM head). Every OpenMP region ends in a barrier that
// waits for all its threads: on a shared machine a descheduled thread stalls the region, and
// ~120 regions per token made 2-thread decode ~40x slower than 1 thread. One region per large
// matrix bounds that damage.
constexpr long kParallelMinBytes = 16l << 20;

// What a tile's results become (out rows have stride ldo):
enum Epilogue {
    kStore,   // out (type A) = acc (+ res)
    kAddF32,  // out (fp32) += acc  (the residual stream)
    kSwiGLU,  // out (type A) [T, N/2] = silu(gate) * up, paired panels
};

template <typename W, typename A>
void gemm(const A* x, long xs, long T, const W* wpk, long N, long K, Epilogue ep, const A* res,
          void* out, long ldo, int threads) {
    Blocks b;
    const long kp = packed_k(sizeof(W) == 2, K);
    const long cols = ep == kSwiGLU ? N / 2 : N;             // output features
    const long np = ep == kSwiGLU ? (cols + VL - 1) / VL : (N + NR - 1) / NR;
    const long per = ep == kSwiGLU ? VL : NR;                // output features per panel
    for (long t0 = 0; t0 < T; t0 += kMaxTokens) {           // prefill: a few blocks of rows at a time
        const long tn = std::min(kMaxTokens, T - t0);
        split_tokens(tn, b);
        const float* xp = pack_x<W, A>(x + t0 * xs, xs, tn, K, kp, b);
        const long chunk = b.n == 1 ? kp : kChunk;
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (threads > 1 && N * K * static_cast<long>(sizeof(W)) >= kParallelMinBytes)
        for (long p = 0; p < np; ++p) {
            alignas(64) float acc[kMaxTokens * NR];
            const W* panel = wpk + p * NR * kp;
            for (long k0 = 0; k0 < kp; k0 += chunk) {
                const long k1 = std::min(kp, k0 + chunk);
                const char* here = reinterpret_cast<const char*>(panel + k0 * NR);
                constexpr long step_bytes = NR * static_cast<long>(sizeof(W));
                for (int i = 0; i < b.n; ++i) {
                    // one block: prefetch kPrefetch ahead of its own loads. Several: each block's
                    // walk requests its share of the chunk kPfChunks ahead, so the memory stream
                    // runs through every block's walk, not in bursts during the first one's
                    const char* pf = b.n == 1 ? here + kPrefetch
                                              : here + kPfChunks * chunk * step_bytes + i * chunk * step_bytes / b.n;
                    const long pf_step = b.n == 1 ? step_bytes : std::max(1l, step_bytes / b.n);
                    tile<W>(b.size[i], panel, xp + b.start[i] * kp, k0, k1, acc + b.start[i] * NR, k0 == 0, pf, pf_step);
                }
            }
            const long n0 = p * per, nn = std::min(per, cols - n0);
            for (long m = 0; m < tn; ++m) {
                const float* a = acc + m * NR;
                const long row = t0 + m;
                if (ep == kStore) {
                    A* o = static_cast<A*>(out) + row * ldo + n0;
                    const A* r = res ? res + row * ldo + n0 : nullptr;
                    for (long j = 0; j < nn; ++j) store_act(o, j, r ? a[j] + load_act(r, j) : a[j]);
                } else if (ep == kAddF32) {
                    float* o = static_cast<float*>(out) + row * ldo + n0;
                    for (long j = 0; j < nn; ++j) o[j] += a[j];
                } else {
                    alignas(64) float e[VL];
                    for (long j = 0; j < VL; ++j) e[j] = -a[j];
                    exp_inplace(e, VL);
                    A* o = static_cast<A*>(out) + row * ldo + n0;
                    for (long j = 0; j < nn; ++j) store_act(o, j, a[j] / (1.f + e[j]) * a[VL + j]);
                }
            }
        }
    }
}


// ------------------------------------------------------------------------------ decoder layers
// A run of decoder layers for T <= kMaxTokens tokens at batch 1, in one call: the computation of
// real/model/decoder.py's TransformerBlock (RMSNorm, fused QKV, RoPE, KV-cache write, grouped-query
// attention over cache slots [0, S), output projection + residual, RMSNorm, SwiGLU, down
// projection + residual) without the ~20 PyTorch dispatches per layer that otherwise cost more
// than the weight streaming of a 135M model. The residual stream is fp32 inside a layer and
// rounded to the activations' dtype between layers, as the op-by-op path keeps it, so a run of
// layers gives the same result however it is split into calls (the stages of a pipeline); GEMM
// inputs and the QKV projection are rounded to the weights' dtype (as the op-by-op path does);
// K/V are stored in the cache's dtype and read back from it.

struct LayerPtrs {  // specbed_kernels/native.py: _LayerPtrs (weights packed by sb_pack; w13 paired)
    const void* attn_norm;
    const void* wqkv;
    const void* wo;
    const void* ffn_norm;
    const void* w13;
    const void* w2;
    void* k_cache;  // [n_kv_heads, max_seq, head_dim] of batch row 0
    void* v_cache;
};

struct LayerDims {  // specbed_kernels/native.py: _LayerDims
    long dim, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq;
    int dtype;        // weights, activations, RoPE tables: 0 fp32, 1 bf16
    int cache_dtype;  // 0 fp32, 1 bf16
    float eps;
};

// Tensor parallelism (real/model/tp.py): a rank holds some of each layer's heads (n_heads, n_kv_heads
// are its own) and a slice of the FFN (ffn_dim is its own), so the output and down projections
// give partial sums. ``fn`` sums buf [n] over the ranks in place (the residual is added after,
// so it is counted once); it returns 0, or non-zero to abort the call with that code.
typedef int (*AllReduceFn)(float* buf, long n, void* ctx);
struct AllReduce {
    AllReduceFn fn;
    void* ctx;
};

// h [T, N] += x W^T summed over the ranks
template <typename W>
int project_add(const AllReduce& ar, const W* x, long T, const W* w, float* h, long N, long K, int threads) {
    if (ar.fn == nullptr) {
        gemm<W, W>(x, K, T, w, N, K, kAddF32, nullptr, h, N, threads);
        return 0;
    }
    float* part = scratch<float>(kPart, T * N);
    std::fill(part, part + T * N, 0.f);
    gemm<W, W>(x, K, T, w, N, K, kAddF32, nullptr, part, N, threads);
    if (const int rc = ar.fn(part, T * N, ar.ctx)) return rc;
    for (long i = 0; i < T * N; ++i) h[i] += part[i];
    return 0;
}

inline void load_any(int dtype, const void* p, long n, float* out) {
    if (dtype == 0) std::memcpy(out, p, n * sizeof(float));
    else for (long i = 0; i < n; ++i) out[i] = bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}
inline void store_any(int dtype, void* p, long off, long n, const float* in) {
    if (dtype == 0) {
        std::memcpy(static_cast<float*>(p) + off, in, n * sizeof(float));
    } else {
        uint16_t* a = static_cast<uint16_t*>(p) + off;
        for (long i = 0; i < n; ++i) a[i] = f32_to_bf16(in[i]);
    }
}

// out[t] = rms_norm(h[t]) * weight, in the weights' type A (the next GEMM's input)
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

// x rotated in place: x * cos + roll(x, D/2) * sin_signed (the reference's rotate-half form)
inline void rope_head(float* x, const float* cos, const float* sin, long d) {
    const long half = d / 2;
    float tmp[512];
    for (long i = 0; i < d; ++i) tmp[i] = x[i];
    // two halves instead of an index modulo d: a division per element cost ~2 % of a forward
    for (long i = 0; i < half; ++i) x[i] = tmp[i] * cos[i] + tmp[i + half] * sin[i];
    for (long i = half; i < d; ++i) x[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

#if defined(SB_AVX2) || defined(SB_AVX512)
inline __m256i first_lanes(long n) {  // lanes [0, n) set (all for n >= 8)
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 8 keys (rows of k, d a multiple of 8) transposed into kt [d][ld] fp32 (columns 0-7 of each
// row; ld = 8 on AVX2, 16 on AVX-512: two calls fill a row of 16 keys), 8 x 8 at a time
template <typename C>
inline void transpose_keys(const C* k, long d, float* kt, long ld = 8) {
    for (long i0 = 0; i0 < d; i0 += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) {
            if constexpr (sizeof(C) == 2) {
                const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k + j * d + i0));
                r[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
            } else {
                r[j] = _mm256_loadu_ps(reinterpret_cast<const float*>(k) + j * d + i0);
            }
        }
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
        const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
        const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
        const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
        const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
        float* o = kt + i0 * ld;
        _mm256_store_ps(o + 0 * ld, _mm256_permute2f128_ps(u0, u4, 0x20));
        _mm256_store_ps(o + 1 * ld, _mm256_permute2f128_ps(u1, u5, 0x20));
        _mm256_store_ps(o + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
        _mm256_store_ps(o + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
        _mm256_store_ps(o + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
        _mm256_store_ps(o + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
        _mm256_store_ps(o + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
        _mm256_store_ps(o + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
}
#endif

#if defined(SB_AVX2)
// out rows [row0, row0 + R) of attention (row = r T + t: query head h0 + r of token t) = their
// probabilities p [rows][S] times V [S][d], 16 dimensions at a time, one FMA chain over s per output
template <typename C, int R>
inline void weigh_values(const float* p, const C* vh, long S, long d, long row0, long T, long hq, long h0,
                         float* out) {
    for (long i0 = 0; i0 < d; i0 += 16) {
        __m256 o[R][2];
        for (int r = 0; r < R; ++r) o[r][0] = o[r][1] = _mm256_setzero_ps();
        for (long s = 0; s < S; ++s) {
            __m256 v0, v1;
            if constexpr (sizeof(C) == 2) {
                const __m128i* vs = reinterpret_cast<const __m128i*>(vh + s * d + i0);
                v0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(vs)), 16));
                v1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(vs + 1)), 16));
            } else {
                const float* vs = reinterpret_cast<const float*>(vh) + s * d + i0;
                v0 = _mm256_loadu_ps(vs);
                v1 = _mm256_loadu_ps(vs + 8);
            }
            SB_IN_REGISTER(v0);  // loaded once for the R rows, not folded into each FMA
            SB_IN_REGISTER(v1);
            for (int r = 0; r < R; ++r) {
                const __m256 ps = _mm256_broadcast_ss(p + (row0 + r) * S + s);
                o[r][0] = _mm256_fmadd_ps(ps, v0, o[r][0]);
                o[r][1] = _mm256_fmadd_ps(ps, v1, o[r][1]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const long row = row0 + r;
            float* dst = out + (row % T) * hq * d + (h0 + row / T) * d + i0;
            _mm256_storeu_ps(dst, o[r][0]);
            _mm256_storeu_ps(dst + 8, o[r][1]);
        }
    }
}
#endif

#if defined(SB_AVX2)
// Scores of rows [row0, row0 + R) (row = r T + t: query head h0 + r of token t) against one block
// of 8 keys transposed in kt [d][8]: each score the same single FMA chain over i as every other
// path here, R of them in flight (one alone waits out the FMA latency at every step).
template <int R>
inline void key_block_scores(const float* q, const float* kt, long d, long qkv, long T, long h0, long row0,
                             float scale, __m256i lanes, float* p, long S) {
    const float* qr[R];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
        const long row = row0 + r;
        qr[r] = q + (row % T) * qkv + (h0 + row / T) * d;
        acc[r] = _mm256_setzero_ps();
    }
    for (long i = 0; i < d; ++i) {
        const __m256 k = _mm256_load_ps(kt + i * 8);
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(qr[r][i]), k, acc[r]);
    }
    for (int r = 0; r < R; ++r)
        _mm256_maskstore_ps(p + (row0 + r) * S, lanes, _mm256_mul_ps(acc[r], _mm256_set1_ps(scale)));
}
#endif

#if defined(SB_AVX512)
// AVX-512: scores of rows [row0, row0 + R) against G blocks of 16 keys transposed in kt [G][d][16],
// R x G chains in flight (one alone waits out the FMA latency at every step); each score is the
// single FMA chain over i that every block of this path computes, so a score does not depend on
// how many rows or keys share the call. m: the keys of the last block that exist.
template <int R, int G>
inline void key_blocks16(const float* q, const float* kt, long d, long qkv, long T, long h0, long row0,
                         float scale, __mmask16 m, float* p, long S) {
    const float* qr[R];
    __m512 acc[R][G];
    for (int r = 0; r < R; ++r) {
        const long row = row0 + r;
        qr[r] = q + (row % T) * qkv + (h0 + row / T) * d;
        for (int b = 0; b < G; ++b) acc[r][b] = _mm512_setzero_ps();
    }
    for (long i = 0; i < d; ++i) {
        __m512 k[G];
        for (int b = 0; b < G; ++b) k[b] = _mm512_load_ps(kt + (b * d + i) * 16);
        for (int r = 0; r < R; ++r) {
            const __m512 x = _mm512_set1_ps(qr[r][i]);
            for (int b = 0; b < G; ++b) acc[r][b] = _mm512_fmadd_ps(x, k[b], acc[r][b]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r)
        for (int b = 0; b < G; ++b)
            _mm512_mask_storeu_ps(p + (row0 + r) * S + 16 * b, b == G - 1 ? m : __mmask16(0xffff),
                                  _mm512_mul_ps(acc[r][b], sc));
}

// 16 keys from row s0 of kh (nb of them exist) into kt [d][16] fp32, missing keys as zeros
template <typename C>
inline void keys16(const C* kh, long d, long nb, float* kt) {
    if (nb == 16 && d % 8 == 0) {
        transpose_keys(kh, d, kt, 16);
        transpose_keys(kh + 8 * d, d, kt + 8, 16);
        return;
    }
    for (long j = 0; j < 16; ++j)
        for (long i = 0; i < d; ++i) kt[i * 16 + j] = j < nb ? load_act(kh + j * d, i) : 0.f;
}

// out rows [row0, row0 + R) (row = r T + t: query head h0 + r of token t) = their probabilities
// p [rows][S] times V [S][D], D a multiple of 16 (<= 128): each V row loaded and widened once for
// the R rows; every output one FMA chain over s, the same whatever R
template <typename C, int R, int D>
inline void weigh_values16(const float* p, const C* vh, long S, long row0, long T, long hq, long h0, float* out) {
    constexpr int NV = D / 16;
    __m512 o[R][NV];
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < NV; ++j) o[r][j] = _mm512_setzero_ps();
    for (long s = 0; s < S; ++s) {
        __m512 v[NV];
        for (int j = 0; j < NV; ++j) {
            if constexpr (sizeof(C) == 2) {
                v[j] = widen16(vh + s * D + 16 * j);
            } else {
                v[j] = _mm512_loadu_ps(reinterpret_cast<const float*>(vh) + s * D + 16 * j);
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m512 ps = _mm512_set1_ps(p[(row0 + r) * S + s]);
            for (int j = 0; j < NV; ++j) o[r][j] = _mm512_fmadd_ps(ps, v[j], o[r][j]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const long row = row0 + r;
        float* dst = out + (row % T) * hq * D + (h0 + row / T) * D;
        for (int j = 0; j < NV; ++j) _mm512_storeu_ps(dst + 16 * j, o[r][j]);
    }
}

// rows of one V pass: 6 (D = 64: 24 accumulators, 4 V vectors) or 3 (D = 128) at a time
template <int D>
constexpr long kValueRows = D == 64 ? 6 : 3;

// every row of weigh_values16, kValueRows<D> at a time and the rest in one call
template <typename C, int D>
inline void weigh_value_rows(const float* p, const C* vh, long S, long rows, long T, long hq, long h0, float* out) {
    constexpr long R = kValueRows<D>;
    long row = 0;
    for (; row + R <= rows; row += R) weigh_values16<C, R, D>(p, vh, S, row, T, hq, h0, out);
    switch (rows - row) {
        case 5: if constexpr (R > 5) weigh_values16<C, 5, D>(p, vh, S, row, T, hq, h0, out); break;
        case 4: if constexpr (R > 4) weigh_values16<C, 4, D>(p, vh, S, row, T, hq, h0, out); break;
        case 3: if constexpr (R > 3) weigh_values16<C, 3, D>(p, vh, S, row, T, hq, h0, out); break;
        case 2: weigh_values16<C, 2, D>(p, vh, S, row, T, hq, h0, out); break;
        case 1: weigh_values16<C, 1, D>(p, vh, S, row, T, hq, h0, out); break;
        default: break;
    }
}
#endif

// The K and V rows [0, S) of the group attended next (the next KV head, or the next sequence's
// first): requested into L2 a share per key while this group's keys are read, so that the cache,
// read once per forward from memory, streams at a steady rate (asked for all at once, the
// requests stalled on the full miss queue: 1.2 ms of a forward of 32 one-token requests).
struct KvNext {
    const void* k = nullptr;
    const void* v = nullptr;
    long S = 0;
};

#if defined(SB_AVX512)
// 16 vectors a[0..16) -> one whose lane j is the sum of a[j]'s 16 lanes, by a fixed tree of
// pairwise sums: in-lane unpacks and shuffles first (pairs, then fours of vectors), then across
// the four 128-bit lanes
inline __m512 sum_lanes16(__m512* a) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    const __m512 v01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    const __m512 v23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v01, v23, 0x88), _mm512_shuffle_f32x4(v01, v23, 0xdd));
}

// Scores p [rows][S] of rows (row = r T + t: query head h0 + r of token t) against the keys kh
// [S][D], each one dot product of fixed order: 16 lanes of D / 16 products each, then
// sum_lanes16. A score depends on its query and key only, never on how many rows or keys share
// the call (what greedy decoding needs to match its verifications). The keys are read once, into
// an fp32 copy (widened from bf16), in one sequential pass that pulls the keys ahead of it into L1
// and requests the next group's K and V into L2 (KvNext). Without a transpose of the keys, a
// decode's 3 rows per group cost their own FMAs, not the keys' shuffling.
template <typename C, int D>
void dot_scores(const float* q, const C* kh, long S, long rows, long qkv, long T, long h0, float scale,
                const KvNext& next, float* p) {
    constexpr int NV = D / 16;
    constexpr long kAheadKeys = 16;
    float* kf = scratch<float>(kKeys, (S + 16) * D);
    const long row_bytes = D * static_cast<long>(sizeof(C));
    const long next_lines = next.k ? next.S * row_bytes / 64 : 0;
    for (long s = 0; s < S; ++s) {
        if (s + kAheadKeys < S)  // from L2 (see KvNext) into L1
            for (long b = 0; b < row_bytes; b += 64)
                _mm_prefetch(reinterpret_cast<const char*>(kh + (s + kAheadKeys) * D) + b, _MM_HINT_T0);
        for (long l = s * next_lines / S; l < (s + 1) * next_lines / S; ++l) {
            _mm_prefetch(static_cast<const char*>(next.k) + 64 * l, _MM_HINT_T1);
            _mm_prefetch(static_cast<const char*>(next.v) + 64 * l, _MM_HINT_T1);
        }
        for (int j = 0; j < NV; ++j) {
            __m512 v;
            if constexpr (sizeof(C) == 2) {
                v = widen16(kh + s * D + 16 * j);
            } else {
                v = _mm512_loadu_ps(reinterpret_cast<const float*>(kh) + s * D + 16 * j);
            }
            _mm512_store_ps(kf + s * D + 16 * j, v);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    // 16 keys (4-8 KB of fp32, in L1) at a time for every row: row by row over all keys re-read
    // the whole copy (S x D floats, past L1) from L2 for each row
    for (long s0 = 0; s0 < S; s0 += 16) {
        const long nb = std::min(16l, S - s0);
        for (long row = 0; row < rows; ++row) {
            const float* qr = q + (row % T) * qkv + (h0 + row / T) * D;
            __m512 qv[NV];
            for (int j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qr + 16 * j);
            __m512 acc[16];
            for (long k = 0; k < 16; ++k) {
                if (k >= nb) {
                    acc[k] = _mm512_setzero_ps();
                    continue;
                }
                const float* kr = kf + (s0 + k) * D;
                acc[k] = _mm512_mul_ps(qv[0], _mm512_load_ps(kr));
                for (int j = 1; j < NV; ++j) acc[k] = _mm512_fmadd_ps(qv[j], _mm512_load_ps(kr + 16 * j), acc[k]);
            }
            const __mmask16 m = nb == 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << nb) - 1u);
            _mm512_mask_storeu_ps(p + row * S + s0, m, _mm512_mul_ps(sum_lanes16(acc), sc));
        }
    }
}
#endif

// Sum of p[0, n) front to back, one chain: exact zeros (keys this row may not see) change nothing,
// so a row's softmax normalizer is the same whatever the other rows of the call, the length n
// past its keys, or the gaps between them (a tree's masked siblings). With it every kernel here
// is batch invariant: a token's logits in a k-token verification or a tree equal its decode's
// bit for bit, which greedy bf16 needs to reproduce ar token for token (a vectorised sum's order
// depends on n; ~2 % of a 16-token forward).
inline float sequential_sum(const float* p, long n) {
    float sum = 0.f;
    for (long s = 0; s < n; ++s) sum += p[s];
    return sum;
}
// sequential_sum of nr <= 8 rows p [nr][n] at once, each the same chain (8 chains in flight
// cover the add latency on the two add pipes; 4 left half of them idle)
inline void sequential_sums(const float* p, long n, long nr, float* sum) {
    if (nr < 8) {
        long j = 0;
        for (; j + 4 <= nr; j += 4) {
            float a = 0.f, b = 0.f, c = 0.f, e = 0.f;
            const float* q = p + j * n;
            for (long s = 0; s < n; ++s) {
                a += q[s];
                b += q[n + s];
                c += q[2 * n + s];
                e += q[3 * n + s];
            }
            sum[j] = a, sum[j + 1] = b, sum[j + 2] = c, sum[j + 3] = e;
        }
        for (; j < nr; ++j) sum[j] = sequential_sum(p + j * n, n);
        return;
    }
    float a[8] = {};
    for (long s = 0; s < n; ++s)
        for (int j = 0; j < 8; ++j) a[j] += p[j * n + s];
    for (int j = 0; j < 8; ++j) sum[j] = a[j];
}

// Grouped-query attention of T tokens over cache slots [0, S): the rep = Hq/Hkv query heads of
// a K/V head (times T tokens) share every K row loaded. On AVX-512 at head size 64 or 128 the
// scores are dot_scores' fixed-order dot products; elsewhere they come from VL keys transposed at
// a time (VL broadcast FMAs per head dimension instead of a horizontal sum per (row, key)).
// D (head_dim) is a compile-time constant for the common sizes.
template <typename C, int D>
void attend_group(const LayerDims& dm, const float* q, const C* kh, const C* vh, const long* slots,
                  const uint8_t* mask, long S, long T, long g, float* p, float* out, const KvNext& next) {
    const long hq = dm.n_heads, d = D > 0 ? D : dm.head_dim, rep = hq / dm.n_kv_heads;
    const long qkv = (hq + 2 * dm.n_kv_heads) * d, rows = rep * T;
    const float scale = 1.f / std::sqrt(static_cast<float>(d));
    long s0 = 0;
#if defined(SB_AVX512)
    if constexpr (D == 64 || D == 128) {
        dot_scores<C, D>(q, kh, S, rows, qkv, T, g * rep, scale, next, p);
        s0 = S;
    } else {  // every row count: a score must not depend on how many rows share the call
        // two blocks of 16 keys at a time (up to 4 rows x 2 blocks of chains in flight), then one
        alignas(64) float kt[2 * 512 * 16];
        for (; s0 + 32 <= S; s0 += 32) {
            keys16(kh + s0 * d, d, 16, kt);
            keys16(kh + (s0 + 16) * d, d, 16, kt + d * 16);
            long row = 0;
            for (; row + 4 <= rows; row += 4) key_blocks16<4, 2>(q, kt, d, qkv, T, g * rep, row, scale, 0xffff, p + s0, S);
            for (; row + 2 <= rows; row += 2) key_blocks16<2, 2>(q, kt, d, qkv, T, g * rep, row, scale, 0xffff, p + s0, S);
            for (; row < rows; ++row) key_blocks16<1, 2>(q, kt, d, qkv, T, g * rep, row, scale, 0xffff, p + s0, S);
        }
        for (; s0 < S; s0 += 16) {
            const long nb = S - s0 < 16 ? S - s0 : 16;
            keys16(kh + s0 * d, d, nb, kt);
            const __mmask16 m = nb == 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << nb) - 1u);
            long row = 0;
            for (; row + 4 <= rows; row += 4) key_blocks16<4, 1>(q, kt, d, qkv, T, g * rep, row, scale, m, p + s0, S);
            for (; row < rows; ++row) key_blocks16<1, 1>(q, kt, d, qkv, T, g * rep, row, scale, m, p + s0, S);
        }
    }
#elif defined(SB_AVX2)
    {
        // Groups of G blocks of 8 keys first: one FMA chain per score is 4 cycles per step, so a
        // row walks the G blocks (and two rows at a time) to keep 2G chains in flight; each score
        // is still the one chain over i below (the same result as the single-block loop).
        constexpr long G = 4;
        alignas(32) float kt[G * (D > 0 ? D : 512) * 8];
        const __m256 sc = _mm256_set1_ps(scale);
        for (; s0 + G * 8 <= S && d % 8 == 0; s0 += G * 8) {
            for (long b = 0; b < G; ++b) transpose_keys(kh + (s0 + 8 * b) * d, d, kt + b * d * 8);
            long row = 0;
            for (; row + 2 <= rows; row += 2) {
                const float* qa = q + (row % T) * qkv + (g * rep + row / T) * d;
                const float* qb = q + ((row + 1) % T) * qkv + (g * rep + (row + 1) / T) * d;
                __m256 a[G], c[G];
                for (long b = 0; b < G; ++b) a[b] = c[b] = _mm256_setzero_ps();
                for (long i = 0; i < d; ++i) {
                    const __m256 xa = _mm256_set1_ps(qa[i]), xb = _mm256_set1_ps(qb[i]);
                    for (long b = 0; b < G; ++b) {
                        const __m256 kb = _mm256_load_ps(kt + (b * d + i) * 8);
                        a[b] = _mm256_fmadd_ps(xa, kb, a[b]);
                        c[b] = _mm256_fmadd_ps(xb, kb, c[b]);
                    }
                }
                for (long b = 0; b < G; ++b) {
                    _mm256_storeu_ps(p + row * S + s0 + 8 * b, _mm256_mul_ps(a[b], sc));
                    _mm256_storeu_ps(p + (row + 1) * S + s0 + 8 * b, _mm256_mul_ps(c[b], sc));
                }
            }
            for (; row < rows; ++row) {
                const float* qa = q + (row % T) * qkv + (g * rep + row / T) * d;
                __m256 a[G];
                for (long b = 0; b < G; ++b) a[b] = _mm256_setzero_ps();
                for (long i = 0; i < d; ++i) {
                    const __m256 xa = _mm256_set1_ps(qa[i]);
                    for (long b = 0; b < G; ++b) a[b] = _mm256_fmadd_ps(xa, _mm256_load_ps(kt + (b * d + i) * 8), a[b]);
                }
                for (long b = 0; b < G; ++b) _mm256_storeu_ps(p + row * S + s0 + 8 * b, _mm256_mul_ps(a[b], sc));
            }
        }
        for (; s0 < S; s0 += 8) {  // the last < G blocks: R rows side by side, R chains in flight
            const long nb = S - s0 < 8 ? S - s0 : 8;
            for (long j = 0; j < 8; ++j)
                for (long i = 0; i < d; ++i) kt[i * 8 + j] = j < nb ? load_act(kh + (s0 + j) * d, i) : 0.f;
            const __m256i m = first_lanes(nb);
            long row = 0;
            for (; row + 8 <= rows; row += 8) key_block_scores<8>(q, kt, d, qkv, T, g * rep, row, scale, m, p + s0, S);
            for (; row < rows; ++row) key_block_scores<1>(q, kt, d, qkv, T, g * rep, row, scale, m, p + s0, S);
        }
    }
#endif
    if (s0 > 0) {  // the blocked scores above: the mask now
        for (long t = 0; t < T; ++t) {
            const uint8_t* mt = mask ? mask + t * S : nullptr;
            // causal by slot: only the keys after the token's own slot (a window's last few)
            const long first = mask ? 0 : std::max(0l, std::min(S, slots[t] + 1));
            for (long r = 0; r < rep; ++r) {
                float* pr = p + (r * T + t) * S;
                if (!mt) {
                    for (long s = first; s < S; ++s) pr[s] = -INFINITY;
                    continue;
                }
#pragma omp simd
                for (long s = 0; s < S; ++s) pr[s] = mt[s] != 0 ? pr[s] : -INFINITY;
            }
        }
    }
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
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (long s = 0; s < S; ++s) mx = pr[s] > mx ? pr[s] : mx;
#pragma omp simd
        for (long s = 0; s < S; ++s) pr[s] -= mx;
        exp_inplace(pr, S);
    }
    for (long row0 = 0; row0 < rows; row0 += 8) {  // 8 rows' sums side by side: 8 add chains in flight
        const long nr = std::min(8l, rows - row0);
        float sum[8];
        sequential_sums(p + row0 * S, S, nr, sum);
        for (long j = 0; j < nr; ++j) {
            float* pr = p + (row0 + j) * S;
            const float inv = 1.f / sum[j];
#pragma omp simd
            for (long s = 0; s < S; ++s) pr[s] *= inv;
        }
    }
    long row = 0;
#if defined(SB_AVX512)
    // Four rows at a time: each V row loaded (and widened) once for the four; every output is the
    // same FMA chain over s whatever the number of rows
    if constexpr (D == 64 || D == 128) {
        if (sizeof(C) == 2 && rows > kValueRows<D>) {
            // more than one pass over V: widen it to fp32 once (exact) instead of once per pass
            float* vw = scratch<float>(kValues, S * D);
            for (long i = 0; i < S * D; i += 16) _mm512_store_ps(vw + i, widen16(reinterpret_cast<const uint16_t*>(vh + i)));
            weigh_value_rows<float, D>(p, vw, S, rows, T, hq, g * rep, out);
        } else {
            weigh_value_rows<C, D>(p, vh, S, rows, T, hq, g * rep, out);
        }
        row = rows;
    }
#endif
#if defined(SB_AVX2)
    // Four rows at a time over 16 dimensions: each V row loaded (and widened) once for the four;
    // every output is the same FMA chain over s as below.
    if (d % 16 == 0)
        for (; row + 4 <= rows; row += 4) weigh_values<C, 4>(p, vh, S, d, row, T, hq, g * rep, out);
    if (d % 16 == 0 && row < rows) {
        if (rows - row == 3) weigh_values<C, 3>(p, vh, S, d, row, T, hq, g * rep, out);
        else if (rows - row == 2) weigh_values<C, 2>(p, vh, S, d, row, T, hq, g * rep, out);
        else weigh_values<C, 1>(p, vh, S, d, row, T, hq, g * rep, out);
        row = rows;
    }
#endif
    for (; row < rows; ++row) {
        const long r = row / T, t = row % T;
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

// after: the group attended after this sequence's last (KvNext)
template <typename C>
void attend(const LayerDims& dm, const float* q, const C* kc, const C* vc, const long* slots,
            const uint8_t* mask, long S, long T, float* out, const KvNext& after) {
    const long hkv = dm.n_kv_heads, d = dm.head_dim, rows = dm.n_heads / hkv * T;
    float* probs = scratch<float>(kProbs, hkv * rows * S);  // single-threaded: small next to the GEMMs
    for (long g = 0; g < hkv; ++g) {
        const C* kh = kc + g * dm.max_seq * d;
        const C* vh = vc + g * dm.max_seq * d;
        float* p = probs + g * rows * S;
        const KvNext next = g + 1 < hkv ? KvNext{kh + dm.max_seq * d, vh + dm.max_seq * d, S} : after;
        if (d == 64) attend_group<C, 64>(dm, q, kh, vh, slots, mask, S, T, g, p, out, next);
        else if (d == 128) attend_group<C, 128>(dm, q, kh, vh, slots, mask, S, T, g, p, out, next);
        else attend_group<C, 0>(dm, q, kh, vh, slots, mask, S, T, g, p, out, next);
    }
}

// The sequences of one call (continuous batching): rows [start[i], start[i + 1]) are sequence i's
// tokens; it attends over slots [0, kv_len[i]) of KV-cache batch row cache_row[i], through its
// own mask (mask + mask_off[i], [T_i, kv_len[i]]) or causally by slot (mask_off[i] < 0). The GEMMs
// see all rows at once (the weights are streamed once for the whole batch); attention stays per
// sequence, so a row's result is the same bit for bit whatever else shares the call.
struct Segments {
    long n;
    const long* start;      // [n + 1]
    const long* kv_len;     // [n]
    const long* cache_row;  // [n]
    const long* mask_off;   // [n]
};

template <typename W>
int layer(const LayerDims& dm, const LayerPtrs& L, const AllReduce& ar, float* h, const long* slots,
          const float* cos, const float* sin, const uint8_t* mask, const Segments& sg, long T, int threads) {
    const long dim = dm.dim, hq = dm.n_heads, hkv = dm.n_kv_heads, d = dm.head_dim, F = dm.ffn_dim;
    const long nqkv = (hq + 2 * hkv) * d;
    W* xin = scratch<W>(kXin, T * std::max(dim, hq * d));
    W* qkv_w = scratch<W>(kAct, T * std::max(nqkv, F));
    float* qkv = scratch<float>(kQkv, T * nqkv);
    float* att = scratch<float>(kAtt, T * hq * d);

    // attention block
    const long per_row = hkv * dm.max_seq * d;  // one batch row of the cache
    const long cache_bytes = dm.cache_dtype == 0 ? 4 : 2;
    const auto group0 = [&](long i) {  // sequence i's first K/V head (KvNext), or none
        if (i >= sg.n) return KvNext{};
        const long off = sg.cache_row[i] * per_row * cache_bytes;
        return KvNext{static_cast<const char*>(L.k_cache) + off, static_cast<const char*>(L.v_cache) + off,
                      sg.kv_len[i]};
    };
    {  // the first sequence's first head, while the QKV projection streams its weights
        const KvNext first = group0(0);
        for (long b = 0; b < first.S * d * cache_bytes; b += 64) {
            _mm_prefetch(static_cast<const char*>(first.k) + b, _MM_HINT_T1);
            _mm_prefetch(static_cast<const char*>(first.v) + b, _MM_HINT_T1);
        }
    }
    rms_norm_rows<W>(h, static_cast<const W*>(L.attn_norm), xin, T, dim, dm.eps);
    gemm<W, W>(xin, dim, T, static_cast<const W*>(L.wqkv), nqkv, dim, kStore, nullptr, qkv_w, nqkv, threads);
    for (long i = 0; i < sg.n; ++i)
        for (long t = sg.start[i]; t < sg.start[i + 1]; ++t) {
            float* row = qkv + t * nqkv;
            for (long j = 0; j < nqkv; ++j) row[j] = load_act(qkv_w, t * nqkv + j);
            for (long hd = 0; hd < hq + hkv; ++hd) rope_head(row + hd * d, cos + t * d, sin + t * d, d);
            for (long g = 0; g < hkv; ++g) {
                const long off = sg.cache_row[i] * per_row + (g * dm.max_seq + slots[t]) * d;
                store_any(dm.cache_dtype, L.k_cache, off, d, row + (hq + g) * d);
                store_any(dm.cache_dtype, L.v_cache, off, d, row + (hq + hkv + g) * d);
            }
        }
    for (long i = 0; i < sg.n; ++i) {
        const long t0 = sg.start[i], tn = sg.start[i + 1] - t0, S = sg.kv_len[i], c0 = sg.cache_row[i] * per_row;
        const uint8_t* m = mask && sg.mask_off[i] >= 0 ? mask + sg.mask_off[i] : nullptr;
        if (dm.cache_dtype == 0)
            attend<float>(dm, qkv + t0 * nqkv, static_cast<const float*>(L.k_cache) + c0,
                          static_cast<const float*>(L.v_cache) + c0, slots + t0, m, S, tn, att + t0 * hq * d,
                          group0(i + 1));
        else
            attend<uint16_t>(dm, qkv + t0 * nqkv, static_cast<const uint16_t*>(L.k_cache) + c0,
                             static_cast<const uint16_t*>(L.v_cache) + c0, slots + t0, m, S, tn, att + t0 * hq * d,
                             group0(i + 1));
    }
    for (long i = 0; i < T * hq * d; ++i) store_act(xin, i, att[i]);
    if (const int rc = project_add<W>(ar, xin, T, static_cast<const W*>(L.wo), h, dim, hq * d, threads))
        return rc;

    // MLP block
    rms_norm_rows<W>(h, static_cast<const W*>(L.ffn_norm), xin, T, dim, dm.eps);
    W* act = qkv_w;  // free again
    gemm<W, W>(xin, dim, T, static_cast<const W*>(L.w13), 2 * F, dim, kSwiGLU, nullptr, act, F, threads);
    return project_add<W>(ar, act, T, static_cast<const W*>(L.w2), h, dim, F, threads);
}

template <typename W>
int layers_any(const LayerDims& dm, const LayerPtrs* layers, const AllReduce& ar, int n, void* hio,
               const long* slots, const void* cos_in, const void* sin_in, const uint8_t* mask,
               const Segments& sg, long T, int threads) {
    if (T < 1 || T > kMaxTokens || dm.head_dim > 512 || dm.n_heads % dm.n_kv_heads) return 1;
    if (sg.n < 1 || sg.start[0] != 0 || sg.start[sg.n] != T) return 1;
    for (long i = 0; i < sg.n; ++i)
        if (sg.start[i + 1] <= sg.start[i] || sg.kv_len[i] < 1 || sg.kv_len[i] > dm.max_seq || sg.cache_row[i] < 0)
            return 1;
    const long dim = dm.dim, d = dm.head_dim;
    std::vector<float> h(T * dim), cos(T * d), sin(T * d);
    load_any(dm.dtype, hio, T * dim, h.data());
    load_any(dm.dtype, cos_in, T * d, cos.data());
    load_any(dm.dtype, sin_in, T * d, sin.data());
    for (int l = 0; l < n; ++l) {
        if (const int rc = layer<W>(dm, layers[l], ar, h.data(), slots, cos.data(), sin.data(), mask, sg, T, threads))
            return rc;  // hio untouched: the caller raises (the ranks are out of step now)
        if (dm.dtype != 0 && l + 1 < n)  // the residual in the activations' type between layers
            for (long i = 0; i < T * dim; ++i) h[i] = bf16_to_f32(f32_to_bf16(h[i]));
    }
    store_any(dm.dtype, hio, 0, T * dim, h.data());
    return 0;
}

}  // namespace

extern "C" {
// dtype codes: 0 = fp32, 1 = bf16 (weights and activations share one dtype). Return 0 on success.

// Elements (of the dtype) of W [N, K] packed by sb_pack (paired: SwiGLU's [gate; up], N even).
long sb_packed_elems(int dtype, int paired, long N, long K) {
    if (paired) return (N / 2 + VL - 1) / VL * NR * packed_k(dtype, K);
    return packed_elems(dtype, N, K);
}

int sb_pack(int dtype, int paired, const void* w, long N, long K, void* out) {
    if (N < 1 || K < 1 || (paired && N % 2)) return 1;
    if (dtype == 0) pack<float>(static_cast<const float*>(w), paired, N, K, static_cast<float*>(out));
    else pack<uint16_t>(static_cast<const uint16_t*>(w), paired, N, K, static_cast<uint16_t*>(out));
    return 0;
}

// y [T, N] = x [T, K] W^T (+ res [T, N]); w packed by sb_pack. Any T >= 1.
int sb_linear(int dtype, const void* x, const void* w, const void* res, void* y, long T, long N, long K,
              int threads) {
    if (T < 1) return 1;
    if (dtype == 0)
        gemm<float, float>(static_cast<const float*>(x), K, T, static_cast<const float*>(w), N, K, kStore,
                           static_cast<const float*>(res), y, N, threads);
    else
        gemm<uint16_t, uint16_t>(static_cast<const uint16_t*>(x), K, T, static_cast<const uint16_t*>(w), N, K,
                                 kStore, static_cast<const uint16_t*>(res), y, N, threads);
    return 0;
}

// y [T, F] = silu(x gate^T) * (x up^T), w = [gate; up] (2F rows) packed paired.
int sb_swiglu(int dtype, const void* x, const void* w, void* y, long T, long F, long K, int threads) {
    if (T < 1) return 1;
    if (dtype == 0)
        gemm<float, float>(static_cast<const float*>(x), K, T, static_cast<const float*>(w), 2 * F, K, kSwiGLU,
                           nullptr, y, F, threads);
    else
        gemm<uint16_t, uint16_t>(static_cast<const uint16_t*>(x), K, T, static_cast<const uint16_t*>(w), 2 * F,
                                 K, kSwiGLU, nullptr, y, F, threads);
    return 0;
}

// Layers [0, n) of ``layers`` on hidden states hio [T, dim] (dims.dtype), updated in place.
// slots [T]: cache slots written; mask [T, S] (1 = attend) or null: token t sees slots <= slots[t].
// allreduce/ctx: the tensor-parallel sum (see AllReduce), or null on a single rank.
int sb_layers(const LayerDims* dims, const LayerPtrs* layers, int n, void* hio, const long* slots,
              const void* cos, const void* sin, const uint8_t* mask, long S, long T, int threads,
              AllReduceFn allreduce, void* ctx) {
    const AllReduce ar{allreduce, ctx};
    const long start[2] = {0, T}, kv_len[1] = {S}, cache_row[1] = {0}, mask_off[1] = {mask ? 0 : -1};
    const Segments sg{1, start, kv_len, cache_row, mask_off};
    return dims->dtype == 0
               ? layers_any<float>(*dims, layers, ar, n, hio, slots, cos, sin, mask, sg, T, threads)
               : layers_any<uint16_t>(*dims, layers, ar, n, hio, slots, cos, sin, mask, sg, T, threads);
}

// sb_layers over the rows of several sequences (continuous batching; see Segments): n_seq
// sequences, start [n_seq + 1], kv_len / cache_row / mask_off [n_seq]; mask: every masked
// sequence's [T_i, kv_len_i] mask at its offset (or null when none is masked). The caches of
// ``layers`` point at batch row 0 of [max_batch, n_kv_heads, max_seq, head_dim].
int sb_layers_batch(const LayerDims* dims, const LayerPtrs* layers, int n, void* hio, const long* slots,
                    const void* cos, const void* sin, const uint8_t* mask, long n_seq, const long* start,
                    const long* kv_len, const long* cache_row, const long* mask_off, int threads,
                    AllReduceFn allreduce, void* ctx) {
    const AllReduce ar{allreduce, ctx};
    const Segments sg{n_seq, start, kv_len, cache_row, mask_off};
    const long T = n_seq > 0 ? start[n_seq] : 0;
    return dims->dtype == 0
               ? layers_any<float>(*dims, layers, ar, n, hio, slots, cos, sin, mask, sg, T, threads)
               : layers_any<uint16_t>(*dims, layers, ar, n, hio, slots, cos, sin, mask, sg, T, threads);
}

long sb_max_tokens() { return kMaxTokens; }

// Sum of p[0, n) read front to back by ``threads`` threads (contiguous shares): the read-bandwidth
// probe of benchmarks/bench_verify.py (next to torch's sum), independent of the GEMM it judges.
double sb_read_sum(const float* p, long n, int threads) {
    double total = 0.0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (long part = 0; part < threads; ++part) {
        const long lo = n * part / threads, hi = n * (part + 1) / threads;
        vf a[4] = {vzero(), vzero(), vzero(), vzero()};
        long i = lo;
        for (; i + 4 * VL <= hi; i += 4 * VL) {
            for (int line = 0; line < 4 * VL * 4; line += 64)  // every line of the step
                _mm_prefetch(reinterpret_cast<const char*>(p + i) + kPrefetch + line, _MM_HINT_T0);
            for (int u = 0; u < 4; ++u) a[u] = a[u] + vload(p + i + u * VL);
        }
        float lanes[VL];
        vstore(lanes, (a[0] + a[1]) + (a[2] + a[3]));
        double s = 0.0;
        for (int j = 0; j < VL; ++j) s += lanes[j];
        for (; i < hi; ++i) s += p[i];
        total += s;
    }
    return total;
}

// The core's fp32 FMA peak in GFLOP/s: 2 * VL * 2 FLOPs per FMA over 12 independent chains
// for ``seconds`` (the compute roof of benchmarks/bench_verify.py, next to torch.matmul's).
double sb_fma_peak(double seconds) {
    vf a[12];
    for (int j = 0; j < 12; ++j) {
        const float v = static_cast<float>(j);
        a[j] = vbcast(&v);
    }
    const float bs = 0.999999f, cs = 1e-6f;
    const vf b = vbcast(&bs), c = vbcast(&cs);
    const double start = omp_get_wtime();
    long iters = 0;
    double now = start;
    while (now - start < seconds) {
        for (int i = 0; i < 4096; ++i)
            for (int j = 0; j < 12; ++j) a[j] = vfma(a[j], b, c);
        iters += 4096;
        now = omp_get_wtime();
    }
    float sink[VL];
    vf s = a[0];
    for (int j = 1; j < 12; ++j) s = s + a[j];
    vstore(sink, s);
    volatile float keep = sink[0];
    (void)keep;
    return iters * 12.0 * VL * 2.0 / (now - start) / 1e9;
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

// The k largest of rows of x [rows, n] with their indices, largest first (ties: the lower index
// first), for top-k / top-p sampling (testbed.spec.sampling) where torch.topk costs ~0.3 ms per
// 49k-vocabulary row: the maxima of blocks of 64, then the k largest among the values of the k
// blocks with the largest maxima (they hold the k largest values). NaN is not expected (logits).
// n_ge (or null): per row, how many values are >= the k-th largest (> k: a tie at the cut).
int sb_topk(const float* x, long rows, long n, long k, float* vals, long* idx, long* n_ge) {
    constexpr long B = 64;
    if (n <= 0 || k <= 0 || k > n) return 1;
    const long nb = (n + B - 1) / B;
    std::vector<float> bmax(nb);
    std::vector<long> blocks(nb), cand;
    for (long r = 0; r < rows; ++r) {
        const float* xr = x + r * n;
        for (long b = 0; b < nb; ++b) {
            const long lo = b * B, hi = std::min(n, lo + B);
            float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
            for (long i = lo; i < hi; ++i) bm = xr[i] > bm ? xr[i] : bm;
            bmax[b] = bm;
            blocks[b] = b;
        }
        const long kb = std::min(k, nb);
        std::partial_sort(blocks.begin(), blocks.begin() + kb, blocks.end(),
                          [&](long a, long b) { return bmax[a] > bmax[b] || (bmax[a] == bmax[b] && a < b); });
        // every value >= the kb-th largest block maximum is a candidate (ties across blocks too):
        // at least k of them, and each of the k largest is one
        const float floor_v = bmax[blocks[kb - 1]];
        cand.clear();
        for (long b = 0; b < nb; ++b) {
            if (bmax[b] < floor_v) continue;
            for (long i = b * B; i < std::min(n, (b + 1) * B); ++i) cand.push_back(i);
        }
        std::partial_sort(cand.begin(), cand.begin() + k, cand.end(),
                          [&](long a, long b) { return xr[a] > xr[b] || (xr[a] == xr[b] && a < b); });
        for (long j = 0; j < k; ++j) {
            idx[r * k + j] = cand[j];
            vals[r * k + j] = xr[cand[j]];
        }
        if (n_ge) {  // values >= the k-th: k unless it ties with one left out (all are candidates)
            const float kth = xr[cand[k - 1]];
            n_ge[r] = static_cast<long>(std::count_if(cand.begin(), cand.end(), [&](long i) { return xr[i] >= kth; }));
        }
    }
    return 0;
}

// Top-p (nucleus) over probability rows p [rows, n] (>= 0, summing to ~1): out = p renormalised
// on the smallest most-probable prefix whose mass reaches top_p, in the order of decreasing
// probability with ties taken lower index first (a token is dropped when the mass strictly before
// it already reaches top_p; the first one is always kept). Why not sort: the nucleus of a
// flat distribution is thousands of tokens, and sorting a 49k-token row costs ~5 ms on one core.
// A radix select over the float bits (monotone for p >= 0) finds the boundary: a histogram of
// mass by the top 10 bits (exponent + 1 mantissa bit: bins a factor sqrt 2 wide) locates the
// bin where the prefix mass first reaches top_p; a second over the next 10 bits of that bin's
// tokens narrows it to a relative width of 2^-11, whose few tokens are sorted and walked. Prefix
// masses are float64 (over thousands of tokens float32 rounding would decide the boundary).
int sb_top_p(const float* p, long rows, long n, double top_p, float* out) {  // out may be p
    if (n <= 0) return 1;
    constexpr int kBins = 1024, kWays = 4;
    // per-thread scratch kept between calls: fresh buffers of this size are fresh pages each call
    thread_local std::vector<double> hist(static_cast<size_t>(kBins) * kWays);
    thread_local std::vector<uint16_t> key;
    thread_local std::vector<uint32_t> cand;
    thread_local std::vector<long> next;
    if (static_cast<long>(key.size()) < n) {
        key.resize(n);
        cand.resize(n);
    }
    for (long r = 0; r < rows; ++r) {
        const float* pr = p + r * n;
        const uint32_t* bits = reinterpret_cast<const uint32_t*>(pr);
        // level 1: mass per top-10-bit bin. The keys first, in a vectorised pass (the histogram
        // loop then runs at ~2x the speed), and kWays interleaved copies of the histogram so
        // that neighbouring tokens of one bin do not serialise on one accumulator
        for (long j = 0; j < n; ++j) key[j] = static_cast<uint16_t>(bits[j] >> 22);
        std::fill(hist.begin(), hist.end(), 0.0);
        long i = 0;
        for (; i + kWays <= n; i += kWays)
            for (int w = 0; w < kWays; ++w) hist[w * kBins + key[i + w]] += pr[i + w];
        for (; i < n; ++i) hist[key[i]] += pr[i];
        double above = 0.0;  // mass of every token in a higher bin than the one chosen
        int b1 = -1;
        for (int b = kBins - 1; b >= 0 && b1 < 0; --b) {
            double m = 0.0;
            for (int w = 0; w < kWays; ++w) m += hist[w * kBins + b];
            if (m > 0.0 && above + m >= top_p) b1 = b;
            else above += m;
        }
        float v_star = 0.0f;  // the last kept token's probability ...
        long last_tie = n;     // ... and the largest index kept among the tokens equal to it
        double kept = above;   // rounding left the whole row short of top_p (b1 < 0): all kept
        if (b1 >= 0) {
            long m = 0;
            for (long j = 0; j < n; ++j) {  // branch-free: most tokens are in other bins
                cand[m] = static_cast<uint32_t>(j);
                m += key[j] == b1;
            }
            // level 2: the next 10 bits within that bin
            double* h2 = hist.data();
            std::fill(h2, h2 + kBins, 0.0);
            for (long c = 0; c < m; ++c) h2[(bits[cand[c]] >> 12) & (kBins - 1)] += pr[cand[c]];
            int b2 = -1;
            bool reached = false;
            for (int b = kBins - 1; b >= 0 && !reached; --b) {
                if (h2[b] == 0.0) continue;
                b2 = b;
                if (above + h2[b] >= top_p) reached = true;
                else above += h2[b];
            }
            if (!reached) above -= h2[b2];  // summed in another order the bin fell just short: walk its last sub-bin whole
            next.clear();
            for (long c = 0; c < m; ++c)
                if (static_cast<int>((bits[cand[c]] >> 12) & (kBins - 1)) == b2) next.push_back(cand[c]);
            // candidates are in index order: a stable sort by decreasing p puts ties lower index first
            std::stable_sort(next.begin(), next.end(), [&](long a, long b) { return pr[a] > pr[b]; });
            kept = above;
            for (long j : next) {
                if (kept >= top_p) break;
                kept += pr[j];
                v_star = pr[j];
                last_tie = j;
            }
        }
        float* o = out + r * n;
        const float scale = kept > 0.0 ? static_cast<float>(1.0 / kept) : 0.0f;
        // branch-free selects (a branch per token mispredicts on the nucleus's ragged edge)
        const long split = std::min(n, last_tie + 1);  // tokens equal to v_star: kept up to last_tie
        for (long j = 0; j < split; ++j) o[j] = pr[j] * (pr[j] >= v_star ? scale : 0.0f);
        for (long j = split; j < n; ++j) o[j] = pr[j] * (pr[j] > v_star ? scale : 0.0f);
    }
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
