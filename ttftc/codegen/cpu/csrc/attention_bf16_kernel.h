// Exact attention forward on bf16 inputs with AVX512-BF16 dot products (vdpbf16ps: two bf16 products per fp32
// lane and instruction, twice the fp32 FMA rate), in the shared structure of attention_kernel.h.
//
// Included by isa_kernels.h after attention_kernel.h, in the AVX512-BF16 target region only. Numerics are those of
// FlashAttention-2's bf16 mode: scores accumulate in fp32 and are scaled in fp32, the softmax runs in fp32, the
// probabilities are rounded to bf16 for the product with V, which again accumulates in fp32; the output is rounded
// to bf16 once.
//
// vdpbf16ps multiplies pairs: lane i gets a[2i] b[2i] + a[2i+1] b[2i+1]. Scores pair the head dimension (a query
// block is stored as [d/2][query] pairs, a key row's pair (d, d+1) is broadcast); value products pair the keys
// (probabilities as [key/2][query] pairs, values as [key/2][d] pairs, packed per block).

namespace TTFTC_NS {

// 32 bf16: (a[i], b[i]) for i < 16, each rounded to nearest even.
static inline __m512i interleave_pairs(__m256i a, __m256i b) {
  alignas(64) static const int16_t kOrder[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  return _mm512_permutexvar_epi16(_mm512_load_si512(kOrder), both);
}
static inline __m256i to_bf16(vf x) { return (__m256i)_mm512_cvtneps_pbh((__m512)x); }
static inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

struct BF16 {
  using T = uint16_t;

  // qt as 32-bit words: qt[d/2][i] = (q[i][d], q[i][d + 1]); the scale is applied to the fp32 scores instead.
  template <int C>
  static void pack_queries(Scratch& s, const uint16_t* q, int64_t q_ss, int64_t d_len, int64_t n_q, float qscale) {
    constexpr int BQ = C * VW;
    uint32_t* qp = reinterpret_cast<uint32_t*>(s.qt);
    for (int64_t i = 0; i < BQ; ++i)  // query by query, as the fp32 kernel packs (L1 sets)
      for (int64_t d2 = 0; d2 < d_len / 2; ++d2) {
        uint32_t pair = 0;
        if (i < n_q) std::memcpy(&pair, q + i * q_ss + 2 * d2, sizeof pair);
        qp[d2 * BQ + i] = pair;
      }
    s.qscale = qscale;
  }

  template <int C>
  static void scores(const AttentionArgs& a, Scratch& s, const uint16_t* kbase, int64_t rows, int64_t tiles) {
    constexpr int BQ = C * VW;
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(s.qt);
    const int64_t d2_len = a.d / 2;
    const uint16_t* krow[R];
    for (int64_t t = 0; t < tiles; ++t) {
      for (int r = 0; r < R; ++r) krow[r] = kbase + std::min<int64_t>(t * R + r, rows - 1) * a.k_ss;
      __m512 acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
      for (int64_t d2 = 0; d2 < d2_len; ++d2) {
        __m512i qv[C];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_load_si512(qp + d2 * BQ + c * VW);
        for (int r = 0; r < R; ++r) {
          uint32_t pair;
          std::memcpy(&pair, krow[r] + 2 * d2, sizeof pair);
          const __m512i kb = _mm512_set1_epi32(int(pair));
          for (int c = 0; c < C; ++c) acc[r][c] = dot_pairs(acc[r][c], kb, qv[c]);
        }
      }
      float* st = s.st + t * R * BQ;
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) _mm512_store_ps(st + r * BQ + c * VW, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(s.qscale)));
    }
  }

  template <int C>
  static void values(const AttentionArgs& a, Scratch& s, const uint16_t* vbase, int64_t rows, int64_t padded,
                     const vf* alpha) {
    constexpr int BQ = C * VW;
    const int64_t DV = a.dv, pairs = padded / 2;  // padded is a multiple of R, so even
    // Probabilities (0 on masked and padding rows) as bf16 pairs of keys: pt[j/2][i].
    uint32_t* pt = reinterpret_cast<uint32_t*>(s.pt);
    for (int64_t j2 = 0; j2 < pairs; ++j2)
      for (int c = 0; c < C; ++c) {
        const vf p0 = *(const vf*)(s.st + 2 * j2 * BQ + c * VW), p1 = *(const vf*)(s.st + (2 * j2 + 1) * BQ + c * VW);
        _mm512_store_si512(pt + j2 * BQ + c * VW, interleave_pairs(to_bf16(p0), to_bf16(p1)));
      }
    // Values as bf16 pairs of keys: vt[j/2][d] = (v[j][d], v[j + 1][d]); rows past the block are zeros.
    uint32_t* vt = reinterpret_cast<uint32_t*>(s.vt);
    for (int64_t j2 = 0; j2 < pairs; ++j2) {
      const int64_t j = 2 * j2;
      const uint16_t* r0 = j < rows ? vbase + j * a.v_ss : nullptr;
      const uint16_t* r1 = j + 1 < rows ? vbase + (j + 1) * a.v_ss : nullptr;
      int64_t d = 0;
      for (; d + 16 <= DV; d += 16) {
        const __m256i v0 = r0 ? _mm256_loadu_si256((const __m256i*)(r0 + d)) : _mm256_setzero_si256();
        const __m256i v1 = r1 ? _mm256_loadu_si256((const __m256i*)(r1 + d)) : _mm256_setzero_si256();
        _mm512_storeu_si512(vt + j2 * DV + d, interleave_pairs(v0, v1));
      }
      for (; d < DV; ++d)
        vt[j2 * DV + d] = uint32_t(r0 ? r0[d] : 0) | (uint32_t(r1 ? r1[d] : 0) << 16);
    }
    for (int64_t d0 = 0; d0 < DV; d0 += R) {
      __m512 acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_mul_ps(_mm512_load_ps(s.ot + (d0 + r) * BQ + c * VW), (__m512)alpha[c]);
      for (int64_t j2 = 0; j2 < pairs; ++j2) {
        __m512i pv[C];
        for (int c = 0; c < C; ++c) pv[c] = _mm512_load_si512(pt + j2 * BQ + c * VW);
        const uint32_t* vrow = vt + j2 * DV + d0;
        for (int r = 0; r < R; ++r) {
          const __m512i vb = _mm512_set1_epi32(int(vrow[r]));
          for (int c = 0; c < C; ++c) acc[r][c] = dot_pairs(acc[r][c], vb, pv[c]);
        }
      }
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) _mm512_store_ps(s.ot + (d0 + r) * BQ + c * VW, acc[r][c]);
    }
  }

  static void store(uint16_t* dst, const float* ot, int64_t dv, int64_t stride, float inv) {
    for (int64_t d = 0; d < dv; ++d) store1(dst + d, ot[d * stride] * inv);
  }
};

static bool attention_bf16(const AttentionArgs& a, int threads) { return attention_with<BF16>(a, threads); }

}  // namespace TTFTC_NS
