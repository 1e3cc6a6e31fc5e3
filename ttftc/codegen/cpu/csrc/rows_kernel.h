// The glue of W8A8 on CPU, one pass per row where ATen takes one pass per op: per-token int8 quantisation, a
// residual add and norm that end in it, the dequantisation of an int32 GEMM accumulator, and the gated FFN's
// dequant -> act(gate) * up -> quantise between its two GEMMs.
//
// Included once per instruction set by native.cpp (see attention_kernel.h for the macros). Rows are independent,
// so each kernel is a loop over rows that native.cpp hands out to threads in chunks.
//
// Numerics follow the ops' references (ttftc/ops/int8_linear.py, quant.py, norm_linear.py): statistics in fp32,
// x / scale rounded half to even, a 16-bit input rounded back to its dtype where the reference rounds it.

namespace TTFTC_NS {

typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));
typedef int8_t vc __attribute__((vector_size(VW)));

static inline vf vabs(vf x) { return (vf)((vu)x & 0x7fffffffu); }
static inline vf vmin(vf a, vf b) { return a < b ? a : b; }

static inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline vf load(const uint16_t* p) {  // bf16: the high half of an fp32
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline void store(uint16_t* p, vf v) {  // fp32 -> bf16, rounded to nearest even; NaN stays NaN
  vu u = (vu)v;
  vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  rounded = v != v ? vu{} + 0x7fc0u : rounded;
  vh h = __builtin_convertvector(rounded, vh);
  std::memcpy(p, &h, sizeof h);
}
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) {
  uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline void store1(float* p, float f) { *p = f; }
static inline void store1(uint16_t* p, float f) {
  vf v = splat(f);
  uint16_t h[VW];
  store(h, v);
  *p = h[0];
}
// A value as the 16-bit dtype holds it (the identity for fp32): where the reference computes in that dtype.
template <class T> static inline vf as_dtype(vf v) {
  if constexpr (sizeof(T) == 2) {
    T tmp[VW];
    store(tmp, v);
    return load(tmp);
  } else {
    return v;
  }
}
template <class T> static inline float as_dtype1(float f) {
  if constexpr (sizeof(T) == 2) {
    T tmp;
    store1(&tmp, f);
    return load1(&tmp);
  } else {
    return f;
  }
}

// Round half to even for |x| < 2^22 under the default rounding mode (as torch.round), no libm call.
static inline vf round_even(vf x) {
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23
  return (x + magic) - magic;
}
static inline float round_even1(float x) { return (x + 12582912.0f) - 12582912.0f; }

// e^x for any x, as 2^(x log2 e) clamped to [2^-126, 2^126]: beyond it silu and gelu are already exact in fp32.
static inline vf exp_any(vf x) { return exp2_clamped(x * 1.4426950408889634f); }

static inline vf act(vf x, int kind) {
  if (kind == 0) return x / (1.0f + exp_any(-x));  // silu, as ATen: x / (1 + e^-x)
  if (kind == 2) return vmax(x, vf{});  // relu
  // gelu, tanh approximation: 0.5 x (1 + tanh(y)) = x / (1 + e^(-2y)), which does not cancel where tanh(y) -> -1
  vf y = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return x / (1.0f + exp_any(-2.0f * y));
}
static inline float act1(float x, int kind) { return act(splat(x), kind)[0]; }

// Symmetric int8 of one fp32 row, as quantize_per_token: scale = max(amax, 1e-8) / 127, q = round(x / scale).
static inline float quantize_row(const float* x, int64_t n, float amax, int8_t* q) {
  const float scale = std::max(amax, 1e-8f) / 127.0f;
  const vf vs = splat(scale), lo = splat(-127.0f), hi = splat(127.0f);
  int64_t i = 0;
  for (; i + VW <= n; i += VW) {
    vf r = vmax(vmin(round_even(load(x + i) / vs), hi), lo);
    vc c = __builtin_convertvector(__builtin_convertvector(r, vi), vc);
    std::memcpy(q + i, &c, sizeof c);
  }
  for (; i < n; ++i) q[i] = int8_t(std::max(-127.0f, std::min(127.0f, round_even1(x[i] / scale))));
  return scale;
}

template <class T> static inline float row_amax(const T* x, int64_t n) {
  vf m = vf{};
  int64_t i = 0;
  for (; i + VW <= n; i += VW) m = vmax(m, vabs(load(x + i)));
  float amax = 0.0f;
  for (int lane = 0; lane < VW; ++lane) amax = std::max(amax, m[lane]);
  for (; i < n; ++i) amax = std::max(amax, std::fabs(load1(x + i)));
  return amax;
}

// --- quantize_rows: x [M, K] (row stride x_rs) -> q [M, K] int8, scale [M] ---------------------------------
template <class T>
static void quantize_rows(const QuantArgs& a, std::vector<float>& row, int64_t m) {
  const T* x = static_cast<const T*>(a.x) + m * a.x_rs;
  const float amax = row_amax(x, a.k);
  float* xf = row.data();
  int64_t i = 0;
  for (; i + VW <= a.k; i += VW) store(xf + i, load(x + i));
  for (; i < a.k; ++i) xf[i] = load1(x + i);
  a.scale[m] = quantize_row(xf, a.k, amax, a.q + m * a.k);
}

// --- norms: (x + residual ->) RMSNorm / LayerNorm, then int8 per token or the normalised row itself ---------

// Normalises row m into y (fp32, rounded where the reference rounds); writes x + residual when there is one.
// Returns max |y|, for the quantiser.
template <class T, class W>
static float normalize_row(const NormArgs& a, float* y, int64_t m) {
  const int64_t k = a.k;
  const T* x = static_cast<const T*>(a.x) + m * k;
  if (a.residual) {  // the sum, in x's dtype, is both the norm's input and residual_out
    const T* r = static_cast<const T*>(a.residual) + m * k;
    T* out = static_cast<T*>(a.residual_out) + m * k;
    int64_t i = 0;
    for (; i + VW <= k; i += VW) store(out + i, load(x + i) + load(r + i));
    for (; i < k; ++i) store1(out + i, load1(x + i) + load1(r + i));
    x = out;
  }
  const W* w = static_cast<const W*>(a.weight);
  const W* b = static_cast<const W*>(a.bias);
  vf acc = vf{};
  float tail = 0.0f, shift = 0.0f;
  int64_t i = 0;
  if (a.layer) {  // mean, then the biased variance around it (two passes, as ATen's layer_norm)
    for (i = 0; i + VW <= k; i += VW) acc += load(x + i);
    for (; i < k; ++i) tail += load1(x + i);
    float sum = tail;
    for (int lane = 0; lane < VW; ++lane) sum += acc[lane];
    shift = sum / float(k);
    acc = vf{};
    tail = 0.0f;
  }
  for (i = 0; i + VW <= k; i += VW) {
    vf d = load(x + i) - shift;
    acc += d * d;
  }
  for (; i < k; ++i) {
    float d = load1(x + i) - shift;
    tail += d * d;
  }
  float sq = tail;
  for (int lane = 0; lane < VW; ++lane) sq += acc[lane];
  const float inv = 1.0f / std::sqrt(sq / float(k) + a.eps);
  // RMSNorm rounds the normalised x to its dtype before the weight (as Hugging Face does), and the product to the
  // promoted dtype of x and weight; LayerNorm applies weight and bias in fp32 and rounds once.
  vf m_abs = vf{};
  float amax = 0.0f;
  for (i = 0; i + VW <= k; i += VW) {
    vf v = (load(x + i) - shift) * inv;
    if (a.layer) {
      v = as_dtype<T>(v * load(w + i) + load(b + i));
    } else {
      v = as_dtype<T>(v) * load(w + i);
      if (a.round_product) v = as_dtype<T>(v);
    }
    store(y + i, v);
    m_abs = vmax(m_abs, vabs(v));
  }
  for (; i < k; ++i) {
    float v = (load1(x + i) - shift) * inv;
    if (a.layer) {
      v = as_dtype1<T>(v * load1(w + i) + load1(b + i));
    } else {
      v = as_dtype1<T>(v) * load1(w + i);
      if (a.round_product) v = as_dtype1<T>(v);
    }
    y[i] = v;
    amax = std::max(amax, std::fabs(v));
  }
  for (int lane = 0; lane < VW; ++lane) amax = std::max(amax, m_abs[lane]);
  return amax;
}

template <class T, class W>
static void norm_quant(const NormArgs& a, std::vector<float>& row, int64_t m) {
  const float amax = normalize_row<T, W>(a, row.data(), m);
  a.scale[m] = quantize_row(row.data(), a.k, amax, a.q + m * a.k);
}

// The normalised row in the output's dtype (every value is already rounded to it).
template <class T, class W, class O>
static void norm_rows(const NormArgs& a, std::vector<float>& row, int64_t m) {
  normalize_row<T, W>(a, row.data(), m);
  O* out = static_cast<O*>(a.out) + m * a.k;
  int64_t i = 0;
  for (; i + VW <= a.k; i += VW) store(out + i, load(row.data() + i));
  for (; i < a.k; ++i) store1(out + i, row[i]);
}

// --- dequant: acc [M, N] int32 -> acc * w_scale * x_scale (+ bias) in out's dtype ---------------------------
static inline vf dequant_vec(const int32_t* acc, const float* w_scale, vf x_scale, const float* bias, int64_t i) {
  vi v;
  std::memcpy(&v, acc + i, sizeof v);
  vf out = __builtin_convertvector(v, vf) * load(w_scale + i) * x_scale;
  return bias ? out + load(bias + i) : out;
}
static inline float dequant1(const int32_t* acc, const float* w_scale, float x_scale, const float* bias, int64_t i) {
  float out = float(acc[i]) * w_scale[i] * x_scale;
  return bias ? out + bias[i] : out;
}

template <class T>
static void dequant(const DequantArgs& a, std::vector<float>&, int64_t m) {
  const int32_t* acc = a.acc + m * a.acc_rs;
  T* out = static_cast<T*>(a.out) + m * a.out_rs;
  const vf xs = splat(a.x_scale[m]);
  int64_t i = 0;
  for (; i + VW <= a.n; i += VW) store(out + i, dequant_vec(acc, a.w_scale, xs, a.bias, i));
  for (; i < a.n; ++i) store1(out + i, dequant1(acc, a.w_scale, a.x_scale[m], a.bias, i));
}

// --- the gated FFN's middle: acc [M, 2I] int32 (gate | up) -> act(gate) * up -> int8 [M, I], scale [M] ------
static void gated_quant(const GatedQuantArgs& a, std::vector<float>& row, int64_t m) {
  const int64_t inter = a.inter;
  const int32_t* acc = a.acc + m * 2 * inter;
  const vf xs = splat(a.x_scale[m]);
  const float* ws_up = a.w_scale + inter;
  const float* b_up = a.bias ? a.bias + inter : nullptr;
  float* h = row.data();
  vf m_abs = vf{};
  float amax = 0.0f;
  int64_t i = 0;
  for (; i + VW <= inter; i += VW) {
    vf v = act(dequant_vec(acc, a.w_scale, xs, a.bias, i), a.act) * dequant_vec(acc + inter, ws_up, xs, b_up, i);
    store(h + i, v);
    m_abs = vmax(m_abs, vabs(v));
  }
  for (; i < inter; ++i) {
    float v = act1(dequant1(acc, a.w_scale, a.x_scale[m], a.bias, i), a.act) *
              dequant1(acc + inter, ws_up, a.x_scale[m], b_up, i);
    h[i] = v;
    amax = std::max(amax, std::fabs(v));
  }
  for (int lane = 0; lane < VW; ++lane) amax = std::max(amax, m_abs[lane]);
  a.scale[m] = quantize_row(h, inter, amax, a.q + m * inter);
}

// --- the float gated FFN's middle: gate_up [M, 2I] -> act(gate) * up [M, I], contiguous -----------------------
// In x's dtype as the reference computes it: act(gate) rounded to the dtype, then the product.
template <class T>
static void gated_act(const GatedActArgs& a, std::vector<float>&, int64_t m) {
  const T* gate = static_cast<const T*>(a.x) + m * a.x_rs;
  const T* up = gate + a.inter;
  T* out = static_cast<T*>(a.out) + m * a.inter;
  int64_t i = 0;
  for (; i + VW <= a.inter; i += VW) store(out + i, as_dtype<T>(act(load(gate + i), a.act)) * load(up + i));
  for (; i < a.inter; ++i) store1(out + i, as_dtype1<T>(act1(load1(gate + i), a.act)) * load1(up + i));
}

// Row kernels: items are chunks of rows, each thread keeps one fp32 row of scratch. False where that row cannot be
// allocated (parallel_for).
template <class Args, class Fn>
static bool rows(const Args& a, int64_t m, int64_t width, int threads, Fn fn) {
  constexpr int64_t kChunk = 8;
  return parallel_for<std::vector<float>>(
      (m + kChunk - 1) / kChunk, threads,
      [&](std::vector<float>& row) {
        if (width < 0 || width > INT64_MAX - VW) return false;
        row.resize(size_t(width) + VW);  // std::bad_alloc, std::length_error: parallel_for catches them
        return true;
      },
      [&](std::vector<float>& row, int64_t item) {
        const int64_t stop = std::min(m, (item + 1) * kChunk);
        for (int64_t r = item * kChunk; r < stop; ++r) fn(a, row, r);
      });
}

static bool quantize_rows_any(const QuantArgs& a, int threads) {
  return a.x_bf16 ? rows(a, a.m, a.k, threads, quantize_rows<uint16_t>) : rows(a, a.m, a.k, threads, quantize_rows<float>);
}

static bool norm_any(const NormArgs& a, int threads) {
  using B = uint16_t;
  if (a.q) {
    if (a.x_bf16 && a.w_bf16) return rows(a, a.m, a.k, threads, norm_quant<B, B>);
    if (a.x_bf16) return rows(a, a.m, a.k, threads, norm_quant<B, float>);
    return rows(a, a.m, a.k, threads, norm_quant<float, float>);
  }
  if (a.x_bf16 && a.w_bf16) return rows(a, a.m, a.k, threads, norm_rows<B, B, B>);
  if (a.x_bf16) return rows(a, a.m, a.k, threads, norm_rows<B, float, float>);  // an fp32 RMSNorm weight: fp32 out
  return rows(a, a.m, a.k, threads, norm_rows<float, float, float>);
}

static bool dequant_any(const DequantArgs& a, int threads) {
  return a.out_bf16 ? rows(a, a.m, 0, threads, dequant<uint16_t>) : rows(a, a.m, 0, threads, dequant<float>);
}

static bool gated_quant_any(const GatedQuantArgs& a, int threads) { return rows(a, a.m, a.inter, threads, gated_quant); }

static bool gated_act_any(const GatedActArgs& a, int threads) {
  return a.bf16 ? rows(a, a.m, 0, threads, gated_act<uint16_t>) : rows(a, a.m, 0, threads, gated_act<float>);
}

}  // namespace TTFTC_NS
