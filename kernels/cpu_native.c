/* kvscale's CPU kernels (x86-64, AVX2 + FMA; where the CPU has AVX-512 with BF16, the bf16 GEMV and prefill
 * attention by vdpbf16ps and the elementwise kernels 16 lanes at a time), built on first use by
 * kernels/cpu_native.py. A 16-lane loop does its 8-lane loop's operations, so both builds give the same results.
 *
 * Every kernel but the GEMV takes fp32 or bf16 tensors (flag `bf`): each has one body, specialized per dtype by
 * the compiler (always_inline with a constant flag). Loads widen bf16 to fp32, the math runs in fp32, and each
 * result is rounded to the storage dtype exactly where the torch reference rounds (after every torch op in
 * bf16), so bf16 outputs match the reference bit for bit except for reduction order.
 *
 * Decoding at small batch is a stream over every weight matrix, so the linear kernel here is built to read the
 * weights at the memory's bandwidth (figures and commands: bench/results/design_figures.md). OpenMP shares torch's own runtime (same soname, already loaded), so there is
 * one thread pool, not two.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#define KVS_INLINE static inline __attribute__((always_inline))
typedef uint16_t bf16_t;

/* bf16 <-> fp32: widening is exact (the high half of a float); narrowing rounds to nearest even, NaN kept */
KVS_INLINE float bf2f(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
KVS_INLINE bf16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40);
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
KVS_INLINE __m256 bf8_to_f(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
KVS_INLINE __m128i f_to_bf8(__m256 v) {  /* round to nearest even (activations hold no NaN) */
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

/* element i of a fp32 (bf = 0) or bf16 (bf = 1) array, as fp32; and stores that round to the array's dtype */
KVS_INLINE float ld1(const void *p, long i, int bf) { return bf ? bf2f(((const bf16_t *)p)[i]) : ((const float *)p)[i]; }
KVS_INLINE void st1(void *p, long i, float v, int bf) {
    if (bf) ((bf16_t *)p)[i] = f2bf(v); else ((float *)p)[i] = v;
}
KVS_INLINE float rnd1(float v, int bf) { return bf ? bf2f(f2bf(v)) : v; }  /* v as the dtype holds it */
KVS_INLINE __m256 ld8(const void *p, long i, int bf) {
    return bf ? bf8_to_f(_mm_loadu_si128((const __m128i *)((const bf16_t *)p + i))) : _mm256_loadu_ps((const float *)p + i);
}
KVS_INLINE void st8(void *p, long i, __m256 v, int bf) {
    if (bf) _mm_storeu_si128((__m128i *)((bf16_t *)p + i), f_to_bf8(v)); else _mm256_storeu_ps((float *)p + i, v);
}
KVS_INLINE __m256 rnd8(__m256 v, int bf) { return bf ? bf8_to_f(f_to_bf8(v)) : v; }

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* sum_i a[i] * b[i] over fp32 b, a read 8 at a time by LD8(a, i) and one at a time by LD1(a, i): four independent
 * FMA chains over 32 floats, then 8 at a time, then one by one, into s. One list of steps for a in fp32 and in bf16
 * (each value widened exactly), so both give the same bits for the same values. */
#define KVS_DOT_STEPS(LD8, LD1, a, b, n, s)                                              \
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(); \
    __m256 a3 = _mm256_setzero_ps();                                                     \
    long i = 0;                                                                          \
    for (; i + 32 <= n; i += 32) {                                                       \
        a0 = _mm256_fmadd_ps(LD8(a, i), _mm256_loadu_ps(b + i), a0);                     \
        a1 = _mm256_fmadd_ps(LD8(a, i + 8), _mm256_loadu_ps(b + i + 8), a1);             \
        a2 = _mm256_fmadd_ps(LD8(a, i + 16), _mm256_loadu_ps(b + i + 16), a2);           \
        a3 = _mm256_fmadd_ps(LD8(a, i + 24), _mm256_loadu_ps(b + i + 24), a3);           \
    }                                                                                    \
    for (; i + 8 <= n; i += 8)                                                           \
        a0 = _mm256_fmadd_ps(LD8(a, i), _mm256_loadu_ps(b + i), a0);                     \
    s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));               \
    for (; i < n; i++) s += LD1(a, i) * b[i]
#define KVS_F32_LD8(p, i) _mm256_loadu_ps((p) + (i))
#define KVS_F32_LD1(p, i) ((p)[i])
#define KVS_BF16_LD8(p, i) ld8((p), (i), 1)
#define KVS_BF16_LD1(p, i) bf2f((p)[i])

static inline float dot_f32(const float *a, const float *b, long n) {
    float s;
    KVS_DOT_STEPS(KVS_F32_LD8, KVS_F32_LD1, a, b, n, s);
    return s;
}

/* dot_f32 with `a` given in bf16: the same bits as dot_f32 over the widened values, from half the bytes */
static inline float dot_f32_bf16a(const bf16_t *a, const float *b, long n) {
    float s;
    KVS_DOT_STEPS(KVS_BF16_LD8, KVS_BF16_LD1, a, b, n, s);
    return s;
}

/* y[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]), for r < rows: x (rows, in), w (out, in), y (rows, out),
 * all float32, row-major, contiguous. Each thread walks its contiguous share of the weight rows in order (one
 * stream per thread, which read faster than interleaving rows: bench/results/design_figures.md); each weight row is read from memory once for all rows of x. */
#define KVS_GEMV_F32(DOT, W_T)                                                          \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                   \
    for (long o = 0; o < out; o++) {                                                    \
        const W_T *wr = w + o * in;                                                     \
        for (long r = 0; r < rows; r++)                                                 \
            y[r * out + o] = DOT(wr, x + r * in, in) + (bias ? bias[o] : 0.0f);         \
    }
void kvs_linear_f32(const float *x, const float *w, const float *bias, float *y,
                    long rows, long in, long out, int threads) {
    KVS_GEMV_F32(dot_f32, float);
}

/* kvs_linear_f32 with the weights given as their bf16 copy, for an fp32 model whose weights are bf16 values (a
 * bf16 checkpoint run in fp32, what CPUs without AVX512-BF16 do): the same results, bit for bit, from half the
 * weight bytes, which is what a decode step of few rows waits on. */
void kvs_linear_f32_bf16w(const float *x, const bf16_t *w, const float *bias, float *y,
                          long rows, long in, long out, int threads) {
    KVS_GEMV_F32(dot_f32_bf16a, bf16_t);
}

/* The library's fp32 GEMM (BLAS sgemm, Fortran interface: column-major, arguments by pointer), given once by
 * kernels/cpu_native.py from the library torch itself calls (kvs_set_sgemm); kvs_linear_tiled_f32 returns 0
 * while it is unset. */
typedef void (*kvs_sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                             const float *, const int *, const float *, const int *, const float *, float *, const int *);
static kvs_sgemm_fn kvs_sgemm;
void kvs_set_sgemm(void *fn) { kvs_sgemm = (kvs_sgemm_fn)fn; }

/* y = x @ w.T (+ bias) for many rows (prefill, larger decode batches): fp32, row-major, contiguous, as
 * kvs_linear_f32. The output is cut into tiles of tile_rows x tile_cols, each one single-threaded sgemm call (the
 * BLAS runs sequentially inside a parallel region), handed out to the threads one at a time (dynamic schedule).
 * Why not one multithreaded GEMM: the library splits its work statically over the threads, so when another
 * process takes one core for a moment (on a small machine: Ray's processes, the HTTP proxy, the client) the other
 * core waits at the end of the call; here it takes the next tiles meanwhile (bench/contention.py). Returns 1, or 0
 * (nothing done) when no sgemm was given. */
