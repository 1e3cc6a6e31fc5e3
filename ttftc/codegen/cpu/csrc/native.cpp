// ttftc's native CPU kernels, built at install time as the extension module ttftc.codegen.cpu._native_kernels
// (setup.py; optional: without a C++ compiler the lowerings that use it report themselves incapable).
//
// One source, several instruction sets: each kernel header is compiled once per ISA inside a target region
// (AVX-512, AVX2+FMA, and the baseline), and the ISA is chosen at run time from the CPU this process runs on.
// So a build never depends on the build machine's CPU (no -march=native): the same .so is right on an AMD EPYC
// with AVX-512 and on an older Xeon without it.
//
// The kernels are torch operators, torch.ops.ttftc_native.* (TORCH_LIBRARY at the end of this file), with typed
// schemas: the profiler shows them by name, Inductor's generated code can call them, and tracing uses their fakes
// (ttftc/codegen/cpu/_native.py). Each operator checks every tensor it is given (device, dtype, shape, unit stride
// along the last dimension) before it takes a pointer, and its own size arithmetic and allocations: a failure is a
// Python exception (ValueError, or torch.OutOfMemoryError for working memory), never an abort. The module itself
// keeps the process-wide switches (isa, set_isa, use_openmp, source_digest).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <dlfcn.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

// `floats` floats as a byte count rounded up to 64 (aligned_alloc's rule); false where that overflows size_t.
bool aligned_bytes(size_t floats, size_t* bytes) {
  size_t raw;
  if (__builtin_mul_overflow(floats, sizeof(float), &raw) || __builtin_add_overflow(raw, size_t(63), &raw)) return false;
  *bytes = raw / 64 * 64;
  return true;
}

// a * b for non-negative sizes, false where it is negative or overflows size_t.
bool size_product(int64_t a, int64_t b, size_t* out) {
  return a >= 0 && b >= 0 && !__builtin_mul_overflow(size_t(a), size_t(b), out);
}

struct AttentionArgs {
  const void* q;  // fp32, or bf16 for attention_bf16
  const void* k;
  const void* v;
  void* o;
  const int64_t* kv_len;  // per batch row, or null
  int64_t batch, hq, hkv, sq, skv, d, dv;
  int64_t q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss;  // strides in elements
  float scale;
  bool causal;
  int64_t q_offset, window, block_k;
  bool pack_kv = false;  // fp32: copy K and V into tile order first (attention_kernel.h, F32Packed)
  int64_t v_panel = 0;   // packed V: elements from one panel of value columns to the next
};

// The calling thread's K/V copy of the last attention call, kept so the next call (the next layer) reuses the pages
// instead of faulting in fresh ones (a fresh 16 MiB buffer cost more than the copy itself); trim() returns buffers
// above kKeepBytes to the system.
struct PackedKV {
  static constexpr size_t kKeepBytes = size_t(64) << 20;
  float* data = nullptr;
  size_t capacity = 0;

  // Null when `floats` does not fit in memory (or its byte count in size_t): the caller reads K and V in place.
  float* reserve(size_t floats) {
    if (floats > capacity) {
      std::free(data);
      size_t bytes = 0;
      data = aligned_bytes(floats, &bytes) ? static_cast<float*>(std::aligned_alloc(64, bytes)) : nullptr;
      capacity = data ? floats : 0;
    }
    return data;
  }
  void trim() {
    if (capacity * sizeof(float) > kKeepBytes) {
      std::free(data);
      data = nullptr;
      capacity = 0;
    }
  }
  ~PackedKV() { std::free(data); }
};

PackedKV& packed_kv_buffer() {
  static thread_local PackedKV buffer;
  return buffer;
}

struct QuantArgs {
  const void* x;  // fp32 or bf16 (x_bf16)
  int64_t x_rs;   // row stride in elements
  int8_t* q;
  float* scale;
  int64_t m, k;
  bool x_bf16;
};

struct NormArgs {
  const void* x;
  const void* residual;  // or null
  void* residual_out;    // x + residual (x's dtype), when residual is given
  const void* weight;
  const void* bias;  // LayerNorm only
  int8_t* q;         // int8 per token (with scale), or null: the normalised rows go to `out`
  float* scale;
  void* out;
  int64_t m, k;
  bool x_bf16, w_bf16, layer, round_product;  // round_product: RMSNorm's weight product in x's dtype
  float eps;
};

struct GatedActArgs {
  const void* x;  // [M, 2 * inter] rows of gate | up, row stride x_rs
  int64_t x_rs;
  void* out;  // [M, inter], contiguous
  int64_t m, inter;
  int act;
  bool bf16;
};

struct RopeArgs {
  const void* x;  // [B, H, S, D], strides x_st (b, h, s) in elements, unit stride along D
  const void* cos;  // broadcast to x: a stride of 0 along a dimension it does not have
  const void* sin;
  void* out;  // [B, H, S, D], strides out_st, unit stride along D
  int64_t batch, h, s, d;
  int64_t x_st[3], cos_st[3], sin_st[3], out_st[3];
  bool bf16;
};

struct DequantArgs {
  const int32_t* acc;
  int64_t acc_rs;
  const float* x_scale;
  const float* w_scale;
  const float* bias;  // or null
  void* out;
  int64_t out_rs, m, n;
  bool out_bf16;
};

struct GatedQuantArgs {
  const int32_t* acc;  // [M, 2 * inter]: gate | up
  const float* x_scale;
  const float* w_scale;  // [2 * inter]
  const float* bias;     // [2 * inter] or null
  int8_t* q;             // [M, inter]
  float* scale;
  int64_t m, inter;
  int act;  // 0 silu, 1 gelu (tanh approximation), 2 relu
};

