// How fast one core reads DRAM as one or several sequential streams (BENCHMARKS.md, stop 31): K consecutive
// rows of ROW bytes are read together, 64 bytes of each in turn, as a kernel computing K weight rows at once
// (or one row beside an x that misses L1) reads them.
// Usage: gcc -O2 -mavx2 -o streams tools/bench/streams.c && ./streams K ROW   (e.g. ./streams 2 14336)
// Prints the best of 7 passes over 88 MiB, in GB/s.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc != 3 || atoi(argv[1]) < 1 || atoi(argv[2]) < 64 || atoi(argv[2]) % 64) {
    fprintf(stderr, "usage: streams K ROW (K >= 1 streams, ROW a multiple of 64 bytes)\n");
    return 2;
  }
  size_t n = (size_t)88 << 20, k = atoi(argv[1]), row = atoi(argv[2]);
  char *b = aligned_alloc(4096, n);
  memset(b, 1, n);
  __m256i acc = _mm256_setzero_si256();
  double best = 1e9;
  for (int pass = 0; pass < 7; pass++) {
    double t0 = now();
    for (size_t r = 0; r + k * row <= n; r += k * row)
      for (size_t o = 0; o < row; o += 64)
        for (size_t s = 0; s < k; s++) {
          const char *p = b + r + s * row + o;
          acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)p));
          acc = _mm256_xor_si256(acc, _mm256_load_si256((const __m256i *)(p + 32)));
        }
    double t = now() - t0;
    if (t < best) best = t;
  }
  // The xor result is printed so the loads are not optimised away.
  printf("%zu streams of %zu-byte rows: %.1f GB/s (%d)\n", k, row, n / best / 1e9,
         _mm256_extract_epi32(acc, 0) & 1);
  return 0;
}