int kvs_linear_tiled_f32(const float *x, const float *w, const float *bias, float *y, long rows, long in, long out,
                         long tile_rows, long tile_cols, int threads) {
    if (!kvs_sgemm) return 0;
    long tiles_m = (rows + tile_rows - 1) / tile_rows, tiles_n = (out + tile_cols - 1) / tile_cols;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long t = 0; t < tiles_m * tiles_n; t++) {
        long r0 = (t / tiles_n) * tile_rows, o0 = (t % tiles_n) * tile_cols;
        int m = (int)(rows - r0 < tile_rows ? rows - r0 : tile_rows);
        int n = (int)(out - o0 < tile_cols ? out - o0 : tile_cols);
        int k = (int)in, ldy = (int)out;
        const float one = 1.0f, beta = bias ? 1.0f : 0.0f;
        if (bias)  /* as torch's addmm: the bias first, then the product added to it (the same bits as F.linear) */
            for (long r = r0; r < r0 + m; r++) memcpy(y + r * out + o0, bias + o0, (size_t)n * sizeof(float));
        /* column-major view: y.T[n, m] = w[o0:o0+n] @ x[r0:r0+m].T, i.e. sgemm("T", "N") on the row-major arrays */
        kvs_sgemm("T", "N", &n, &m, &k, &one, w + o0 * in, &k, x + r0 * in, &k, &beta, y + r0 * out + o0, &ldy);
    }
    return 1;
}

/* exp(x): range reduction to n*ln2 + r and a degree-5 polynomial (the Cephes expf scheme), within 2 ulp of expf
 * for the inputs attention feeds it (x <= 0). One list of steps for both widths (P: the intrinsics' prefix,
 * _mm256 or _mm512), so a 16-lane exp does an 8-lane one's operations: x clamped, n = floor(x log2(e) + 1/2)
 * given, y = e^r afterwards. */
#define KVS_EXP_STEPS(P, x, n, y)                                                        \
    x = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                  \
    x = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), x);                               \
    y = P##_set1_ps(1.9875691500E-4f);                                                   \
    y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507E-3f));                               \
    y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073E-3f));                               \
    y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894E-2f));                               \
    y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459E-1f));                               \
    y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201E-1f));                               \
    y = P##_fmadd_ps(y, P##_mul_ps(x, x), P##_add_ps(x, P##_set1_ps(1.0f)))
#define KVS_EXP_HI 88.3762626647949f
#define KVS_LOG2E 1.44269504088896341f

static inline __m256 exp256(__m256 x) {  /* 8 lanes */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(KVS_EXP_HI)), _mm256_set1_ps(-KVS_EXP_HI));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(KVS_LOG2E), _mm256_set1_ps(0.5f))), y;
    KVS_EXP_STEPS(_mm256, x, n, y);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
/* exp256 on 16 lanes (the same IEEE operations lane by lane, so the same results), except that lanes below its
 * range (-inf: masked keys) give 0 */
static inline __m512 exp512(__m512 x) {
    __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-KVS_EXP_HI), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(KVS_EXP_HI)), _mm512_set1_ps(-KVS_EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(KVS_LOG2E), _mm512_set1_ps(0.5f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), y;
    KVS_EXP_STEPS(_mm512, x, n, y);
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps((__mmask16)~below, _mm512_mul_ps(y, _mm512_castsi512_ps(e)));
}

/* 16-lane loads and stores of fp32 or bf16 arrays, rounding as st8 and rnd8 do */
KVS_INLINE __m512 ld16(const void *p, long i, int bf) {
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256((const __m256i *)((const bf16_t *)p + i))), 16))
              : _mm512_loadu_ps((const float *)p + i);
}
KVS_INLINE __m512i f_to_bf16_bits(__m512 v) {  /* round to nearest even, in the low half of each lane */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
}
KVS_INLINE void st16(void *p, long i, __m512 v, int bf) {
    if (bf) _mm256_storeu_si256((__m256i *)((bf16_t *)p + i), _mm512_cvtepi32_epi16(f_to_bf16_bits(v)));
    else _mm512_storeu_ps((float *)p + i, v);
}
KVS_INLINE __m512 rnd16(__m512 v, int bf) {
    return bf ? _mm512_castsi512_ps(_mm512_slli_epi32(f_to_bf16_bits(v), 16)) : v;
}
#endif

/* Eight dot products in, one vector of their eight sums out (a hadd tree: one reduction per 8 keys, not 8). */
static inline __m256 hsum8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}


/* y = x @ w.T (+ bias) in bf16: x (rows, in), w (out, in), bias (out), y (rows, out), contiguous. Products and
 * sums in fp32, the bias added in fp32, one rounding to bf16 at the end, as oneDNN's bf16 linear does. With
 * AVX512-BF16, vdpbf16ps multiplies 32 bf16 pairs per instruction and the stream over w is the only cost; without
 * it, x is widened to fp32 once and w 8 values at a time. Threads split the weight rows as in the fp32 GEMV. */
#ifdef __AVX512BF16__
KVS_INLINE float dot_bf16(const bf16_t *w, const bf16_t *x, long n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    long i = 0;
#define KVS_DP(acc, o) acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + i + o), (__m512bh)_mm512_loadu_si512(x + i + o))
    for (; i + 128 <= n; i += 128) { KVS_DP(a0, 0); KVS_DP(a1, 32); KVS_DP(a2, 64); KVS_DP(a3, 96); }
    for (; i + 32 <= n; i += 32) KVS_DP(a0, 0);
#undef KVS_DP
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; i < n; i++) s += bf2f(w[i]) * bf2f(x[i]);
    return s;
}
#endif

KVS_INLINE float dot_bf16w_f32x(const bf16_t *w, const float *x, long n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(ld8(w, i, 1), _mm256_loadu_ps(x + i), a0);
        a1 = _mm256_fmadd_ps(ld8(w, i + 8, 1), _mm256_loadu_ps(x + i + 8), a1);
    }
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += bf2f(w[i]) * x[i];
    return s;
}

int kvs_has_avx512bf16(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

void kvs_linear_bf16(const bf16_t *x, const bf16_t *w, const bf16_t *bias, bf16_t *y,
                     long rows, long in, long out, int threads) {
#ifdef __AVX512BF16__
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long o = 0; o < out; o++) {
        const bf16_t *wr = w + o * in;
        for (long r = 0; r < rows; r++)
            y[r * out + o] = f2bf(dot_bf16(wr, x + r * in, in) + (bias ? bf2f(bias[o]) : 0.0f));
    }
#else
    float *xf = malloc(sizeof(float) * (size_t)(rows * in));
    for (long i = 0; i < rows * in; i++) xf[i] = bf2f(x[i]);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long o = 0; o < out; o++) {
        const bf16_t *wr = w + o * in;
        for (long r = 0; r < rows; r++)
            y[r * out + o] = f2bf(dot_bf16w_f32x(wr, xf + r * in, in) + (bias ? bf2f(bias[o]) : 0.0f));
    }
    free(xf);
#endif
}

/* the lower and upper halves of a vector of floats, widened to doubles */
KVS_INLINE __m256d pd_lo8(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
KVS_INLINE __m256d pd_hi8(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }
#ifdef __AVX512F__
KVS_INLINE __m512d pd_lo16(__m512 v) { return _mm512_cvtps_pd(_mm512_castps512_ps256(v)); }
KVS_INLINE __m512d pd_hi16(__m512 v) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)); }
#endif

