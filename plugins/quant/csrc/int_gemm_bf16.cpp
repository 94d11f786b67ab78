// servelab's fused weight-only GEMM for bf16 activations on AVX512-BF16 CPUs, 4- and 8-bit codes
// (plugins/quant/_int_gemm.py builds, loads and calls it; see that module for the layouts' Python side).
//
//   y (M, N) bf16 = x (M, K) bf16 @ W^T,  W[n, k] = codes[n, k] * scale[n, g] + offset[n, g],  g = k / G
//
// Why: torch's aten._weight_int4pack_mm_for_cpu dequantizes each weight once per 4 rows and multiplies in float32
// FMA, so its time grows with the rows as a GEMV's does (2x a bf16 GEMM at 64 rows), and torch has no kernel for
// group-wise 8-bit weights at all. Here, for more than 4 rows, each 64-column tile's codes are unpacked once per call
// into an L2-resident buffer of bf16 integers (0..255 are exact in bf16) and every row block reads them with
// AVX512-BF16 dot products (vdpbf16ps: two bf16 products per float32 lane); up to 4 rows, codes are unpacked into
// registers and used at once (one pass over the weights).
// Scales are applied per group, outside the inner loop ("scale folding"):
//   y[m, n] = sum_g scale[n, g] * (x[m, g] . codes[n, g]) + offset[n, g] * sum(x[m, g])
// Products of bf16 values are exact in float32, so the per-group dot is as exact as float32 accumulation allows;
// only the output is rounded to bf16 (round to nearest even).
//
// Layouts (made once at load by pack_vnni in _int_gemm.py; VNNI lane i of a 16-column block and k-pair is column
// i / 2, k offset i % 2, the operand order vdpbf16ps multiplies pairwise):
//   wq, 4-bit: (N / 16, K / 4, 32) uint8. For 16 output columns and 4 consecutive k, byte i holds in its low nibble
//       the code of VNNI lane i of k-pair 0 and in its high nibble that of k-pair 1.
//   wq, 8-bit: (N / 16, K / 2, 32) uint8: byte i of a k-pair is VNNI lane i's code.
//   sb: (N / 16, K / G, 2, 16) float16: the 16 columns' scale, then offset, per group (float16: at one row the
//       kernel is memory-bound, and float32 scales were 20% of its bytes).
// Requires bits 4 or 8, N % 16 == 0, K % 4 == 0, G % 4 == 0, K % G == 0 (else returns 1; 2 when out of memory).
// Threads: OpenMP over 64-column tiles (the process's libgomp: torch's, already loaded, is reused by soname).

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

constexpr int kTileBlocks = 4;  // 16-column blocks per tile: 4 x 512-bit B registers
constexpr int kRows = 4;        // rows per micro-kernel: 4 x 4 group accumulators + 4 x 4 totals

// Unpacking one 32-byte load of codes into VNNI vectors of exact bf16 integers (BITS = 4: two k-pairs, the low
// and the high nibbles, through a 16-entry table; BITS = 8: one k-pair, through float32).
template <int BITS>
struct Codes;

template <>
struct Codes<4> {
  static constexpr int kPairs = 2;  // k-pairs per 32-byte load
  static inline void unpack(const uint8_t* p, __m512i lut, __m512i* out) {
    const __m256i low4 = _mm256_set1_epi8(15);
    const __m256i v = _mm256_loadu_si256((const __m256i*)p);
    out[0] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(v, low4)), lut);
    out[1] = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4)), lut);
  }
};

template <>
struct Codes<8> {
  static constexpr int kPairs = 1;
  static inline void unpack(const uint8_t* p, __m512i, __m512i* out) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    out[0] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // 0..255 are exact in bf16
  }
};

// acc += scale * gacc + offset * sum(x over the group), for group g of every row and block.
template <int MR, int NB>
inline void add_group(__m512 (&acc)[MR][NB], const __m512 (&gacc)[MR][NB], const uint16_t* sb, int ngroups, int g,
                      const float* xs) {
  for (int j = 0; j < NB; ++j) {
    const uint16_t* sj = sb + ((long)j * ngroups + g) * 32;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sj));
    const __m512 offset = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sj + 16)));
    for (int r = 0; r < MR; ++r) {
      acc[r][j] = _mm512_fmadd_ps(gacc[r][j], scale, acc[r][j]);
      acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * ngroups + g]), offset, acc[r][j]);
    }
  }
}

