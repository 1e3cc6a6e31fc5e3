// Rotary position embedding, rotate-half form (ttftc/ops/rope.py): y = x * cos + rotate_half(x) * sin, one read of
// x and one write of y where the decomposition makes six passes over x-sized tensors.
//
// Included once per instruction set by native.cpp, after rows_kernel.h (whose load/store/as_dtype it uses). A work
// item is one (batch, position) pair: its heads' rows sit next to each other when q or k is a slice of a merged
// q|k|v GEMM output ([B, S, H, D] in memory), and they share one cos row and one sin row. The output's strides are
// the caller's (the decomposition's layout). Each product is rounded to the dtype before the sum, as the
// decomposition rounds it.

namespace TTFTC_NS {

template <class T>
static void rope_position(const RopeArgs& a, std::vector<float>&, int64_t item) {
  const int64_t b = item / a.s, s = item % a.s, half = a.d / 2;
  const T* x_base = static_cast<const T*>(a.x) + b * a.x_st[0] + s * a.x_st[2];
  const T* cos_base = static_cast<const T*>(a.cos) + b * a.cos_st[0] + s * a.cos_st[2];
  const T* sin_base = static_cast<const T*>(a.sin) + b * a.sin_st[0] + s * a.sin_st[2];
  for (int64_t h = 0; h < a.h; ++h) {
    const T* x = x_base + h * a.x_st[1];
    const T* c = cos_base + h * a.cos_st[1];
    const T* sn = sin_base + h * a.sin_st[1];
    T* y = static_cast<T*>(a.out) + b * a.out_st[0] + h * a.out_st[1] + s * a.out_st[2];
    int64_t i = 0;
    for (; i + VW <= half; i += VW) {
      const vf low = load(x + i), high = load(x + half + i);
      store(y + i, as_dtype<T>(low * load(c + i)) - as_dtype<T>(high * load(sn + i)));
      store(y + half + i, as_dtype<T>(high * load(c + half + i)) + as_dtype<T>(low * load(sn + half + i)));
    }
    for (; i < half; ++i) {
      const float low = load1(x + i), high = load1(x + half + i);
      store1(y + i, as_dtype1<T>(low * load1(c + i)) - as_dtype1<T>(high * load1(sn + i)));
      store1(y + half + i, as_dtype1<T>(high * load1(c + half + i)) + as_dtype1<T>(low * load1(sn + half + i)));
    }
  }
}

static bool rope_any(const RopeArgs& a, int threads) {
  return a.bf16 ? rows(a, a.batch * a.s, 0, threads, rope_position<uint16_t>)
                : rows(a, a.batch * a.s, 0, threads, rope_position<float>);
}

}  // namespace TTFTC_NS
