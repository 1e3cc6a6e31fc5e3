// An exact s8 x s8 -> s32 GEMM for CPUs with AVX2 and no VNNI, with the W8A8 dequantisation fused into its stores.
//
// AVX2's only byte multiply is vpmaddubsw: u8 x s8, adjacent products summed into a *saturating* int16. With
// x + 128 as the u8 side (oneDNN's way) a pair reaches 2 * 255 * 127 = 64770 and saturates. Here the u8 side is
// |x| (vpabsb: -128 becomes 0x80, read as 128) and x's sign moves onto the weight (vpsignb), so a pair is at most
// 2 * 128 * 127 = 32512 < 32767: never saturated, as long as no weight is -128 (its negation would not fit in s8;
// the packer in _native.py refuses such a weight, and the quantiser clamps to [-127, 127]). vpmaddwd with ones then
// widens the pair sums into int32 lanes, where they are accumulated.
//
// The operator takes a packed weight from anyone, so the kernel also looks for -128 itself: the first row tiles of
// the work items whose rows start at 0 (together they load every byte of the packed weight) keep a running byte
// minimum of the weight vectors they load anyway, and report one that reaches -128 (a.saw_minus_128; the operator
// raises). One vpminsb per weight vector in those tiles and no extra memory traffic, where a scan of its own before
// every call would read the weight twice at M = 1; every other tile skips it. The scalar version checks the same
// bytes (its int32 product is exact either way, but the contract is the same on every ISA).
//
// The weight is packed once (_native.pack_int8_weight) as [ceil(N / 8)][ceil(K / 4)][8 columns][4 k] int8, zero
// padded: one 32-byte load is 4 consecutive k of 8 consecutive columns, which is exactly what one broadcast of 4
// activation bytes multiplies into 8 int32 lanes (one per column). A register tile is kRows rows x kVecs such
// 8-column vectors; the work items are (row block, column block) tiles sized so a column block's packed weight
// stays in L2 while every row of the block streams past it.
//
// The baseline ISA (and non-x86 builds) runs the same loop order in scalar int32: exact, slow, for tests and
// completeness; ttftc only offers this GEMM where the AVX2 version runs.
//
// Included once per instruction set by native.cpp; TTFTC_INT8_AVX2 marks the regions whose target has AVX2, and
// TTFTC_INT8_VNNI the extra region (AVX-512 with VNNI) that native.cpp compiles for this kernel alone.

namespace TTFTC_NS {

constexpr int kI8Cols = 8;   // columns per packed vector (int32 lanes of a ymm register)
constexpr int kI8Depth = 4;  // k per packed group (bytes of one column in a vector)

// The fused epilogue of 8 columns of one row: acc * w_scale * x_scale (+ bias), rounded after every operation as
// ATen's dequantisation (int8_linear.py: dequant_epilogue's fallback, fp32_gemm) rounds it, whatever the ISA.
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));
typedef int32_t v8i __attribute__((vector_size(8 * sizeof(int32_t))));

static inline uint16_t bf16_bits(float f) {  // round to nearest even; NaN stays NaN (as rows_kernel.h's store)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (f != f) return 0x7fc0u;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void i8_store_row(const Int8GemmArgs& a, int64_t m, int64_t n0, const int32_t* acc8) {
  const int64_t cols = std::min<int64_t>(kI8Cols, a.n - n0);
  if (a.out_kind == 0) {
    std::memcpy(static_cast<int32_t*>(a.out) + m * a.out_rs + n0, acc8, size_t(cols) * sizeof(int32_t));
    return;
  }
  float ws[kI8Cols] = {}, bias[kI8Cols] = {};
  std::memcpy(ws, a.w_scale + n0, size_t(cols) * sizeof(float));
  if (a.bias) std::memcpy(bias, a.bias + n0, size_t(cols) * sizeof(float));
  v8i acc;
  v8f w, b;
  std::memcpy(&acc, acc8, sizeof acc);
  std::memcpy(&w, ws, sizeof w);
  std::memcpy(&b, bias, sizeof b);
  v8f out = __builtin_convertvector(acc, v8f) * w * (a.x_scale[m] - v8f{});
  if (a.bias) {
    __asm__("" : "+m"(out));  // no fused multiply-add into the bias (-ffp-contract=fast would make one)
    out = out + b;
  }
  if (a.out_kind == 1) {
    float* dst = static_cast<float*>(a.out) + m * a.out_rs + n0;
    if (cols == kI8Cols) {
      std::memcpy(dst, &out, sizeof out);
    } else {
      for (int64_t c = 0; c < cols; ++c) dst[c] = out[c];
    }
  } else {
    uint16_t* dst = static_cast<uint16_t*>(a.out) + m * a.out_rs + n0;
    for (int64_t c = 0; c < cols; ++c) dst[c] = bf16_bits(out[c]);
  }
}