struct Int8GemmArgs {
  const int8_t* x;  // [M, K], row stride x_rs
  int64_t x_rs;
  const int8_t* packed;  // int8_gemm_kernel.h's layout: ceil(N / 8) panels of `panel` bytes
  int64_t panel;         // ceil(K / 4) * 32, computed with an overflow check
  void* out;             // [M, N] int32 (out_kind 0), fp32 (1) or bf16 (2), row stride out_rs
  int64_t out_rs;
  const float* x_scale;  // [M], [N] and [N] or null: read only when out_kind != 0
  const float* w_scale;
  const float* bias;
  int64_t m, n, k;
  int out_kind;
  int64_t block_m, block_nv;  // rows and 8-column vectors per work item
  // Set by the kernel where the packed weight holds -128, which its sign trick cannot negate (int8_gemm_kernel.h):
  // the results are wrong then, and the operator raises instead of returning them.
  std::atomic<bool>* saw_minus_128 = nullptr;
};

// Per-thread working memory of one attention call, 64-byte aligned for vector loads.
struct Scratch {
  float* qt = nullptr;
  float* st = nullptr;
  float* ot = nullptr;
  float* pt = nullptr;  // bf16 kernel: probabilities as bf16 pairs of keys
  float* vt = nullptr;  // bf16 kernel: values as bf16 pairs of keys
  float qscale = 1.0f;  // bf16 kernel: applied to the fp32 scores
  void* base = nullptr;

  // False (nothing allocated) where a size overflows or the memory is not there.
  bool reserve(int64_t d, int64_t dv, int64_t block_k, int64_t bq, int64_t r) {
    if (block_k < 1 || r < 1 || block_k > INT64_MAX - r) return false;
    const int64_t rows = (block_k + r - 1) / r * r;
    size_t qt_n, st_n, ot_n, pt_n, vt_n;
    if (!size_product(d, bq, &qt_n) || !size_product(rows, bq, &st_n) || !size_product(dv, bq, &ot_n) ||
        !size_product(rows / 2 + 1, bq, &pt_n) || !size_product(rows / 2 + 1, dv, &vt_n))
      return false;
    const size_t sizes[5] = {qt_n, st_n, ot_n, pt_n, vt_n};  // rows is even: (rows / 2 + 1) n = rows n / 2 + n
    size_t offsets[5], bytes = 0;
    for (int i = 0; i < 5; ++i) {
      size_t part;
      offsets[i] = bytes;
      if (!aligned_bytes(sizes[i], &part) || __builtin_add_overflow(bytes, part, &bytes)) return false;
    }
    base = std::aligned_alloc(64, std::max<size_t>(bytes, 64));
    if (base == nullptr) return false;
    float** parts[5] = {&qt, &st, &ot, &pt, &vt};
    for (int i = 0; i < 5; ++i) *parts[i] = reinterpret_cast<float*>(static_cast<char*>(base) + offsets[i]);
    return true;
  }
  ~Scratch() { std::free(base); }
};

// The OpenMP runtime torch already loaded, reached through its GOMP_parallel entry point (libgomp's, which Intel's
// runtime also exports). Why not threads of our own: torch's OpenMP workers spin for a while after each parallel
// op, so freshly started threads would share their cores with spinning ones and lose what a faster kernel gains
// (benchmarks/README.md, threads). On torch's own team the cores are handed over, as between two ATen ops.
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
GompParallel gomp_parallel = nullptr;

struct TeamTask {
  void (*run)(void*);
  void* context;
};

void run_team_task(void* task) {
  auto* t = static_cast<TeamTask*>(task);
  t->run(t->context);
}

// Runs body(state, item) for item in [0, n) on `threads` threads (the caller is one of them), each with its own
// State, handing items out one at a time from a shared counter: work items differ in cost (causal masks), so
// static splits idle. init(state) returns false (or throws, e.g. std::bad_alloc) when it cannot set up its working
// memory; then no thread takes another item and parallel_for returns false: the caller reports it to Python. An
// exception must not leave a worker (on an OpenMP or std::thread worker it would terminate the process).
template <class State, class Init, class Body>
bool parallel_for(int64_t n, int threads, const Init& init, const Body& body) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  auto worker = [&]() {
    State s;
    bool ready = false;
    try {
      ready = init(s);
    } catch (const std::exception&) {
      ready = false;
    }
    if (!ready) {
      failed.store(true);
      return;
    }
    for (int64_t item = next.fetch_add(1); item < n && !failed.load(std::memory_order_relaxed); item = next.fetch_add(1))
      body(s, item);
  };
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, n)));
  if (threads == 1) {
    worker();
  } else if (gomp_parallel) {
    TeamTask task{[](void* w) { (*static_cast<decltype(worker)*>(w))(); }, &worker};
    gomp_parallel(run_team_task, &task, unsigned(threads), 0);
  } else {
    std::vector<std::thread> pool;
    try {
      pool.reserve(threads - 1);
      for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
    } catch (const std::exception&) {  // no more threads: the ones started (and this one) take every item
    }
    worker();
    for (auto& t : pool) t.join();
  }
  return !failed.load();
}

}  // namespace

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TTFTC_X86 1
#endif

