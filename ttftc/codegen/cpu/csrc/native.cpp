// ttftc's native CPU kernels, built at install time as the extension module ttftc.codegen.cpu._native_kernels
// (setup.py; optional: without a C++ compiler the lowerings that use it report themselves incapable).
//
// One source, several instruction sets: each kernel header is compiled once per ISA inside a target region
// (AVX-512, AVX2+FMA, and the baseline), and the ISA is chosen at run time from the CPU this process runs on.
// So a build never depends on the build machine's CPU (no -march=native): the same .so is right on an AMD EPYC
// with AVX-512 and on an older Xeon without it.
//
// The Python side (ttftc/codegen/cpu/_native.py) validates every tensor (device, dtype, shapes, strides) and every
// count before it hands raw pointers here; this file trusts the pointers it is given. What it does not trust is its
// own size arithmetic: every allocation size is computed with overflow checks and every allocation is checked, and
// a failure is a Python exception (MemoryError, or ValueError for a count out of range), never an abort.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
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
// op, so freshly started threads would share their cores with spinning ones (measured: no gain at all from a
// kernel 1.3-1.9x faster in isolation). On torch's own team the cores are handed over, as between two ATen ops.
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

// Reads `count` Python ints from a tuple; false with a Python error set when that fails.
bool parse_ints(PyObject* args, const char* name, Py_ssize_t count, int64_t* out, double* real) {
  PyObject* ints;
  int ok = real ? PyArg_ParseTuple(args, "O!d", &PyTuple_Type, &ints, real) : PyArg_ParseTuple(args, "O!", &PyTuple_Type, &ints);
  if (!ok) return false;
  if (PyTuple_GET_SIZE(ints) != count) {
    PyErr_Format(PyExc_ValueError, "%s expects %zd integers, got %zd", name, count, PyTuple_GET_SIZE(ints));
    return false;
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(ints, i));
    if (out[i] == -1 && PyErr_Occurred()) return false;
  }
  return true;
}

// False with a ValueError set unless every count is non-negative (sizes, and offsets that index forward only).
bool non_negative(const char* name, std::initializer_list<int64_t> counts) {
  for (int64_t n : counts) {
    if (n < 0) {
      PyErr_Format(PyExc_ValueError, "%s: a size or count is negative (%lld)", name, (long long)n);
      return false;
    }
  }
  return true;
}

template <class Args>
PyObject* run(const char* name, const Kernel<Args> (&by_isa)[kIsas], const Args& a, int64_t threads) {
  if (threads < 1 || threads > INT_MAX) {
    PyErr_Format(PyExc_ValueError, "%s: threads must be in [1, %d], got %lld", name, INT_MAX, (long long)threads);
    return nullptr;
  }
  bool done;
  Py_BEGIN_ALLOW_THREADS
  done = by_isa[int(kIsa)](a, int(threads));
  Py_END_ALLOW_THREADS
  if (!done) {
    PyErr_Format(PyExc_MemoryError, "%s: the working memory of a thread cannot be allocated (its size overflows or "
                 "memory is exhausted)", name);
    return nullptr;
  }
  Py_RETURN_NONE;
}

template <class T>
T* ptr(int64_t address) {
  return reinterpret_cast<T*>(address);
}