// The 4 activation bytes of group g of row x (zeros past k: the packed weight is zero there too).
static inline int32_t i8_group(const int8_t* x, int64_t g, int64_t k) {
  int32_t v = 0;
  const int64_t k0 = g * kI8Depth;
  std::memcpy(&v, x + k0, size_t(std::min<int64_t>(kI8Depth, k - k0)));
  return v;
}

#ifdef TTFTC_INT8_AVX2
constexpr int kI8Rows = 4;  // 4 x 2 int32 accumulators + 2 weight vectors + broadcasts/temporaries: 16 ymm
constexpr int kI8Vecs = 2;

static inline __m256i i8_madd(__m256i acc, __m256i x4, __m256i ax4, __m256i w, __m256i ones) {
#ifdef TTFTC_INT8_VNNI
  // vpdpbusd sums the four u8 x s8 products straight into the int32 lane: no 16-bit step, one instruction where
  // AVX2 takes three. The same operands (|x|, w with x's sign), so the same exact product.
  (void)ones;
  return _mm256_dpbusd_epi32(acc, ax4, _mm256_sign_epi8(w, x4));
#else
  const __m256i pairs = _mm256_maddubs_epi16(ax4, _mm256_sign_epi8(w, x4));  // |x| * (w * sign x), never saturated
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
#endif
}

// One k group (4 bytes of each of R rows, at x[r]) into the R x V accumulators. The bytes are broadcast straight
// from memory (vbroadcastss: one load uop, where a 32-bit integer load goes through a general register first).
// kCheck: fold the weight bytes into `low`, their running minimum.
template <int R, int V, bool kCheck>
static inline void i8_group_step(__m256i (&acc)[R][V], const int8_t* w, int64_t panel, const int8_t* const (&x)[R],
                                 __m256i ones, __m256i& low) {
  __m256i wv[V];
  for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + v * panel));
  if constexpr (kCheck)
    for (int v = 0; v < V; ++v) low = _mm256_min_epi8(low, wv[v]);
  for (int r = 0; r < R; ++r) {
    const __m256i x4 = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(x[r])));
    const __m256i ax4 = _mm256_abs_epi8(x4);
    for (int v = 0; v < V; ++v) acc[r][v] = i8_madd(acc[r][v], x4, ax4, wv[v], ones);
  }
}

template <int R, int V, bool kCheck>
static void i8_tile(const Int8GemmArgs& a, int64_t m0, int64_t nv0) {
  const int64_t full = a.k / kI8Depth, groups = (a.k + kI8Depth - 1) / kI8Depth;
  const int8_t* w = a.packed + nv0 * a.panel;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.x + (m0 + r) * a.x_rs;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i low = _mm256_setzero_si256();
  __m256i acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_si256();
  // The last, partial group comes from a zero-padded copy (never read past a row), in the same loop: a second
  // copy of the step after it made the compiler keep the accumulators in memory too.
  int32_t tail[R];
  for (int r = 0; r < R; ++r) tail[r] = full < groups ? i8_group(x[r], full, a.k) : 0;
  const int8_t* xg[R];
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < R; ++r)
      xg[r] = g < full ? x[r] + g * kI8Depth : reinterpret_cast<const int8_t*>(&tail[r]);
    i8_group_step<R, V, kCheck>(acc, w + g * 32, a.panel, xg, ones, low);
  }
  if (kCheck && _mm256_movemask_epi8(_mm256_cmpeq_epi8(low, _mm256_set1_epi8(-128))))
    a.saw_minus_128->store(true, std::memory_order_relaxed);
  // All accumulators leave their registers at once, in unrolled code: an epilogue indexing them in a loop would
  // make the compiler keep a memory copy of them up to date inside the k loop.
  alignas(32) int32_t lanes[R][V][kI8Cols];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[r][v]), acc[r][v]);
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < V; ++v) {
      const int64_t n0 = (nv0 + v) * kI8Cols;
      if (n0 >= a.n) break;
      i8_store_row(a, m0 + r, n0, lanes[r][v]);
    }
  }
}

