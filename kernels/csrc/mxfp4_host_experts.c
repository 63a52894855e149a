/* Copyright 2026 The Kimi K3 for transformers authors. Licensed under the Apache License, Version 2.0.
 *
 * K3's routed experts (SiTU-GLU) computed on the CPU over their packed MXFP4 bytes, where they live in host memory
 * (docs/design.md, Routed experts computed where they live). No dequantised copy of a stack or an expert is made:
 * each 32-value group of a weight row is decoded in registers (E2M1 code -> its value through a 16-entry table,
 * times the group's E8M0 scale) and multiplied into every token routed to the expert while it is there.
 *
 * Numerics (docs/architecture.md, Stable LatentMoE; the reference is ops_kimi_k3.routed_experts over
 * dequantize_mxfp4): gate and up = x . w accumulated in f32, rounded to the model's dtype; act = SiTU-GLU in f32
 * (b1 tanh(a/b1) sigmoid(a) times b2 tanh(u/b2)), rounded to the dtype; out = act . down accumulated in f32,
 * rounded to the dtype. The weights' values are exactly the reference's (code value times scale, both exact in f32);
 * only the order of the f32 sums differs from a BLAS's.
 *
 * Plain C with OpenMP, built at first use by kimik3.kernels.mxfp4_host (-O3 -march=native): AVX-512 where the
 * compiler targets it, AVX2 next, scalar C otherwise. Called through ctypes, which releases the GIL for the call.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32   /* values per E8M0 scale */
#define HALF 16    /* bytes per group: two E2M1 codes a byte, the low nibble the even value */
#define TOKENS 8   /* tokens one pass over a row serves (their accumulators stay in registers) */
#define ROWS 16    /* weight rows per work item */

static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* 2^(byte - 127) from its f32 bits, byte 0 the denormal 2^-127 and 255 inf, as ops_kimi_k3._e8m0_to_float */
static inline float e8m0(uint8_t byte) {
    uint32_t bits = byte == 0 ? (1u << 22) : ((uint32_t)byte << 23);
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* f32 -> bf16 -> f32, round to nearest even (torch's conversion); NaN stays NaN */
static inline float round_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u) {
        if (bits & 0x007fffffu) bits |= 0x00400000u;
    } else {
        bits += 0x7fffu + ((bits >> 16) & 1u);
    }
    bits &= 0xffff0000u;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline float to_dtype(float value, int bf16) { return bf16 ? round_bf16(value) : value; }

/* acc[t] = sum_k w[k] x_t[k] for one packed row (codes: K/2 bytes, scales: K/32 bytes) and `count` <= TOKENS
 * tokens whose inputs are split into even and odd values: even_t = x_t[0::2], odd_t = x_t[1::2], each K/2 floats,
 * token t's at `even + t * stride`. */
static inline __attribute__((always_inline)) void row_dot_n(
    const uint8_t *codes, const uint8_t *scales, const float *even, const float *odd, int64_t stride, int64_t groups,
    const int count, float *acc) {
#if defined(__AVX512F__) || defined(__AVX2__)
    /* the next row's codes and scales (contiguous after this one's) requested now: a work item walks its rows in
     * order, and the hardware prefetcher alone left one thread at a fraction of the memory's bandwidth */
    for (int64_t byte = 0; byte < groups * HALF; byte += 64)
        _mm_prefetch((const char *)(codes + groups * HALF + byte), _MM_HINT_T0);
    for (int64_t byte = 0; byte < groups; byte += 64)
        _mm_prefetch((const char *)(scales + groups + byte), _MM_HINT_T0);
#endif
#if defined(__AVX512F__)
    const __m512 table = _mm512_loadu_ps(E2M1);
    const __m512i low_bits = _mm512_set1_epi32(15);
    if (count == 1) {
        /* one token (decode at batch 1): four independent sums (even and odd values of two groups), so the adds
         * are not one chain each waiting for the last */
        __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
        int64_t g = 0;
        for (; g + 1 < groups; g += 2) {
            __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + g * HALF)));
            __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + (g + 1) * HALF)));
            __m512 c0 = _mm512_set1_ps(e8m0(scales[g])), c1 = _mm512_set1_ps(e8m0(scales[g + 1]));
            s0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b0, low_bits), table), c0),
                                 _mm512_loadu_ps(even + g * HALF), s0);
            s1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), table), c0),
                                 _mm512_loadu_ps(odd + g * HALF), s1);
            s2 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b1, low_bits), table), c1),
                                 _mm512_loadu_ps(even + (g + 1) * HALF), s2);
            s3 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), table), c1),
                                 _mm512_loadu_ps(odd + (g + 1) * HALF), s3);
        }
        for (; g < groups; ++g) {
            __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + g * HALF)));
            __m512 c0 = _mm512_set1_ps(e8m0(scales[g]));
            s0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(b0, low_bits), table), c0),
                                 _mm512_loadu_ps(even + g * HALF), s0);
            s1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), table), c0),
                                 _mm512_loadu_ps(odd + g * HALF), s1);
        }
        acc[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
        return;
    }
    __m512 sums[TOKENS];
    for (int t = 0; t < count; ++t) sums[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + g * HALF)));
        __m512 scale = _mm512_set1_ps(e8m0(scales[g]));
        __m512 w_even = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(bytes, low_bits), table), scale);
        __m512 w_odd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table), scale);
        for (int t = 0; t < count; ++t) {
            const float *e = even + t * stride + g * HALF, *o = odd + t * stride + g * HALF;
            sums[t] = _mm512_fmadd_ps(w_even, _mm512_loadu_ps(e), sums[t]);
            sums[t] = _mm512_fmadd_ps(w_odd, _mm512_loadu_ps(o), sums[t]);
        }
    }
    for (int t = 0; t < count; ++t) acc[t] = _mm512_reduce_add_ps(sums[t]);