// attention(ints, scale): ints = (q, k, v, o, kv_len or 0 as addresses; batch, hq, hkv, sq, skv, d, dv;
// q strides b/h/s, k strides, v strides, o strides; causal, q_offset, window, block_k, threads, bf16, pack_kv).
// bf16 needs the avx512_bf16 kernels.
PyObject* attention(PyObject*, PyObject* args) {
  int64_t x[31];
  double scale;
  if (!parse_ints(args, "attention", 31, x, &scale)) return nullptr;
  AttentionArgs a;
  a.q = ptr<const void>(x[0]);
  a.k = ptr<const void>(x[1]);
  a.v = ptr<const void>(x[2]);
  a.o = ptr<void>(x[3]);
  a.kv_len = ptr<const int64_t>(x[4]);
  a.batch = x[5]; a.hq = x[6]; a.hkv = x[7]; a.sq = x[8]; a.skv = x[9]; a.d = x[10]; a.dv = x[11];
  a.q_sb = x[12]; a.q_sh = x[13]; a.q_ss = x[14];
  a.k_sb = x[15]; a.k_sh = x[16]; a.k_ss = x[17];
  a.v_sb = x[18]; a.v_sh = x[19]; a.v_ss = x[20];
  a.o_sb = x[21]; a.o_sh = x[22]; a.o_ss = x[23];
  a.causal = x[24] != 0; a.q_offset = x[25]; a.window = x[26]; a.block_k = x[27];
  a.scale = float(scale);
  a.pack_kv = x[30] != 0;
  if (!non_negative("attention", {a.batch, a.hq, a.hkv, a.sq, a.skv, a.d, a.dv, a.q_offset, a.window})) return nullptr;
  if (a.block_k < 1 || a.hkv < 1 || a.hq % a.hkv != 0) {
    PyErr_Format(PyExc_ValueError, "attention: block_k (%lld) and kv heads (%lld) must be >= 1, query heads (%lld) a "
                 "multiple of kv heads", (long long)a.block_k, (long long)a.hkv, (long long)a.hq);
    return nullptr;
  }
  // A block holds at most the keys there are (the kernel visits min(block_k, keys left) at a time), so past them
  // block_k only sized the working memory. Clamped to the keys rounded up to 8 (a multiple of every ISA's register
  // tile), blocks and results are the same as unclamped.
  a.block_k = std::min(a.block_k, (std::max<int64_t>(a.skv, 1) + 7) / 8 * 8);
  if (x[29] == 0) {
    static const Kernel<AttentionArgs> kernels[kIsas] = TTFTC_BY_ISA(attention);
    return run("attention", kernels, a, x[28]);
  }
#ifdef TTFTC_X86
  if (kIsa == Isa::avx512_bf16) {
    static const Kernel<AttentionArgs> kernels[kIsas] = {nullptr, nullptr, nullptr, isa_avx512_bf16::attention_bf16};
    return run("attention", kernels, a, x[28]);
  }
#endif
  PyErr_Format(PyExc_ValueError, "bf16 attention needs the avx512_bf16 kernels; this process runs %s", isa_name(kIsa));
  return nullptr;
}

// quantize_rows(ints) = (x, x_bf16, x_row_stride, q, scale, m, k, threads)
PyObject* quantize_rows(PyObject*, PyObject* args) {
  int64_t x[8];
  if (!parse_ints(args, "quantize_rows", 8, x, nullptr)) return nullptr;
  QuantArgs a{ptr<const void>(x[0]), x[2], ptr<int8_t>(x[3]), ptr<float>(x[4]), x[5], x[6], x[1] != 0};
  if (!non_negative("quantize_rows", {a.m, a.k})) return nullptr;
  static const Kernel<QuantArgs> kernels[kIsas] = TTFTC_BY_ISA(quantize_rows_any);
  return run("quantize_rows", kernels, a, x[7]);
}

// norm(ints, eps): ints = (x, residual, residual_out, weight, bias, q, scale, out, m, k, x_bf16, w_bf16, layer,
// round_product, threads); absent pointers are 0; q and scale, or out (in the promoted dtype of x and weight).
PyObject* norm(PyObject*, PyObject* args) {
  int64_t x[15];
  double eps;
  if (!parse_ints(args, "norm", 15, x, &eps)) return nullptr;
  NormArgs a{ptr<const void>(x[0]), ptr<const void>(x[1]), ptr<void>(x[2]), ptr<const void>(x[3]),
             ptr<const void>(x[4]), ptr<int8_t>(x[5]), ptr<float>(x[6]), ptr<void>(x[7]), x[8], x[9],
             x[10] != 0, x[11] != 0, x[12] != 0, x[13] != 0, float(eps)};
  if (!non_negative("norm", {a.m, a.k})) return nullptr;
  static const Kernel<NormArgs> kernels[kIsas] = TTFTC_BY_ISA(norm_any);
  return run("norm", kernels, a, x[14]);
}

// gated_act(ints) = (x, x_row_stride, out, m, inter, act, bf16, threads)
PyObject* gated_act(PyObject*, PyObject* args) {
  int64_t x[8];
  if (!parse_ints(args, "gated_act", 8, x, nullptr)) return nullptr;
  GatedActArgs a{ptr<const void>(x[0]), x[1], ptr<void>(x[2]), x[3], x[4], int(x[5]), x[6] != 0};
  if (!non_negative("gated_act", {a.m, a.inter})) return nullptr;
  static const Kernel<GatedActArgs> kernels[kIsas] = TTFTC_BY_ISA(gated_act_any);
  return run("gated_act", kernels, a, x[7]);
}

