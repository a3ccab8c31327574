// The host's ceiling for a forward that streams weights and computes on them at once.
//
//   g++ -O2 -march=native -o /tmp/stream_fma benchmarks/native/stream_fma.cpp && /tmp/stream_fma [CPU]
//
// A k-token forward reads each 64-byte weight step once and does 2k FMAs on it (k tokens x two
// 8-float vectors, specbed_kernels/native.cpp's AVX2 tile). Its roofline, max(bytes / read bandwidth,
// FLOPs / FMA peak), assumes both run at full rate at the same time. This loop is the ideal such
// forward: it streams 256 MB with 256-bit loads and feeds each pair of vectors F register-only
// FMAs (F = 2k), with and without a software prefetch 4 KB ahead; beside it the same FMAs on an
// L1-resident buffer (the compute time) and the plain read (the memory time). "% of roofline"
// = max(read, compute) / streamed. Where it is near 100 % the roofline is reachable on this core
// and a kernel below it loses in its own schedule, not to the machine (docs/kernels.md).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sched.h>

static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <int F, bool Prefetch>
__attribute__((noinline)) float stream(const float* p, long n, long passes) {
    __m256 acc[12];
    for (auto& a : acc) a = _mm256_setzero_ps();
    __m256 x[2];  // the tokens' values, kept in registers (12 + 2 + 2 of the 16): the ideal tile
    for (int i = 0; i < 2; ++i) x[i] = _mm256_set1_ps(1e-9f * (i + 1));
    for (long r = 0; r < passes; ++r)
        for (long i = 0; i < n; i += 16) {
            if (Prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + i) + 4096, _MM_HINT_T0);
            __m256 w0 = _mm256_load_ps(p + i), w1 = _mm256_load_ps(p + i + 8);
            asm volatile("" : "+x"(w0), "+x"(w1));  // one load each, not a memory operand per FMA
#pragma GCC unroll 16
            for (int j = 0; j < F / 2; ++j) {
                acc[(2 * j) % 12] = _mm256_fmadd_ps(w0, x[j % 2], acc[(2 * j) % 12]);
                acc[(2 * j + 1) % 12] = _mm256_fmadd_ps(w1, x[j % 2], acc[(2 * j + 1) % 12]);
            }
        }
    __m256 s = acc[0];
    for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
    float o[8];
    _mm256_storeu_ps(o, s);
    return o[0];
}

template <int F>
void point(const float* big, long nbig, const float* small, long nsmall) {
    double t_pf = 1e9, t_plain = 1e9, t_compute = 1e9, t_read = 1e9;
    volatile float sink = 0;
    for (int t = 0; t < 5; ++t) {  // best of 5 of each, interleaved (the machine drifts)
        double a = now(); sink = sink + stream<F, true>(big, nbig, 1); t_pf = std::min(t_pf, now() - a);
        a = now(); sink = sink + stream<F, false>(big, nbig, 1); t_plain = std::min(t_plain, now() - a);
        a = now(); sink = sink + stream<F, false>(small, nsmall, nbig / nsmall); t_compute = std::min(t_compute, now() - a);
        a = now(); sink = sink + stream<0, true>(big, nbig, 1); t_read = std::min(t_read, now() - a);
    }
    const double roof = std::max(t_read, t_compute), flops = 2.0 * 8 * F * (nbig / 16);
    std::printf("| %2d | %2d | %5.1f | %5.1f | %5.1f | %5.1f | %4.0f %% | %4.0f %% |\n", F, F / 2, 1e3 * t_read,
                flops / t_compute / 1e9, 1e3 * t_plain, 1e3 * t_pf, 100 * roof / t_plain, 100 * roof / t_pf);
}

int main(int argc, char** argv) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(argc > 1 ? std::atoi(argv[1]) : 0, &set);
    sched_setaffinity(0, sizeof set, &set);
    const long bytes = 256l << 20, nbig = bytes / 4, nsmall = 4096;
    float* big = static_cast<float*>(std::aligned_alloc(64, bytes));
    float* small = static_cast<float*>(std::aligned_alloc(64, nsmall * 4));
    for (long i = 0; i < nbig; ++i) big[i] = 1.0f;
    for (long i = 0; i < nsmall; ++i) small[i] = 1.0f;
    std::printf("| FMAs per 64 B | k | read ms | compute GFLOP/s | streamed ms | prefetched ms | "
                "%% of roofline | with prefetch |\n|---|---|---|---|---|---|---|---|\n");
    point<2>(big, nbig, small, nsmall);
    point<4>(big, nbig, small, nsmall);
    point<8>(big, nbig, small, nsmall);
    point<12>(big, nbig, small, nsmall);
    point<16>(big, nbig, small, nsmall);
    point<24>(big, nbig, small, nsmall);
    point<32>(big, nbig, small, nsmall);
}