#elif defined(__AVX2__)
    /* 8 lanes: the magnitude from the table's first 8 entries (the low 3 bits), the sign from bit 3 */
    const __m256 magnitudes = _mm256_loadu_ps(E2M1);
    const __m256i low_bits = _mm256_set1_epi32(15), sign_bit = _mm256_set1_epi32(8);
    __m256 sums[TOKENS];
    for (int t = 0; t < count; ++t) sums[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m256 scale = _mm256_set1_ps(e8m0(scales[g]));
        for (int h = 0; h < 2; ++h) {
            __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + g * HALF + h * 8)));
            __m256i lo = _mm256_and_si256(bytes, low_bits), hi = _mm256_srli_epi32(bytes, 4);
            __m256 w_even = _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, lo),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(lo, sign_bit), 28)));
            __m256 w_odd = _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, hi),
                                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(hi, sign_bit), 28)));
            w_even = _mm256_mul_ps(w_even, scale);
            w_odd = _mm256_mul_ps(w_odd, scale);
            for (int t = 0; t < count; ++t) {
                const float *e = even + t * stride + g * HALF + h * 8, *o = odd + t * stride + g * HALF + h * 8;
                sums[t] = _mm256_fmadd_ps(w_even, _mm256_loadu_ps(e), sums[t]);
                sums[t] = _mm256_fmadd_ps(w_odd, _mm256_loadu_ps(o), sums[t]);
            }
        }
    }
    for (int t = 0; t < count; ++t) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(sums[t]), _mm256_extractf128_ps(sums[t], 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        acc[t] = _mm_cvtss_f32(s);
    }
#else
    for (int t = 0; t < count; ++t) acc[t] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
        float scale = e8m0(scales[g]);
        for (int j = 0; j < HALF; ++j) {
            uint8_t byte = codes[g * HALF + j];
            float w_even = E2M1[byte & 15] * scale, w_odd = E2M1[byte >> 4] * scale;
            for (int t = 0; t < count; ++t)
                acc[t] += w_even * even[t * stride + g * HALF + j] + w_odd * odd[t * stride + g * HALF + j];
        }
    }