/* RMSNorm's first pass, W lanes at a time (V, VD: the float and double vectors, P: the intrinsics' prefix): x (+
 * the residual, rounded and stored) squared into two double accumulators A0, A1. One list of steps for both
 * widths, as KVS_EXP_STEPS. */
#define KVS_NORM_SQUARES(W, V, VD, P, A0, A1)                                             \
    for (; i + W <= hidden; i += W) {                                                     \
        V v = ld##W(x, xo + i, bf);                                                       \
        if (residual) {                                                                   \
            v = rnd##W(P##_add_ps(v, ld##W(residual, ro + i, bf)), bf);                   \
            st##W(residual_out, so + i, v, bf);                                           \
        }                                                                                 \
        VD lo = pd_lo##W(v), hi = pd_hi##W(v);                                           \
        A0 = P##_add_pd(A0, P##_mul_pd(lo, lo));                                          \
        A1 = P##_add_pd(A1, P##_mul_pd(hi, hi));                                          \
    }

/* RMSNorm's second pass, W lanes at a time: out = w * dtype(s * inv) */
#define KVS_NORM_SCALE(W, P)                                                                      \
    for (; i + W <= hidden; i += W)                                                               \
        st##W(out, oo + i, P##_mul_ps(ld##W(w, i, bf),                                            \
                                      rnd##W(P##_mul_ps(ld##W(s, so + i, bf), P##_set1_ps(inv)), bf)), bf)

/* RMSNorm of each row of x (optionally x + residual, which is then also written to residual_out), as the
 * reference: s = x (+ residual, rounded to the dtype), out = w * dtype(s / sqrt(mean(s^2) + eps)) with the
 * statistics in fp32 (here double, in vector accumulators: two chains, so the sum runs at the vector units'
 * rate rather than one add's latency an element). 16 lanes where built with AVX-512, then 8, then one by one;
 * the residual's sum and the sum of squares in one pass. Rows in parallel; strides in elements. */
KVS_INLINE void rms_norm_body(const void *x, const void *residual, void *out, void *residual_out, const void *w,
                              long rows, long hidden, long stride_x, long stride_r, float eps, int threads, int bf) {
    #pragma omp parallel for schedule(static) num_threads(rows >= 4 * threads ? threads : 1)
    for (long t = 0; t < rows; t++) {
        /* the normalized row is s[so ...]: x's row, or the residual's sum as stored */
        const void *s = residual ? residual_out : x;
        long so = residual ? t * hidden : t * stride_x, xo = t * stride_x, ro = t * stride_r, i = 0;
        double sq = 0.0;
#ifdef __AVX512F__
        __m512d d0 = _mm512_setzero_pd(), d1 = _mm512_setzero_pd();
        KVS_NORM_SQUARES(16, __m512, __m512d, _mm512, d0, d1);
        sq = _mm512_reduce_add_pd(_mm512_add_pd(d0, d1));
#endif
        __m256d q0 = _mm256_setzero_pd(), q1 = _mm256_setzero_pd();
        KVS_NORM_SQUARES(8, __m256, __m256d, _mm256, q0, q1);
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(q0, q1));
        sq += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
        for (; i < hidden; i++) {
            double v = ld1(x, xo + i, bf);
            if (residual) {
                v = rnd1((float)v + ld1(residual, ro + i, bf), bf);
                st1(residual_out, so + i, (float)v, bf);
            }
            sq += v * v;
        }
        float inv = 1.0f / sqrtf((float)(sq / hidden) + eps);
        long oo = t * hidden;
        i = 0;
#ifdef __AVX512F__
        KVS_NORM_SCALE(16, _mm512);
#endif
        KVS_NORM_SCALE(8, _mm256);
        for (; i < hidden; i++) st1(out, oo + i, ld1(w, i, bf) * rnd1(ld1(s, so + i, bf) * inv, bf), bf);
    }
}

void kvs_rms_norm(const void *x, const void *residual, void *out, void *residual_out, const void *w, long rows,
                  long hidden, long stride_x, long stride_r, float eps, int bf, int threads) {
    if (bf) rms_norm_body(x, residual, out, residual_out, w, rows, hidden, stride_x, stride_r, eps, threads, 1);
    else rms_norm_body(x, residual, out, residual_out, w, rows, hidden, stride_x, stride_r, eps, threads, 0);
}

/* rotary W lanes at a time (V: the vector type, P: the intrinsics' prefix): one list of steps for both widths */
#define KVS_ROTARY_STEPS(W, V, P)                                                                                  \
    for (; half % W == 0 && i < half; i += W) {                                                                    \
        V x1 = ld##W(x, xo + i, bf), x2 = ld##W(x, xo + i + half, bf);                                             \
        V c1 = P##_loadu_ps(cr + i), c2 = P##_loadu_ps(cr + i + half);                                             \
        V s1 = P##_loadu_ps(sr + i), s2 = P##_loadu_ps(sr + i + half);                                             \
        V nx2 = P##_sub_ps(P##_setzero_ps(), x2);                                                                  \
        st##W(out, oo + i, P##_add_ps(rnd##W(P##_mul_ps(x1, c1), bf), rnd##W(P##_mul_ps(nx2, s1), bf)), bf);       \
        st##W(out, oo + i + half, P##_add_ps(rnd##W(P##_mul_ps(x2, c2), bf), rnd##W(P##_mul_ps(x1, s2), bf)), bf); \
    }

/* Rotate-half rotary of x (tokens, heads, head_dim) into out (contiguous), cos/sin rows (fp32 tables, rounded to
 * the dtype first, as the reference's .to(dtype)) picked by position: out = x * cos + rotate_half(x) * sin, each
 * product and the sum rounded to the dtype. Tables of full head_dim width, row stride cs_stride. */
KVS_INLINE void rotary_body(const void *x, void *out, const long *positions, const float *cos_t, const float *sin_t,
                            long tokens, long heads, long head_dim, long stride_xt, long stride_xh, long cs_stride,
                            int threads, int bf) {
    long half = head_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(tokens >= 4 * threads ? threads : 1)
    for (long t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * cs_stride, *sn = sin_t + positions[t] * cs_stride;
        float cr[head_dim], sr[head_dim];  /* this token's table rows as the dtype holds them, for all its heads */
        for (long i = 0; i < head_dim; i++) { cr[i] = rnd1(c[i], bf); sr[i] = rnd1(sn[i], bf); }
        for (long h = 0; h < heads; h++) {
            long xo = t * stride_xt + h * stride_xh, oo = (t * heads + h) * head_dim, i = 0;
#ifdef __AVX512F__
            KVS_ROTARY_STEPS(16, __m512, _mm512);
#endif
            KVS_ROTARY_STEPS(8, __m256, _mm256);
            for (; i < half; i++) {
                float x1 = ld1(x, xo + i, bf), x2 = ld1(x, xo + i + half, bf);
                st1(out, oo + i, rnd1(x1 * cr[i], bf) + rnd1(-x2 * sr[i], bf), bf);
                st1(out, oo + i + half, rnd1(x2 * cr[i + half], bf) + rnd1(x1 * sr[i + half], bf), bf);
            }
        }
    }
}

void kvs_rotary(const void *x, void *out, const long *positions, const float *cos_t, const float *sin_t, long tokens,
                long heads, long head_dim, long stride_xt, long stride_xh, long cs_stride, int bf, int threads) {
    if (bf) rotary_body(x, out, positions, cos_t, sin_t, tokens, heads, head_dim, stride_xt, stride_xh, cs_stride, threads, 1);
    else rotary_body(x, out, positions, cos_t, sin_t, tokens, heads, head_dim, stride_xt, stride_xh, cs_stride, threads, 0);
}