#ifdef TTFTC_X86
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")
#endif
#define TTFTC_NS isa_avx512
#define TTFTC_INT8_AVX2 1
#define TTFTC_VW 16
#define TTFTC_R 8
#include "isa_kernels.h"
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma")
#endif
// AVX-512 with bf16 dot products (AMD Zen 4 and later, Intel Cooper Lake and Sapphire Rapids): every kernel, plus
// the bf16 attention kernel that only this ISA has.
#define TTFTC_NS isa_avx512_bf16
#define TTFTC_INT8_AVX2 1
#define TTFTC_VW 16
#define TTFTC_R 8
#define TTFTC_BF16_DOT 1
#include "isa_kernels.h"
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
// 16 ymm registers: a 4 x 3 accumulator tile, three query vectors and a broadcast.
#define TTFTC_NS isa_avx2
#define TTFTC_INT8_AVX2 1
#define TTFTC_VW 8
#define TTFTC_R 4
#include "isa_kernels.h"
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma")
#endif
// The int8 GEMM alone again, with VNNI's vpdpbusd (Intel Cascade Lake and later, AMD Zen 4 and later): taken by the
// AVX-512 ISAs where the CPU has it (int8_gemm below), so set_isa("avx2") still reaches the AVX2 version.
#define TTFTC_NS isa_avx512_vnni
#define TTFTC_INT8_AVX2 1
#define TTFTC_INT8_VNNI 1
#include "int8_gemm_kernel.h"
#undef TTFTC_NS
#undef TTFTC_INT8_AVX2
#undef TTFTC_INT8_VNNI
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // TTFTC_X86

// The baseline: SSE2 on x86-64, NEON on AArch64 (both have 128-bit vectors in their base ISA).
#define TTFTC_NS isa_base
#define TTFTC_VW 4
#define TTFTC_R 4
#include "isa_kernels.h"

namespace {

enum class Isa { base, avx2, avx512, avx512_bf16 };

Isa detect_isa() {
#ifdef TTFTC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return __builtin_cpu_supports("avx512bf16") ? Isa::avx512_bf16 : Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::base;
}

const Isa kBestIsa = detect_isa();

#ifdef TTFTC_X86
const bool kHasVnni = kBestIsa >= Isa::avx512 && __builtin_cpu_supports("avx512vnni");
#else
const bool kHasVnni = false;
#endif
Isa kIsa = kBestIsa;  // set_isa lowers it, so tests reach every version on one machine

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "base";
  }
}

// Each kernel, indexed by Isa: the base version stands in for the x86 ones elsewhere.
#ifdef TTFTC_X86
#define TTFTC_BY_ISA(fn) {isa_base::fn, isa_avx2::fn, isa_avx512::fn, isa_avx512_bf16::fn}
#else
#define TTFTC_BY_ISA(fn) {isa_base::fn, isa_base::fn, isa_base::fn, isa_base::fn}
#endif
constexpr int kIsas = 4;

// A kernel returns false where a thread's working memory cannot be allocated (parallel_for).
template <class Args>
using Kernel = bool (*)(const Args&, int);

// Threads a call may ask for (the kernels never start more than they have work items for). libgomp does not report a
// thread it cannot create: it exits the process ("libgomp: Thread creation failed"). So a count from anyone is capped
// here, before any team starts, far below what a process can start; _native.MAX_THREADS is the same cap (the module's
// max_threads() returns this one, and a test checks that the two agree).
constexpr int64_t kMaxThreads = int64_t(1) << 12;

// Every check below raises a c10 exception, which the dispatcher hands to Python as ValueError (TORCH_CHECK_VALUE)
// or torch.OutOfMemoryError.
void check_threads(const char* name, int64_t threads) {
  TORCH_CHECK_VALUE(threads >= 1 && threads <= kMaxThreads, name, ": threads must be in [1, ", kMaxThreads,
                    "] (the cap on threads a call may ask for), got ", threads);
}

void non_negative(const char* name, std::initializer_list<int64_t> counts) {
  for (int64_t n : counts) TORCH_CHECK_VALUE(n >= 0, name, ": a size or count is negative (", n, ")");
}

template <class Args>
void launch(const char* name, const Kernel<Args> (&by_isa)[kIsas], const Args& a, int64_t threads) {
  check_threads(name, threads);
  const bool done = by_isa[int(kIsa)](a, int(threads));
  TORCH_CHECK_WITH(OutOfMemoryError, done, name, ": the working memory of a thread cannot be allocated (its size "
                   "overflows or memory is exhausted)");
}

// The attention masks compare query and key positions as fp32, which holds every integer up to 2^24 exactly.
constexpr int64_t kMaxPosition = int64_t(1) << 24;

// Every element of the attention output NaN, through its strides (bf16: the quiet NaN the kernels store).
void fill_nan(const AttentionArgs& a, bool bf16) {
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t h = 0; h < a.hq; ++h)
      for (int64_t i = 0; i < a.sq; ++i) {
        const int64_t row = b * a.o_sb + h * a.o_sh + i * a.o_ss;
        if (bf16) {
          std::fill_n(static_cast<uint16_t*>(a.o) + row, a.dv, uint16_t(0x7fc0));
        } else {
          std::fill_n(static_cast<float*>(a.o) + row, a.dv, std::numeric_limits<float>::quiet_NaN());
        }
      }
}

