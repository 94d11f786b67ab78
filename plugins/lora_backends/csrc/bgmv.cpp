// servelab's BGMV kernel on the CPU: every token's LoRA term with its own adapter, no gathered weights
// (plugins/lora_backends/bgmv.py builds, loads and calls it).
//
//   y[t, start_p : start_p + size_p] += scale[s] * B_p[s] (A_p[s] x[t]),   s = slots[t] >= 0, for each part p
//
// Punica's BGMV contract (Chen et al., "Punica: Multi-Tenant LoRA Serving", MLSys 2024, section 4): one pass over the
// batch, each token reading its adapter's A and B where they lie. On a GPU that is a gather kernel; here one token
// is one unit of work (OpenMP over tokens): a shrink of R = parts * rank dot products of length `in` against the
// token's row, then an expand of `rank` axpys of length size_p per part over the transposed B. Work per token is
// R * (in + out) multiply-adds whatever the number of distinct adapters in the step; the adapters' weights stay in
// cache across the step's tokens. Accumulation is float32; each y element is rounded once (bf16: to nearest even).
//
// Layouts (all contiguous rows): x (T, in) with row stride ldx; a (S, R, in); bt (S, R, out_total), B transposed
// (a fused linear's B is block-diagonal: part p reads rows p*rank.. and columns start_p..); scales (S,) float32;
// slots (T,) int64, -1 = no adapter; y (T, out_total) with row stride ldy, added to in place.
// dtype 0: float32 tensors; 1: bfloat16 (uint16 bit patterns). Returns 0, 1 for bad arguments, 2 out of memory.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

namespace {

inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *p = (uint16_t)((u >> 16) | 0x40);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = (uint16_t)(u >> 16);
}

template <typename T>
int bgmv(const T* x, long ldx, const T* a, const T* bt, const float* scales, const int64_t* slots, T* y, long ldy,
         int ntok, int in, int rank, int nparts, const int* starts, const int* sizes, int out_total, int nthreads) {
  const int R = rank * nparts;
  int err = 0;
#pragma omp parallel num_threads(nthreads)
  {
    float* xf = (float*)malloc(sizeof(float) * ((size_t)in + (size_t)out_total + (size_t)R));
    if (!xf) {
#pragma omp atomic write
      err = 2;
    }
#pragma omp for schedule(static)
    for (int t = 0; t < ntok; ++t) {
      const int64_t s = slots[t];
      if (s < 0 || !xf) continue;
      float* acc = xf + in;
      float* h = acc + out_total;
      const T* xr = x + (long)t * ldx;
#pragma omp simd
      for (int k = 0; k < in; ++k) xf[k] = to_f32(xr[k]);
      const float scale = scales[s];
      for (int i = 0; i < R; ++i) {  // shrink: h = scale * A[s] x
        const T* ar = a + ((long)s * R + i) * in;
        float d = 0.f;
#pragma omp simd reduction(+ : d)
        for (int k = 0; k < in; ++k) d += to_f32(ar[k]) * xf[k];
        h[i] = d * scale;
      }
      for (int p = 0; p < nparts; ++p) {  // expand each part with its own rank block
        const int n = sizes[p];
#pragma omp simd
        for (int o = 0; o < n; ++o) acc[o] = 0.f;
        for (int j = 0; j < rank; ++j) {
          const float c = h[p * rank + j];
          const T* br = bt + ((long)s * R + p * rank + j) * out_total + starts[p];
#pragma omp simd
          for (int o = 0; o < n; ++o) acc[o] += c * to_f32(br[o]);
        }
        T* yr = y + (long)t * ldy + starts[p];
        for (int o = 0; o < n; ++o) store(yr + o, to_f32(yr[o]) + acc[o]);
      }
    }
    free(xf);
  }
  return err;
}

}  // namespace

extern "C" int servelab_bgmv(const void* x, long ldx, const void* a, const void* bt, const float* scales,
                             const int64_t* slots, void* y, long ldy, int ntok, int in, int rank, int nparts,
                             const int* starts, const int* sizes, int out_total, int dtype, int nthreads) {
  if (ntok < 0 || in <= 0 || rank <= 0 || nparts <= 0) return 1;
  for (int p = 0; p < nparts; ++p)
    if (starts[p] < 0 || sizes[p] < 0 || starts[p] + sizes[p] > out_total) return 1;
  if (dtype == 0)
    return bgmv((const float*)x, ldx, (const float*)a, (const float*)bt, scales, slots, (float*)y, ldy, ntok, in,
                rank, nparts, starts, sizes, out_total, nthreads);
  if (dtype == 1)
    return bgmv((const uint16_t*)x, ldx, (const uint16_t*)a, (const uint16_t*)bt, scales, slots, (uint16_t*)y, ldy,
                ntok, in, rank, nparts, starts, sizes, out_total, nthreads);
  return 1;
}