/* Decode attention straight from the paged cache: one query token per sequence, no gathered copy of K/V.
 * q, out: (tokens, heads, head_dim); caches: (blocks, block_size, kv_heads, head_dim), all fp32 or all bf16,
 * contiguous; scores, softmax and the weighted sum of V in fp32, the output rounded once to the dtype.
 * For decode row i: its token is tokens[i], its block table row is block_tables + rows[i] * bt_stride, and it
 * sees keys [max(0, ctx - window), ctx) (window 0: all). A task is one row and all its KV heads (or, when
 * there are too few rows to keep the threads busy, one KV head), so each cache row comes from memory once:
 * scores 8 keys at a time for every query head while those 8 K rows sit in L1, an exact softmax over the
 * score buffer, then V in chunks of 64 rows (in L1/L2) added into every head's output vector by vector. */
#define KVS_V_CHUNK 64
/* K/V element loads: the cache holds the query's dtype (fp8 = 0), or fp8 codes read through `table` (their 256
 * fp32 values, as torch converts them); the fp8 scales are folded in by the caller (scores, output) */
KVS_INLINE float ldkv1(const void *p, long i, int bf, int fp8, const float *table) {
    return fp8 ? table[((const uint8_t *)p)[i]] : ld1(p, i, bf);
}
KVS_INLINE __m256 ldkv8(const void *p, long i, int bf, int fp8, const float *table) {
    if (!fp8) return ld8(p, i, bf);
    __m128i codes = _mm_loadl_epi64((const __m128i *)((const uint8_t *)p + i));
    return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(codes), 4);
}

/* Softmax of each of `rows` score rows (len each, contiguous), in place, exact (max subtracted) */
static void softmax_rows(float *s, long rows, long len) {
    for (long x = 0; x < rows; x++) {
        float *sx = s + x * len, m = -INFINITY, sum = 0.0f;
        for (long t = 0; t < len; t++) m = sx[t] > m ? sx[t] : m;
        long t = 0;
        __m256 vm = _mm256_set1_ps(m), vs = _mm256_setzero_ps();
        for (; t + 8 <= len; t += 8) {
            __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sx + t), vm));
            _mm256_storeu_ps(sx + t, e);
            vs = _mm256_add_ps(vs, e);
        }
        sum = hsum(vs);
        for (; t < len; t++) { sx[t] = expf(sx[t] - m); sum += sx[t]; }
        float inv = 1.0f / sum;
        for (t = 0; t < len; t++) sx[t] *= inv;
    }
}

#ifdef __AVX512BF16__
/* One decode task with AVX-512 (head_dim a multiple of 32, at most 8 query heads per KV head), on a bf16 cache or
 * an fp8 one (fp8 = 1: the pages hold codes, `lut` their bf16 values): scores key by key, each K row (all the
 * task's KV heads, contiguous) dotted with the query heads that read it by dot_bf16 (vdpbf16ps: bf16 pairs
 * multiplied exactly, summed in fp32); then V in chunks of KVS_V_CHUNK rows, each row widened 16 lanes at a time
 * and added into every reading head's accumulators. The scores loop prefetches the K row KVS_PREFETCH keys ahead
 * into L1 and its V row into L2, so V's memory traffic overlaps the scores' arithmetic: what made this kernel wait
 * on memory (bench/kernels.py; README, Performance). Every fp8 code of either format is a bf16 value exactly, so
 * an fp8 row goes through the same arithmetic as a bf16 one, its scales folded into the scores and the output
 * by the caller. key/value (NULL: none): the row's own token (the last key) as written, in bf16, weighted in the
 * cache's units (inv_k_scale, inv_v_scale). Same result as the AVX2 loops up to the order of fp32 additions.
 * s: (heads, len) scores; acc: (heads, head_dim) out. */
#define KVS_PREFETCH 4
#define KVS_MAX_HEAD_DIM 512
KVS_INLINE __m512 ldbf16x16(const bf16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* 32 fp8 codes (in the low bytes of `c`, widened to 16 bits) as 32 bf16 values: the magnitude's 128 values from
 * lut[0..3] (64 entries per permute), the sign bit moved to bf16's */
KVS_INLINE __m512i fp8x32_to_bf16(__m512i c, const __m512i *lut) {
    __m512i lo = _mm512_permutex2var_epi16(lut[0], c, lut[1]), hi = _mm512_permutex2var_epi16(lut[2], c, lut[3]);
    __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8));
}
KVS_INLINE __m512 ldfp8x16(const uint8_t *p, const __m512i *lut) {
    __m512i c = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)));
    __m512i h = fp8x32_to_bf16(c, lut);  /* its low 16 words hold p's 16 values */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
}
KVS_INLINE void decode_task_avx512(const bf16_t *q, const void *k_cache, const void *v_cache, const long *off,
                                   long len, long kv_heads, long group, long head_dim, float scale, float *s,
                                   float *acc, int fp8, const __m512i *lut, const bf16_t *key, const bf16_t *value,
                                   float inv_k_scale, float inv_v_scale) {
    long heads = kv_heads * group, row = kv_heads * head_dim, es = fp8 ? 1 : (long)sizeof(bf16_t);
    long cached = key ? len - 1 : len;  /* keys read from the pages; the last one from `key` when given */
    bf16_t krow[KVS_MAX_HEAD_DIM];  /* one KV head's K row of an fp8 cache, as bf16 */
    for (long j = 0; j < cached; j++) {
        const char *kp = (const char *)k_cache + off[j] * es;
        if (j + KVS_PREFETCH < cached) {
            const char *kn = (const char *)k_cache + off[j + KVS_PREFETCH] * es;
            const char *vn = (const char *)v_cache + off[j + KVS_PREFETCH] * es;
            for (long b = 0; b < row * es; b += 64) {
                _mm_prefetch(kn + b, _MM_HINT_T0);
                _mm_prefetch(vn + b, _MM_HINT_T1);
            }
        }
        for (long g = 0; g < kv_heads; g++) {  /* the K row stays in L1 for the group's query heads */
            const bf16_t *kr = (const bf16_t *)kp + g * head_dim;
            if (fp8) {
                for (long d = 0; d < head_dim; d += 32) {
                    const __m256i *src = (const __m256i *)((const uint8_t *)kp + g * head_dim + d);
                    _mm512_storeu_si512(krow + d, fp8x32_to_bf16(_mm512_cvtepu8_epi16(_mm256_loadu_si256(src)), lut));
                }
                kr = krow;
            }
            for (long x = 0; x < group; x++)
                s[(g * group + x) * len + j] = dot_bf16(kr, q + (g * group + x) * head_dim, head_dim) * scale;
        }
    }
    if (key)
        for (long x = 0; x < heads; x++)
            s[x * len + len - 1] = dot_bf16(key + (x / group) * head_dim, q + x * head_dim, head_dim) * inv_k_scale * scale;
    softmax_rows(s, heads, len);
    for (long e = 0; e < heads * head_dim; e++) acc[e] = 0.0f;
    for (long t0 = 0; t0 < cached; t0 += KVS_V_CHUNK) {
        long t1 = t0 + KVS_V_CHUNK < cached ? t0 + KVS_V_CHUNK : cached;
        for (long g = 0; g < kv_heads; g++)
            for (long d0 = 0; d0 < head_dim; d0 += 64) {  /* 64 dims of every reading head: 4 x group vectors */
                long nd = head_dim - d0 < 64 ? (head_dim - d0) / 16 : 4;
                __m512 o[32];
                for (long x = 0; x < group; x++)
                    for (long c = 0; c < nd; c++) o[x * nd + c] = _mm512_loadu_ps(acc + (g * group + x) * head_dim + d0 + c * 16);
                for (long t = t0; t < t1; t++) {
                    const char *vr = (const char *)v_cache + (off[t] + g * head_dim + d0) * es;
                    if (t + 8 < cached) _mm_prefetch((const char *)v_cache + (off[t + 8] + g * head_dim + d0) * es, _MM_HINT_T0);
                    __m512 vv[4];
                    for (long c = 0; c < nd; c++)
                        vv[c] = fp8 ? ldfp8x16((const uint8_t *)vr + c * 16, lut) : ldbf16x16((const bf16_t *)vr + c * 16);
                    for (long x = 0; x < group; x++) {
                        __m512 w = _mm512_set1_ps(s[(g * group + x) * len + t]);
                        for (long c = 0; c < nd; c++) o[x * nd + c] = _mm512_fmadd_ps(w, vv[c], o[x * nd + c]);
                    }
                }
                for (long x = 0; x < group; x++)
                    for (long c = 0; c < nd; c++)
                        _mm512_storeu_ps(acc + (g * group + x) * head_dim + d0 + c * 16, o[x * nd + c]);
            }
    }
    if (value)  /* the last key's value, as written */
        for (long x = 0; x < heads; x++) {
            __m512 w = _mm512_set1_ps(s[x * len + len - 1] * inv_v_scale);
            for (long d = 0; d < head_dim; d += 16)
                _mm512_storeu_ps(acc + x * head_dim + d, _mm512_fmadd_ps(w, ldbf16x16(value + (x / group) * head_dim + d),
                                                                         _mm512_loadu_ps(acc + x * head_dim + d)));
        }
}
#endif