// bf16 needs the avx512_bf16 kernels. `empty`: nothing to write (the counts are still checked).
void run_attention(AttentionArgs a, bool bf16, int64_t threads, bool empty) {
  non_negative("attention", {a.batch, a.hq, a.hkv, a.sq, a.skv, a.d, a.dv, a.q_offset, a.window});
  TORCH_CHECK_VALUE(a.block_k >= 1 && a.hkv >= 1 && a.hq % a.hkv == 0, "attention: block_k (", a.block_k,
                    ") and kv heads (", a.hkv, ") must be >= 1, query heads (", a.hq, ") a multiple of kv heads");
  check_threads("attention", threads);
  // A block holds at most the keys there are (the kernel visits min(block_k, keys left) at a time), so past them
  // block_k only sized the working memory. Clamped to the keys rounded up to 8 (a multiple of every ISA's register
  // tile), blocks and results are the same as unclamped.
  a.block_k = std::min(a.block_k, (std::max<int64_t>(a.skv, 1) + 7) / 8 * 8);
  // A window past every query's position hides nothing, as one of exactly that size does: clamped, it stays exact
  // in the kernel's fp32 position arithmetic.
  if (a.window > a.q_offset + a.sq) a.window = a.q_offset + a.sq;
  if (empty) return;
  // SDPA's definition (its math backend, and ttftc's reference) multiplies every score by the scale: a NaN or
  // infinite one makes every score, and so every output, NaN. The kernel's softmax would not: its running maximum and
  // its exp2 clamp skip a NaN score, so it wrote zeros.
  if (!std::isfinite(a.scale)) return fill_nan(a, bf16);
  if (!bf16) {
    static const Kernel<AttentionArgs> kernels[kIsas] = TTFTC_BY_ISA(attention);
    return launch("attention", kernels, a, threads);
  }
#ifdef TTFTC_X86
  if (kIsa == Isa::avx512_bf16) {
    static const Kernel<AttentionArgs> kernels[kIsas] = {nullptr, nullptr, nullptr, isa_avx512_bf16::attention_bf16};
    return launch("attention", kernels, a, threads);
  }
#endif
  TORCH_CHECK_VALUE(false, "bf16 attention needs the avx512_bf16 kernels; this process runs ", isa_name(kIsa));
}

void run_quantize_rows(const QuantArgs& a, int64_t threads) {
  non_negative("quantize_rows", {a.m, a.k});
  static const Kernel<QuantArgs> kernels[kIsas] = TTFTC_BY_ISA(quantize_rows_any);
  launch("quantize_rows", kernels, a, threads);
}

void run_norm(const NormArgs& a, int64_t threads) {
  non_negative("norm", {a.m, a.k});
  static const Kernel<NormArgs> kernels[kIsas] = TTFTC_BY_ISA(norm_any);
  launch("norm", kernels, a, threads);
}

void run_gated_act(const GatedActArgs& a, int64_t threads) {
  non_negative("gated_act", {a.m, a.inter});
  static const Kernel<GatedActArgs> kernels[kIsas] = TTFTC_BY_ISA(gated_act_any);
  launch("gated_act", kernels, a, threads);
}

void run_rope(const RopeArgs& a, int64_t threads) {
  non_negative("rope", {a.batch, a.h, a.s, a.d});
  static const Kernel<RopeArgs> kernels[kIsas] = TTFTC_BY_ISA(rope_any);
  launch("rope", kernels, a, threads);
}

void run_dequant(const DequantArgs& a, int64_t threads) {
  non_negative("dequant", {a.m, a.n});
  static const Kernel<DequantArgs> kernels[kIsas] = TTFTC_BY_ISA(dequant_any);
  launch("dequant", kernels, a, threads);
}

void run_gated_quant(const GatedQuantArgs& a, int64_t threads) {
  non_negative("gated_quant", {a.m, a.inter});
  static const Kernel<GatedQuantArgs> kernels[kIsas] = TTFTC_BY_ISA(gated_quant_any);
  launch("gated_quant", kernels, a, threads);
}

bool int8_vnni() { return kHasVnni && (kIsa == Isa::avx512 || kIsa == Isa::avx512_bf16); }

// out = x [M, K] s8 . packed weight [N, K] s8, as int32 (out_kind 0) or dequantised (acc * w_scale * x_scale + bias)
// as fp32 (1) or bf16 (2). See int8_gemm_kernel.h. Fills in a.panel. A packed weight holding -128 is a ValueError
// after the run: the kernel looks for it in the weight bytes its first row tiles load anyway, so the check costs no
// memory traffic (a scan of its own before every call would read the weight twice at M = 1).
void run_int8_gemm(Int8GemmArgs a, int64_t threads) {
  non_negative("int8_gemm", {a.x_rs, a.out_rs, a.m, a.n, a.k});
  TORCH_CHECK_VALUE(a.out_kind >= 0 && a.out_kind <= 2 && a.block_m >= 1 && a.block_nv >= 1, "int8_gemm: out_kind ",
                    a.out_kind, " must be 0, 1 or 2 and blocks (", a.block_m, ", ", a.block_nv, ") positive");
  // The kernel's own offsets: a panel's bytes, every panel, the last row of x and out, and the count of work items
  // (row blocks x column blocks), all within int64.
  const int64_t groups = a.k / 4 + (a.k % 4 != 0), vecs = a.n / 8 + (a.n % 8 != 0);
  const int64_t m_blocks = a.m / a.block_m + (a.m % a.block_m != 0);
  const int64_t n_blocks = vecs / a.block_nv + (vecs % a.block_nv != 0);
  int64_t packed_bytes, x_end, out_end, items;
  TORCH_CHECK_VALUE(
      !(__builtin_mul_overflow(groups, int64_t(32), &a.panel) || __builtin_mul_overflow(vecs, a.panel, &packed_bytes) ||
        __builtin_mul_overflow(a.m, a.x_rs, &x_end) || __builtin_add_overflow(x_end, a.k, &x_end) ||
        __builtin_mul_overflow(a.m, a.out_rs, &out_end) || __builtin_add_overflow(out_end, a.n, &out_end) ||
        __builtin_mul_overflow(m_blocks, n_blocks, &items)),
      "int8_gemm: the operands' sizes overflow int64");
  std::atomic<bool> saw_minus_128{false};
  a.saw_minus_128 = &saw_minus_128;
  static const Kernel<Int8GemmArgs> kernels[kIsas] = TTFTC_BY_ISA(int8_gemm);
#ifdef TTFTC_X86
  static const Kernel<Int8GemmArgs> vnni[kIsas] = {nullptr, nullptr, isa_avx512_vnni::int8_gemm,
                                                   isa_avx512_vnni::int8_gemm};
  launch("int8_gemm", int8_vnni() ? vnni : kernels, a, threads);
#else
  launch("int8_gemm", kernels, a, threads);
#endif
  TORCH_CHECK_VALUE(!saw_minus_128.load(), "int8_gemm: the packed weight holds -128, which the kernel's sign trick "
                    "cannot negate, so `out` holds wrong numbers; int8 weights must lie in [-127, 127] (pack them with "
                    "ttftc.codegen.cpu._native.pack_int8_weight, which refuses -128)");
}

