/* kvscale's CPU kernels (x86-64, AVX2 + FMA), built on first use by kernels/cpu_native.py.
 *
 * Decoding at small batch is a stream over every weight matrix: oneDNN's GEMV read the default model's
 * matrices at about 45 % of this machine's copy bandwidth in one measurement, the linear kernel here at about
 * 90 % (bench/kernels.py prints both). OpenMP shares torch's own runtime (same soname, already loaded), so
 * there is one thread pool, not two.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* y[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]), for r < rows: x (rows, in), w (out, in), y (rows, out),
 * all float32, row-major, contiguous. Each thread walks its contiguous share of the weight rows in order (one
 * stream per thread: on this class of machine that reads at about the copy bandwidth, where interleaving 4
 * weight rows measured 30 % slower); each weight row is read from memory once for all rows of x. */
void kvs_linear_f32(const float *x, const float *w, const float *bias, float *y,
                    long rows, long in, long out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long o = 0; o < out; o++) {
        const float *wr = w + o * in;
        for (long r = 0; r < rows; r++) {
            const float *xr = x + r * in;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
            __m256 a3 = _mm256_setzero_ps();
            long i = 0;
            for (; i + 32 <= in; i += 32) {  /* 4 independent FMA chains */
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i), _mm256_loadu_ps(xr + i), a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i + 8), _mm256_loadu_ps(xr + i + 8), a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i + 16), _mm256_loadu_ps(xr + i + 16), a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i + 24), _mm256_loadu_ps(xr + i + 24), a3);
            }
            for (; i + 8 <= in; i += 8)
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + i), _mm256_loadu_ps(xr + i), a0);
            float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            for (; i < in; i++) s += wr[i] * xr[i];
            y[r * out + o] = s + (bias ? bias[o] : 0.0f);
        }
    }
}

/* RMSNorm of each row of x (optionally x + residual, which is then also written to residual_out), fp32 as the
 * reference: out = w * (s * 1 / sqrt(mean(s^2) + eps)). Rows in parallel; strides in elements. */
void kvs_rms_norm_f32(const float *x, const float *residual, float *out, float *residual_out, const float *w,
                      long rows, long hidden, long stride_x, long stride_r, float eps, int threads) {
    #pragma omp parallel for schedule(static) num_threads(rows >= 4 * threads ? threads : 1)
    for (long t = 0; t < rows; t++) {
        const float *xr = x + t * stride_x;
        float *o = out + t * hidden;
        const float *s = xr;
        if (residual) {
            const float *rr = residual + t * stride_r;
            float *ro = residual_out + t * hidden;
            for (long i = 0; i < hidden; i++) ro[i] = xr[i] + rr[i];
            s = ro;
        }
        double sq = 0.0;
        for (long i = 0; i < hidden; i++) sq += (double)s[i] * s[i];
        float inv = 1.0f / sqrtf((float)(sq / hidden) + eps);
        for (long i = 0; i < hidden; i++) o[i] = w[i] * (s[i] * inv);
    }
}

/* Rotate-half rotary of x (tokens, heads, head_dim) into out (contiguous), cos/sin rows picked by position:
 * out = x * cos + rotate_half(x) * sin, with cos/sin tables of full head_dim width (row stride cs_stride). */
void kvs_rotary_f32(const float *x, float *out, const long *positions, const float *cos_t, const float *sin_t,
                    long tokens, long heads, long head_dim, long stride_xt, long stride_xh, long cs_stride,
                    int threads) {
    long half = head_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(tokens >= 4 * threads ? threads : 1)
    for (long t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * cs_stride, *sn = sin_t + positions[t] * cs_stride;
        for (long h = 0; h < heads; h++) {
            const float *xh = x + t * stride_xt + h * stride_xh;
            float *o = out + (t * heads + h) * head_dim;
            for (long i = 0; i < half; i++) {
                o[i] = xh[i] * c[i] + (-xh[i + half]) * sn[i];
                o[i + half] = xh[i + half] * c[i + half] + xh[i] * sn[i + half];
            }
        }
    }
}

/* exp(x) on 8 floats: range reduction to n*ln2 + r and a degree-5 polynomial (the Cephes expf scheme), within
 * 2 ulp of expf for the inputs attention feeds it (x <= 0). */
