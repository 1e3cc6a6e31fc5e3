// Exact attention forward in fp32 on CPU: FlashAttention-2's online softmax, vectorised along the queries.
//
// Included once per instruction set by native.cpp, inside a target region, with
//   TTFTC_NS  the namespace of this instantiation,
//   TTFTC_VW  floats per vector register (16 for AVX-512, 8 for AVX2, 4 for SSE/NEON),
//   TTFTC_R   kv rows (score tile) and value columns (output tile) per register tile.
//
// Why queries along the vector lanes: with scores stored transposed, S^T[j][i] for key j and query i, every
// per-query quantity of the softmax (running max, sum, rescale factor) is one vector, so the row reductions of
// flash attention become element-wise max/add across tile rows, and K and V are read in their natural [S, D]
// layout as broadcast scalars. Nothing needs packing but the query block itself (D x BQ, once per work item).
// A register tile is TTFTC_R rows x C vectors (C <= 3) of accumulators: 8 x 3 = 24 of AVX-512's 32 registers.
//
// Work item: one (batch, head, block of BQ = C * VW queries). Its keys [lo, hi) are the ones any of its queries
// can see (causal diagonal at q_offset, sliding window, per-sequence kv_len); they are visited in blocks of
// block_k rows, and only blocks that cross a boundary are masked element by element.

namespace TTFTC_NS {

constexpr int VW = TTFTC_VW;
constexpr int R = TTFTC_R;
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(int32_t))));