// rope(ints) = (x, cos, sin, out, batch, heads, seq, head_dim, x strides b/h/s, cos strides, sin strides, out
// strides, bf16, threads)
PyObject* rope(PyObject*, PyObject* args) {
  int64_t x[22];
  if (!parse_ints(args, "rope", 22, x, nullptr)) return nullptr;
  RopeArgs a{ptr<const void>(x[0]), ptr<const void>(x[1]), ptr<const void>(x[2]), ptr<void>(x[3]), x[4], x[5], x[6],
             x[7], {x[8], x[9], x[10]}, {x[11], x[12], x[13]}, {x[14], x[15], x[16]}, {x[17], x[18], x[19]},
             x[20] != 0};
  if (!non_negative("rope", {a.batch, a.h, a.s, a.d})) return nullptr;
  static const Kernel<RopeArgs> kernels[kIsas] = TTFTC_BY_ISA(rope_any);
  return run("rope", kernels, a, x[21]);
}

// dequant(ints) = (acc, acc_row_stride, x_scale, w_scale, bias or 0, out, out_row_stride, m, n, out_bf16, threads)
PyObject* dequant(PyObject*, PyObject* args) {
  int64_t x[11];
  if (!parse_ints(args, "dequant", 11, x, nullptr)) return nullptr;
  DequantArgs a{ptr<const int32_t>(x[0]), x[1], ptr<const float>(x[2]), ptr<const float>(x[3]),
                ptr<const float>(x[4]), ptr<void>(x[5]), x[6], x[7], x[8], x[9] != 0};
  if (!non_negative("dequant", {a.m, a.n})) return nullptr;
  static const Kernel<DequantArgs> kernels[kIsas] = TTFTC_BY_ISA(dequant_any);
  return run("dequant", kernels, a, x[10]);
}

// gated_quant(ints) = (acc, x_scale, w_scale, bias or 0, q, scale, m, inter, act, threads)
PyObject* gated_quant(PyObject*, PyObject* args) {
  int64_t x[10];
  if (!parse_ints(args, "gated_quant", 10, x, nullptr)) return nullptr;
  GatedQuantArgs a{ptr<const int32_t>(x[0]), ptr<const float>(x[1]), ptr<const float>(x[2]), ptr<const float>(x[3]),
                   ptr<int8_t>(x[4]), ptr<float>(x[5]), x[6], x[7], int(x[8])};
  if (!non_negative("gated_quant", {a.m, a.inter})) return nullptr;
  static const Kernel<GatedQuantArgs> kernels[kIsas] = TTFTC_BY_ISA(gated_quant_any);
  return run("gated_quant", kernels, a, x[9]);
}

bool int8_vnni() { return kHasVnni && (kIsa == Isa::avx512 || kIsa == Isa::avx512_bf16); }