// The rows' float32 totals rounded to bf16 (nearest even) into y.
template <int MR, int NB>
inline void store_rows(const __m512 (&acc)[MR][NB], uint16_t* y, long ldy) {
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j)
      _mm256_storeu_si256((__m256i*)(y + r * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}

template <int MR, int NB>
inline void micro(const uint16_t* x, long ldx, const __m512i* buf, int G, const uint16_t* sb, int ngroups,
                  const float* xs, uint16_t* y, long ldy) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int pairs = G / 2;
  for (int g = 0; g < ngroups; ++g) {
    __m512 gacc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j) gacc[r][j] = _mm512_setzero_ps();
    for (int kp = g * pairs; kp < (g + 1) * pairs; ++kp) {
      __m512i b[NB];
      for (int j = 0; j < NB; ++j) b[j] = _mm512_load_si512(buf + (long)kp * NB + j);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        memcpy(&pair, x + r * ldx + 2 * kp, 4);
        const __m512i a = _mm512_set1_epi32(pair);
        for (int j = 0; j < NB; ++j) gacc[r][j] = _mm512_dpbf16_ps(gacc[r][j], (__m512bh)a, (__m512bh)b[j]);
      }
    }
    add_group<MR, NB>(acc, gacc, sb, ngroups, g, xs);
  }
  store_rows<MR, NB>(acc, y, ldy);
}

// Few rows (M <= kRows): unpack each 32-byte load of codes into registers and use it at once. Weights stream from
// memory once, with no unpack-then-multiply phases (a phase that reads no memory idles the prefetchers: the
// buffered form ran at half torch's kernel's speed at one row on weights not in cache).
template <int BITS, int MR, int NB>
inline void direct(const uint16_t* x, long ldx, const uint8_t* wq, long block_bytes, int G, const uint16_t* sb,
                   int ngroups, const float* xs, uint16_t* y, long ldy, __m512i lut) {
  constexpr int P = Codes<BITS>::kPairs;
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int units = G / 2 / P;  // 32-byte loads per group and block
  for (int g = 0; g < ngroups; ++g) {
    __m512 gacc[MR][NB];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j) gacc[r][j] = _mm512_setzero_ps();
    for (int u = g * units; u < (g + 1) * units; ++u) {
      __m512i a[MR][P];
      for (int r = 0; r < MR; ++r)
        for (int pp = 0; pp < P; ++pp) {
          int32_t pair;
          memcpy(&pair, x + r * ldx + 2 * (u * P + pp), 4);
          a[r][pp] = _mm512_set1_epi32(pair);
        }
      for (int j = 0; j < NB; ++j) {
        __m512i b[P];
        Codes<BITS>::unpack(wq + j * block_bytes + 32L * u, lut, b);
        for (int r = 0; r < MR; ++r)
          for (int pp = 0; pp < P; ++pp)
            gacc[r][j] = _mm512_dpbf16_ps(gacc[r][j], (__m512bh)a[r][pp], (__m512bh)b[pp]);
      }
    }
    add_group<MR, NB>(acc, gacc, sb, ngroups, g, xs);
  }
  store_rows<MR, NB>(acc, y, ldy);
}

template <int BITS, int NB>
void direct_rows(const uint16_t* x, long ldx, const uint8_t* wq, long block_bytes, int G, const uint16_t* sb,
                 int ngroups, const float* xs, uint16_t* y, long ldy, int M, __m512i lut) {
  switch (M) {
    case 1: direct<BITS, 1, NB>(x, ldx, wq, block_bytes, G, sb, ngroups, xs, y, ldy, lut); break;
    case 2: direct<BITS, 2, NB>(x, ldx, wq, block_bytes, G, sb, ngroups, xs, y, ldy, lut); break;
    case 3: direct<BITS, 3, NB>(x, ldx, wq, block_bytes, G, sb, ngroups, xs, y, ldy, lut); break;
    default: direct<BITS, 4, NB>(x, ldx, wq, block_bytes, G, sb, ngroups, xs, y, ldy, lut); break;
  }
}

template <int NB>
void tile_rows(const uint16_t* x, long ldx, const __m512i* buf, int G, const uint16_t* sb, int ngroups,
               const float* xs, uint16_t* y, long ldy, int M) {
  int m = 0;
  for (; m + kRows <= M; m += kRows)
    micro<kRows, NB>(x + m * ldx, ldx, buf, G, sb, ngroups, xs + (long)m * ngroups, y + m * ldy, ldy);
  for (; m < M; ++m) micro<1, NB>(x + m * ldx, ldx, buf, G, sb, ngroups, xs + (long)m * ngroups, y + m * ldy, ldy);
}

// Row sums of x per group, float32 (M, K / G).
void group_sums(const uint16_t* x, long ldx, int M, int K, int G, float* xs) {
  for (int m = 0; m < M; ++m)
    for (int g = 0; g < K / G; ++g) {
      __m512 s = _mm512_setzero_ps();
      int k = g * G;
      for (; k + 16 <= (g + 1) * G; k += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(x + m * ldx + k));
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
      }
      float t = _mm512_reduce_add_ps(s);
      for (; k < (g + 1) * G; ++k) {
        const uint32_t u = (uint32_t)x[m * ldx + k] << 16;
        float f;
        memcpy(&f, &u, 4);
        t += f;
      }
      xs[(long)m * (K / G) + g] = t;
    }
}