#endif
}

/* as row_dot_bf16: one compile-time token count per case */
static void row_dot(const uint8_t *codes, const uint8_t *scales, const float *even, const float *odd,
                    int64_t stride, int64_t groups, int count, float *acc) {
    switch (count) {
    case 1: row_dot_n(codes, scales, even, odd, stride, groups, 1, acc); break;
    case 2: row_dot_n(codes, scales, even, odd, stride, groups, 2, acc); break;
    case 3: row_dot_n(codes, scales, even, odd, stride, groups, 3, acc); break;
    case 4: row_dot_n(codes, scales, even, odd, stride, groups, 4, acc); break;
    case 5: row_dot_n(codes, scales, even, odd, stride, groups, 5, acc); break;
    case 6: row_dot_n(codes, scales, even, odd, stride, groups, 6, acc); break;
    case 7: row_dot_n(codes, scales, even, odd, stride, groups, 7, acc); break;
    default: row_dot_n(codes, scales, even, odd, stride, groups, TOKENS, acc); break;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16_DOT 1
/* The same product for bf16 inputs (a bf16 model's activations, exact in bf16) with AVX512-BF16's pair dot
 * product: two groups (64 values) a step, the codes decoded straight to bf16 (every E2M1 value is exact in bf16)
 * by a 16-bit table lookup, the bf16 pairs multiplied and added into f32 lanes (lanes 0-7 the first group's,
 * 8-15 the second's), each group's sum then scaled by its E8M0 value (a power of two) into the accumulator. The
 * instruction treats bf16 inputs below 2^-126 as zero and flushes results below it (DAZ/FTZ). even / odd: the
 * inputs' even and odd values as bf16 words, K/2 each, token t's at `even + t * stride`. */
static const uint16_t E2M1_BF16[32] = {0x0000, 0x3f00, 0x3f80, 0x3fc0, 0x4000, 0x4040, 0x4080, 0x40c0,
                                       0x8000, 0xbf00, 0xbf80, 0xbfc0, 0xc000, 0xc040, 0xc080, 0xc0c0};

static inline __attribute__((always_inline)) void row_dot_bf16_n(
    const uint8_t *codes, const uint8_t *scales, const uint16_t *even, const uint16_t *odd, int64_t stride,
    int64_t groups, const int count, float *acc) {
    for (int64_t byte = 0; byte < groups * HALF; byte += 64)
        _mm_prefetch((const char *)(codes + groups * HALF + byte), _MM_HINT_T0);
    for (int64_t byte = 0; byte < groups; byte += 64)
        _mm_prefetch((const char *)(scales + groups + byte), _MM_HINT_T0);
    const __m512i table = _mm512_loadu_si512((const void *)E2M1_BF16);
    const __m512i low_bits = _mm512_set1_epi16(15);
    __m512 sums[TOKENS];
    for (int t = 0; t < count; ++t) sums[t] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 1 < groups; g += 2) {
        __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + g * HALF)));
        __m512bh w_even = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(bytes, low_bits), table);
        __m512bh w_odd = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
        __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(e8m0(scales[g])), _mm256_set1_ps(e8m0(scales[g + 1])), 1);
        for (int t = 0; t < count; ++t) {
            const uint16_t *e = even + t * stride + g * HALF, *o = odd + t * stride + g * HALF;
            __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), w_even, (__m512bh)_mm512_loadu_si512((const void *)e));
            part = _mm512_dpbf16_ps(part, w_odd, (__m512bh)_mm512_loadu_si512((const void *)o));
            sums[t] = _mm512_fmadd_ps(part, scale, sums[t]);
        }
    }
    if (g < groups) { /* an odd last group: the upper half of the vector masked off */
        __m128i last = _mm_loadu_si128((const __m128i *)(codes + g * HALF));
        __m512i bytes = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(last));
        __m512bh w_even = (__m512bh)_mm512_maskz_permutexvar_epi16(0xFFFF, _mm512_and_si512(bytes, low_bits), table);
        __m512bh w_odd = (__m512bh)_mm512_maskz_permutexvar_epi16(0xFFFF, _mm512_srli_epi16(bytes, 4), table);
        __m512 scale = _mm512_maskz_mov_ps(0x00FF, _mm512_set1_ps(e8m0(scales[g])));
        for (int t = 0; t < count; ++t) {
            const uint16_t *e = even + t * stride + g * HALF, *o = odd + t * stride + g * HALF;
            __m512bh xe = (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, e);
            __m512bh xo = (__m512bh)_mm512_maskz_loadu_epi16(0xFFFF, o);
            __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), w_even, xe);
            part = _mm512_dpbf16_ps(part, w_odd, xo);
            sums[t] = _mm512_fmadd_ps(part, scale, sums[t]);
        }
    }
    for (int t = 0; t < count; ++t) acc[t] = _mm512_reduce_add_ps(sums[t]);
}