template <int R, bool kCheck>
static void i8_row_tiles(const Int8GemmArgs& a, int64_t m0, int64_t nv_begin, int64_t nv_end) {
  int64_t nv = nv_begin;
  for (; nv + kI8Vecs <= nv_end; nv += kI8Vecs) i8_tile<R, kI8Vecs, kCheck>(a, m0, nv);
  for (; nv < nv_end; ++nv) i8_tile<R, 1, kCheck>(a, m0, nv);
}

// The tiles of up to kI8Rows rows from m0 (fewer at the block's end); returns how many rows they took.
template <bool kCheck>
static int64_t i8_rows(const Int8GemmArgs& a, int64_t m0, int64_t m_end, int64_t nv_begin, int64_t nv_end) {
  switch (std::min<int64_t>(kI8Rows, m_end - m0)) {
    case 4: i8_row_tiles<4, kCheck>(a, m0, nv_begin, nv_end); return 4;
    case 3: i8_row_tiles<3, kCheck>(a, m0, nv_begin, nv_end); return 3;
    case 2: i8_row_tiles<2, kCheck>(a, m0, nv_begin, nv_end); return 2;
    default: i8_row_tiles<1, kCheck>(a, m0, nv_begin, nv_end); return 1;
  }
}

static void i8_block(const Int8GemmArgs& a, int64_t m_begin, int64_t m_end, int64_t nv_begin, int64_t nv_end) {
  static_assert(kI8Rows == 4, "i8_rows has a case per row count");
  int64_t m = m_begin;
  if (m == 0 && m < m_end) m += i8_rows<true>(a, m, m_end, nv_begin, nv_end);  // the first tiles look for -128
  while (m < m_end) m += i8_rows<false>(a, m, m_end, nv_begin, nv_end);
}
#else
static void i8_block(const Int8GemmArgs& a, int64_t m_begin, int64_t m_end, int64_t nv_begin, int64_t nv_end) {
  const int64_t groups = (a.k + kI8Depth - 1) / kI8Depth;
  if (m_begin == 0) {  // the first row block looks for -128 in the weight bytes of its columns
    const int8_t *begin = a.packed + nv_begin * a.panel, *end = a.packed + nv_end * a.panel;
    if (std::find(begin, end, int8_t(-128)) != end) a.saw_minus_128->store(true, std::memory_order_relaxed);
  }
  for (int64_t m = m_begin; m < m_end; ++m) {
    const int8_t* x = a.x + m * a.x_rs;
    for (int64_t nv = nv_begin; nv < nv_end; ++nv) {
      const int8_t* w = a.packed + nv * a.panel;
      // Unsigned sums wrap modulo 2^32 as the vector adds (and _int_mm) do past int32, where signed ones would be
      // undefined.
      uint32_t acc[kI8Cols] = {};
      for (int64_t g = 0; g < groups; ++g) {
        int8_t x4[kI8Depth];
        const int32_t bytes = i8_group(x, g, a.k);
        std::memcpy(x4, &bytes, sizeof x4);
        for (int c = 0; c < kI8Cols; ++c)
          for (int d = 0; d < kI8Depth; ++d) acc[c] += uint32_t(int32_t(x4[d]) * int32_t(w[g * 32 + c * kI8Depth + d]));
      }
      int32_t sums[kI8Cols];
      std::memcpy(sums, acc, sizeof sums);
      i8_store_row(a, m, nv * kI8Cols, sums);
    }
  }
}
#endif

// Work items are (row block, column block) tiles, row blocks outermost within a column block so that consecutive
// items on one thread share the column block's packed weight.
static bool int8_gemm(const Int8GemmArgs& a, int threads) {
  const int64_t m_blocks = a.m / a.block_m + (a.m % a.block_m != 0);  // no a.m + a.block_m - 1: it may overflow
  const int64_t vecs = a.n / kI8Cols + (a.n % kI8Cols != 0);
  const int64_t n_blocks = vecs / a.block_nv + (vecs % a.block_nv != 0);
  return parallel_for<int>(
      m_blocks * n_blocks, threads, [](int&) { return true; },
      [&](int&, int64_t item) {
        const int64_t mb = item % m_blocks, nb = item / m_blocks;
        const int64_t m_begin = mb * a.block_m, nv_begin = nb * a.block_nv;
        i8_block(a, m_begin, std::min(a.m, m_begin + a.block_m), nv_begin, std::min(vecs, nv_begin + a.block_nv));
      });
}

}  // namespace TTFTC_NS