template <int BITS>
int gemm(const uint16_t* x, long ldx, const uint8_t* wq, const uint16_t* sb, uint16_t* y, long ldy, int M, int N, int K,
         int G, int nthreads) {
  constexpr int P = Codes<BITS>::kPairs;
  const int nblocks = N / 16, pairs = K / 2, ngroups = K / G;
  const long block_bytes = (long)pairs * 16 * BITS / 4;  // one 16-column block's codes
  const int ntiles = (nblocks + kTileBlocks - 1) / kTileBlocks;
  float* xs = (float*)malloc(sizeof(float) * ((long)M * ngroups + 1));
  if (!xs) return 2;
  group_sums(x, ldx, M, K, G, xs);
  alignas(64) uint16_t lut_bits[32];  // bf16 bit patterns of 0..15 (vpermw reads an index's low 5 bits)
  for (int i = 0; i < 32; ++i) {
    const float f = (float)(i & 15);
    uint32_t u;
    memcpy(&u, &f, 4);
    lut_bits[i] = (uint16_t)(u >> 16);
  }
  const __m512i lut = _mm512_load_si512(lut_bits);
  const long buf_bytes = (long)pairs * kTileBlocks * 64;
  int err = 0;
#pragma omp parallel num_threads(nthreads)
  {
    __m512i* buf = M > kRows ? (__m512i*)aligned_alloc(64, buf_bytes) : nullptr;
    if (M > kRows && !buf) {
#pragma omp atomic write
      err = 2;
    }
#pragma omp for schedule(static)
    for (int t = 0; t < ntiles; ++t) {
      if (M > kRows && !buf) continue;
      const int nb0 = t * kTileBlocks;
      const int nbt = nblocks - nb0 < kTileBlocks ? nblocks - nb0 : kTileBlocks;
      const uint16_t* sbt = sb + (long)nb0 * ngroups * 32;
      uint16_t* yt = y + nb0 * 16;
      if (M <= kRows) {
        const uint8_t* wt = wq + nb0 * block_bytes;
        switch (nbt) {
          case 1: direct_rows<BITS, 1>(x, ldx, wt, block_bytes, G, sbt, ngroups, xs, yt, ldy, M, lut); break;
          case 2: direct_rows<BITS, 2>(x, ldx, wt, block_bytes, G, sbt, ngroups, xs, yt, ldy, M, lut); break;
          case 3: direct_rows<BITS, 3>(x, ldx, wt, block_bytes, G, sbt, ngroups, xs, yt, ldy, M, lut); break;
          default: direct_rows<BITS, 4>(x, ldx, wt, block_bytes, G, sbt, ngroups, xs, yt, ldy, M, lut); break;
        }
        continue;
      }
      for (int j = 0; j < nbt; ++j) {  // unpack the tile's codes: buf[k-pair][block] holds 16 columns x 2 k
        const uint8_t* wp = wq + (nb0 + j) * block_bytes;
        for (int u = 0; u < pairs / P; ++u) {
          __m512i b[P];
          Codes<BITS>::unpack(wp + 32L * u, lut, b);
          for (int pp = 0; pp < P; ++pp) _mm512_store_si512(buf + (long)(u * P + pp) * nbt + j, b[pp]);
        }
      }
      switch (nbt) {
        case 1: tile_rows<1>(x, ldx, buf, G, sbt, ngroups, xs, yt, ldy, M); break;
        case 2: tile_rows<2>(x, ldx, buf, G, sbt, ngroups, xs, yt, ldy, M); break;
        case 3: tile_rows<3>(x, ldx, buf, G, sbt, ngroups, xs, yt, ldy, M); break;
        default: tile_rows<4>(x, ldx, buf, G, sbt, ngroups, xs, yt, ldy, M); break;
      }
    }
    free(buf);
  }
  free(xs);
  return err;
}

}  // namespace

extern "C" int servelab_int_gemm_bf16(const uint16_t* x, long ldx, const uint8_t* wq, const uint16_t* sb, uint16_t* y,
                                      long ldy, int M, int N, int K, int G, int bits, int nthreads) {
  if (N % 16 || K % 4 || G % 4 || K % G || M < 0) return 1;
  if (bits == 4) return gemm<4>(x, ldx, wq, sb, y, ldy, M, N, K, G, nthreads);
  if (bits == 8) return gemm<8>(x, ldx, wq, sb, y, ldy, M, N, K, G, nthreads);
  return 1;
}