/* the token count a compile-time constant in each case, so the sums stay in registers (an array indexed by a
 * runtime count lived on the stack, one store and reload per product) */
static void row_dot_bf16(const uint8_t *codes, const uint8_t *scales, const uint16_t *even, const uint16_t *odd,
                         int64_t stride, int64_t groups, int count, float *acc) {
    switch (count) {
    case 1: row_dot_bf16_n(codes, scales, even, odd, stride, groups, 1, acc); break;
    case 2: row_dot_bf16_n(codes, scales, even, odd, stride, groups, 2, acc); break;
    case 3: row_dot_bf16_n(codes, scales, even, odd, stride, groups, 3, acc); break;
    case 4: row_dot_bf16_n(codes, scales, even, odd, stride, groups, 4, acc); break;
    case 5: row_dot_bf16_n(codes, scales, even, odd, stride, groups, 5, acc); break;
    case 6: row_dot_bf16_n(codes, scales, even, odd, stride, groups, 6, acc); break;
    case 7: row_dot_bf16_n(codes, scales, even, odd, stride, groups, 7, acc); break;
    default: row_dot_bf16_n(codes, scales, even, odd, stride, groups, TOKENS, acc); break;
    }
}
#else
#define HAVE_BF16_DOT 0
#endif

static inline uint16_t bf16_bits(float value) { /* value already rounded to bf16 */
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)(bits >> 16);
}

static inline float situ_glu(float gate, float up, float beta, float linear_beta, int has_linear_beta) {
    float act = beta * tanhf(gate / beta) * (1.0f / (1.0f + expf(-gate)));
    if (has_linear_beta) up = linear_beta * tanhf(up / linear_beta);
    return act * up;
}

/* row_dot or row_dot_bf16 over the inputs' rows from `first` (an element offset into even / odd) */
static inline void dot(const uint8_t *codes, const uint8_t *scales, const void *even, const void *odd, int64_t first,
                       int64_t stride, int64_t groups, int count, float *acc, int bf16_dot) {
#if HAVE_BF16_DOT
    if (bf16_dot) {
        row_dot_bf16(codes, scales, (const uint16_t *)even + first, (const uint16_t *)odd + first, stride, groups,
                     count, acc);
        return;
    }
#endif
    (void)bf16_dot;
    row_dot(codes, scales, (const float *)even + first, (const float *)odd + first, stride, groups, count, acc);
}

/* The routed experts of `n` experts for the rows of x grouped by expert: rows offsets[e] .. offsets[e+1] go to
 * expert e, whose packed matrices are gate and up (codes [I, K/2], scales [I, K/32] each: the two halves of a fused
 * gate_up stack, or the release's w1 and w3 tensors wherever they are) and down (codes [K, I/2], scales [K, I/32]).
 * x_even / x_odd: [R, K/2] each (x split into its even and odd values). Writes
 * out [R, K] (f32 holding values of the dtype) and uses hidden_even / hidden_odd [R, I/2] as workspace. With
 * `bf16_dot` (a bf16 model where the build has AVX512-BF16: k3_mxfp4_host_bf16_dot) the inputs and the workspace
 * are bf16 words and the products run through row_dot_bf16; else they are f32. Returns 0, -1 when the work lists
 * cannot be allocated, -2 for bf16_dot where it is not built or the model is not bf16. */
