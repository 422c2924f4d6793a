/* The library's own exp (engine/exact_attention.c's softmax, engine/block_forward.c's SiLU): the same bits in
   every vector lane as alone, on every machine (libm's expf differs between libraries and builds, and one call
   per value was a fifth of a 1k-token prefill's attention). Included by those two sources: part of a build's key
   (engine.weights.gguf_blocks.HEADERS). */
#ifndef KVB_OWN_EXP_H
#define KVB_OWN_EXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

/* exp(x) for x <= EXP_CEIL (2^n below must stay a normal float's power: n <= 127; the softmax's x, a score minus
   the row's largest, is <= 0), the same bits in every lane and in exp_one: x = n ln2 + r (n = nearest integer to
   x / ln2, ln2 in two parts), exp(r) by a degree-6 polynomial in r (Horner, fused multiply-adds), times 2^n built
   in the exponent field; below -87.33 (about where exp leaves the normal floats): 0. Within 3 ulp of exp. */
#define EXP_CEIL 88.0f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_FLOOR -87.33f
static const float exp_poly[7] = {1.0f, 1.0f, 0.5f, 1.6666665459e-1f, 4.1666641831e-2f, 8.3333803341e-3f,
                                  1.3887316255e-3f};

static inline float exp_one(float x) {
    if (!(x >= EXP_FLOOR)) return 0.0f;
    const float n = nearbyintf(x * EXP_LOG2E);
    float r = fmaf(n, -EXP_LN2_HI, x);
    r = fmaf(n, -EXP_LN2_LO, r);
    float e = exp_poly[6];
    for (int i = 5; i >= 0; i--) e = fmaf(e, r, exp_poly[i]);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return e * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp8(__m256 x) {
    const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR)); /* masked to 0 below; keeps 2^n in range */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_LN2_LO), r);
    __m256 e = _mm256_set1_ps(exp_poly[6]);
    for (int i = 5; i >= 0; i--) e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(exp_poly[i]));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(e, _mm256_castsi256_ps(bits)), keep);
}
#endif

#ifdef __AVX512F__
static inline __m512 exp16(__m512 x) { /* exp8's operations, 16 lanes */
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-EXP_LN2_LO), r);
    __m512 e = _mm512_set1_ps(exp_poly[6]);
    for (int i = 5; i >= 0; i--) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(exp_poly[i]));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(keep, e, _mm512_castsi512_ps(bits));
}
#endif

#endif