// --- the operators, torch.ops.ttftc_native.* ------------------------------------------------------------------
// Anyone can call these (Inductor's generated code, a user), so each checks what it is given (device, dtype, shape,
// a unit stride along the last dimension) before it takes a pointer; ttftc/codegen/cpu/_native.py's wrappers check
// the same first, with the messages the lowerings report.

const at::Tensor* present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined() ? &*t : nullptr; }

template <class T = void>
T* address(const std::optional<at::Tensor>& t) { return present(t) ? static_cast<T*>(t->data_ptr()) : nullptr; }

void on_cpu(const char* op, const char* what, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", what, " is on ", t.device(), ", not the CPU");
}

void on_cpu(const char* op, const char* what, const std::optional<at::Tensor>& t) {
  if (present(t)) on_cpu(op, what, *t);
}

bool float_or_bf16(const at::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; }

bool unit_rows(const at::Tensor& t) { return t.numel() == 0 || t.stride(-1) == 1; }

// t is a contiguous tensor of this dtype and these sizes.
bool is_block(const at::Tensor& t, at::ScalarType dtype, at::IntArrayRef sizes) {
  return t.scalar_type() == dtype && t.sizes() == sizes && t.is_contiguous();
}

bool is_block(const std::optional<at::Tensor>& t, at::ScalarType dtype, at::IntArrayRef sizes) {
  return present(t) && is_block(*t, dtype, sizes);
}

int activation_code(const char* op, c10::string_view act) {
  if (act == "silu") return 0;
  if (act == "gelu_tanh") return 1;
  if (act == "relu") return 2;
  TORCH_CHECK_VALUE(false, op, ": activation ", std::string(act), " is none of silu, gelu_tanh, relu");
}

void attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                  const std::optional<at::Tensor>& kv_len, bool causal, double scale, int64_t q_offset, int64_t window,
                  int64_t block_k, int64_t threads, bool pack_kv) {
  const char* op = "attention";
  on_cpu(op, "q", q), on_cpu(op, "k", k), on_cpu(op, "v", v), on_cpu(op, "out", out), on_cpu(op, "kv_len", kv_len);
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && out.dim() == 4, "attention: q, k, v and out "
                    "must be 4-D");
  const at::ScalarType dtype = q.scalar_type();
  TORCH_CHECK_VALUE(float_or_bf16(q) && k.scalar_type() == dtype && v.scalar_type() == dtype &&
                    out.scalar_type() == dtype, "attention: q, k, v and out must share one dtype, fp32 or bf16");
  const int64_t b = q.size(0), hq = q.size(1), sq = q.size(2), d = q.size(3);
  const int64_t hkv = k.size(1), skv = k.size(2), dv = v.size(3);
  TORCH_CHECK_VALUE(k.size(0) == b && k.size(3) == d && v.size(0) == b && v.size(1) == hkv && v.size(2) == skv &&
                    out.sizes() == at::IntArrayRef({b, hq, sq, dv}), "attention: q ", q.sizes(), ", k ", k.sizes(),
                    ", v ", v.sizes(), " and out ", out.sizes(), " do not fit together");
  TORCH_CHECK_VALUE(d % 8 == 0 && dv % 8 == 0, "attention: head dims ", d, ", ", dv, " are not multiples of 8");
  TORCH_CHECK_VALUE(unit_rows(q) && unit_rows(k) && unit_rows(v) && unit_rows(out), "attention: q, k, v and out "
                    "need a contiguous last dimension");
  TORCH_CHECK_VALUE(q_offset >= 0 && q_offset <= kMaxPosition - sq && skv <= kMaxPosition, "attention: positions "
                    "past ", kMaxPosition, " (the masks compare positions as fp32)");
  TORCH_CHECK_VALUE(!present(kv_len) || is_block(kv_len, at::kLong, {b}), "attention: kv_len must be a contiguous "
                    "int64 tensor of shape (", b, ")");
  AttentionArgs a;
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.o = out.data_ptr();
  a.kv_len = address<const int64_t>(kv_len);
  a.batch = b; a.hq = hq; a.hkv = hkv; a.sq = sq; a.skv = skv; a.d = d; a.dv = dv;
  a.q_sb = q.stride(0); a.q_sh = q.stride(1); a.q_ss = q.stride(2);
  a.k_sb = k.stride(0); a.k_sh = k.stride(1); a.k_ss = k.stride(2);
  a.v_sb = v.stride(0); a.v_sh = v.stride(1); a.v_ss = v.stride(2);
  a.o_sb = out.stride(0); a.o_sh = out.stride(1); a.o_ss = out.stride(2);
  a.causal = causal; a.q_offset = q_offset; a.window = window; a.block_k = block_k;
  a.scale = float(scale);
  a.pack_kv = pack_kv;
  run_attention(a, dtype == at::kBFloat16, threads, out.numel() == 0);
}