int k3_mxfp4_host_experts(const void *x_even, const void *x_odd, const int64_t *offsets, int n,
                          const uint8_t *const *gate_codes, const uint8_t *const *gate_scales,
                          const uint8_t *const *up_codes, const uint8_t *const *up_scales,
                          const uint8_t *const *down_codes, const uint8_t *const *down_scales, int64_t K, int64_t I,
                          float beta, float linear_beta, int has_linear_beta, int bf16, int bf16_dot,
                          void *hidden_even, void *hidden_odd, float *out, int threads) {
    if (bf16_dot && !(HAVE_BF16_DOT && bf16)) return -2;
    /* work items: (expert, first weight row); the tokens of an expert are served TOKENS at a time inside one */
    int64_t up_blocks = (I + ROWS - 1) / ROWS, down_blocks = (K + ROWS - 1) / ROWS;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (first == NULL) return -1;
    first[0] = 0;
    for (int e = 0; e < n; ++e) first[e + 1] = first[e] + (offsets[e + 1] > offsets[e] ? 1 : 0);
    int busy = (int)first[n];
    int *which = (int *)malloc(sizeof(int) * (size_t)(busy > 0 ? busy : 1));
    if (which == NULL) {
        free(first);
        return -1;
    }
    for (int e = 0, j = 0; e < n; ++e)
        if (offsets[e + 1] > offsets[e]) which[j++] = e;
    const int64_t half_k = K / 2, half_i = I / 2;

#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)busy * up_blocks; ++item) {
            int e = which[item / up_blocks];
            int64_t row0 = (item % up_blocks) * ROWS, row1 = row0 + ROWS < I ? row0 + ROWS : I;
            const uint8_t *g_codes = gate_codes[e], *g_scales = gate_scales[e];
            const uint8_t *u_codes = up_codes[e], *u_scales = up_scales[e];
            for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += TOKENS) {
                int count = (int)(offsets[e + 1] - r0 < TOKENS ? offsets[e + 1] - r0 : TOKENS);
                for (int64_t i = row0; i < row1; ++i) {
                    float gate[TOKENS], up[TOKENS];
                    dot(g_codes + i * half_k, g_scales + i * (K / GROUP), x_even, x_odd, r0 * half_k, half_k,
                        K / GROUP, count, gate, bf16_dot);
                    dot(u_codes + i * half_k, u_scales + i * (K / GROUP), x_even, x_odd, r0 * half_k, half_k,
                        K / GROUP, count, up, bf16_dot);
                    void *hidden = (i & 1) ? hidden_odd : hidden_even;
                    for (int t = 0; t < count; ++t) {
                        float value = to_dtype(situ_glu(to_dtype(gate[t], bf16), to_dtype(up[t], bf16), beta,
                                                        linear_beta, has_linear_beta), bf16);
                        if (bf16_dot)
                            ((uint16_t *)hidden)[(r0 + t) * half_i + i / 2] = bf16_bits(value);
                        else
                            ((float *)hidden)[(r0 + t) * half_i + i / 2] = value;
                    }
                }
            }
        }
        /* the implicit barrier of the loop above: every hidden value is written before the down rows read them */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)busy * down_blocks; ++item) {
            int e = which[item / down_blocks];
            int64_t row0 = (item % down_blocks) * ROWS, row1 = row0 + ROWS < K ? row0 + ROWS : K;
            const uint8_t *codes = down_codes[e], *scales = down_scales[e];
            for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += TOKENS) {
                int count = (int)(offsets[e + 1] - r0 < TOKENS ? offsets[e + 1] - r0 : TOKENS);
                for (int64_t k = row0; k < row1; ++k) {
                    float acc[TOKENS];
                    dot(codes + k * half_i, scales + k * (I / GROUP), hidden_even, hidden_odd, r0 * half_i, half_i,
                        I / GROUP, count, acc, bf16_dot);
                    for (int t = 0; t < count; ++t) out[(r0 + t) * K + k] = to_dtype(acc[t], bf16);
                }
            }
        }
    }
    free(which);
    free(first);
    return 0;
}