static inline __m256 exp256(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float dot_f32(const float *a, const float *b, long n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    float s = hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Decode attention straight from the paged cache: one query token per sequence, no gathered copy of K/V.
 * q, out: (tokens, heads, head_dim); caches: (blocks, block_size, kv_heads, head_dim), all fp32 contiguous.
 * For decode row i: its token is tokens[i], its block table row is block_tables + rows[i] * bt_stride, and it
 * sees keys [max(0, ctx - window), ctx) (window 0: all). One task per (row, KV head): every key row is read
 * once for the G query heads that share it; softmax in two passes over a score buffer. */
void kvs_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                          const int *block_tables, long bt_stride, const long *rows, const long *tokens,
                          const long *ctx_lens, long n, long num_heads, long num_kv_heads, long head_dim,
                          long block_size, long window, float scale, int threads) {
    long group = num_heads / num_kv_heads, kv_row = num_kv_heads * head_dim;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long task = 0; task < n * num_kv_heads; task++) {
        long i = task / num_kv_heads, h = task % num_kv_heads;
        long ctx = ctx_lens[i], lo = window > 0 && ctx > window ? ctx - window : 0, len = ctx - lo;
        const int *bt = block_tables + rows[i] * bt_stride;
        const float *qh = q + (tokens[i] * num_heads + h * group) * head_dim;
        float *s = malloc(sizeof(float) * (size_t)(group * len));
        float *acc = calloc((size_t)(group * head_dim), sizeof(float));
        for (long p = lo; p < ctx; p++) {
            const float *kr = k_cache + ((long)bt[p / block_size] * block_size + p % block_size) * kv_row + h * head_dim;
            for (long g = 0; g < group; g++) s[g * len + p - lo] = dot_f32(qh + g * head_dim, kr, head_dim) * scale;
        }
        for (long g = 0; g < group; g++) {
            float *sg = s + g * len, m = -INFINITY, sum = 0.0f;
            for (long j = 0; j < len; j++) m = sg[j] > m ? sg[j] : m;
            long j = 0;
            __m256 vm = _mm256_set1_ps(m), vs = _mm256_setzero_ps();
            for (; j + 8 <= len; j += 8) {
                __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), vm));
                _mm256_storeu_ps(sg + j, e);
                vs = _mm256_add_ps(vs, e);
            }
            sum = hsum(vs);
            for (; j < len; j++) { sg[j] = expf(sg[j] - m); sum += sg[j]; }
            float inv = 1.0f / sum;
            for (j = 0; j < len; j++) sg[j] *= inv;
        }
        for (long p = lo; p < ctx; p++) {
            const float *vr = v_cache + ((long)bt[p / block_size] * block_size + p % block_size) * kv_row + h * head_dim;
            for (long g = 0; g < group; g++) {
                float w = s[g * len + p - lo], *a = acc + g * head_dim;
                __m256 vw = _mm256_set1_ps(w);
                long d = 0;
                for (; d + 8 <= head_dim; d += 8)
                    _mm256_storeu_ps(a + d, _mm256_fmadd_ps(vw, _mm256_loadu_ps(vr + d), _mm256_loadu_ps(a + d)));
                for (; d < head_dim; d++) a[d] += w * vr[d];
            }
        }
        memcpy(out + (tokens[i] * num_heads + h * group) * head_dim, acc, sizeof(float) * (size_t)(group * head_dim));
        free(s);
        free(acc);
    }
}

/* KV write: row t of key/value (kv_heads * head_dim contiguous floats, rows stride_k / stride_v apart) into
 * cache slot slots[t]; slot -1 (padding) stores nothing. */
void kvs_write_kv_f32(const float *key, const float *value, float *k_cache, float *v_cache, const long *slots,
                      long tokens, long row, long stride_k, long stride_v) {
    for (long t = 0; t < tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row, key + t * stride_k, sizeof(float) * (size_t)row);
        memcpy(v_cache + slots[t] * row, value + t * stride_v, sizeof(float) * (size_t)row);
    }
}

/* SwiGLU's gate: out[r, i] = silu(gu[r, i]) * gu[r, inter + i], silu(g) = g / (1 + exp(-g)) as torch
 * computes it; gu rows are stride_gu apart, out is contiguous (rows, inter). */
void kvs_silu_mul_f32(const float *gu, float *out, long rows, long inter, long stride_gu, int threads) {
    #pragma omp parallel for schedule(static) num_threads(rows >= 4 * threads ? threads : 1)
    for (long r = 0; r < rows; r++) {
        const float *g = gu + r * stride_gu, *u = g + inter;
        float *o = out + r * inter;
        long i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