void quantize_rows_op(const at::Tensor& x, at::Tensor& q, at::Tensor& scale, int64_t threads) {
  const char* op = "quantize_rows";
  on_cpu(op, "x", x), on_cpu(op, "q", q), on_cpu(op, "scale", scale);
  TORCH_CHECK_VALUE(x.dim() == 2 && float_or_bf16(x) && unit_rows(x), "quantize_rows: x must be fp32 or bf16 [M, K] "
                    "rows with a unit stride, got ", x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE(is_block(q, at::kChar, {m, k}) && is_block(scale, at::kFloat, {m}), "quantize_rows: q must be "
                    "contiguous int8 [", m, ", ", k, "] and scale contiguous fp32 [", m, "]");
  const QuantArgs a{x.data_ptr(), x.stride(0), q.data_ptr<int8_t>(), scale.data_ptr<float>(), m, k,
                    x.scalar_type() == at::kBFloat16};
  check_threads(op, threads);
  if (m) run_quantize_rows(a, threads);  // with k 0 too: such rows get the all-zero row's scale, 1e-8 / 127
}

void norm_op(const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& summed,
             const at::Tensor& weight, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& q,
             const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& out, bool layer, double eps,
             int64_t threads) {
  const char* op = "norm";
  on_cpu(op, "x", x), on_cpu(op, "residual", residual), on_cpu(op, "summed", summed), on_cpu(op, "weight", weight);
  on_cpu(op, "bias", bias), on_cpu(op, "q", q), on_cpu(op, "scale", scale), on_cpu(op, "out", out);
  TORCH_CHECK_VALUE(x.dim() == 2 && float_or_bf16(x) && x.is_contiguous(), "norm: x must be contiguous fp32 or bf16 "
                    "[M, K], got ", x.scalar_type(), " ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  const at::ScalarType dtype = x.scalar_type(), w_dtype = weight.scalar_type();
  TORCH_CHECK_VALUE((w_dtype == at::kFloat || w_dtype == dtype) && is_block(weight, w_dtype, {k}), "norm: weight "
                    "must be contiguous [", k, "] in fp32 or x's dtype");
  if (layer) {
    TORCH_CHECK_VALUE(w_dtype == dtype && is_block(bias, dtype, {k}), "norm: LayerNorm needs weight and bias of x's "
                      "dtype");
  } else {
    TORCH_CHECK_VALUE(!present(bias), "norm: RMSNorm takes no bias");
  }
  TORCH_CHECK_VALUE(!present(residual) == !present(summed) &&
                    (!present(residual) || (is_block(residual, dtype, x.sizes()) && is_block(summed, dtype, x.sizes()))),
                    "norm: a residual and its sum with x come together, each contiguous and matching x");
  const bool quantize = present(q) || present(scale);
  if (quantize) {
    TORCH_CHECK_VALUE(is_block(q, at::kChar, {m, k}) && is_block(scale, at::kFloat, {m}) && !present(out), "norm: "
                      "quantising takes q, contiguous int8 [", m, ", ", k, "], and scale, contiguous fp32 [", m,
                      "], and no out");
  } else {
    TORCH_CHECK_VALUE(is_block(out, c10::promoteTypes(dtype, w_dtype), {m, k}), "norm: out must be contiguous [", m,
                      ", ", k, "] in the promoted dtype of x and weight");
  }
  check_threads(op, threads);
  if (quantize && m && !k) {  // zero-width rows: the quantiser gives them the all-zero row's scale
    return run_quantize_rows(QuantArgs{x.data_ptr(), k, address<int8_t>(q), address<float>(scale), m, k,
                                       dtype == at::kBFloat16}, threads);
  }
  if (!m || !k) return;
  const bool x_bf16 = dtype == at::kBFloat16, w_bf16 = w_dtype == at::kBFloat16;
  const NormArgs a{x.data_ptr(), address<const void>(residual), address(summed), weight.data_ptr(),
                   layer ? address<const void>(bias) : nullptr, address<int8_t>(q), address<float>(scale),
                   address(out), m, k, x_bf16, w_bf16, layer, x_bf16 && w_bf16, float(eps)};
  run_norm(a, threads);
}

void gated_act_op(const at::Tensor& gate_up, at::Tensor& out, c10::string_view act, int64_t threads) {
  const char* op = "gated_act";
  on_cpu(op, "gate_up", gate_up), on_cpu(op, "out", out);
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && float_or_bf16(gate_up) && unit_rows(gate_up) && gate_up.size(1) % 2 == 0,
                    "gated_act: gate_up must be fp32 or bf16 [M, 2I] rows with a unit stride, got ",
                    gate_up.scalar_type(), " ", gate_up.sizes(), " strides ", gate_up.strides());
  const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK_VALUE(is_block(out, gate_up.scalar_type(), {m, inter}), "gated_act: out must be contiguous [", m, ", ",
                    inter, "] in gate_up's dtype");
  const GatedActArgs a{gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), m, inter, activation_code(op, act),
                       gate_up.scalar_type() == at::kBFloat16};
  check_threads(op, threads);
  if (m && inter) run_gated_act(a, threads);
}

void dequant_op(const at::Tensor& acc, const at::Tensor& x_scale, const at::Tensor& w_scale,
                const std::optional<at::Tensor>& bias, at::Tensor& out, int64_t threads) {
  const char* op = "dequant";
  on_cpu(op, "acc", acc), on_cpu(op, "x_scale", x_scale), on_cpu(op, "w_scale", w_scale), on_cpu(op, "bias", bias);
  on_cpu(op, "out", out);
  TORCH_CHECK_VALUE(acc.dim() == 2 && acc.scalar_type() == at::kInt && unit_rows(acc), "dequant: acc must be int32 "
                    "[M, N] rows with a unit stride");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK_VALUE(is_block(x_scale, at::kFloat, {m}) && is_block(w_scale, at::kFloat, {n}) &&
                    (!present(bias) || is_block(bias, at::kFloat, {n})), "dequant: scales (and bias) must be "
                    "contiguous fp32 [", m, "] and [", n, "]");
  TORCH_CHECK_VALUE(float_or_bf16(out) && is_block(out, out.scalar_type(), {m, n}), "dequant: out must be "
                    "contiguous fp32 or bf16 [", m, ", ", n, "]");
  const DequantArgs a{acc.data_ptr<int32_t>(), acc.stride(0), x_scale.data_ptr<float>(), w_scale.data_ptr<float>(),
                      address<const float>(bias), out.data_ptr(), n, m, n, out.scalar_type() == at::kBFloat16};
  check_threads(op, threads);
  if (m && n) run_dequant(a, threads);
}