// int8_gemm(ints) = (x, x_row_stride, packed, out, out_row_stride, x_scale, w_scale, bias or 0, m, n, k, out_kind,
// block_m, block_nv, threads): out = x [M, K] s8 . packed weight [N, K] s8, as int32 (out_kind 0) or dequantised
// (acc * w_scale * x_scale + bias) as fp32 (1) or bf16 (2). See int8_gemm_kernel.h.
PyObject* int8_gemm(PyObject*, PyObject* args) {
  int64_t x[15];
  if (!parse_ints(args, "int8_gemm", 15, x, nullptr)) return nullptr;
  Int8GemmArgs a{ptr<const int8_t>(x[0]), x[1], ptr<const int8_t>(x[2]), 0, ptr<void>(x[3]), x[4],
                 ptr<const float>(x[5]), ptr<const float>(x[6]), ptr<const float>(x[7]), x[8], x[9], x[10],
                 int(std::min<int64_t>(std::max<int64_t>(x[11], -1), 3)), x[12], x[13]};
  if (!non_negative("int8_gemm", {a.x_rs, a.out_rs, a.m, a.n, a.k})) return nullptr;
  if (a.out_kind < 0 || a.out_kind > 2 || a.block_m < 1 || a.block_nv < 1) {
    PyErr_Format(PyExc_ValueError, "int8_gemm: out_kind %lld must be 0, 1 or 2 and blocks (%lld, %lld) positive",
                 (long long)x[11], (long long)a.block_m, (long long)a.block_nv);
    return nullptr;
  }
  // The kernel's own offsets: a panel's bytes, every panel, the last row of x and out, and the count of work items
  // (row blocks x column blocks), all within int64.
  const int64_t groups = a.k / 4 + (a.k % 4 != 0), vecs = a.n / 8 + (a.n % 8 != 0);
  const int64_t m_blocks = a.m / a.block_m + (a.m % a.block_m != 0);
  const int64_t n_blocks = vecs / a.block_nv + (vecs % a.block_nv != 0);
  int64_t packed_bytes, x_end, out_end, items;
  if (__builtin_mul_overflow(groups, int64_t(32), &a.panel) || __builtin_mul_overflow(vecs, a.panel, &packed_bytes) ||
      __builtin_mul_overflow(a.m, a.x_rs, &x_end) || __builtin_add_overflow(x_end, a.k, &x_end) ||
      __builtin_mul_overflow(a.m, a.out_rs, &out_end) || __builtin_add_overflow(out_end, a.n, &out_end) ||
      __builtin_mul_overflow(m_blocks, n_blocks, &items)) {
    PyErr_SetString(PyExc_ValueError, "int8_gemm: the operands' sizes overflow int64");
    return nullptr;
  }
#ifdef TTFTC_X86
  if (int8_vnni()) {
    static const Kernel<Int8GemmArgs> kernels[kIsas] = {nullptr, nullptr, isa_avx512_vnni::int8_gemm,
                                                        isa_avx512_vnni::int8_gemm};
    return run("int8_gemm", kernels, a, x[14]);
  }
#endif
  static const Kernel<Int8GemmArgs> kernels[kIsas] = TTFTC_BY_ISA(int8_gemm);
  return run("int8_gemm", kernels, a, x[14]);
}

// The version int8_gemm runs in this process: "avx512_vnni", "avx2" (the AVX2 kernel, also under the AVX-512 ISAs
// of a CPU without VNNI) or "base".
PyObject* int8_gemm_isa(PyObject*, PyObject*) {
  return PyUnicode_FromString(int8_vnni() ? "avx512_vnni" : kIsa == Isa::base ? "base" : "avx2");
}

PyObject* isa(PyObject*, PyObject*) { return PyUnicode_FromString(isa_name(kIsa)); }

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
    {"attention", attention, METH_VARARGS, "Exact attention forward, fp32 or bf16 (attention_kernel.h)."},
    {"quantize_rows", quantize_rows, METH_VARARGS, "Symmetric int8 per row (see rows_kernel.h)."},
    {"norm", norm, METH_VARARGS, "Residual add, RMSNorm/LayerNorm, then int8 per row or the rows (rows_kernel.h)."},
    {"gated_act", gated_act, METH_VARARGS, "act(gate) * up of a gate|up matrix, contiguous (see rows_kernel.h)."},
    {"rope", rope, METH_VARARGS, "Rotary embedding, rotate-half form (see rope_kernel.h)."},
    {"dequant", dequant, METH_VARARGS, "int32 accumulator to float with per-row and per-column scales."},
    {"gated_quant", gated_quant, METH_VARARGS, "Dequant, act(gate) * up, int8 per row (see rows_kernel.h)."},
    {"int8_gemm", int8_gemm, METH_VARARGS, "Exact s8 x s8 GEMM on a packed weight, int32 or dequantised."},
    {"int8_gemm_isa", int8_gemm_isa, METH_NOARGS, "The version of int8_gemm this process runs."},
    {"isa", isa, METH_NOARGS, "The instruction set the kernels run with on this CPU."},
    {"use_openmp", use_openmp, METH_VARARGS, "Run parallel kernels on this already-loaded OpenMP runtime."},
    {"set_isa", set_isa, METH_VARARGS, "Run the kernels with another instruction set this CPU has; returns the previous."},
    {"source_digest", source_digest, METH_NOARGS, "sha256 of the sources this module was built from."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_native_kernels", "ttftc's native CPU kernels.", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__native_kernels(void) { return PyModule_Create(&kModule); }