/* Whether this build multiplies bf16 inputs with AVX512-BF16 (row_dot_bf16). */
int k3_mxfp4_host_bf16_dot(void) { return HAVE_BF16_DOT; }

/* Which instruction set this build uses, for the benchmark's and the plan's records. */
const char *k3_mxfp4_host_isa(void) {
#if HAVE_BF16_DOT
    return "avx512-bf16";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
}

/* One MoE layer's routes computed on the CPU in a GPU stream's order (docs/design.md, Routed experts computed where
 * they live): k3_host_routes_step is a CUDA host function (cuLaunchHostFunc), queued after the copies of the layer's
 * rows and routes into pinned host memory and before the copy of its outputs back, so that a decode step is one
 * queue (one CUDA graph) with no read of the routes by the thread that drives the GPU. It reads nothing but its
 * argument and the memory it points to, and calls no CUDA function (a host function may not).
 *
 * The routes are taken in the order ops_kimi_k3.routed_experts takes them (by expert, stable: a counting sort), the
 * routes to experts held on the device are left out (the device marks them in the routes it sends, as -1 - expert:
 * its map of what it holds and the routes cross together, in stream order), and each other route's expert output
 * (before its routing weight, in the model's dtype) is written at its place in that order: out [R, K], R = tokens x
 * top_k. The device fills the held routes' rows and sums every route in that order, as the eager split does. */
typedef struct {
    int64_t tokens, top_k, K, I, num_experts;
    const void *x;        /* [tokens, K], the model's dtype (bf16 words or f32), pinned */
    const int64_t *ids;   /* [tokens, top_k] the routes' experts (-1 - expert: held on the device), pinned */
    void *out;            /* [R, K], the model's dtype, pinned */
    /* [E] each: every expert's gate, up and down codes and scales */
    const uint8_t *const *gate_codes, *const *gate_scales, *const *up_codes, *const *up_scales;
    const uint8_t *const *down_codes, *const *down_scales;
    uint8_t *held;        /* [E] workspace: nonzero where this step's routes mark the expert held */
    int64_t *routes;      /* [E] routes counted per expert (the placement's frequencies) */
    float beta, linear_beta;
    int has_linear_beta, bf16, bf16_dot, threads;
    /* workspace for R rows, the model's layer alone: */
    int64_t *order, *count, *offsets;  /* [R], [E + 1] (reused as the n + 1 offsets of the host's experts), [E + 1] */
    const uint8_t **chosen;            /* [6 E]: the chosen experts' pointers, six lists */
    void *x_even, *x_odd, *hidden_even, *hidden_odd;  /* [R, K/2] x2, [R, I/2] x2 (bf16 words or f32) */
    float *work;                       /* [R, K] */
    int status;           /* 0, or why the last step wrote zeros: -1 allocation, -3 an expert id out of range */
} k3_route_step;