KVS_INLINE void paged_decode_body(const void *q, const void *k_cache, const void *v_cache, void *out,
                                  const int *block_tables, long bt_stride, const long *rows, const long *tokens,
                                  const long *ctx_lens, long n, long num_heads, long num_kv_heads, long head_dim,
                                  long block_size, long window, float scale, float v_scale, const float *table,
                                  const void *key, const void *value, long stride_k, long stride_v,
                                  float inv_k_scale, float inv_v_scale, int threads, int bf, int fp8) {
    long group = num_heads / num_kv_heads, kv_row = num_kv_heads * head_dim;
    long splits = n < 2 * threads ? num_kv_heads : 1, per_task = num_kv_heads / splits;
    int vec = head_dim % 8 == 0;
#ifdef __AVX512BF16__
    /* fp8: the bf16 value of each code's magnitude (128 entries, 4 registers), when every code is its magnitude's
     * value with the sign bit set (both fp8 formats; checked, not assumed) */
    __m512i lut[4];
    int lut_ok = fp8 != 0;
    if (fp8) {
        bf16_t words[128];
        for (int c = 0; c < 128; c++) {
            uint32_t u, n;
            memcpy(&u, table + c, 4);
            memcpy(&n, table + c + 128, 4);
            lut_ok &= (u & 0xffffu) == 0 && n == (u | 0x80000000u);
            words[c] = (bf16_t)(u >> 16);
        }
        for (int r = 0; r < 4; r++) lut[r] = _mm512_loadu_si512(words + 32 * r);
    }
#endif
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long task = 0; task < n * splits; task++) {
        long i = task / splits, h0 = task % splits * per_task;
        long heads = per_task * group;  /* query heads of this task: h0 * group ... */
        long ctx = ctx_lens[i], lo = window > 0 && ctx > window ? ctx - window : 0, len = ctx - lo;
        const int *bt = block_tables + rows[i] * bt_stride;
        long q0 = (tokens[i] * num_heads + h0 * group) * head_dim;  /* this task's first query element */
        float *s = malloc(sizeof(float) * (size_t)(heads * len));
        float *acc = calloc((size_t)(heads * head_dim), sizeof(float));
        long *off = malloc(sizeof(long) * (size_t)len);  /* each visible key's row in the caches */
        for (long j = 0; j < len; j++) {
            long p = lo + j;
            off[j] = ((long)bt[p / block_size] * block_size + p % block_size) * kv_row + h0 * head_dim;
        }
        int done = 0;  /* the AVX-512 task did it all: the loops below then have nothing to do */
#ifdef __AVX512BF16__
        if (bf && head_dim % 32 == 0 && group <= 8 && (!fp8 || (lut_ok && head_dim <= KVS_MAX_HEAD_DIM))) {
            const bf16_t *kr = key ? (const bf16_t *)key + tokens[i] * stride_k + h0 * head_dim : NULL;
            const bf16_t *vr = value ? (const bf16_t *)value + tokens[i] * stride_v + h0 * head_dim : NULL;
            decode_task_avx512((const bf16_t *)q + q0, k_cache, v_cache, off, len, per_task, group, head_dim, scale,
                               s, acc, fp8, lut, kr, vr, inv_k_scale, inv_v_scale);
            done = 1;
        }
#endif
        /* with `key`, the row's own token (the last key) comes from key/value as written, not from the pages */
        long cached = done ? 0 : key ? len - 1 : len;
        long j = 0;
        if (vec) {
            for (; j + 8 <= cached; j += 8) {
                for (long x = 0; x < heads; x++) {  /* query head x reads KV head x / group of this task */
                    long qx = q0 + x * head_dim, kh = (x / group) * head_dim;
                    __m256 a[8];
                    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
                    for (long d = 0; d < head_dim; d += 8) {
                        __m256 qv = ld8(q, qx + d, bf);
                        for (int k = 0; k < 8; k++)
                            a[k] = _mm256_fmadd_ps(ldkv8(k_cache, off[j + k] + kh + d, bf, fp8, table), qv, a[k]);
                    }
                    _mm256_storeu_ps(s + x * len + j, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
                }
            }
        }
        for (; j < cached; j++)
            for (long x = 0; x < heads; x++) {
                long qx = q0 + x * head_dim, kx = off[j] + (x / group) * head_dim;
                float dot = 0.0f;
                for (long d = 0; d < head_dim; d++) dot += ld1(q, qx + d, bf) * ldkv1(k_cache, kx + d, bf, fp8, table);
                s[x * len + j] = dot * scale;
            }
        if (key && !done)  /* in the cache's units: the scores' scale carries k_scale */
            for (long x = 0; x < heads; x++) {
                long qx = q0 + x * head_dim, kx = tokens[i] * stride_k + (h0 + x / group) * head_dim;
                float dot = 0.0f;
                for (long d = 0; d < head_dim; d++) dot += ld1(q, qx + d, bf) * ld1(key, kx + d, bf);
                s[x * len + len - 1] = dot * inv_k_scale * scale;
            }
        if (!done) softmax_rows(s, heads, len);
        for (long j0 = 0; j0 < cached; j0 += KVS_V_CHUNK) {
            long j1 = j0 + KVS_V_CHUNK < cached ? j0 + KVS_V_CHUNK : cached;
            for (long x = 0; x < heads; x++) {
                const float *w = s + x * len;
                long vh = (x / group) * head_dim;
                float *a = acc + x * head_dim;
                long d = 0;
                if (vec) {
                    for (; d < head_dim; d += 8) {
                        __m256 c0 = _mm256_loadu_ps(a + d), c1 = _mm256_setzero_ps();
                        __m256 c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
                        long t = j0;
                        for (; t + 4 <= j1; t += 4) {
                            c0 = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), ldkv8(v_cache, vh + off[t] + d, bf, fp8, table), c0);
                            c1 = _mm256_fmadd_ps(_mm256_set1_ps(w[t + 1]), ldkv8(v_cache, vh + off[t + 1] + d, bf, fp8, table), c1);
                            c2 = _mm256_fmadd_ps(_mm256_set1_ps(w[t + 2]), ldkv8(v_cache, vh + off[t + 2] + d, bf, fp8, table), c2);
                            c3 = _mm256_fmadd_ps(_mm256_set1_ps(w[t + 3]), ldkv8(v_cache, vh + off[t + 3] + d, bf, fp8, table), c3);
                        }
                        for (; t < j1; t++)
                            c0 = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), ldkv8(v_cache, vh + off[t] + d, bf, fp8, table), c0);
                        _mm256_storeu_ps(a + d, _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
                    }
                }
                for (; d < head_dim; d++)  /* head_dim not a multiple of 8 */
                    for (long t = j0; t < j1; t++) a[d] += w[t] * ldkv1(v_cache, vh + off[t] + d, bf, fp8, table);
            }
        }
        if (value && !done)  /* in the cache's units: the output's scale carries v_scale */
            for (long x = 0; x < heads; x++) {
                float w = s[x * len + len - 1] * inv_v_scale;
                long vx = tokens[i] * stride_v + (h0 + x / group) * head_dim;
                for (long d = 0; d < head_dim; d++) acc[x * head_dim + d] += w * ld1(value, vx + d, bf);
            }
        for (long e = 0; e < heads * head_dim; e++) st1(out, q0 + e, acc[e] * v_scale, bf);
        free(off);
        free(s);
        free(acc);
    }
}

