/* kvscale's CPU kernels (x86-64, AVX2 + FMA), built on first use by kernels/cpu_native.py.
 *
 * Decoding at small batch is a stream over every weight matrix, so the linear kernel here is built to read the
 * weights at the memory's bandwidth (figures and commands: bench/results/design_figures.md). OpenMP shares torch's own runtime (same soname, already loaded), so there is
 * one thread pool, not two.
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

/* sum_i a[i] * b[i]: four independent FMA chains over 32 floats, then 8 at a time, then one by one */
static inline float dot_f32(const float *a, const float *b, long n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps();
    __m256 a3 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]), for r < rows: x (rows, in), w (out, in), y (rows, out),
 * all float32, row-major, contiguous. Each thread walks its contiguous share of the weight rows in order (one
 * stream per thread, which read faster than interleaving rows: bench/results/design_figures.md); each weight row is read from memory once for all rows of x. */
void kvs_linear_f32(const float *x, const float *w, const float *bias, float *y,
                    long rows, long in, long out, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long o = 0; o < out; o++) {
        const float *wr = w + o * in;
        for (long r = 0; r < rows; r++)
            y[r * out + o] = dot_f32(wr, x + r * in, in) + (bias ? bias[o] : 0.0f);
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

/* Eight dot products in, one vector of their eight sums out (a hadd tree: one reduction per 8 keys, not 8). */
static inline __m256 hsum8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Decode attention straight from the paged cache: one query token per sequence, no gathered copy of K/V.
 * q, out: (tokens, heads, head_dim); caches: (blocks, block_size, kv_heads, head_dim), all fp32 contiguous.
 * For decode row i: its token is tokens[i], its block table row is block_tables + rows[i] * bt_stride, and it
 * sees keys [max(0, ctx - window), ctx) (window 0: all). A task is one row and all its KV heads (or, when
 * there are too few rows to keep the threads busy, one KV head), so each cache row comes from memory once:
 * scores 8 keys at a time for every query head while those 8 K rows sit in L1, an exact softmax over the
 * score buffer, then V in chunks of 64 rows (in L1/L2) added into every head's output vector by vector. */
#define KVS_V_CHUNK 64
void kvs_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, float *out,
                          const int *block_tables, long bt_stride, const long *rows, const long *tokens,
                          const long *ctx_lens, long n, long num_heads, long num_kv_heads, long head_dim,
                          long block_size, long window, float scale, int threads) {
    long group = num_heads / num_kv_heads, kv_row = num_kv_heads * head_dim;
    long splits = n < 2 * threads ? num_kv_heads : 1, per_task = num_kv_heads / splits;
    int vec = head_dim % 8 == 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long task = 0; task < n * splits; task++) {
        long i = task / splits, h0 = task % splits * per_task;
        long heads = per_task * group;  /* query heads of this task: h0 * group ... */
        long ctx = ctx_lens[i], lo = window > 0 && ctx > window ? ctx - window : 0, len = ctx - lo;
        const int *bt = block_tables + rows[i] * bt_stride;
        const float *qh = q + (tokens[i] * num_heads + h0 * group) * head_dim;
        float *s = malloc(sizeof(float) * (size_t)(heads * len));
        float *acc = calloc((size_t)(heads * head_dim), sizeof(float));
        long *off = malloc(sizeof(long) * (size_t)len);  /* each visible key's row in the caches */
        for (long j = 0; j < len; j++) {
            long p = lo + j;
            off[j] = ((long)bt[p / block_size] * block_size + p % block_size) * kv_row + h0 * head_dim;
        }
        long j = 0;
        if (vec) {
            for (; j + 8 <= len; j += 8) {
                for (long x = 0; x < heads; x++) {  /* query head x reads KV head x / group of this task */
                    const float *qx = qh + x * head_dim;
                    long kh = (x / group) * head_dim;
                    __m256 a[8];
                    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
                    for (long d = 0; d < head_dim; d += 8) {
                        __m256 qv = _mm256_loadu_ps(qx + d);
                        for (int k = 0; k < 8; k++)
                            a[k] = _mm256_fmadd_ps(_mm256_loadu_ps(k_cache + off[j + k] + kh + d), qv, a[k]);
                    }
                    _mm256_storeu_ps(s + x * len + j, _mm256_mul_ps(hsum8(a), _mm256_set1_ps(scale)));
                }
            }
        }
        for (; j < len; j++)
            for (long x = 0; x < heads; x++)
                s[x * len + j] = dot_f32(qh + x * head_dim, k_cache + off[j] + (x / group) * head_dim, head_dim) * scale;
        for (long x = 0; x < heads; x++) {
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
        for (long j0 = 0; j0 < len; j0 += KVS_V_CHUNK) {
            long j1 = j0 + KVS_V_CHUNK < len ? j0 + KVS_V_CHUNK : len;
            for (long x = 0; x < heads; x++) {
                const float *w = s + x * len, *vh = v_cache + (x / group) * head_dim;
                float *a = acc + x * head_dim;
                long d = 0;
                if (vec) {
                    for (; d < head_dim; d += 8) {
                        __m256 c0 = _mm256_loadu_ps(a + d), c1 = _mm256_setzero_ps();
                        __m256 c2 = _mm256_setzero_ps(), c3 = _mm256_setzero_ps();
                        long t = j0;
                        for (; t + 4 <= j1; t += 4) {
                            c0 = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), _mm256_loadu_ps(vh + off[t] + d), c0);
                            c1 = _mm256_fmadd_ps(_mm256_set1_ps(w[t + 1]), _mm256_loadu_ps(vh + off[t + 1] + d), c1);
                            c2 = _mm256_fmadd_ps(_mm256_set1_ps(w[t + 2]), _mm256_loadu_ps(vh + off[t + 2] + d), c2);
                            c3 = _mm256_fmadd_ps(_mm256_set1_ps(w[t + 3]), _mm256_loadu_ps(vh + off[t + 3] + d), c3);
                        }
                        for (; t < j1; t++)
                            c0 = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), _mm256_loadu_ps(vh + off[t] + d), c0);
                        _mm256_storeu_ps(a + d, _mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
                    }
                }
                for (; d < head_dim; d++)  /* head_dim not a multiple of 8 */
                    for (long t = j0; t < j1; t++) a[d] += w[t] * vh[off[t] + d];
            }
        }
        memcpy(out + (tokens[i] * num_heads + h0 * group) * head_dim, acc, sizeof(float) * (size_t)(heads * head_dim));
        free(off);
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