static inline float load_dtype(const void *base, int64_t i, int bf16) {
    if (!bf16) return ((const float *)base)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

void k3_host_routes_step(void *arg) {
    k3_route_step *s = (k3_route_step *)arg;
    const int64_t R = s->tokens * s->top_k, E = s->num_experts, K = s->K, half_k = K / 2;
    const size_t row_bytes = (size_t)K * (s->bf16 ? 2 : 4);
    memset(s->out, 0, (size_t)R * row_bytes);
    memset(s->count, 0, sizeof(int64_t) * (size_t)E);
    memset(s->held, 0, (size_t)E);
    for (int64_t r = 0; r < R; ++r) {
        int64_t e = s->ids[r] < 0 ? -1 - s->ids[r] : s->ids[r];
        if (e < 0 || e >= E) {
            s->status = -3;
            return;
        }
        s->count[e] += 1;
        if (s->ids[r] < 0) s->held[e] = 1;
    }
    for (int64_t e = 0; e < E; ++e) s->routes[e] += s->count[e];
    /* stable counting sort: position of each route in the by-expert order, the held experts' routes included */
    int64_t *start = s->offsets; /* reused: start of each expert's run in the full order */
    start[0] = 0;
    for (int64_t e = 0; e < E; ++e) start[e + 1] = start[e] + s->count[e];
    for (int64_t r = 0; r < R; ++r) s->order[start[s->ids[r] < 0 ? -1 - s->ids[r] : s->ids[r]]++] = r;
    /* the host's experts in ascending id, their rows gathered (split into even and odd values) in that order */
    int n = 0;
    int64_t rows = 0, first = 0;
    int64_t *host_offsets = s->count; /* reused: offsets into the gathered rows, n + 1 of them */
    const uint8_t **g_c = s->chosen, **g_s = s->chosen + E, **u_c = s->chosen + 2 * E, **u_s = s->chosen + 3 * E;
    const uint8_t **dn_c = s->chosen + 4 * E, **dn_s = s->chosen + 5 * E;
    /* walk the full order expert by expert (start[] now holds each run's end) */
    int64_t run_begin = 0;
    for (int64_t e = 0; e < E; ++e) {
        int64_t run_end = start[e];
        if (run_end > run_begin && !s->held[e]) {
            g_c[n] = s->gate_codes[e];
            g_s[n] = s->gate_scales[e];
            u_c[n] = s->up_codes[e];
            u_s[n] = s->up_scales[e];
            dn_c[n] = s->down_codes[e];
            dn_s[n] = s->down_scales[e];
            host_offsets[n] = first;
            for (int64_t p = run_begin; p < run_end; ++p) {
                int64_t token = s->order[p] / s->top_k;
                for (int64_t j = 0; j < half_k; ++j) {
                    float even = load_dtype(s->x, token * K + 2 * j, s->bf16);
                    float odd = load_dtype(s->x, token * K + 2 * j + 1, s->bf16);
                    if (s->bf16_dot) {
                        ((uint16_t *)s->x_even)[rows * half_k + j] = bf16_bits(even);
                        ((uint16_t *)s->x_odd)[rows * half_k + j] = bf16_bits(odd);
                    } else {
                        ((float *)s->x_even)[rows * half_k + j] = even;
                        ((float *)s->x_odd)[rows * half_k + j] = odd;
                    }
                }
                s->order[rows] = p; /* gathered row `rows` goes to order position p (rows <= p: read before) */
                ++rows;
            }
            first = rows;
            ++n;
        }
        run_begin = run_end;
    }
    host_offsets[n] = rows;
    if (n) {
        int status = k3_mxfp4_host_experts(s->x_even, s->x_odd, host_offsets, n, g_c, g_s, u_c, u_s, dn_c, dn_s, K,
                                           s->I, s->beta, s->linear_beta, s->has_linear_beta, s->bf16, s->bf16_dot,
                                           s->hidden_even, s->hidden_odd, s->work, s->threads);
        if (status) {
            s->status = status;
            return;
        }
    }
    for (int64_t j = 0; j < rows; ++j) {
        int64_t p = s->order[j];
        const float *src = s->work + j * K;
        if (s->bf16) {
            uint16_t *dst = (uint16_t *)s->out + p * K;
            for (int64_t k = 0; k < K; ++k) dst[k] = bf16_bits(src[k]);
        } else {
            memcpy((float *)s->out + p * K, src, sizeof(float) * (size_t)K);
        }
    }
    s->status = 0;
}