/* scale: the softmax scale times the fp8 k_scale; out = attention * v_scale; fp8_table: NULL when the cache holds
 * the query's dtype, else the fp8 codes' values; key/value (the query's dtype, rows stride_k / stride_v elements
 * apart; NULL: none): this step's own K/V, each row's own token read from there as written */
void kvs_paged_decode(const void *q, const void *k_cache, const void *v_cache, void *out, const int *block_tables,
                      long bt_stride, const long *rows, const long *tokens, const long *ctx_lens, long n,
                      long num_heads, long num_kv_heads, long head_dim, long block_size, long window, float scale,
                      float v_scale, const float *fp8_table, const void *key, const void *value, long stride_k,
                      long stride_v, float inv_k_scale, float inv_v_scale, int bf, int threads) {
#define KVS_DECODE(BF, FP8) paged_decode_body(q, k_cache, v_cache, out, block_tables, bt_stride, rows, tokens, \
    ctx_lens, n, num_heads, num_kv_heads, head_dim, block_size, window, scale, v_scale, fp8_table, key, value, \
    stride_k, stride_v, inv_k_scale, inv_v_scale, threads, BF, FP8)
    if (fp8_table) { if (bf) KVS_DECODE(1, 1); else KVS_DECODE(0, 1); }
    else { if (bf) KVS_DECODE(1, 0); else KVS_DECODE(0, 0); }
#undef KVS_DECODE
}

/* The task loop of both flash attentions (in the caller's scope: q, kp, v, out, their strides, q_len, ctx, heads,
 * group, per_head, window, scale, threads): tasks of up to ROWS query rows of one head, handed out dynamically,
 * the last row blocks first since they see the most keys. TASK: the dtype's task function. */
#define KVS_PREFILL_TASKS(ROWS, TASK)                                                                          \
    do {                                                                                                     \
        long row_blocks_ = (q_len + (ROWS) - 1) / (ROWS), tasks_ = num_heads * row_blocks_;                \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                              \
        for (long task = 0; task < tasks_; task++) {                                                        \
            long rb = row_blocks_ - 1 - task / num_heads, h = task % num_heads, g = h / group;             \
            long i0 = rb * (ROWS), rows = q_len - i0 < (ROWS) ? q_len - i0 : (ROWS);                       \
            TASK(q + i0 * q_tok + h * head_dim, q_tok, kp + g * per_head, v + g * v_head, v_tok,            \
                 out + (i0 * num_heads + h) * head_dim, num_heads * head_dim, rows, ctx - q_len + i0,       \
                 window, head_dim, scale);                                                                 \
        }                                                                                                    \
    } while (0)

/* Causal prefill attention in bf16 with AVX512-BF16, flash-style (no score matrix in memory), for one sequence: q
 * (q_len, heads, head_dim) rows q_stride elements apart, k/v (ctx, kv_heads, head_dim) with token / head strides
 * in elements, out (q_len, heads, head_dim) contiguous. Query row i sits at position ctx - q_len + i and sees keys
 * 0 .. its position (window > 0: only the last `window` of them, its own included). A task is (query head, 8 query
 * rows): their scores against 32 keys at a time by vdpbf16ps (exact bf16 products summed in fp32; K packed once
 * per KV head as pairs of dims for 32 keys), an online softmax in fp32, and P.V by fp32 FMAs over V rows widened
 * from bf16; the output divided by the softmax's sum and rounded once to bf16. Same math as torch's SDPA up to the
 * order of fp32 additions; what it is for: SDPA ran this shape at 55-70 GFLOP/s on 2 cores (README, Performance).
 * head_dim: a multiple of 32, at most 256. */