// x - 0 (not 0 + x) folds to x exactly, so this compiles to one broadcast and no add.
static inline vf splat(float x) { return x - vf{}; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// 2^x for x in [-127, 126], to about 1 ulp: x = n + f with n an integer and |f| <= 1/2, 2^f from a degree-6
// polynomial (least-maximum relative error, 1.0e-7 in fp32 arithmetic), 2^n from the exponent bits. At n = -127
// the exponent field is 0 and the result exactly 0.
static inline vf exp2_in_range(vf x) {
  const vf n = (x + 12582912.0f) - 12582912.0f;  // round to nearest integer (|x| < 2^22), no libm call
  const vf f = x - n;
  vf p = splat(1.5345811e-04f);
  p = p * f + 1.3399931e-03f;
  p = p * f + 9.6184891e-03f;
  p = p * f + 5.5503286e-02f;
  p = p * f + 2.4022646e-01f;
  p = p * f + 6.9314718e-01f;
  p = p * f + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * (vf)e;
}

// 2^x clamped to [2^-126, 2^126].
static inline vf exp2_clamped(vf x) {
  const vf low = vmax(x, splat(-126.0f));
  return exp2_in_range(low < 126.0f ? low : splat(126.0f));
}

// 2^x for x <= 0 (every softmax argument is a difference from a running maximum). The one clamp at -127 flushes
// what would be subnormal to 0 and maps -inf (a masked score) to 0.
static inline vf exp2_nonpositive(vf x) { return exp2_in_range(vmax(x, splat(-127.0f))); }

// st[r][c] = sum_d qt[d][c] * k(r, d): a tile of R keys x C query vectors, k(r, d) = krow[r][d * KSTEP] (key rows
// read in place: KSTEP 1; packed tiles: krow[r] = tile + r, KSTEP R).
template <int C, int KSTEP>
static inline void score_tile(const float* __restrict qt, int64_t d_len, const float* const* krow,
                              float* __restrict st) {
  constexpr int BQ = C * VW;
  vf acc[R][C] = {};
  for (int64_t d = 0; d < d_len; ++d) {
    vf qv[C];
    for (int c = 0; c < C; ++c) qv[c] = *(const vf*)(qt + d * BQ + c * VW);
    for (int r = 0; r < R; ++r) {
      vf kb = splat(krow[r][d * KSTEP]);
      for (int c = 0; c < C; ++c) acc[r][c] += kb * qv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) *(vf*)(st + r * BQ + c * VW) = acc[r][c];
}

// ot[d0 + r][c] = ot[d0 + r][c] * alpha[c] + sum_j pt[j][c] * v[j][d0 + r]: R output columns x C query vectors;
// vcols points at v[0][d0], key j's columns at vcols + j * v_stride.
template <int C>
static inline void value_tile(const float* __restrict pt, int64_t rows, const float* vcols, int64_t v_stride,
                              int64_t d0, const vf* alpha, float* __restrict ot) {
  constexpr int BQ = C * VW;
  vf acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = *(const vf*)(ot + (d0 + r) * BQ + c * VW) * alpha[c];
  const float* vrow = vcols;
  for (int64_t j = 0; j < rows; ++j, vrow += v_stride) {
    vf pv[C];
    for (int c = 0; c < C; ++c) pv[c] = *(const vf*)(pt + j * BQ + c * VW);
    for (int r = 0; r < R; ++r) {
      vf vb = splat(vrow[r]);
      for (int c = 0; c < C; ++c) acc[r][c] += vb * pv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) *(vf*)(ot + (d0 + r) * BQ + c * VW) = acc[r][c];
}

// fp32 inputs: the query block transposed to qt[d][i], pre-scaled by scale * log2(e) so the softmax runs in base 2;
// scores and value products as above.
struct F32 {
  using T = float;

  template <int C>
  static void pack_queries(Scratch& s, const float* q, int64_t q_ss, int64_t d_len, int64_t n_q, float qscale) {
    constexpr int BQ = C * VW;
    // Query by query: each source row is read front to back once; rows 4 KiB apart would evict each other from
    // L1 if the block were read column by column.
    for (int64_t i = 0; i < BQ; ++i) {
      const float* row = q + i * q_ss;
      for (int64_t d = 0; d < d_len; ++d) s.qt[d * BQ + i] = i < n_q ? row[d] * qscale : 0.0f;
    }
  }

  // s.st[r][i] = scaled score of key j0 + r for query i, for `tiles` tiles of R keys (rows past `rows` repeat
  // the block's last key; the caller masks them).
  template <int C>
  static void scores(const AttentionArgs& a, Scratch& s, const float* kbase, int64_t rows, int64_t tiles) {
    const float* krow[R];
    for (int64_t t = 0; t < tiles; ++t) {
      for (int r = 0; r < R; ++r) krow[r] = kbase + std::min<int64_t>(t * R + r, rows - 1) * a.k_ss;
      score_tile<C, 1>(s.qt, a.d, krow, s.st + t * R * C * VW);
    }
  }

  template <int C>
  static void values(const AttentionArgs& a, Scratch& s, const float* vbase, int64_t rows, int64_t, const vf* alpha) {
    for (int64_t d0 = 0; d0 < a.dv; d0 += R) value_tile<C>(s.st, rows, vbase + d0, a.v_ss, d0, alpha, s.ot);
  }

  static void store(float* dst, const float* ot, int64_t dv, int64_t stride, float inv) {
    for (int64_t d = 0; d < dv; ++d) dst[d] = ot[d * stride] * inv;
  }
};

// fp32 with K and V copied once per call into register-tile order (pack_kv below): a score tile reads its R keys
// as kp[d][r], a value tile its R output columns as vp[panel][j][r], both front to back. Read in place, rows of
// 16 interleaved heads of 64 floats lie 4 KiB apart and share L1 sets, so the tiles evict each other.
struct F32Packed : F32 {
  template <int C>
  static void scores(const AttentionArgs& a, Scratch& s, const float* kbase, int64_t, int64_t tiles) {
    const float* krow[R];
    for (int64_t t = 0; t < tiles; ++t) {
      for (int r = 0; r < R; ++r) krow[r] = kbase + t * R * a.d + r;
      score_tile<C, R>(s.qt, a.d, krow, s.st + t * R * C * VW);
    }
  }

  template <int C>
  static void values(const AttentionArgs& a, Scratch& s, const float* vbase, int64_t rows, int64_t, const vf* alpha) {
    for (int64_t d0 = 0; d0 < a.dv; d0 += R)
      value_tile<C>(s.st, rows, vbase + d0 / R * a.v_panel, R, d0, alpha, s.ot);
  }
};

// Floats of the K and V copies pack_kv writes; 0 (no copy: read in place) where that overflows.
static size_t packed_kv_floats(const AttentionArgs& a) {
  size_t heads, keys, floats;
  if (!size_product(a.batch, a.hkv, &heads) || a.skv > INT64_MAX - R || a.d > INT64_MAX - a.dv ||
      !size_product(int64_t(heads), (a.skv + R - 1) / R * R, &keys) || keys > size_t(INT64_MAX) ||
      !size_product(int64_t(keys), a.d + a.dv, &floats))
    return 0;
  return floats;
}

// K of every (batch, kv head) as tiles [key / R][d][key % R], then V as panels [d / R][key][d % R], into `buffer`
// (packed_kv_floats(a) floats); keys past skv in the last tile are zeros (their scores are finite, and masked).
// Returns the arguments that read the copies.
static AttentionArgs pack_kv(const AttentionArgs& a, float* buffer, int threads) {
  const int64_t tiles = (a.skv + R - 1) / R, k_head = tiles * R * a.d, panel = tiles * R * R, v_head = tiles * R * a.dv;
  float* kp = buffer;
  float* vp = buffer + a.batch * a.hkv * k_head;
  parallel_for<int>(a.batch * a.hkv, threads, [](int&) { return true; }, [&](int&, int64_t bh) {
    const int64_t b = bh / a.hkv, h = bh % a.hkv;
    const float* k = static_cast<const float*>(a.k) + b * a.k_sb + h * a.k_sh;
    const float* v = static_cast<const float*>(a.v) + b * a.v_sb + h * a.v_sh;
    float* kh = kp + bh * k_head;
    float* vh = vp + bh * v_head;
    // Tile by tile, so the writes of R keys stay within one K tile and R-key runs of each V panel.
    for (int64_t t = 0; t < tiles; ++t) {
      float* kt = kh + t * R * a.d;
      for (int r = 0; r < R; ++r) {
        const int64_t j = t * R + r;
        for (int64_t d = 0; d < a.d; ++d) kt[d * R + r] = j < a.skv ? k[j * a.k_ss + d] : 0.0f;
      }
      for (int64_t p0 = 0; p0 < a.dv; p0 += R) {
        float* vt = vh + p0 / R * panel + t * R * R;
        for (int r = 0; r < R && t * R + r < a.skv; ++r)
          for (int c = 0; c < R; ++c) vt[r * R + c] = v[(t * R + r) * a.v_ss + p0 + c];
      }
    }
  });
  AttentionArgs p = a;
  p.k = kp;
  p.k_sb = a.hkv * k_head;
  p.k_sh = k_head;
  p.k_ss = a.d;  // key j0 (a multiple of R) starts tile j0 / R
  p.v = vp;
  p.v_sb = a.hkv * v_head;
  p.v_sh = v_head;
  p.v_ss = R;  // key j's R values of panel 0
  p.v_panel = panel;
  p.block_k = std::max<int64_t>(R, a.block_k / R * R);  // every block starts a K tile
  return p;
}

// One work item: `Kernel` (F32, or BF16 in attention_bf16_kernel.h) packs queries, computes score tiles and
// value products; the masking and the online softmax around them are shared.
template <class Kernel, int C>
static void attend_block(const AttentionArgs& a, Scratch& s, int64_t b, int64_t h, int64_t i0) {
  using T = typename Kernel::T;
  constexpr int BQ = C * VW;
  const int64_t DV = a.dv;
  const int64_t kvh = h / (a.hq / a.hkv);
  const int64_t n_q = std::min<int64_t>(BQ, a.sq - i0);
  const int64_t kv_len = a.kv_len ? std::max<int64_t>(0, std::min<int64_t>(a.kv_len[b], a.skv)) : a.skv;
  const T* q = static_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh;
  const T* k = static_cast<const T*>(a.k) + b * a.k_sb + kvh * a.k_sh;
  const T* v = static_cast<const T*>(a.v) + b * a.v_sb + kvh * a.v_sh;
  T* o = static_cast<T*>(a.o) + b * a.o_sb + h * a.o_sh;

  // Keys any query of the block may see: [lo, hi).
  const int64_t first_pos = a.q_offset + i0, last_pos = a.q_offset + i0 + n_q - 1;
  int64_t hi = a.causal ? std::min(kv_len, last_pos + 1) : kv_len;
  int64_t lo = (a.causal && a.window > 0) ? std::max<int64_t>(0, first_pos - a.window + 1) : 0;
  lo -= lo % R;  // blocks start on a register tile (packed K); the keys below the window this adds are masked

  // The block's query rows lie a head-interleaved row apart (often 4 KiB, a page): no hardware prefetcher follows
  // them, so request every line at once rather than one row's misses after another's.
  const char* q_rows = reinterpret_cast<const char*>(q + i0 * a.q_ss);
  for (int64_t i = 0; i < n_q; ++i)
    for (int64_t byte = 0; byte < a.d * int64_t(sizeof(T)); byte += 64)
      __builtin_prefetch(q_rows + i * a.q_ss * int64_t(sizeof(T)) + byte);
  // Padding queries (past sq) are zeros: finite scores, never stored.
  Kernel::template pack_queries<C>(s, q + i0 * a.q_ss, a.q_ss, a.d, n_q, a.scale * 1.4426950408889634f);
  for (int64_t x = 0; x < DV * BQ; ++x) s.ot[x] = 0.0f;
  vf m[C], l[C], qpos[C];
  for (int c = 0; c < C; ++c) {
    m[c] = splat(-INFINITY);
    l[c] = vf{};
    for (int lane = 0; lane < VW; ++lane) qpos[c][lane] = (float)(a.q_offset + i0 + c * VW + lane);
  }
  for (int64_t j0 = lo; j0 < hi; j0 += a.block_k) {
    const int64_t rows = std::min<int64_t>(a.block_k, hi - j0);
    const int64_t tiles = (rows + R - 1) / R;
    const int64_t padded = tiles * R;
    Kernel::template scores<C>(a, s, k + j0 * a.k_ss, rows, tiles);
    // Mask where the block crosses a boundary: padding rows, the causal diagonal, the window's lower edge.
    const bool crosses = padded != rows || (a.causal && j0 + rows - 1 > first_pos) ||
                         (a.causal && a.window > 0 && j0 <= last_pos - a.window);
    if (crosses) {
      for (int64_t r = 0; r < padded; ++r) {
        const int64_t j = j0 + r;
        const vf jv = splat((float)j);
        for (int c = 0; c < C; ++c) {
          vf* sv = (vf*)(s.st + r * BQ + c * VW);
          if (r >= rows) {
            *sv = splat(-INFINITY);
            continue;
          }
          if (a.causal) {
            *sv = jv <= qpos[c] ? *sv : splat(-INFINITY);
            if (a.window > 0) *sv = jv > qpos[c] - (float)a.window ? *sv : splat(-INFINITY);
          }
        }
      }
    }
    vf alpha[C];
    for (int c = 0; c < C; ++c) {
      vf mb = m[c];
      for (int64_t r = 0; r < padded; ++r) mb = vmax(mb, *(const vf*)(s.st + r * BQ + c * VW));
      // A query that has seen no key yet keeps a -inf maximum; subtract 0 instead so exp2 gives 0, not NaN.
      const vf shift = mb == splat(-INFINITY) ? vf{} : mb;
      alpha[c] = exp2_nonpositive(m[c] - shift);
      vf sum = vf{};
      for (int64_t r = 0; r < padded; ++r) {
        vf* sv = (vf*)(s.st + r * BQ + c * VW);
        *sv = exp2_nonpositive(*sv - shift);
        sum += *sv;
      }
      l[c] = l[c] * alpha[c] + sum;
      m[c] = mb;
    }
    Kernel::template values<C>(a, s, v + j0 * a.v_ss, rows, padded, alpha);
  }
  // Normalise and store; a query that saw no key gets zeros (l == 0).
  float inv[BQ];
  for (int c = 0; c < C; ++c) {
    const vf safe = l[c] > vf{} ? l[c] : splat(1.0f);
    const vf r = l[c] > vf{} ? splat(1.0f) / safe : vf{};
    for (int lane = 0; lane < VW; ++lane) inv[c * VW + lane] = r[lane];
  }
  for (int64_t i = 0; i < n_q; ++i) Kernel::store(o + (i0 + i) * a.o_ss, s.ot + i, DV, BQ, inv[i]);
}

// False where the working memory of a thread cannot be allocated (the sizes overflow, or memory is exhausted).
template <class Kernel>
static bool attention_with(const AttentionArgs& a, int threads) {
  const int C = a.sq > 2 * VW ? 3 : a.sq > VW ? 2 : 1;
  const int64_t bq = C * VW;
  const int64_t q_blocks = (a.sq + bq - 1) / bq;
  const int64_t heads = a.batch * a.hq;
  // Later query blocks see more keys under a causal mask: hand them out first, so the cheap ones fill the end.
  return parallel_for<Scratch>(q_blocks * heads, threads, [&](Scratch& s) { return s.reserve(a.d, a.dv, a.block_k, bq, R); },
               [&](Scratch& s, int64_t item) {
                 const int64_t qb = q_blocks - 1 - item / heads, bh = item % heads;
                 const int64_t b = bh / a.hq, h = bh % a.hq;
                 if (C == 3) attend_block<Kernel, 3>(a, s, b, h, qb * bq);
                 else if (C == 2) attend_block<Kernel, 2>(a, s, b, h, qb * bq);
                 else attend_block<Kernel, 1>(a, s, b, h, qb * bq);
               });
}

// fp32: with a.pack_kv, K and V are first copied into tile order (the caller decides when that pays).
static bool attention(const AttentionArgs& a, int threads) {
  PackedKV& buffer = packed_kv_buffer();
  const size_t floats = a.pack_kv ? packed_kv_floats(a) : 0;
  float* base = floats ? buffer.reserve(floats) : nullptr;
  if (base == nullptr) return attention_with<F32>(a, threads);  // not asked to, or no memory for the copy: in place
  const bool done = attention_with<F32Packed>(pack_kv(a, base, threads), threads);
  buffer.trim();
  return done;
}

}  // namespace TTFTC_NS
