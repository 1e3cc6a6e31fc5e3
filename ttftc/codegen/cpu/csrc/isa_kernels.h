// Every kernel compiled for one ISA: native.cpp includes this once per ISA region, with TTFTC_NS (the namespace),
// TTFTC_VW (fp32 lanes per vector) and TTFTC_R (query vectors per register tile) defined, TTFTC_BF16_DOT where the
// region's target has AVX512-BF16 dot products, and TTFTC_INT8_AVX2 where it has AVX2. No include guard on purpose:
// each inclusion is another ISA.
#include "attention_kernel.h"
#include "rows_kernel.h"
#include "rope_kernel.h"
#include "int8_gemm_kernel.h"
#ifdef TTFTC_BF16_DOT
#include "attention_bf16_kernel.h"
#endif
#undef TTFTC_NS
#undef TTFTC_VW
#undef TTFTC_R
#undef TTFTC_BF16_DOT
#undef TTFTC_INT8_AVX2