#ifdef __AVX512BF16__
#define KVS_PF_ROWS 8
#define KVS_PF_KEYS 32
KVS_INLINE __mmask16 first_bits(long n) {  /* the lowest n of 16 lanes */
    return n <= 0 ? 0 : n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
}
static void prefill_task_bf16(const bf16_t *q, long q_stride, const bf16_t *kp, const bf16_t *v, long v_tok,
                              bf16_t *out, long out_stride, long rows, long pos0, long window, long head_dim,
                              float scale) {
    /* rows (<= 8) query rows at positions pos0 .. pos0 + rows - 1; kp: this KV head's packed K, block b at
     * kp + b * 32 * head_dim as [head_dim / 2][32 keys][2]; v: this KV head's row 0, v_tok elements a token */
    float o[KVS_PF_ROWS][256], m[KVS_PF_ROWS], l[KVS_PF_ROWS], p[KVS_PF_ROWS][KVS_PF_KEYS];
    long pairs = head_dim / 2, last = pos0 + rows - 1;
    for (long r = 0; r < KVS_PF_ROWS; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (long d = 0; d < head_dim; d++) o[r][d] = 0.0f;
    }
    long first = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;  /* the first row's first key */
    for (long j0 = first / KVS_PF_KEYS * KVS_PF_KEYS; j0 <= last; j0 += KVS_PF_KEYS) {
        const bf16_t *kb = kp + (j0 / KVS_PF_KEYS) * KVS_PF_KEYS * head_dim;
        __m512 s[KVS_PF_ROWS][2];
        for (long r = 0; r < KVS_PF_ROWS; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
        for (long dp = 0; dp < pairs; dp++) {
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + dp * 64), k1 = (__m512bh)_mm512_loadu_si512(kb + dp * 64 + 32);
            for (long r = 0; r < KVS_PF_ROWS; r++) {
                int32_t pair;
                memcpy(&pair, q + (r < rows ? r : rows - 1) * q_stride + 2 * dp, 4);
                __m512bh qq = (__m512bh)_mm512_set1_epi32(pair);
                s[r][0] = _mm512_dpbf16_ps(s[r][0], qq, k0);
                s[r][1] = _mm512_dpbf16_ps(s[r][1], qq, k1);
            }
        }
        long nk = last + 1 - j0 < KVS_PF_KEYS ? last + 1 - j0 : KVS_PF_KEYS;  /* keys any row of the task sees */
        for (long r = 0; r < rows; r++) {
            /* row r sees this block's keys from .. see - 1: its own position and, with a window, the window-1 before */
            long see = pos0 + r + 1 - j0, from = window > 0 ? see - window : 0;
            __mmask16 m0 = first_bits(see) & (__mmask16)~first_bits(from);
            __mmask16 m1 = first_bits(see - 16) & (__mmask16)~first_bits(from - 16);
            if (!(m0 | m1) && m[r] == -INFINITY) {  /* nothing seen yet, nothing in this block: no weights */
                for (long t = 0; t < KVS_PF_KEYS; t++) p[r][t] = 0.0f;
                continue;
            }
            __m512 ninf = _mm512_set1_ps(-INFINITY);
            __m512 a = _mm512_mask_mul_ps(ninf, m0, s[r][0], _mm512_set1_ps(scale));
            __m512 b = _mm512_mask_mul_ps(ninf, m1, s[r][1], _mm512_set1_ps(scale));
            float mx = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
            float mn = mx > m[r] ? mx : m[r];
            __m512 e0 = exp512(_mm512_sub_ps(a, _mm512_set1_ps(mn))), e1 = exp512(_mm512_sub_ps(b, _mm512_set1_ps(mn)));
            float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);
            l[r] = l[r] * corr + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
            m[r] = mn;
            _mm512_storeu_ps(p[r], e0);
            _mm512_storeu_ps(p[r] + 16, e1);
            if (corr != 1.0f)
                for (long d = 0; d < head_dim; d += 16)
                    _mm512_storeu_ps(o[r] + d, _mm512_mul_ps(_mm512_loadu_ps(o[r] + d), _mm512_set1_ps(corr)));
        }
        for (long d0 = 0; d0 < head_dim; d0 += 32) {  /* P.V, 32 dims of every row at a time */
            __m512 c[KVS_PF_ROWS][2];
            for (long r = 0; r < rows; r++) {
                c[r][0] = _mm512_loadu_ps(o[r] + d0);
                c[r][1] = _mm512_loadu_ps(o[r] + d0 + 16);
            }
            for (long t = 0; t < nk; t++) {
                const bf16_t *vr = v + (j0 + t) * v_tok + d0;
                __m512 v0 = ldbf16x16(vr), v1 = ldbf16x16(vr + 16);
                for (long r = 0; r < rows; r++) {
                    __m512 w = _mm512_set1_ps(p[r][t]);
                    c[r][0] = _mm512_fmadd_ps(w, v0, c[r][0]);
                    c[r][1] = _mm512_fmadd_ps(w, v1, c[r][1]);
                }
            }
            for (long r = 0; r < rows; r++) {
                _mm512_storeu_ps(o[r] + d0, c[r][0]);
                _mm512_storeu_ps(o[r] + d0 + 16, c[r][1]);
            }
        }
    }
    for (long r = 0; r < rows; r++) {
        float inv = 1.0f / l[r];
        for (long d = 0; d < head_dim; d++) out[r * out_stride + d] = f2bf(o[r][d] * inv);
    }
}
#endif

/* returns 0 when this build cannot (no AVX512-BF16, head_dim not a multiple of 32 or over 256): callers use SDPA */
int kvs_prefill_attention_bf16(const bf16_t *q, const bf16_t *k, const bf16_t *v, bf16_t *out, long q_len, long ctx,
                               long num_heads, long num_kv_heads, long head_dim, long q_tok, long k_tok, long k_head,
                               long v_tok, long v_head, long window, float scale, int threads) {
#ifdef __AVX512BF16__
    if (head_dim % 32 != 0 || head_dim > 256 || q_len > ctx || q_len < 1) return 0;
    long blocks = (ctx + KVS_PF_KEYS - 1) / KVS_PF_KEYS, group = num_heads / num_kv_heads;
    long per_head = blocks * KVS_PF_KEYS * head_dim;
    /* with a window, blocks before the first row's first key are never read: not packed */
    long b0 = window > 0 && ctx - q_len + 1 > window ? (ctx - q_len + 1 - window) / KVS_PF_KEYS : 0;
    bf16_t *kp = malloc(sizeof(bf16_t) * (size_t)(num_kv_heads * per_head));
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long gb = 0; gb < num_kv_heads * (blocks - b0); gb++) {  /* pack K: [head][block][dim pair][32 keys][2] */
        long g = gb / (blocks - b0), b = b0 + gb % (blocks - b0);
        bf16_t *dst = kp + g * per_head + b * KVS_PF_KEYS * head_dim;
        for (long t = 0; t < KVS_PF_KEYS; t++) {
            long j = b * KVS_PF_KEYS + t;
            const bf16_t *src = k + j * k_tok + g * k_head;
            for (long dp = 0; dp < head_dim / 2; dp++) {
                dst[dp * 64 + 2 * t] = j < ctx ? src[2 * dp] : 0;
                dst[dp * 64 + 2 * t + 1] = j < ctx ? src[2 * dp + 1] : 0;
            }
        }
    }
    KVS_PREFILL_TASKS(KVS_PF_ROWS, prefill_task_bf16);
    free(kp);
    return 1;
#else
    (void)q; (void)k; (void)v; (void)out; (void)q_len; (void)ctx; (void)num_heads; (void)num_kv_heads;
    (void)head_dim; (void)q_tok; (void)k_tok; (void)k_head; (void)v_tok; (void)v_head; (void)window; (void)scale;
    (void)threads;
    return 0;
#endif
}

/* fp32 prompts and chunks: the same flash attention in AVX2 + FMA (every x86-64 build here). A task is up to 8
 * query rows of one head; it walks its keys 32 at a time: scores 8 keys a vector (K packed per KV head as
 * [group of 8 keys][head_dim][8]), an online softmax in fp32, P.V by FMAs 8 dims a vector. Tasks are handed out
 * dynamically, so a thread whose core is taken for a moment leaves its share to the other (torch's SDPA splits
 * its loop statically). */