void gated_quant_op(const at::Tensor& acc, const at::Tensor& x_scale, const at::Tensor& w_scale,
                    const std::optional<at::Tensor>& bias, at::Tensor& q, at::Tensor& scale, c10::string_view act,
                    int64_t threads) {
  const char* op = "gated_quant";
  on_cpu(op, "acc", acc), on_cpu(op, "x_scale", x_scale), on_cpu(op, "w_scale", w_scale), on_cpu(op, "bias", bias);
  on_cpu(op, "q", q), on_cpu(op, "scale", scale);
  TORCH_CHECK_VALUE(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous() && acc.size(1) % 2 == 0,
                    "gated_quant: acc must be contiguous int32 [M, 2I]");
  const int64_t m = acc.size(0), two_i = acc.size(1), inter = two_i / 2;
  TORCH_CHECK_VALUE(is_block(x_scale, at::kFloat, {m}) && is_block(w_scale, at::kFloat, {two_i}) &&
                    (!present(bias) || is_block(bias, at::kFloat, {two_i})), "gated_quant: scales (and bias) must be "
                    "contiguous fp32 [", m, "] and [", two_i, "]");
  TORCH_CHECK_VALUE(is_block(q, at::kChar, {m, inter}) && is_block(scale, at::kFloat, {m}), "gated_quant: q must be "
                    "contiguous int8 [", m, ", ", inter, "] and scale contiguous fp32 [", m, "]");
  const GatedQuantArgs a{acc.data_ptr<int32_t>(), x_scale.data_ptr<float>(), w_scale.data_ptr<float>(),
                         address<const float>(bias), q.data_ptr<int8_t>(), scale.data_ptr<float>(), m, inter,
                         activation_code(op, act)};
  check_threads(op, threads);
  if (m) run_gated_quant(a, threads);  // with inter 0 too: such rows get the all-zero row's scale
}

void rope_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out, int64_t threads) {
  const char* op = "rope";
  on_cpu(op, "x", x), on_cpu(op, "cos", cos), on_cpu(op, "sin", sin), on_cpu(op, "out", out);
  TORCH_CHECK_VALUE(x.dim() == 4 && float_or_bf16(x) && x.size(3) % 2 == 0, "rope: x must be fp32 or bf16 "
                    "[B, H, S, D] with an even D, got ", x.scalar_type(), " ", x.sizes());
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK_VALUE(cos.sizes() == x.sizes() && sin.sizes() == x.sizes() && out.sizes() == x.sizes() &&
                    cos.scalar_type() == dtype && sin.scalar_type() == dtype && out.scalar_type() == dtype,
                    "rope: cos, sin (broadcast views welcome) and out must have x's shape and dtype");
  TORCH_CHECK_VALUE(unit_rows(x) && unit_rows(cos) && unit_rows(sin) && unit_rows(out), "rope: x, cos, sin and out "
                    "need a unit stride along the head dimension");
  const RopeArgs a{x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), x.size(0), x.size(1), x.size(2),
                   x.size(3), {x.stride(0), x.stride(1), x.stride(2)}, {cos.stride(0), cos.stride(1), cos.stride(2)},
                   {sin.stride(0), sin.stride(1), sin.stride(2)}, {out.stride(0), out.stride(1), out.stride(2)},
                   dtype == at::kBFloat16};
  check_threads(op, threads);
  if (out.numel()) run_rope(a, threads);
}

void int8_gemm_op(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& x_scale,
                  const std::optional<at::Tensor>& w_scale, const std::optional<at::Tensor>& bias, at::Tensor& out,
                  int64_t block_rows, int64_t block_vecs, int64_t threads) {
  const char* op = "int8_gemm";
  on_cpu(op, "x", x), on_cpu(op, "packed", packed), on_cpu(op, "x_scale", x_scale), on_cpu(op, "w_scale", w_scale);
  on_cpu(op, "bias", bias), on_cpu(op, "out", out);
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kChar && unit_rows(x), "int8_gemm: x must be int8 [M, K] "
                    "rows with a unit stride");
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.is_contiguous(), "int8_gemm: out must be "
                    "contiguous [", x.size(0), ", N]");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const at::ScalarType out_dtype = out.scalar_type();
  const int64_t out_kind = out_dtype == at::kInt ? 0 : out_dtype == at::kFloat ? 1 : out_dtype == at::kBFloat16 ? 2 : -1;
  TORCH_CHECK_VALUE(out_kind >= 0, "int8_gemm: out must be int32, fp32 or bf16, not ", out_dtype);
  const int64_t vecs = n / 8 + (n % 8 != 0), groups = k / 4 + (k % 4 != 0);
  TORCH_CHECK_VALUE(is_block(packed, at::kChar, {vecs, groups, 8, 4}), "int8_gemm: packed must be pack_int8_weight's "
                    "contiguous int8 [", vecs, ", ", groups, ", 8, 4] for a [", n, ", ", k, "] weight, got ",
                    packed.scalar_type(), " ", packed.sizes());
  if (out_kind) {
    TORCH_CHECK_VALUE(is_block(x_scale, at::kFloat, {m}) && is_block(w_scale, at::kFloat, {n}) &&
                      (!present(bias) || is_block(bias, at::kFloat, {n})), "int8_gemm: a dequantised output needs "
                      "scales (and takes a bias), contiguous fp32 [", m, "] and [", n, "]");
  } else {
    TORCH_CHECK_VALUE(!present(x_scale) && !present(w_scale) && !present(bias), "int8_gemm: an int32 output takes no "
                      "scales and no bias");
  }
  const Int8GemmArgs a{x.data_ptr<int8_t>(), m > 1 ? x.stride(0) : k, packed.data_ptr<int8_t>(), 0, out.data_ptr(), n,
                       address<const float>(x_scale), address<const float>(w_scale), address<const float>(bias), m, n,
                       k, int(out_kind), block_rows, block_vecs};
  check_threads(op, threads);
  if (m && n) run_int8_gemm(a, threads);
}