#define KVS_PF32_ROWS 8
#define KVS_PF32_KEYS 32
static void prefill_task_f32(const float *q, long q_stride, const float *kp, const float *v, long v_tok,
                             float *out, long out_stride, long rows, long pos0, long window, long head_dim,
                             float scale) {
    float o[KVS_PF32_ROWS][256], m[KVS_PF32_ROWS], l[KVS_PF32_ROWS], p[KVS_PF32_ROWS][KVS_PF32_KEYS];
    float s[KVS_PF32_ROWS][KVS_PF32_KEYS];
    const float *qr[KVS_PF32_ROWS];
    long last = pos0 + rows - 1;
    for (long r = 0; r < KVS_PF32_ROWS; r++) {
        qr[r] = q + (r < rows ? r : rows - 1) * q_stride;  /* rows past the task's repeat its last (unused) */
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (long d = 0; d < head_dim; d++) o[r][d] = 0.0f;
    }
    long first = window > 0 && pos0 + 1 > window ? pos0 + 1 - window : 0;  /* the first row's first key */
    for (long j0 = first / KVS_PF32_KEYS * KVS_PF32_KEYS; j0 <= last; j0 += KVS_PF32_KEYS) {
        long nk = last + 1 - j0 < KVS_PF32_KEYS ? last + 1 - j0 : KVS_PF32_KEYS;  /* keys any row sees */
        for (long t0 = 0; t0 < nk; t0 += 8) {
            const float *kb = kp + (j0 + t0) / 8 * 8 * head_dim;
            __m256 acc[KVS_PF32_ROWS];
            for (long r = 0; r < KVS_PF32_ROWS; r++) acc[r] = _mm256_setzero_ps();
            for (long d = 0; d < head_dim; d++) {
                __m256 kk = _mm256_loadu_ps(kb + d * 8);
                for (long r = 0; r < KVS_PF32_ROWS; r++)
                    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(qr[r][d]), kk, acc[r]);
            }
            for (long r = 0; r < KVS_PF32_ROWS; r++)
                _mm256_storeu_ps(s[r] + t0, _mm256_mul_ps(acc[r], _mm256_set1_ps(scale)));
        }
        for (long r = 0; r < rows; r++) {
            /* row r sees keys j0 + t for from <= t < see: up to its own position, and the window-1 before it */
            long see = pos0 + r + 1 - j0, from = window > 0 ? see - window : 0;
            long lo = from > 0 ? from : 0, hi = see < nk ? see : nk;
            if (lo >= hi) {  /* nothing in this block for this row */
                for (long t = 0; t < KVS_PF32_KEYS; t++) p[r][t] = 0.0f;
                continue;
            }
            float mx = -INFINITY;
            for (long t = lo; t < hi; t++) mx = s[r][t] > mx ? s[r][t] : mx;
            float mn = mx > m[r] ? mx : m[r];
            float corr = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);
            __m256 sum = _mm256_setzero_ps(), idx0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
            for (long t0 = 0; t0 < KVS_PF32_KEYS; t0 += 8) {
                __m256 idx = _mm256_add_ps(idx0, _mm256_set1_ps((float)t0));
                __m256 in = _mm256_and_ps(_mm256_cmp_ps(idx, _mm256_set1_ps((float)lo), _CMP_GE_OQ),
                                          _mm256_cmp_ps(idx, _mm256_set1_ps((float)hi), _CMP_LT_OQ));
                __m256 e = _mm256_and_ps(in, exp256(_mm256_sub_ps(_mm256_loadu_ps(s[r] + t0), _mm256_set1_ps(mn))));
                _mm256_storeu_ps(p[r] + t0, e);
                sum = _mm256_add_ps(sum, e);
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, sum);
            l[r] = l[r] * corr + (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
            m[r] = mn;
            if (corr != 1.0f)
                for (long d = 0; d < head_dim; d += 8)
                    _mm256_storeu_ps(o[r] + d, _mm256_mul_ps(_mm256_loadu_ps(o[r] + d), _mm256_set1_ps(corr)));
        }
        for (long d0 = 0; d0 < head_dim; d0 += 8) {  /* P.V, 8 dims of every row at a time */
            __m256 c[KVS_PF32_ROWS];
            for (long r = 0; r < rows; r++) c[r] = _mm256_loadu_ps(o[r] + d0);
            for (long t = 0; t < nk; t++) {
                __m256 vv = _mm256_loadu_ps(v + (j0 + t) * v_tok + d0);
                for (long r = 0; r < rows; r++) c[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r][t]), vv, c[r]);
            }
            for (long r = 0; r < rows; r++) _mm256_storeu_ps(o[r] + d0, c[r]);
        }
    }
    for (long r = 0; r < rows; r++) {
        float inv = 1.0f / l[r];
        for (long d = 0; d < head_dim; d++) out[r * out_stride + d] = o[r][d] * inv;
    }
}

/* returns 0 when it cannot take the call (head_dim not a multiple of 8 or over 256): callers use SDPA. Layouts as
 * kvs_prefill_attention_bf16's. */
int kvs_prefill_attention_f32(const float *q, const float *k, const float *v, float *out, long q_len, long ctx,
                              long num_heads, long num_kv_heads, long head_dim, long q_tok, long k_tok, long k_head,
                              long v_tok, long v_head, long window, float scale, int threads) {
    if (head_dim % 8 != 0 || head_dim > 256 || q_len > ctx || q_len < 1) return 0;
    long blocks = (ctx + KVS_PF32_KEYS - 1) / KVS_PF32_KEYS, group = num_heads / num_kv_heads;
    long per_head = blocks * KVS_PF32_KEYS * head_dim;
    /* with a window, blocks before the first row's first key are never read: not packed */
    long b0 = window > 0 && ctx - q_len + 1 > window ? (ctx - q_len + 1 - window) / KVS_PF32_KEYS : 0;
    long groups8 = (blocks - b0) * (KVS_PF32_KEYS / 8);
    float *kp = malloc(sizeof(float) * (size_t)(num_kv_heads * per_head));
    if (kp == NULL) return 0;
    #pragma omp parallel for schedule(dynamic, 4) num_threads(threads)
    for (long gg = 0; gg < num_kv_heads * groups8; gg++) {  /* pack K: [head][group of 8 keys][dim][8] */
        long g = gg / groups8, j8 = b0 * KVS_PF32_KEYS + (gg % groups8) * 8;
        float *dst = kp + g * per_head + j8 * head_dim;
        for (long t = 0; t < 8; t++) {
            long j = j8 + t;
            const float *src = k + j * k_tok + g * k_head;
            for (long d = 0; d < head_dim; d++) dst[d * 8 + t] = j < ctx ? src[d] : 0.0f;
        }
    }
    KVS_PREFILL_TASKS(KVS_PF32_ROWS, prefill_task_f32);
    free(kp);
    return 1;
}

/* KV write: row t of key/value (row_bytes contiguous bytes, rows stride_k / stride_v bytes apart) into cache slot
 * slots[t]; slot -1 (padding) stores nothing. Any dtype: it only copies. */
void kvs_write_kv(const char *key, const char *value, char *k_cache, char *v_cache, const long *slots,
                  long tokens, long row_bytes, long stride_k, long stride_v) {
    for (long t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row_bytes, key + t * stride_k, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, value + t * stride_v, (size_t)row_bytes);
    }
}

/* SwiGLU's gate W lanes at a time (V: the vector type, P: the intrinsics' prefix, EXP: that width's exp): one list
 * of steps for both widths */
#define KVS_SILU_STEPS(W, V, P, EXP)                                                                               \
    for (; i + W <= inter; i += W) {                                                                               \
        V gv = ld##W(gu, g + i, bf);                                                                               \
        V s = rnd##W(P##_div_ps(gv, P##_add_ps(P##_set1_ps(1.0f), EXP(P##_sub_ps(P##_setzero_ps(), gv)))), bf);    \
        st##W(out, o + i, P##_mul_ps(s, ld##W(gu, u + i, bf)), bf);                                                \
    }

/* SwiGLU's gate: out[r, i] = dtype(silu(gu[r, i])) * gu[r, inter + i], silu(g) = g / (1 + exp(-g)) in fp32 as
 * torch computes it, rounded to the dtype before the product as torch's separate ops do; gu rows are stride_gu
 * apart, out is contiguous (rows, inter). */
KVS_INLINE void silu_mul_body(const void *gu, void *out, long rows, long inter, long stride_gu, int threads, int bf) {
    #pragma omp parallel for schedule(static) num_threads(rows >= 4 * threads ? threads : 1)
    for (long r = 0; r < rows; r++) {
        long g = r * stride_gu, u = g + inter, o = r * inter, i = 0;
#ifdef __AVX512F__
        KVS_SILU_STEPS(16, __m512, _mm512, exp512);
#endif
        KVS_SILU_STEPS(8, __m256, _mm256, exp256);
        for (; i < inter; i++) {
            float gv = ld1(gu, g + i, bf);
            st1(out, o + i, rnd1(gv / (1.0f + expf(-gv)), bf) * ld1(gu, u + i, bf), bf);
        }
    }
}

void kvs_silu_mul(const void *gu, void *out, long rows, long inter, long stride_gu, int bf, int threads) {
    if (bf) silu_mul_body(gu, out, rows, inter, stride_gu, threads, 1);
    else silu_mul_body(gu, out, rows, inter, stride_gu, threads, 0);
}