// --- the module: process-wide switches, not kernels ---------------------------------------------------------

// The version int8_gemm runs in this process: "avx512_vnni", "avx2" (the AVX2 kernel, also under the AVX-512 ISAs
// of a CPU without VNNI) or "base".
PyObject* int8_gemm_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(int8_vnni() ? "avx512_vnni" : kIsa == Isa::base ? "base" : "avx2");
}

PyObject* isa(PyObject*, PyObject*) { return PyUnicode_FromString(isa_name(kIsa)); }

PyObject* max_threads(PyObject*, PyObject*) { return PyLong_FromLongLong(kMaxThreads); }

// use_openmp(path) -> bool: run parallel kernels on the OpenMP runtime at `path`, which must already be loaded in
// this process (RTLD_NOLOAD: nothing new is loaded); False, and our own threads, when it is not.
PyObject* use_openmp(PyObject*, PyObject* args) {
  const char* path;
  if (!PyArg_ParseTuple(args, "s", &path)) return nullptr;
  void* handle = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
  void* entry = handle ? dlsym(handle, "GOMP_parallel") : nullptr;
  gomp_parallel = reinterpret_cast<GompParallel>(entry);
  return PyBool_FromLong(entry != nullptr);
}

// set_isa(name) -> previous name: run the kernels with another instruction set this CPU has (for tests).
PyObject* set_isa(PyObject*, PyObject* args) {
  const char* name;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  for (Isa isa : {Isa::base, Isa::avx2, Isa::avx512, Isa::avx512_bf16}) {
    if (std::strcmp(name, isa_name(isa)) != 0) continue;
    if (int(isa) > int(kBestIsa)) {
      PyErr_Format(PyExc_ValueError, "this CPU does not run %s (best: %s)", name, isa_name(kBestIsa));
      return nullptr;
    }
    const char* previous = isa_name(kIsa);
    kIsa = isa;
    return PyUnicode_FromString(previous);
  }
  PyErr_Format(PyExc_ValueError, "unknown instruction set %s; valid: base, avx2, avx512, avx512_bf16", name);
  return nullptr;
}

#ifndef TTFTC_SOURCE_DIGEST
#define TTFTC_SOURCE_DIGEST "unknown"
#endif
PyObject* source_digest(PyObject*, PyObject*) { return PyUnicode_FromString(TTFTC_SOURCE_DIGEST); }

PyMethodDef kMethods[] = {
    // The kernels themselves are torch.ops.ttftc_native.* (TORCH_LIBRARY below).
    {"int8_gemm_isa", int8_gemm_isa, METH_NOARGS, "The version of int8_gemm this process runs."},
    {"isa", isa, METH_NOARGS, "The instruction set the kernels run with on this CPU."},
    {"max_threads", max_threads, METH_NOARGS, "The most threads an operator call may ask for."},
    {"use_openmp", use_openmp, METH_VARARGS, "Run parallel kernels on this already-loaded OpenMP runtime."},
    {"set_isa", set_isa, METH_VARARGS, "Run the kernels with another instruction set this CPU has; returns the previous."},
    {"source_digest", source_digest, METH_NOARGS, "sha256 of the sources this module was built from."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_kernels", "ttftc's native CPU kernels.", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native_kernels(void) { return PyModule_Create(&kModule); }

// Mutated arguments are declared (a!): every kernel writes into buffers its caller allocated, as ATen's out= ops do.
TORCH_LIBRARY(ttftc_native, m) {
  m.set_python_module("ttftc.codegen.cpu._native");  // where the fakes are registered
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor? kv_len, bool causal, float scale, "
        "int q_offset, int window, int block_k, int threads, bool pack_kv) -> ()");
  m.def("quantize_rows(Tensor x, Tensor(a!) q, Tensor(b!) scale, int threads) -> ()");
  m.def("norm(Tensor x, Tensor? residual, Tensor(a!)? summed, Tensor weight, Tensor? bias, Tensor(b!)? q, "
        "Tensor(c!)? scale, Tensor(d!)? out, bool layer, float eps, int threads) -> ()");
  m.def("gated_act(Tensor gate_up, Tensor(a!) out, str act, int threads) -> ()");
  m.def("dequant(Tensor acc, Tensor x_scale, Tensor w_scale, Tensor? bias, Tensor(a!) out, int threads) -> ()");
  m.def("gated_quant(Tensor acc, Tensor x_scale, Tensor w_scale, Tensor? bias, Tensor(a!) q, Tensor(b!) scale, "
        "str act, int threads) -> ()");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor(a!) out, int threads) -> ()");
  m.def("int8_gemm(Tensor x, Tensor packed, Tensor? x_scale, Tensor? w_scale, Tensor? bias, Tensor(a!) out, "
        "int block_rows, int block_vecs, int threads) -> ()");
}

TORCH_LIBRARY_IMPL(ttftc_native, CPU, m) {
  m.impl("attention", &attention_op);
  m.impl("quantize_rows", &quantize_rows_op);
  m.impl("norm", &norm_op);
  m.impl("gated_act", &gated_act_op);
  m.impl("dequant", &dequant_op);
  m.impl("gated_quant", &gated_quant_op);
  m.impl("rope", &rope_op);
  m.impl("int8_gemm", &int8_gemm_op);
}
