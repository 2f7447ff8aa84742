// deltafin CUDA kernels, compiled by NVRTC at run time for the GPU in hand (with --fmad=false, so a
// multiply followed by an add rounds twice, as in the CPU code; fmaf() is written where the CPU fuses).
//
// Every dot product but the routed MXFP4 experts' (on the tensor cores, in an order of their own: see
// rows32_mx) follows the CPU kernels' fixed order (crates/kernels): element i of the 32-multiple prefix goes to
// lane i % 32 in increasing i with one fma, then the lanes fold by the tree acc[k] += acc[k + h], h = 16, 8, 4,
// 2, 1; the tail follows in order. The "lanes" are accumulators, not threads: a warp may hold them one per
// thread (spine matrices, norms, attention), a row's four threads eight each (the gated MLP), or one thread all
// 32 (BF16 experts, as the CPU does). Each (row, output) value is computed by its own threads in a fixed order
// whatever the batch, so results do not depend on which other rows share a pass.

typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;
#define FULL 0xffffffffu

__device__ __forceinline__ float bf16f(u32 bits) { return __int_as_float((int)(bits << 16)); }

// DeepSeek-V3 / Kimi K2 helpers that the shared kernels call (defined in that family's section at the end).
__device__ float e4m3f(u32 b);
__device__ float kv_weight(const u16* w, const float* sc, size_t r, int c, int cols);
__device__ void rope_rotate(float* x, int rope, u32 pos, const float* inv_freq, float attn);
__device__ void keep_groups(int* key, const float* score, const float* bias, int e, int groups, int topk_group,
                            int* gkey);

__device__ __forceinline__ float e8m0f(u32 s) {
    if (s == 0) return __int_as_float(0x00400000);
    if (s == 255) return __int_as_float(0x7fc00000);
    return __int_as_float((int)(s << 23));
}

// Programmatic dependent launch (Launch requests it on sm_90 and later; elsewhere both are no-ops). Every kernel
// launched so first lets the next kernel start (its blocks then sit in pdl_wait), may read constant weights (and
// state that only it touches in a pass, such as a KDA layer's), and calls pdl_wait on every path before it touches
// anything another kernel writes or reads. The wait returns once the previous kernel has finished and its writes are
// visible; since no kernel finishes before its own wait, the chain keeps stream order, while each launch and weight
// prefetch overlaps the kernel before it.
__device__ __forceinline__ void pdl_launch_next() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}
// With DELTAFIN_TIMELINE (`run --timeline`, crates/cuda/src/timeline.rs) thread 0 of every block also notes when
// it is past the wait (%globaltimer, ns): when the kernel before it has finished.
#ifdef DELTAFIN_TIMELINE
#define TIMELINE_CAP (1 << 20)
__device__ unsigned long long timeline[TIMELINE_CAP];
__device__ unsigned int timeline_n;
#endif
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef DELTAFIN_TIMELINE
    if (threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        unsigned int i = atomicAdd(&timeline_n, 1u);
        if (i < TIMELINE_CAP) timeline[i] = t;
    }
#endif
}

// After a pass's last kernel, with the timeline on only: its note is when that kernel finished.
extern "C" __global__ void timeline_mark() {
    pdl_launch_next();
    pdl_wait();
}

// The lane tree; lane 0 ends with the sum.
__device__ __forceinline__ float fold_lanes(float acc) {
    for (int h = 16; h >= 1; h >>= 1) acc += __shfl_down_sync(FULL, acc, h);
    return acc;
}

// 1 / RMS from a row's sum of squares, as deltafin_models::ops::inv_rms computes it (every norm on the device uses it).
__device__ __forceinline__ float inv_rms(float ss, int d, float eps) { return 1.0f / sqrtf(ss / (float)d + eps); }

// The block asks L2 for bytes [p, p + len) of constant weights, one 256-byte line per thread and step: their
// fetch overlaps the staging of x.
__device__ __forceinline__ void prefetch_l2(const void* p, size_t len) {
    for (size_t off = (size_t)threadIdx.x * 256; off < len; off += (size_t)blockDim.x * 256)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)p + off));
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float situf_(float g, float u) {
    float a = 4.0f * tanhf(g / 4.0f) * sigmoidf_(g);
    float b = 25.0f * tanhf(u / 25.0f);
    return a * b;
}
// act 0: SiTU(gate, up); 1: SiLU(gate) * up.
__device__ __forceinline__ float actf(int act, float g, float u) {
    return act == 0 ? situf_(g, u) : siluf_(g) * u;
}

// Any-length dot of two f32 vectors in the fixed order; result valid in lane 0. Loops over global memory with
// a run-time trip count are unrolled where they are latency-bound (one load round trip per iteration
// otherwise): the loads of several iterations are then in flight together, the arithmetic still in order.
__device__ float warp_dot(const float* a, const float* b, int len, int lane) {
    int body = len / 32 * 32;
    float acc = 0.0f;
#pragma unroll 16
    for (int i = lane; i < body; i += 32) acc = fmaf(a[i], b[i], acc);
    acc = fold_lanes(acc);
    if (lane == 0)
        for (int i = body; i < len; i++) acc = fmaf(a[i], b[i], acc);
    return acc;
}

// warp_dot(a, b) and warp_dot(a, c) in one pass over a (each in the fixed order); results valid in lane 0.
__device__ void warp_dot2(const float* a, const float* b, const float* c, int len, int lane, float& ab, float& ac) {
    int body = len / 32 * 32;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll 16
    for (int i = lane; i < body; i += 32) {
        float v = a[i];
        s0 = fmaf(v, b[i], s0);
        s1 = fmaf(v, c[i], s1);
    }
    s0 = fold_lanes(s0);
    s1 = fold_lanes(s1);
    if (lane == 0)
        for (int i = body; i < len; i++) {
            s0 = fmaf(a[i], b[i], s0);
            s1 = fmaf(a[i], c[i], s1);
        }
    ab = s0;
    ac = s1;
}

// Dot of row r of an MLA kv_b (`kv_weight`: BF16, or FP8 where sc is given) with x, one warp, in the fixed
// order (any cols: the tail after the tree, as warp_dot); result valid in lane 0.
__device__ float warp_dot_kv(const u16* w, const float* sc, size_t r, const float* x, int cols, int lane) {
    int body = cols / 32 * 32;
    float acc = 0.0f;
    for (int c = lane; c < body; c += 32) acc = fmaf(kv_weight(w, sc, r, c, cols), x[c], acc);
    acc = fold_lanes(acc);
    if (lane == 0)
        for (int c = body; c < cols; c++) acc = fmaf(kv_weight(w, sc, r, c, cols), x[c], acc);
    return acc;
}

// 16 bytes of weights, prefetching the rest of their 256-byte L2 line: the next blocks of the same row(s)
// are read by the same threads shortly after. Not kept in L1 (read once; the scales and other small reads
// near them are). volatile: a plain asm counts as side-effect free, and the compiler then hoists it out of
// the bounds checks around it (reads past the end of a matrix).
__device__ __forceinline__ uint4 ldg_w(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// BF16 rows with four threads per row: thread q (0..3) owns lanes 8q..8q+7, so each 32-element block is one
// 16-byte load per thread (64 contiguous bytes per row). acc[t][i] is lane 8q+i of x row t; the lane tree
// then runs across the four threads (h = 16, 8 by shuffles) and inside thread 0 (h = 4, 2, 1).
// cols % 32 == 0, rows 16-byte aligned. Every lane of the warp calls this (shuffles); out[t] valid in q == 0.
template <int T>
__device__ __forceinline__ void dot4_bf16(const u16* w, const float* x, int xs, int cols, int nt, int q,
                                          float* out) {
    float acc[T][8];
#pragma unroll
    for (int t = 0; t < T; t++)
#pragma unroll
        for (int i = 0; i < 8; i++) acc[t][i] = 0.0f;
    const u16* wq = w + 8 * q;
    const float* xq = x + 8 * q;
#pragma unroll 8
    for (int c = 0; c < cols; c += 32) {
        uint4 v = ldg_w(wq + c);
        u32 p[4] = {v.x, v.y, v.z, v.w};
        float wf[8];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            wf[2 * i] = __int_as_float((int)(p[i] << 16));
            wf[2 * i + 1] = __int_as_float((int)(p[i] & 0xffff0000u));
        }
#pragma unroll
        for (int t = 0; t < T; t++) {
            if (t < nt) {
                float4 x0 = __ldg((const float4*)(xq + (size_t)t * xs + c));
                float4 x1 = __ldg((const float4*)(xq + (size_t)t * xs + c + 4));
                float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                for (int i = 0; i < 8; i++) acc[t][i] = fmaf(wf[i], xv[i], acc[t][i]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < T; t++) {
#pragma unroll
        for (int i = 0; i < 8; i++) acc[t][i] += __shfl_down_sync(FULL, acc[t][i], 2);
#pragma unroll
        for (int i = 0; i < 8; i++) acc[t][i] += __shfl_down_sync(FULL, acc[t][i], 1);
#pragma unroll
        for (int h = 4; h >= 1; h >>= 1)
#pragma unroll
            for (int i = 0; i < h; i++) acc[t][i] += acc[t][i + h];
        out[t] = acc[t][0];
    }
}

#define TILE 4
// matmul_bf16's largest x tile: a checking pass of up to eight rows streams each weight row once (its one
// accumulator a row per lane is cheap, unlike mlp_rows' eight).
#define MM_TILE 8

// Six offsets passed by value: an MXFP4 record's tensors (bytes), or the parts of a fused matrix (rows).
struct Parts { u64 off[6]; };

// Copies `len` floats (len % 4 == 0, 16-byte aligned) into shared memory with the whole block; barriers on both
// sides (the previous readers are done, the copy is complete).
__device__ __forceinline__ void stage_x(float* xs, const float* x, int len) {
    __syncthreads();
#pragma unroll 8
    for (int i = threadIdx.x; i < len / 4; i += blockDim.x) ((float4*)xs)[i] = __ldg((const float4*)x + i);
    __syncthreads();
}

// 16 bytes global → shared without passing through registers (cp.async), prefetching the 256-byte L2 line.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"((u32)__cvta_generic_to_shared(dst)),
                 "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most N of this thread's groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// A matmul warp's ring of shared-memory pieces: MM_RING pieces of 4 KB, all in flight while one is computed.
#define MM_RING 4

// Piece p of a BF16 row (`chunks` 16-byte chunks) into `dst`, 8 chunks a lane; one cp.async group (maybe empty).
__device__ __forceinline__ void mm_piece(uint4* dst, const uint4* w, int p, int chunks, int lane) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int c = 256 * p + 32 * i + lane;
        if (c < chunks) cp_async16(&dst[32 * i + lane], w + c);
    }
    cp_async_commit();
}

// y[t*rows + r] = W[r] . x[t] for t < n, x rows in tiles of `tile` ≤ T rows (T = 1 when n is 1: a decode step's
// single row then runs a loop of its own). One warp per output row, lane j holding lane j of the order: the row
// streams through a ring of up to MM_RING shared-memory pieces of 4 KB (cp.async; the first ones issued before x
// is staged, so their latency overlaps it), and lane j reads element 32b + j of each block b from there. The
// tile's x rows are staged in shared memory first (read by every warp; from global memory each block would wait on
// a miss). Dynamic shared memory: each warp's ring, then tile · cols floats. Prologue: with norm_w, each staged x
// row is RMS-normalised in shared memory exactly as rms_row does it (the norm fused into its consumer). Epilogue,
// as the CPU adds: v = W[r]·x[t], plus add[o] when add is given; then y[o] = v, or y[o] += v with `accumulate`
// (residual adds fused). Output index o: W may be several matrices back to back (split.off: each part's first
// row, the unused ones = rows); part p's outputs lie together, [n][its rows], from n · off[p] on, so one launch
// serves every part and a one-part matrix is plain [n][rows].
// B: bytes a weight, 2 (BF16) or 1 (FP8 e4m3, each weight times its 128-column block's scale: sc holds
// ceil(cols / 128) scales a row, `matmul_fp8`).
template <int T, int B>
__device__ __forceinline__ void matmul_rows(const void* W, const float* sc, const float* x, float* y, int rows,
                                            int cols, int n, int tile, const float* norm_w, float eps,
                                            const float* add, int accumulate, Parts split) {
    extern __shared__ uint4 dyn[];
    int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int chunks = cols * B / 16, pieces = (chunks + 255) / 256;
    // A row of fewer than MM_RING pieces has a ring of its pieces only: slots past them are never written (its
    // copies from piece MM_RING on are empty).
    int slots = min(MM_RING, pieces);
    uint4* ring = dyn + warp * slots * 256;
    float* xs = (float*)(dyn + warps * slots * 256);
    int r = blockIdx.x * warps + warp;
    const uint4* w = (const uint4*)((const u8*)W + (size_t)min(r, rows - 1) * cols * B);
    const float* srow = sc + (size_t)min(r, rows - 1) * ((cols + 127) >> 7);
    __shared__ float inv[T];
    for (int t0 = 0; t0 < n; t0 += tile) {
        int nt = min(tile, n - t0);
#pragma unroll
        for (int p = 0; p < MM_RING; p++) mm_piece(ring + 256 * p, w, p, chunks, lane);
        pdl_wait();  // the first tile's weights are in flight; x and y belong to earlier kernels
        stage_x(xs, x + (size_t)t0 * cols, nt * cols);
        if (norm_w) {
            for (int t = warp; t < nt; t += warps) {
                float ss = warp_dot(xs + t * cols, xs + t * cols, cols, lane);
                if (lane == 0) inv[t] = inv_rms(ss, cols, eps);
            }
            __syncthreads();
            for (int t = 0; t < nt; t++) {
                float4* r4 = (float4*)(xs + t * cols);
                float it = inv[t];
#pragma unroll 8
                for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) {
                    float4 g = __ldg((const float4*)norm_w + i), v = r4[i];
                    r4[i] = make_float4(g.x * (v.x * it), g.y * (v.y * it), g.z * (v.z * it), g.w * (v.w * it));
                }
            }
            __syncthreads();
        }
        float acc[T];
#pragma unroll
        for (int t = 0; t < T; t++) acc[t] = 0.0f;
        for (int p = 0; p < pieces; p++) {
            cp_async_wait<MM_RING - 1>();  // piece p has landed (for this lane; the barrier: for the warp)
            __syncwarp();
            const uint4* sh = ring + 256 * (p % MM_RING);
            int len = min(4096 / B, cols - 4096 / B * p);
            const float* xc = xs + 4096 / B * p + lane;
#pragma unroll 4
            for (int e = 0; e < len; e += 32) {
                float wv = B == 2 ? bf16f(((const u16*)sh)[e + lane])
                                  : e4m3f(((const u8*)sh)[e + lane]) * srow[(4096 / B * p + e + lane) >> 7];
#pragma unroll
                for (int t = 0; t < T; t++)
                    if (t < nt) acc[t] = fmaf(wv, xc[(size_t)t * cols + e], acc[t]);
            }
            __syncwarp();
            mm_piece(ring + 256 * (p % MM_RING), w, p + MM_RING, chunks, lane);
        }
#pragma unroll
        for (int t = 0; t < T; t++) acc[t] = fold_lanes(acc[t]);
        if (lane == 0 && r < rows) {
            // One row (T == 1): o is r whatever the split, so a decode step's epilogue does not search it.
            int s0 = 0, len = rows;
            if (T > 1) {
                int p = 0;
                while (p < 5 && r >= (int)split.off[p + 1]) p++;
                s0 = (int)split.off[p];
                len = (p < 5 ? (int)split.off[p + 1] : rows) - s0;
            }
            for (int t = 0; t < nt; t++) {
                size_t o = (size_t)n * s0 + (size_t)(t0 + t) * len + (r - s0);
                float v = add ? acc[t] + add[o] : acc[t];
                y[o] = accumulate ? y[o] + v : v;
            }
        }
    }
}

extern "C" __global__ void matmul_bf16(const u16* W, const float* x, float* y, int rows, int cols, int n, int tile,
                                       const float* norm_w, float eps, const float* add, int accumulate,
                                       Parts split) {
    pdl_launch_next();
    int warps = blockDim.x >> 5;
    prefetch_l2(W + (size_t)blockIdx.x * warps * cols, 2 * (size_t)min(warps, rows - (int)blockIdx.x * warps) * cols);
    if (n == 1)
        matmul_rows<1, 2>(W, nullptr, x, y, rows, cols, n, 1, norm_w, eps, add, accumulate, split);
    else
        matmul_rows<MM_TILE, 2>(W, nullptr, x, y, rows, cols, n, tile, norm_w, eps, add, accumulate, split);
}

// out[t*rows + r] = act(G[r] . x[t], U[r] . x[t]): a gated MLP's first half, fused. Eight threads per row:
// four on the gate row, four on the up row; x rows in tiles of T (1 when n is 1, as in matmul_bf16).
template <int T>
__device__ __forceinline__ void mlp_rows(const u16* G, const u16* U, const float* x, float* out, int rows, int cols,
                                         int n, int act) {
    int q = threadIdx.x & 3, up = (threadIdx.x >> 2) & 1;
    int r = blockIdx.x * (blockDim.x / 8) + threadIdx.x / 8;
    if (r - (threadIdx.x & 31) / 8 >= rows) return;
    int rr = min(r, rows - 1);
    const u16* w = (up ? U : G) + (size_t)rr * cols;
    for (int t0 = 0; t0 < n; t0 += T) {
        float acc[T];
        dot4_bf16<T>(w, x + (size_t)t0 * cols, cols, cols, n - t0, q, acc);
#pragma unroll
        for (int t = 0; t < T; t++) {
            float u = __shfl_down_sync(FULL, acc[t], 4);
            if (q == 0 && !up && r < rows && t0 + t < n) out[(size_t)(t0 + t) * rows + r] = actf(act, acc[t], u);
        }
    }
}

extern "C" __global__ void mlp_up_act(const u16* G, const u16* U, const float* x, float* out, int rows, int cols,
                                      int n, int act) {
    pdl_launch_next();
    {
        int r0 = blockIdx.x * (blockDim.x / 8), nr = min((int)blockDim.x / 8, rows - r0);
        prefetch_l2(G + (size_t)r0 * cols, 2 * (size_t)nr * cols);
        prefetch_l2(U + (size_t)r0 * cols, 2 * (size_t)nr * cols);
    }
    pdl_wait();
    if (n == 1)
        mlp_rows<1>(G, U, x, out, rows, cols, n, act);
    else
        mlp_rows<TILE>(G, U, x, out, rows, cols, n, act);
}

extern "C" __global__ void embed_rows(const u16* table, const u32* tokens, float* out, int n, int hd) {
    pdl_launch_next();
    pdl_wait();
    int t = blockIdx.x;
    if (t >= n) return;
    const u16* row = table + (size_t)tokens[t] * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) out[(size_t)t * hd + i] = bf16f(row[i]);
}

// out = w ⊙ (x · 1/sqrt(dot(x,x)/d + eps)) for one row of d, by the whole block (warp 0 sums the squares; every
// thread must call it); out may alias x.
__device__ void rms_row(const float* x, const float* w, float* out, int d, float eps) {
    __shared__ float inv;
    if (threadIdx.x < 32) {
        float ss = warp_dot(x, x, d, threadIdx.x);
        if (threadIdx.x == 0) inv = inv_rms(ss, d, eps);
    }
    __syncthreads();
#pragma unroll 4
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = w[i] * (x[i] * inv);
}

// rms_row for each of n rows, one block (>= 32 threads) a row; out may alias x.
extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float* out, int n, int d, float eps) {
    pdl_launch_next();
    pdl_wait();
    int t = blockIdx.x;
    if (t >= n) return;
    rms_row(x + (size_t)t * d, w, out + (size_t)t * d, d, eps);
}

// AttnRes Mix for each row: values are na anchors ([na][n][hd]) then cur, at most MIX_VALUES (the host checks);
// α = softmax(inv_rms(v)·(v·w)). With norm_w, the mixed row is then RMS-normalised in place by rms_row (fused).
// At one row the kernel is a chain of dependent loads: a value's two dots share one pass over it, and the
// weights are fetched into L2 before the wait.
#define MIX_VALUES 16
extern "C" __global__ void attn_res_mix(const float* anchors, int na, const float* cur, const float* w, float* out,
                                        int n, int hd, float eps, const float* norm_w) {
    pdl_launch_next();
    prefetch_l2(w, 4 * (size_t)hd);
    if (norm_w) prefetch_l2(norm_w, 4 * (size_t)hd);
    pdl_wait();
    __shared__ float alpha[MIX_VALUES];
    int t = blockIdx.x;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    int nv = na + 1;
    for (int i = warp; i < nv; i += warps) {
        const float* v = (i < na) ? anchors + ((size_t)i * n + t) * hd : cur + (size_t)t * hd;
        float ss, s;
        warp_dot2(v, v, w, hd, lane, ss, s);
        if (lane == 0) alpha[i] = inv_rms(ss, hd, eps) * s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mx = __int_as_float(0xff800000);
        for (int i = 0; i < nv; i++) mx = fmaxf(mx, alpha[i]);
        float sum = 0.0f;
        for (int i = 0; i < nv; i++) {
            alpha[i] = expf(alpha[i] - mx);
            sum += alpha[i];
        }
        float inv = 1.0f / sum;
        for (int i = 0; i < nv; i++) alpha[i] *= inv;
    }
    __syncthreads();
    float* o_row = out + (size_t)t * hd;
#pragma unroll 4
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int i = 0; i < nv; i++) {
            const float* v = (i < na) ? anchors + ((size_t)i * n + t) * hd : cur + (size_t)t * hd;
            o += alpha[i] * v[d];
        }
        o_row[d] = o;
    }
    if (!norm_w) return;
    __syncthreads();
    rms_row(o_row, norm_w, o_row, hd, eps);
}

// Most taps of the KDA short convolution the kernel holds in registers (the host checks).
#define KDA_KERN_MAX 8

// Row t's inputs to the KDA recurrence for channel c of head h: its three projections, raw decay, write
// strength and pre-sigmoid output gate.
__device__ __forceinline__ void kda_row_inputs(const float* q, const float* k, const float* v, const float* g,
                                               const float* beta, const float* gate, int t, int w, int c, int heads,
                                               int h, float* x, float& gr, float& br, float& orw) {
    size_t at = (size_t)t * w + c;
    x[0] = q[at];
    x[1] = k[at];
    x[2] = v[at];
    gr = g[at];
    br = beta[(size_t)t * heads + h];
    orw = gate[at];
}

// A thread's three conv windows into a [3][w][kern - 1] copy.
__device__ __forceinline__ void store_windows(float* dst, const float (&win)[3][KDA_KERN_MAX - 1], int w, int c,
                                              int kern) {
#pragma unroll
    for (int p = 0; p < 3; p++)
#pragma unroll
        for (int jj = 0; jj < KDA_KERN_MAX - 1; jj++)
            if (jj < kern - 1) dst[((size_t)p * w + c) * (kern - 1) + jj] = win[p][jj];
}

// The KDA recurrence over n rows in order, one block per head, one thread per channel (blockDim == dim).
// q, k, v: [n][w] projections; conv: 3 windows [w][kern-1];
// S: [heads][dim][dim]; g, beta: [n][w], [n][heads] raw decay and write strength; gate: [n][w] pre-sigmoid
// output gate; out: [n][w]. kind 0 (K3) or 1 (Kimi Linear) picks the decay and the q/k normalisation.
// The session keeps two copies of conv and S: a pass over its positions *pos .. *pos + n reads the copy of
// parity *pos and writes that of parity *pos + n, so a one-row step leaves the state before it intact (a
// decode step run ahead on the device's own choice can be taken back).
// The head's state is read into shared memory before the wait (no kernel of the pass writes it but this one)
// and written back once at the end, and each thread's conv windows stay in registers, so the rows' updates
// cost no round trips to global memory.
// keep (null: none): a checking pass's snapshots, [n - 1][S, conv] in S's and conv's layouts: the state after
// each row but the last, from which a rollback restores the state after any row without running the model.
// Dynamic shared memory: (dim + 4) · dim floats.
extern "C" __global__ void kda_recurrence(const float* q, const float* k, const float* v, const float* g,
                                          const float* beta, const float* gate, const float* dt_bias,
                                          const float* a_log, float lower, const float* conv_w, float* conv_state,
                                          float* S, float* keep, const u32* pos, const float* o_norm, float* out,
                                          int n, int heads, int dim, int kern, int kind, float eps) {
    pdl_launch_next();
    extern __shared__ float sh[];
    float* qs = sh;            // dim
    float* ks = sh + dim;      // dim
    float* ds = sh + 2 * dim;  // dim: exp(g), the decay of row i of S
    float* os = sh + 3 * dim;  // dim
    float* Ss = sh + 4 * dim;  // dim · dim: the head's state, row-major like S
    __shared__ float red[2];
    int h = blockIdx.x, j = threadIdx.x;
    int w = heads * dim;
    int c = h * dim + j;
    // The header was written before the pass began (its upload, or the previous step's decode_pick).
    u32 from = *pos & 1, to = (*pos + n) & 1;
    size_t conv_len = (size_t)3 * w * (kern - 1), s_len = (size_t)heads * dim * dim;
    const float* Sh = S + from * s_len + (size_t)h * dim * dim;
#pragma unroll 8
    for (int i = 0; i < dim; i++) Ss[i * dim + j] = Sh[(size_t)i * dim + j];
    // This thread's three conv windows and weights live in registers for the whole pass (indices are
    // constants after unrolling; entries at or past kern − 1 are unused).
    float win[3][KDA_KERN_MAX - 1], wt[3][KDA_KERN_MAX];
#pragma unroll
    for (int p = 0; p < 3; p++) {
#pragma unroll
        for (int jj = 0; jj < KDA_KERN_MAX; jj++) {
            if (jj < kern) wt[p][jj] = conv_w[((size_t)p * w + c) * kern + jj];
            if (jj < kern - 1) win[p][jj] = conv_state[from * conv_len + ((size_t)p * w + c) * (kern - 1) + jj];
        }
    }
    float ea = expf(a_log[h]), ow = o_norm[j], bias = dt_bias[c];
    float scale = 1.0f / sqrtf((float)dim);
    pdl_wait();
    // Every input of row t that no row writes is loaded before the row's stores (and row t + 1's are in flight
    // while row t runs): the stores could alias them, so loads after a store would each wait a round trip.
    float xv[3], graw, braw, oraw;
    kda_row_inputs(q, k, v, g, beta, gate, 0, w, c, heads, h, xv, graw, braw, oraw);
    for (int t = 0; t < n; t++) {
        float nx[3] = {0.0f, 0.0f, 0.0f}, ng = 0.0f, nb = 0.0f, no = 0.0f;
        if (t + 1 < n) kda_row_inputs(q, k, v, g, beta, gate, t + 1, w, c, heads, h, nx, ng, nb, no);
        // 2. causal short conv, then SiLU.
        float cv[3];
#pragma unroll
        for (int p = 0; p < 3; p++) {
            float acc = 0.0f;
#pragma unroll
            for (int jj = 0; jj < KDA_KERN_MAX - 1; jj++)
                if (jj < kern - 1) acc += wt[p][jj] * win[p][jj];
#pragma unroll
            for (int jj = 0; jj < KDA_KERN_MAX; jj++)
                if (jj == kern - 1) acc += wt[p][jj] * xv[p];
#pragma unroll
            for (int jj = 0; jj < KDA_KERN_MAX - 1; jj++) {
                if (jj + 1 < kern - 1) win[p][jj] = win[p][jj + 1];
                else if (jj == kern - 2) win[p][jj] = xv[p];
            }
            cv[p] = siluf_(acc);
        }
        qs[j] = cv[0];
        ks[j] = cv[1];
        // 5. decay: lower·sigmoid(exp(A_log[h])·raw) (kind 0) or −exp(A_log[h])·softplus(raw) (kind 1),
        // raw = g + dt_bias.
        float raw = graw + bias;
        float gt = kind == 0 ? lower * sigmoidf_(ea * raw) : -ea * softplusf_(raw);
        ds[j] = expf(gt);
        __syncthreads();
        // 3. per-head L2 normalisation (sum of squares left to right, like the CPU).
        if (j < 2) {
            float* x = j == 0 ? qs : ks;
            float ss = 0.0f;
            for (int i = 0; i < dim; i++) ss += x[i] * x[i];
            float nrm = kind == 0 ? fmaxf(sqrtf(ss), 1e-12f) : sqrtf(ss + 1e-6f);
            red[j] = (j == 0 ? scale : 1.0f) / nrm;
        }
        __syncthreads();
        qs[j] *= red[0];
        ks[j] *= red[1];
        __syncthreads();
        // 6. S ← S ⊙ exp(g)[:,None]; δ = v − Sᵀk; S ← S + (β·k) ⊗ δ; o = Sᵀq (column j of S per thread, which
        // this thread alone touches). Eight rows of S at a time are loaded before they are stored.
        float d = cv[2];
        float* col = Ss + j;
        for (int i0 = 0; i0 < dim; i0 += 8) {
            float sv[8], dv[8], kv[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                sv[u] = col[(i0 + u) * dim];
                dv[u] = ds[i0 + u];
                kv[u] = ks[i0 + u];
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
                float s = sv[u] * dv[u];
                col[(i0 + u) * dim] = s;
                d -= s * kv[u];
            }
        }
        float bt = sigmoidf_(braw);  // 4. β
        float o = 0.0f;
        for (int i0 = 0; i0 < dim; i0 += 8) {
            float sv[8], kv[8], qv[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                sv[u] = col[(i0 + u) * dim];
                kv[u] = ks[i0 + u];
                qv[u] = qs[i0 + u];
            }
#pragma unroll
            for (int u = 0; u < 8; u++) {
                float bk = bt * kv[u];
                float s = sv[u] + bk * d;
                col[(i0 + u) * dim] = s;
                o += s * qv[u];
            }
        }
        os[j] = o;
        __syncthreads();
        // 7. RMS over the head, then the output gate.
        if (j < 32) {
            float ss = warp_dot(os, os, dim, j);
            if (j == 0) red[0] = inv_rms(ss, dim, eps);
        }
        __syncthreads();
        float r = ow * (o * red[0]);
        out[(size_t)t * w + c] = r * sigmoidf_(oraw);
        // This thread's column of S and its windows, which it alone writes.
        if (keep && t + 1 < n) {
            float* kt = keep + (size_t)t * (s_len + conv_len);
#pragma unroll 8
            for (int i = 0; i < dim; i++) kt[(size_t)h * dim * dim + (size_t)i * dim + j] = col[i * dim];
            store_windows(kt + s_len, win, w, c, kern);
        }
        __syncthreads();
#pragma unroll
        for (int p = 0; p < 3; p++) xv[p] = nx[p];
        graw = ng;
        braw = nb;
        oraw = no;
    }
    store_windows(conv_state + to * conv_len, win, w, c, kern);
    float* St = S + to * s_len + (size_t)h * dim * dim;
#pragma unroll 8
    for (int i = 0; i < dim; i++) St[(size_t)i * dim + j] = Ss[i * dim + j];
}

// MLA: normalise each row's latent into the cache at position *pos + t and copy its k_pe, rotated for that
// position where the layer has RoPE (inv_freq not null: `rope_rotate`). The position is read from device memory
// (the pass's uploaded header), so a replayed decode graph appends where the session is.
extern "C" __global__ void mla_append(const float* c, const float* kv_norm, float* lat, float* pe, const u32* pos,
                                      int n, int kvl, int rope, float eps, const float* inv_freq, float attn) {
    pdl_launch_next();
    pdl_wait();
    __shared__ float inv;
    int t = blockIdx.x, start = (int)*pos;
    const float* row = c + (size_t)t * (kvl + rope);
    if (threadIdx.x < 32) {
        float ss = warp_dot(row, row, kvl, threadIdx.x);
        if (threadIdx.x == 0) inv = inv_rms(ss, kvl, eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kvl; i += blockDim.x)
        lat[(size_t)(start + t) * kvl + i] = kv_norm[i] * (row[i] * inv);
    float* pe_t = pe + (size_t)(start + t) * rope;
    for (int i = threadIdx.x; i < rope; i += blockDim.x) pe_t[i] = row[kvl + i];
    if (!inv_freq) return;
    __syncthreads();
    if (threadIdx.x == 0) rope_rotate(pe_t, rope, start + t, inv_freq, attn);
}

// The lane tree over 32 accumulators in one thread (written out so that every index is a constant).
__device__ __forceinline__ float fold32(float* acc) {
#pragma unroll
    for (int k = 0; k < 16; k++) acc[k] += acc[k + 16];
#pragma unroll
    for (int k = 0; k < 8; k++) acc[k] += acc[k + 8];
#pragma unroll
    for (int k = 0; k < 4; k++) acc[k] += acc[k + 4];
    acc[0] += acc[2];
    acc[1] += acc[3];
    return acc[0] + acc[1];
}

// warp_dot's arithmetic in one thread: element i into accumulator i % 32 in increasing i, the lane tree, then
// the tail; the same bits as warp_dot, without a warp.
__device__ float thread_dot(const float* a, const float* b, int len) {
    float acc[32];
#pragma unroll
    for (int k = 0; k < 32; k++) acc[k] = 0.0f;
    int body = len / 32 * 32;
    for (int c = 0; c < body; c += 32)
#pragma unroll
        for (int k = 0; k < 32; k++) acc[k] = fmaf(a[c + k], b[c + k], acc[k]);
    float r = fold32(acc);
    for (int i = body; i < len; i++) r = fmaf(a[i], b[i], r);
    return r;
}

// Absorbed MLA for one (row t, head): q_lat = W_UKᵀ q_nope; p_s = softmax((q_lat·lat_s + q_pe·pe_s)·scale) over
// s ≤ *pos + t; ctx = Σ p_s lat_s; out = W_UV ctx, times sigmoid(gate) where the layer has an output gate
// ([n][heads·dv], or null). kv_b: [heads·(nope+dv)][kvl], BF16, or FP8 with kv_sc (`kv_weight`). q_pe is
// rotated for its position where the layer has RoPE (inv_freq not null). Scratch: p [n·heads][ctx_cap] (ctx_cap:
// the cache's capacity, so a replayed decode graph's scratch holds every position it reaches), shared: q_lat,
// ctx and q_pe (2·kvl + rope floats). MLA_THREADS threads. At one row the block is a chain of steps, each arranged to wait as few
// load round trips as it can: the head's weights are fetched into L2 before the wait, a position's score is one
// thread's (thread_dot), and positions go in chunks of the block, whose softmax terms the serial sum and ctx
// read from shared memory.
#define MLA_THREADS 512
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    mla_attend(const float* q, const u16* kv_b, const float* lat, const float* pe, float* p_all, int ctx_cap,
               const float* gate, float* out, int n, int heads, int nope, int rope, int dv, int kvl, const u32* pos,
               float scale, const float* kv_sc, const float* inv_freq, float attn) {
    pdl_launch_next();
    extern __shared__ float sh[];
    float* q_lat = sh;
    float* ctx = sh + kvl;
    float* q_pe = sh + 2 * kvl;
    __shared__ float eb[MLA_THREADS];  // a chunk's softmax terms
    __shared__ float red[MLA_THREADS / 32];
    __shared__ float bc;
    int t = blockIdx.x / heads, hd = blockIdx.x % heads;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    int qd = nope + rope;
    size_t base = (size_t)hd * (nope + dv);
    size_t wb = kv_sc ? 1 : 2;  // bytes a weight
    prefetch_l2((const u8*)kv_b + wb * base * kvl, wb * (nope + dv) * kvl);
    pdl_wait();
    const float* qh = q + (size_t)t * heads * qd + (size_t)hd * qd;
    for (int cc = threadIdx.x; cc < kvl; cc += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 16
        for (int r = 0; r < nope; r++) acc = fmaf(kv_weight(kv_b, kv_sc, base + r, cc, kvl), qh[r], acc);
        q_lat[cc] = acc;
        ctx[cc] = 0.0f;
    }
    if (threadIdx.x == 0) {
        for (int i = 0; i < rope; i++) q_pe[i] = qh[nope + i];
        if (inv_freq) rope_rotate(q_pe, rope, *pos + t, inv_freq, attn);
    }
    __syncthreads();
    int upto = (int)*pos + t + 1;
    float* p = p_all + (size_t)blockIdx.x * ctx_cap;
    // Scores and their maximum (fmaxf in any order gives the serial maximum, up to the sign of a zero, which
    // no p_s − max distinguishes).
    float mx = __int_as_float(0xff800000);
    for (int s = threadIdx.x; s < upto; s += blockDim.x) {
        float a = thread_dot(q_lat, lat + (size_t)s * kvl, kvl);
        float b = thread_dot(q_pe, pe + (size_t)s * rope, rope);
        float sc = (a + b) * scale;
        p[s] = sc;
        mx = fmaxf(mx, sc);
    }
    for (int h = 16; h >= 1; h >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, h));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < warps; i++) mx = fmaxf(mx, red[i]);
        bc = mx;
    }
    __syncthreads();
    mx = bc;
    // exp(p_s − max), summed left to right by thread 0, a chunk at a time. Thread i owns positions ≡ i in
    // every chunk, so it reads back only what it wrote.
    float sum = 0.0f;
    for (int s0 = 0; s0 < upto; s0 += blockDim.x) {
        int s = s0 + threadIdx.x;
        if (s < upto) {
            float e = expf(p[s] - mx);
            p[s] = e;
            eb[threadIdx.x] = e;
        }
        __syncthreads();
        if (threadIdx.x == 0)
            for (int i = 0; i < min((int)blockDim.x, upto - s0); i++) sum += eb[i];
        __syncthreads();
    }
    if (threadIdx.x == 0) bc = 1.0f / sum;
    __syncthreads();
    float inv = bc;
    for (int s0 = 0; s0 < upto; s0 += blockDim.x) {
        int s = s0 + threadIdx.x, m = min((int)blockDim.x, upto - s0);
        if (s < upto) eb[threadIdx.x] = p[s] * inv;
        __syncthreads();
        for (int cc = threadIdx.x; cc < kvl; cc += blockDim.x) {
            float acc = ctx[cc];
#pragma unroll 16
            for (int i = 0; i < m; i++) acc += eb[i] * lat[(size_t)(s0 + i) * kvl + cc];
            ctx[cc] = acc;
        }
        __syncthreads();
    }
    for (int i = warp; i < dv; i += warps) {
        float acc = warp_dot_kv(kv_b, kv_sc, base + nope + i, ctx, kvl, lane);
        size_t o = (size_t)t * heads * dv + (size_t)hd * dv + i;
        if (lane == 0) out[o] = gate ? acc * sigmoidf_(gate[o]) : acc;
    }
}

// Routed experts. x is the same for every warp of a block (staged in shared memory); each warp computes 32
// rows of an expert matrix over a range of its blocks, and each row's order is fixed, so a row's result never
// depends on its batch.
//
// MXFP4 experts run on the tensor cores (mma.m16n8k16, f16 operands, f32 accumulation), in a device layout
// and summation order of their own: results agree with the CPU to rounding (design.md: 1e-4 across backends).
// - Weights: e2m1 values are exact in f16 as e2m1 · 2^-14 (the 0.5 code is the subnormal 2^-15), placed by
//   a mask, a shift or a multiply (mx_frag) straight from the stored word into an A fragment.
// - x: staged times 2^k, k putting its largest |x| in [2^14, 2^15), and split into three f16 parts (hi, mid,
//   lo: 33 significant bits, more than fp32's 24; parts below f16's range are 2^-39 of the largest |x|),
//   which are three of the eight B columns: an f16 MMA then yields all three partial products at once. A second
//   row of x takes three more (passes of several rows: the weights are read once for the two).
// - Each 32-weight block is two MMAs into a zeroed accumulator (its products exact, their sum rounded in
//   f32), scaled once by 2^(s−127) · 2^(14−k) (powers of two: exact) and added with one fma; the three parts
//   are summed at the end as (hi + mid) + lo.
// Copied into VRAM, each tensor is rearranged by `mx_repack`: rows in groups of 32 (whole, checked at load);
// block c of a group is 512 bytes at c · 512, lane L's 16 at L · 16, four words (tile 0 slice 0, tile 0 slice 1,
// tile 1 slice 0, tile 1 slice 1: tiles are rows 0–15 and 16–31, slices are elements 0–15 and 16–31); the word
// holds the eight weights of lane L's A fragment (PTX ISA, m16n8k16: row g = L / 4 and g + 8, elements 2t, 2t+1
// and 2t+8, 2t+9, t = L % 4) at the bits mx_frag takes them from. The block's 32 scales are 32 bytes at c · 32,
// byte 4g + j the scale of row g + 8j (j < 4): one 4-byte load a lane.

// The four f16x2 registers of an A fragment from its stored word (every bit is used once): a mask, a shift
// and a mask, and twice a mask, a multiply and a mask. The multiply adds two shifted copies of the masked bits,
// one landing the magnitudes, the other the signs; no two of their bits meet, so nothing carries.
__device__ __forceinline__ void mx_frag(u32 w, u32* a) {
    a[0] = w & 0x8e008e00u;
    a[1] = (w << 3) & 0x8e008e00u;
    a[2] = ((w & 0x20382038u) * 68u) & 0x8e008e00u;
    a[3] = ((w & 0x40074007u) * 514u) & 0x8e008e00u;
}

// One 32-row group (blockIdx.x) of one tensor (blockIdx.y: w1p w1s w2p w2s w3p w3s) of an MXFP4 record, in
// place, into the device layout. Dynamic shared memory: the group, 16 · max(width, inter) bytes.
extern "C" __global__ void mx_repack(u8* rec, Parts parts, int width, int inter) {
    extern __shared__ uint4 sm[];
    int t = blockIdx.y, down = t == 2 || t == 3;
    int rows = down ? width : inter, nb = (down ? inter : width) / 32;
    int r0 = blockIdx.x * 32;
    if (r0 >= rows) return;
    int n = 32 * nb;
    u8* sb = (u8*)sm;
    if (t % 2 == 0) {
        uint4* g = (uint4*)(rec + parts.off[t]) + (size_t)r0 * nb;
        for (int i = threadIdx.x; i < n; i += blockDim.x) sm[i] = g[i];
        __syncthreads();
        u32* o = (u32*)g;
        // Where each of a word's eight weights sits (mantissa, the two exponent bits, sign), in the fragment's
        // order (register 0 low and high half, register 1 ...): where mx_frag takes it from.
        const int bits[8][4] = {{9, 10, 11, 15}, {25, 26, 27, 31}, {6, 7, 8, 12}, {22, 23, 24, 28},
                                {3, 4, 5, 13},   {19, 20, 21, 29}, {0, 1, 2, 14}, {16, 17, 18, 30}};
        for (int i = threadIdx.x; i < 4 * n; i += blockDim.x) {
            // Word i: block c, lane L = 4gg + tt, tile tau, slice h.
            int c = i >> 7, lane = (i >> 2) & 31, tau = (i >> 1) & 1, h = i & 1, gg = lane >> 2, tt = lane & 3;
            u32 w = 0;
#pragma unroll
            for (int f = 0; f < 8; f++) {
                int row = 16 * tau + gg + 8 * ((f >> 1) & 1), k = 16 * h + 2 * tt + (f & 1) + 8 * (f >> 2);
                u32 nib = (sb[(row * nb + c) * 16 + k / 2] >> (4 * (k & 1))) & 15u;
                w |= ((nib & 1u) << bits[f][0]) | (((nib >> 1) & 1u) << bits[f][1]) |
                     (((nib >> 2) & 1u) << bits[f][2]) | (((nib >> 3) & 1u) << bits[f][3]);
            }
            o[i] = w;
        }
    } else {
        u8* g = rec + parts.off[t] + (size_t)r0 * nb;
        for (int i = threadIdx.x; i < n; i += blockDim.x) sb[i] = g[i];
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            int c = i >> 5, j = i & 31, row = (j >> 2) + 8 * (j & 3);
            g[i] = sb[row * nb + c];
        }
    }
}

__device__ __forceinline__ u16 f16_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float f16_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// v as hi + mid + lo, each rounded to f16 from what the previous parts left (the differences are exact in
// f32); an infinity or NaN stays in hi alone.
__device__ __forceinline__ void split3(float v, u32* p, int shift) {
    u16 a = f16_rn(v);
    float r = v - f16_f32(a);
    r = r == r ? r : 0.0f;
    u16 b = f16_rn(r);
    r -= f16_f32(b);
    p[0] |= (u32)a << shift;
    p[1] |= (u32)b << shift;
    p[2] |= (u32)f16_rn(r) << shift;
}

// R rows of x (len floats each, len % 32 == 0; x1 is row 1 when R is 2, null if there is none) into the MXFP4
// kernels' staging area xs in shared memory: a table of the block scales' factors per row (256 floats), then the
// rows as B fragments (6 bytes an element). Fragments: per 32-element block 192 bytes a row, row r's after row
// r−1's; B column 4r + g holds part g (hi, mid, lo) of row r, which lane L = 16r + 4g + t (t < 4) reads at
// (12r + 4g + t) · 16: elements 2t, 2t+1 | 2t+8, 2t+9 of slice 0, then of slice 1, as f16 pairs, of x · 2^k,
// k = 141 − the largest exponent field of the row, within [−113, 127] (so 2^k and 2^(14−k) are normal floats).
// Table: entry s = 2^(14−k) · 2^(s−127), a block's factor for scale code s (2^(14−k) undoes the staging's 2^k
// and the weights' 2^-14; code 0 is 2^-127, 255 NaN, as e8m0f says). Each row is staged as it is alone.
template <int R>
__device__ void stage_mx_x(float* xs, const float* x0, const float* x1, int len) {
    __shared__ int emax[R];
    __syncthreads();
    if (threadIdx.x < R) emax[threadIdx.x] = 0;
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float* x = r ? x1 : x0;
        if (R > 1 && !x) continue;
        int e = 0;
        for (int i = threadIdx.x; i < len / 4; i += blockDim.x) {
            float4 v = __ldg((const float4*)x + i);
            e = max(e, max(max((__float_as_int(v.x) >> 23) & 255, (__float_as_int(v.y) >> 23) & 255),
                           max((__float_as_int(v.z) >> 23) & 255, (__float_as_int(v.w) >> 23) & 255)));
        }
        for (int h = 16; h >= 1; h >>= 1) e = max(e, __shfl_xor_sync(FULL, e, h));
        if ((threadIdx.x & 31) == 0) atomicMax(&emax[r], e);  // a maximum: the same whatever the order
    }
    __syncthreads();
    u32* xf = (u32*)(xs + 256 * R);
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float* x = r ? x1 : x0;
        if (R > 1 && !x) continue;
        int k = max(-113, min(127, 141 - emax[r]));
        float up = __int_as_float((k + 127) << 23), unscale = __int_as_float((141 - k) << 23);
        for (int s = threadIdx.x; s < 256; s += blockDim.x) xs[256 * r + s] = unscale * e8m0f(s);
        for (int i = threadIdx.x; i < len / 2; i += blockDim.x) {
            float2 v = __ldg((const float2*)x + i);
            u32 p[3] = {0, 0, 0};
            split3(v.x * up, p, 0);
            split3(v.y * up, p, 16);
            int j = 2 * i, c = j >> 5, h = (j >> 4) & 1, q = j & 15;
            u32* w = xf + 48 * (R * c + r) + 4 * ((q & 7) >> 1) + 2 * h + (q >> 3);
#pragma unroll
            for (int g = 0; g < 3; g++) w[16 * g] = p[g];
        }
    }
    __syncthreads();
}

// d = a · b + c, m16n8k16, f16 operands, f32 accumulation.
__device__ __forceinline__ void mma_f16(float* d, const u32* a, u32 b0, u32 b1, const float* c) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// One warp: rows r0 .. r0+31 of an MXFP4 matrix (`cols` columns, device layout; weights W, scales S) times R
// rows of x over blocks [b0, b1), x staged by stage_mx_x<R> in xs (row 1 only if two). Each weight block is
// loaded once for both rows: row r takes B columns 4r .. 4r+2 of the same MMAs, and an MMA computes each
// column alone, so a row's results are the bits it gets alone. Row r's results go to dst[r][0..32) (shared
// memory), row 0's to dst0, row 1's to dst1.
// MX_AHEAD blocks are in flight: each register slot is refilled with the block MX_AHEAD ahead as soon as it has
// been read (on the H200 four beat two and eight: 1.23–1.26 against 1.32 ms a token).
#define MX_AHEAD 4
template <int R>
__device__ void rows32_mx(const u8* W, const u8* S, int cols, int r0, int b0, int b1, const float* xs, bool two,
                          float* dst0, float* dst1) {
    int lane = threadIdx.x & 31, g = lane >> 2;
    int nb = cols / 32;
    const uint4* wp = (const uint4*)(W + (size_t)r0 * (cols / 2)) + lane;
    const u32* sp = (const u32*)(S + (size_t)r0 * nb) + g;
    // The B column this lane loads: part (lane / 4) % 4 of row lane / 16 (columns 3 and 7 are zeros, and row 1's
    // when there is none). The accumulator columns it holds, 2t and 2t + 1 (t = lane % 4), are row t / 2's: that
    // row's scale table.
    bool live = R > 1 ? (lane & 15) < 12 && (lane < 16 || two) : lane < 12;
    const uint4* xp = (const uint4*)(xs + 256 * R) + (R > 1 ? (lane & 15) + 12 * (lane >> 4) : lane);
    const float* tbl = R > 1 ? xs + 256 * ((lane >> 1) & 1) : xs;
    uint4 buf[MX_AHEAD];
    u32 sb[MX_AHEAD];
#pragma unroll
    for (int j = 0; j < MX_AHEAD; j++)
        if (b0 + j < b1) {
            buf[j] = ldg_w(wp + (size_t)(b0 + j) * 32);
            sb[j] = __ldg(sp + (size_t)(b0 + j) * 8);
        }
    const float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float acc[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    for (int c = b0; c < b1; c += MX_AHEAD) {
#pragma unroll
        for (int j = 0; j < MX_AHEAD; j++) {
            uint4 v = buf[j];
            u32 s = sb[j];
            if (c + MX_AHEAD + j < b1) {
                buf[j] = ldg_w(wp + (size_t)(c + MX_AHEAD + j) * 32);
                sb[j] = __ldg(sp + (size_t)(c + MX_AHEAD + j) * 8);
            }
            if (c + j < b1) {
                uint4 xb = live ? xp[12 * R * (c + j)] : make_uint4(0, 0, 0, 0);
                u32 word[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int tau = 0; tau < 2; tau++) {
                    float d[4];
                    u32 a[4];
                    mx_frag(word[2 * tau], a);
                    mma_f16(d, a, xb.x, xb.y, zero);
                    mx_frag(word[2 * tau + 1], a);
                    mma_f16(d, a, xb.z, xb.w, d);
                    float f0 = tbl[(s >> (16 * tau)) & 255], f1 = tbl[(s >> (16 * tau + 8)) & 255];
                    acc[tau][0] = fmaf(d[0], f0, acc[tau][0]);
                    acc[tau][1] = fmaf(d[1], f0, acc[tau][1]);
                    acc[tau][2] = fmaf(d[2], f1, acc[tau][2]);
                    acc[tau][3] = fmaf(d[3], f1, acc[tau][3]);
                }
            }
        }
    }
    // Lane 4g + 2r holds row r's hi and mid of weight rows g and g + 8 of each tile, lane 4g + 2r + 1 their lo.
    float lo[2][2];
#pragma unroll
    for (int tau = 0; tau < 2; tau++) {
        lo[tau][0] = __shfl_down_sync(FULL, acc[tau][0], 1);
        lo[tau][1] = __shfl_down_sync(FULL, acc[tau][2], 1);
    }
    int t = lane & 3;
    if (t == 0 || (R > 1 && t == 2 && two)) {
        float* d = R > 1 && t ? dst1 : dst0;
#pragma unroll
        for (int tau = 0; tau < 2; tau++) {
            d[16 * tau + g] = (acc[tau][0] + acc[tau][1]) + lo[tau][0];
            d[16 * tau + g + 8] = (acc[tau][2] + acc[tau][3]) + lo[tau][1];
        }
    }
}

// Eight BF16 weights (lanes 8q..8q+7 of their block) into the accumulators.
__device__ __forceinline__ void bf16_chunk(float* acc, uint4 v, const float* xc) {
    u32 p[4] = {v.x, v.y, v.z, v.w};
    float4 x0 = ((const float4*)xc)[0], x1 = ((const float4*)xc)[1];
    float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        acc[2 * k] = fmaf(__int_as_float((int)(p[k] << 16)), xv[2 * k], acc[2 * k]);
        acc[2 * k + 1] = fmaf(__int_as_float((int)(p[k] & 0xffff0000u)), xv[2 * k + 1], acc[2 * k + 1]);
    }
}

// Shared memory of one warp: two pieces (double buffering) of 32 rows × eight 16-byte chunks, each row padded to
// nine chunks (conflict-free both for the copies and for a thread reading its own row).
#define PIECE 8
#define PITCH 9
#define WARP_TILE (2 * 32 * PITCH)

// Lane `lane` returns row (lane) · x over `cols` elements (a multiple of 32, maybe 0) of BF16 rows `stride`
// elements long, starting at w + r·row_bytes, r < 32, in the CPU's lane
// order within the range. The warp copies its rows in coalesced 128-byte pieces into shared memory (cp.async,
// double-buffered: the next piece in flight while the current one is computed), from where each thread takes
// its own row's 16-byte chunks (a quarter block). Rows 16-byte aligned; tile: WARP_TILE chunks of this warp's
// shared memory; x in shared memory.
__device__ float rows32_bf16(const u8* w, int cols, int stride, const float* x, uint4* tile) {
    int lane = threadIdx.x & 31;
    int chunks = cols / 8;
    size_t row_bytes = (size_t)stride * 2;
    float acc[32];
#pragma unroll
    for (int j = 0; j < 32; j++) acc[j] = 0.0f;
    // Copies: lane takes chunk (lane % 8) of rows lane / 8 + 4i, i < 8 (four full rows' pieces per instruction).
    int sub = lane & 7, rb = lane >> 3;
    const u8* src[PIECE];
#pragma unroll
    for (int i = 0; i < PIECE; i++) src[i] = w + (size_t)(rb + 4 * i) * row_bytes + 16 * sub;
#pragma unroll
    for (int i = 0; i < PIECE; i++)
        if (sub < chunks) cp_async16(&tile[(rb + 4 * i) * PITCH + sub], src[i]);
    cp_async_commit();
    for (int c0 = 0, k = 0; c0 < chunks; c0 += PIECE, k ^= 1) {
        // The next piece goes to the other buffer (read in the previous round, which every lane has left).
        int c1 = c0 + PIECE;
        uint4* nb = tile + (k ^ 1) * 32 * PITCH;
#pragma unroll
        for (int i = 0; i < PIECE; i++)
            if (c1 + sub < chunks) cp_async16(&nb[(rb + 4 * i) * PITCH + sub], src[i] + 16 * c1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncwarp();
        const uint4* cur = tile + k * 32 * PITCH + lane * PITCH;
#pragma unroll
        for (int j = 0; j < PIECE; j++)
            if (c0 + j < chunks) bf16_chunk(acc + 8 * (j % 4), cur[j], x + 8 * (c0 + j));
        __syncwarp();
    }
    return fold32(acc);
}

// x into the staging area of the experts' kernels (stage_mx_x: R rows, x1 null when there is one; BF16, R = 1: x0
// as it is).
template <bool MX, int R>
__device__ __forceinline__ void stage_expert_x(void* xs, const float* x0, const float* x1, int len) {
    if (MX)
        stage_mx_x<R>((float*)xs, x0, x1, len);
    else
        stage_x((float*)xs, x0, len);
}

// One warp: rows r0 .. r0+31 of an expert matrix over blocks [b0, b1) times the staged x rows (R; the second
// when `two`), into dst0 and dst1 [0..32) (shared memory), x staged by stage_expert_x in xs. MXFP4 (device
// layout): weights at w, scales at s; BF16 (R = 1): tile this warp's shared-memory tile.
template <bool MX, int R>
__device__ __forceinline__ void expert_rows(const u8* w, const u8* s, int cols, int r0, int b0, int b1,
                                            const void* xs, bool two, uint4* tile, float* dst0, float* dst1) {
    if (MX)
        rows32_mx<R>(w, s, cols, r0, b0, b1, (const float*)xs, two, dst0, dst1);
    else
        dst0[threadIdx.x & 31] =
            rows32_bf16(w + ((size_t)r0 * cols + 32 * b0) * 2, 32 * (b1 - b0), cols, (const float*)xs + 32 * b0, tile);
}

// Routed experts of one layer, a group of union entries at a time. For group entry u (blockIdx.y):
// slots[u] = the record in VRAM; its rows are entries row_off[u] .. row_off[u+1] of rows[] (token rows).
// MXFP4: parts = byte offsets of w1p w1s w2p w2s w3p w3s; BF16: of w1 w2 w3. One kernel per encoding, so each
// gets the registers of its own arithmetic. Both kernels have 128 threads, four warps; each warp takes 32 rows
// over half of their blocks (half = blocks [0, nb/2) or [nb/2, nb)), and the halves meet through shared memory
// and add as lo + hi, a fixed order (half-rows give each expert twice the warps; how many rows a block takes
// sets how the grid fills the GPU in waves). R: the x rows taken per pass over the weights (MXFP4 only: the
// `_mx2` kernels, for passes of several rows, read an expert's weights once for each two of its rows). Dynamic
// shared memory: (BF16: 4 warp tiles, then) the staged x.
#define EXPERT_SMEM(MX) (MX ? 0 : 4 * WARP_TILE)

// 64 intermediate rows a block, two groups of 32 in turn over one staging of x (16 K3 experts are then one wave
// of blocks on the H200, not 1.9): warp (half, up), up = warp & 1 the up rows (w3) or the gate rows (w1).
template <bool MX, int R>
__device__ void expert_up(const u64* slots, const int* row_off, const int* rows, const float* z, float* a, int width,
                          int inter, int act, Parts parts) {
    extern __shared__ uint4 dyn[];
    void* xs = dyn + EXPERT_SMEM(MX);
    __shared__ float part[R][2][2][32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, up = warp & 1, half = warp >> 1;
    int u = blockIdx.y;
    int nb = width / 32, b0 = half ? nb / 2 : 0, b1 = half ? nb : nb / 2;
    const u8* rec = (const u8*)slots[u];
    const u8* w = rec + (up ? parts.off[MX ? 4 : 2] : parts.off[0]);
    const u8* sc = rec + (up ? parts.off[5] : parts.off[1]);
    int end = min((int)blockIdx.x * 64 + 64, inter);
    for (int e = row_off[u]; e < row_off[u + 1]; e += R) {
        bool two = R > 1 && e + 1 < row_off[u + 1];
        stage_expert_x<MX, R>(xs, z + (size_t)rows[e] * width, two ? z + (size_t)rows[e + 1] * width : nullptr,
                              width);
        for (int r0 = blockIdx.x * 64; r0 < end; r0 += 32) {
            expert_rows<MX, R>(w, sc, width, r0, b0, b1, xs, two, dyn + warp * WARP_TILE, part[0][up][half],
                               part[R - 1][up][half]);
            __syncthreads();
            // Warp r writes row e + r.
            if (warp < (two ? 2 : 1)) {
                float(*p)[2][32] = part[warp];
                a[(size_t)(e + warp) * inter + r0 + lane] =
                    actf(act, p[0][0][lane] + p[0][1][lane], p[1][0][lane] + p[1][1][lane]);
            }
            __syncthreads();  // part is read before the next group writes it
        }
    }
}

// 64 output rows a block: warp (pair, half), pair = warp >> 1 the rows r0 + 32 · pair.
template <bool MX, int R>
__device__ void expert_down(const u64* slots, const int* row_off, const float* a, float* y, int width, int inter,
                            Parts parts) {
    extern __shared__ uint4 dyn[];
    void* xs = dyn + EXPERT_SMEM(MX);
    __shared__ float part[R][2][2][32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, pair = warp >> 1, half = warp & 1;
    int r0 = blockIdx.x * 64 + 32 * pair;
    bool live = r0 < width;
    int u = blockIdx.y;
    int nb = inter / 32, b0 = half ? nb / 2 : 0, b1 = half ? nb : nb / 2;
    const u8* rec = (const u8*)slots[u];
    for (int e = row_off[u]; e < row_off[u + 1]; e += R) {
        bool two = R > 1 && e + 1 < row_off[u + 1];
        stage_expert_x<MX, R>(xs, a + (size_t)e * inter, two ? a + (size_t)(e + 1) * inter : nullptr, inter);
        if (live)
            expert_rows<MX, R>(rec + parts.off[MX ? 2 : 1], rec + parts.off[3], inter, r0, b0, b1, xs, two,
                               dyn + warp * WARP_TILE, part[0][pair][half], part[R - 1][pair][half]);
        __syncthreads();
        if (live && half == 0) {
            y[(size_t)e * width + r0 + lane] = part[0][pair][0][lane] + part[0][pair][1][lane];
            if (two) y[(size_t)(e + 1) * width + r0 + lane] = part[R - 1][pair][0][lane] + part[R - 1][pair][1][lane];
        }
    }
}

#define EXPERT_UP_ARGS                                                                                         \
    const u64 *slots, const int *row_off, const int *rows, const float *z, float *a, int width, int inter, int act, \
        Parts parts
#define EXPERT_DOWN_ARGS \
    const u64 *slots, const int *row_off, const float *a, float *y, int width, int inter, Parts parts
extern "C" __global__ void expert_up_mx(EXPERT_UP_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_up<true, 1>(slots, row_off, rows, z, a, width, inter, act, parts);
}
extern "C" __global__ void expert_up_mx2(EXPERT_UP_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_up<true, 2>(slots, row_off, rows, z, a, width, inter, act, parts);
}
extern "C" __global__ void expert_up_bf16(EXPERT_UP_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_up<false, 1>(slots, row_off, rows, z, a, width, inter, act, parts);
}
extern "C" __global__ void expert_down_mx(EXPERT_DOWN_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_down<true, 1>(slots, row_off, a, y, width, inter, parts);
}
extern "C" __global__ void expert_down_mx2(EXPERT_DOWN_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_down<true, 2>(slots, row_off, a, y, width, inter, parts);
}
extern "C" __global__ void expert_down_bf16(EXPERT_DOWN_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_down<false, 1>(slots, row_off, a, y, width, inter, parts);
}

// acc[t] = Σ_k w[t][k] · y[entry[t][k]], k over the row's experts in ascending id order (the canonical order).
extern "C" __global__ void moe_combine(const float* y, const int* entry, const float* wts, float* acc, int n, int topk,
                                       int width) {
    pdl_launch_next();
    pdl_wait();
    int t = blockIdx.x;
    int d = blockIdx.y * blockDim.x + threadIdx.x;
    if (d < width) {
        float s = 0.0f;
#pragma unroll 8
        for (int k = 0; k < topk; k++) s += wts[t * topk + k] * y[(size_t)entry[t * topk + k] * width + d];
        acc[(size_t)t * width + d] = s;
    }
}

// The groups of a pass of several resident rows, numbered as routed_via_host numbers them when every expert is
// resident: each chosen expert once, in ascending id (slots[u] its record, from the layer's table), its rows
// ascending (rows[row_off[u] .. row_off[u+1])), and entry[t·topk + k] the row of the experts' output that holds
// row t's k-th expert. The groups past the last, up to `groups` (as many as there can be), are empty (their
// row_off is the total), so that the expert kernels launched for that many skip them; the count of the others
// goes to *count. One block; dynamic shared memory: e words.
extern "C" __global__ void moe_group(const int* ids, int n, int topk, int e, int groups, const u64* table,
                                     u64* slots, int* row_off, int* rows, int* entry, int* count) {
    pdl_launch_next();
    pdl_wait();
    extern __shared__ int next[];  // each expert's row count, then the next free entry of its group
    int pairs = n * topk;
    for (int x = threadIdx.x; x < e; x += blockDim.x) next[x] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) atomicAdd(&next[ids[i]], 1);  // a count: any order
    __syncthreads();
    if (threadIdx.x == 0) {
        int u = 0, off = 0;
        for (int x = 0; x < e; x++) {
            int c = next[x];
            if (c == 0) continue;
            slots[u] = table[x];
            row_off[u++] = off;
            next[x] = off;
            off += c;
        }
        *count = u;
        for (int v = u; v <= groups; v++) {
            if (v < groups) slots[v] = 0;
            row_off[v] = off;
        }
    }
    __syncthreads();
    // Rows in order, a row's experts in parallel (a row chooses an expert at most once).
    for (int t = 0; t < n; t++) {
        for (int k = threadIdx.x; k < topk; k += blockDim.x) {
            int p = next[ids[t * topk + k]]++;
            rows[p] = t;
            entry[t * topk + k] = p;
        }
        __syncthreads();
    }
}

// Rust's f32::total_cmp as a signed integer key: negative values' magnitude bits flipped.
__device__ __forceinline__ int total_key(float f) {
    int b = __float_as_int(f);
    return b ^ (int)(((u32)(b >> 31)) >> 1);
}

// Expert selection of one row per block, as deltafin_models::moe::Router::route: s = sigmoid(logit); the top_k
// largest s + bias in f32::total_cmp order, equal keys to the lower id (with groups > 1, among the experts of
// the topk_group best groups only: `keep_groups`); ids ascending; weight = s / (Σ s + 1e-20)
// · scale (the sum left to right in ascending id order) or s / 1 · scale. Ranks by counting: no sort, no atomics.
// table: the layer's record pointers by expert id when every expert is resident (then slots[k] = its record), or
// null. Dynamic shared memory: 3 · e + topk words.
extern "C" __global__ void moe_route(const float* logits, const float* bias, int e, int topk, int renorm, float scale,
                                     int* ids, float* wts, const u64* table, u64* slots, int groups, int topk_group) {
    pdl_launch_next();
    pdl_wait();
    extern __shared__ int rs[];
    int* key = rs;
    float* score = (float*)(rs + e);
    int* pos = rs + 2 * e;
    int* sel = rs + 3 * e;
    __shared__ float denom;
    int t = blockIdx.x;
    const float* l = logits + (size_t)t * e;
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        float s = sigmoidf_(l[i]);
        score[i] = s;
        key[i] = total_key(s + bias[i]);
    }
    __syncthreads();
    if (groups > 1) keep_groups(key, score, bias, e, groups, topk_group, pos);
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        int ki = key[i], rank = 0;
        for (int j = 0; j < e; j++) rank += key[j] > ki || (key[j] == ki && j < i);
        pos[i] = rank < topk;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        if (pos[i]) {
            int p = 0;
            for (int j = 0; j < i; j++) p += pos[j];
            sel[p] = i;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int k = 0; k < topk; k++) sum += score[sel[k]];
        denom = renorm ? sum + 1e-20f : 1.0f;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < topk; k += blockDim.x) {
        int id = sel[k];
        ids[(size_t)t * topk + k] = id;
        wts[(size_t)t * topk + k] = score[id] / denom * scale;
        if (table) slots[(size_t)t * topk + k] = table[id];
    }
}

// A graphed decode step's end (one block of 1024 threads): the step's logits and its greedy choice (the host's
// argmax: the lowest id on ties, never a NaN, and a NaN first logit keeps id 0) into out[parity of the
// position][vocab + 1], the choice's bits last, whence the copy stream brings them back; and the next step's
// header (that choice, the position + 1), so a step run ahead on the device's choice needs nothing from the host.
extern "C" __global__ void decode_pick(const float* logits, int vocab, u32* hdr, float* out) {
    pdl_launch_next();
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    pdl_wait();
    u32 p0 = hdr[1];
    float* o = out + (size_t)(p0 & 1) * (vocab + 1);
    int t = threadIdx.x;
    float bv = 0.0f;
    int bi = -1;
    for (int i = t; i < vocab; i += blockDim.x) {
        float v = logits[i];
        o[i] = v;
        if (v == v && (bi < 0 || v > bv)) bv = v, bi = i;
    }
    // (value, id) pairs: the larger value wins, the lower id on equal values; -1 is no value.
    for (int h = 16; h >= 1; h >>= 1) {
        float v = __shfl_down_sync(FULL, bv, h);
        int i = __shfl_down_sync(FULL, bi, h);
        if (i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi))) bv = v, bi = i;
    }
    if (t % 32 == 0) best_v[t / 32] = bv, best_i[t / 32] = bi;
    __syncthreads();
    if (t < 32) {
        int warps = blockDim.x / 32;
        bv = t < warps ? best_v[t] : 0.0f;
        bi = t < warps ? best_i[t] : -1;
        for (int h = 16; h >= 1; h >>= 1) {
            float v = __shfl_down_sync(FULL, bv, h);
            int i = __shfl_down_sync(FULL, bi, h);
            if (i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi))) bv = v, bi = i;
        }
        if (t == 0) {
            u32 id = (bi < 0 || logits[0] != logits[0]) ? 0u : (u32)bi;
            o[vocab] = __int_as_float((int)id);
            hdr[0] = id;
            hdr[1] = p0 + 1;
        }
    }
}

// ==== DeepSeek-V3 / Kimi K2 ==================================================================================
// FP8 e4m3 spine matrices (`matmul_fp8`; the MLA's kv_b through `kv_weight`), RoPE on MLA's rope part
// (`rope_rotate`), the grouped router (`keep_groups`), and routed experts stored as FP8 128×128-block or INT4
// group-32 records (`expert_up_fp8` … `expert_down_int4`). Each weight is decoded to f32 where it is read, as the
// CPU decodes it (crates/kernels: the e4m3 or nibble value times its scale, one rounding), and every dot runs in
// the CPU's fixed order.

// A float8_e4m3fn byte's value, exact: normals by their bits, subnormals (exponent field 0) as m · 2^-9 (no f32
// subnormal arithmetic), magnitude 0x7f NaN.
__device__ float e4m3f(u32 b) {
    u32 mag = b & 0x7f, e = mag >> 3, m = mag & 7;
    float v = mag == 0x7f ? __int_as_float(0x7fc00000)
              : e       ? __int_as_float((int)(((e + 120) << 23) | (m << 20)))
                        : (float)m * 0.001953125f;
    return (b & 0x80) ? -v : v;
}

// Weight (r, c) of a `cols`-column spine matrix: BF16 where sc is null, else e4m3 bytes times their 128-column
// block's scale, sc holding ceil(cols / 128) scales a row (the loader widens the 128-row blocks to rows).
__device__ float kv_weight(const u16* w, const float* sc, size_t r, int c, int cols) {
    if (!sc) return bf16f(w[r * cols + c]);
    return e4m3f(((const u8*)w)[r * cols + c]) * sc[r * ((cols + 127) >> 7) + (c >> 7)];
}

// Rotates x's `rope` elements in place for position pos as deltafin_models::rope::Rotary (interleaved pairs
// (2i, 2i+1)): the angle pos · inv_freq[i] in f32, its cosine and sine in f64 times YaRN's attention factor,
// rounded once; x0·c − x1·s and x1·c + x0·s, each product rounded.
__device__ void rope_rotate(float* x, int rope, u32 pos, const float* inv_freq, float attn) {
    for (int i = 0; i < rope / 2; i++) {
        double angle = (double)((float)pos * inv_freq[i]);
        float c = (float)(cos(angle) * (double)attn), s = (float)(sin(angle) * (double)attn);
        float x0 = x[2 * i], x1 = x[2 * i + 1];
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x1 * c + x0 * s;
    }
}

// noaux_tc's group stage, as deltafin_models::moe::Router::route: experts in `groups` groups of consecutive ids,
// a group scoring the sum of its two largest s + bias; the experts outside the topk_group best groups (equal
// scores: the lower group) leave the race (their key becomes the least). gkey: groups words of scratch. The whole
// block calls it; barriers on both sides.
__device__ void keep_groups(int* key, const float* score, const float* bias, int e, int groups, int topk_group,
                            int* gkey) {
    int size = e / groups;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        float v1 = 0.0f, v2 = 0.0f;
        for (int i = g * size, k = 0; i < (g + 1) * size; i++, k++) {
            float v = score[i] + bias[i];
            if (k == 0 || total_key(v) > total_key(v1)) {
                v2 = v1;
                v1 = v;
            } else if (k == 1 || total_key(v) > total_key(v2)) {
                v2 = v;
            }
        }
        gkey[g] = total_key(size > 1 ? v1 + v2 : v1);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        int g = i / size, rank = topk_group;
        if (g < groups) {
            rank = 0;
            for (int h = 0; h < groups; h++) rank += gkey[h] > gkey[g] || (gkey[h] == gkey[g] && h < g);
        }
        if (rank >= topk_group) key[i] = (int)0x80000000u;
    }
    __syncthreads();
}

// matmul_bf16 for FP8 e4m3 weights W with their per-row block scales sc (see matmul_rows).
extern "C" __global__ void matmul_fp8(const u8* W, const float* sc, const float* x, float* y, int rows, int cols, int n,
                                      int tile, const float* norm_w, float eps, const float* add, int accumulate,
                                      Parts split) {
    pdl_launch_next();
    int warps = blockDim.x >> 5;
    prefetch_l2(W + (size_t)blockIdx.x * warps * cols, (size_t)min(warps, rows - (int)blockIdx.x * warps) * cols);
    if (n == 1)
        matmul_rows<1, 1>(W, sc, x, y, rows, cols, n, 1, norm_w, eps, add, accumulate, split);
    else
        matmul_rows<MM_TILE, 1>(W, sc, x, y, rows, cols, n, tile, norm_w, eps, add, accumulate, split);
}

// out[i] = act(g[i], u[i]) for len values: an FP8 gated MLP's activation between its matmuls.
extern "C" __global__ void act_rows(const float* g, const float* u, float* out, int len, int act) {
    pdl_launch_next();
    pdl_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) out[i] = actf(act, g[i], u[i]);
}

// Weight (r, c) of an expert matrix of `cols` columns in its record. ENC 0: FP8, e4m3 bytes w and the F32
// scale_inv s [ceil(rows/128)][ceil(cols/128)]; ENC 1: INT4, nibble c of row r (low first) holding q + 8, and the
// BF16 scales s [rows][cols/32]: (q) · scale.
template <int ENC>
__device__ __forceinline__ float quant_weight(const u8* w, const u8* s, size_t r, int c, int cols) {
    if (ENC == 0)
        return e4m3f(w[r * cols + c]) * ((const float*)s)[(r >> 7) * ((cols + 127) >> 7) + (c >> 7)];
    u32 nib = (w[(r * cols + c) >> 1] >> (4 * (c & 1))) & 15u;
    return ((float)nib - 8.0f) * bf16f(((const u16*)s)[r * (cols >> 5) + (c >> 5)]);
}

// Row r of an expert matrix times x (shared memory), one warp in the CPU's order (lanes, tree, then the tail);
// valid in lane 0.
template <int ENC>
__device__ float quant_dot(const u8* w, const u8* s, size_t r, const float* x, int cols, int lane) {
    int body = cols / 32 * 32;
    float acc = 0.0f;
    for (int c = lane; c < body; c += 32) acc = fmaf(quant_weight<ENC>(w, s, r, c, cols), x[c], acc);
    acc = fold_lanes(acc);
    if (lane == 0)
        for (int c = body; c < cols; c++) acc = fmaf(quant_weight<ENC>(w, s, r, c, cols), x[c], acc);
    return acc;
}

// One row of x (len floats) into shared memory, barriers on both sides.
__device__ __forceinline__ void stage_row(float* xs, const float* x, int len) {
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
}

// The routed experts of FP8 or INT4 records, with the tables of expert_up_bf16 / expert_down_bf16 (parts: byte
// offsets of w1 weights, w1 scales, w2 weights, w2 scales, w3 weights, w3 scales). A block takes 64 rows of the
// output, a warp every fourth of them; dynamic shared memory: the entry's x row.
template <int ENC>
__device__ void expert_up_quant(EXPERT_UP_ARGS) {
    extern __shared__ float xq[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5, u = blockIdx.y;
    const u8* rec = (const u8*)slots[u];
    int end = min((int)blockIdx.x * 64 + 64, inter);
    for (int e = row_off[u]; e < row_off[u + 1]; e++) {
        stage_row(xq, z + (size_t)rows[e] * width, width);
        for (int r = blockIdx.x * 64 + warp; r < end; r += warps) {
            float g = quant_dot<ENC>(rec + parts.off[0], rec + parts.off[1], r, xq, width, lane);
            float v = quant_dot<ENC>(rec + parts.off[4], rec + parts.off[5], r, xq, width, lane);
            if (lane == 0) a[(size_t)e * inter + r] = actf(act, g, v);
        }
    }
}

template <int ENC>
__device__ void expert_down_quant(EXPERT_DOWN_ARGS) {
    extern __shared__ float xq[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5, u = blockIdx.y;
    const u8* rec = (const u8*)slots[u];
    int end = min((int)blockIdx.x * 64 + 64, width);
    for (int e = row_off[u]; e < row_off[u + 1]; e++) {
        stage_row(xq, a + (size_t)e * inter, inter);
        for (int r = blockIdx.x * 64 + warp; r < end; r += warps) {
            float v = quant_dot<ENC>(rec + parts.off[2], rec + parts.off[3], r, xq, inter, lane);
            if (lane == 0) y[(size_t)e * width + r] = v;
        }
    }
}

extern "C" __global__ void expert_up_fp8(EXPERT_UP_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_up_quant<0>(slots, row_off, rows, z, a, width, inter, act, parts);
}
extern "C" __global__ void expert_up_int4(EXPERT_UP_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_up_quant<1>(slots, row_off, rows, z, a, width, inter, act, parts);
}
extern "C" __global__ void expert_down_fp8(EXPERT_DOWN_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_down_quant<0>(slots, row_off, a, y, width, inter, parts);
}
extern "C" __global__ void expert_down_int4(EXPERT_DOWN_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_down_quant<1>(slots, row_off, a, y, width, inter, parts);
}

// ==== gpt-oss (crates/cuda/src/model/gqa.rs, the biased MXFP4 experts, the softmax-over-top-k router) ====

// Each row's q, k and v plus their biases, q and k rotated (rotate-half: element i pairs with i + dim/2) for the
// row's position *pos + t as deltafin_models::rope::Rotary does it: the angle in f32, its cosine and sine in
// f64 times YaRN's factor `attn`, rounded once; k and v then appended to the caches ([position][kv_heads · dim])
// at that position. q is rotated in place. One block a row.
extern "C" __global__ void gqa_append(float* q, const float* k, const float* v, const float* bq, const float* bk,
                                      const float* bv, const float* inv_freq, double attn, float* kc, float* vc,
                                      const u32* pos, int n, int heads, int kv_heads, int dim) {
    pdl_launch_next();
    pdl_wait();
    int t = blockIdx.x, half = dim / 2, kw = kv_heads * dim;
    u32 p = *pos + t;
    float* qr = q + (size_t)t * heads * dim;
    const float* kr = k + (size_t)t * kw;
    float* kd = kc + (size_t)p * kw;
    for (int i = threadIdx.x; i < (heads + kv_heads) * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        bool is_q = h < heads;
        int o = (is_q ? h : h - heads) * dim;
        const float* src = is_q ? qr + o : kr + o;
        const float* b = is_q ? bq + o : bk + o;
        float* dst = is_q ? qr + o : kd + o;
        float angle = (float)p * inv_freq[j];
        float c = (float)(cos((double)angle) * attn), s = (float)(sin((double)angle) * attn);
        float x0 = src[j] + b[j], x1 = src[j + half] + b[j + half];
        dst[j] = x0 * c - x1 * s;
        dst[j + half] = x1 * c + x0 * s;
    }
    const float* vr = v + (size_t)t * kw;
    for (int i = threadIdx.x; i < kw; i += blockDim.x) vc[(size_t)p * kw + i] = vr[i] + bv[i];
}

// Grouped-query attention with a learned sink for one (row t, query head h), as deltafin_models::gqa computes
// it: scores q·k_s · scale (thread_dot: the CPU's dot order) over s from `first` to *pos + t, first = 0 or, with
// a window, the last `window` positions (the current one included); the softmax over the scores and the head's
// sink logit, whose probability is dropped (max from the sink, the sum left to right, then the sink's term);
// out = Σ p_s v_s in position order. Scratch p: [n·heads][ctx_cap]. GQA_THREADS threads, dim ≤ GQA_THREADS (the
// host checks): thread d accumulates element d.
#define GQA_THREADS 128
extern "C" __global__ void __launch_bounds__(GQA_THREADS)
    gqa_attend(const float* q, const float* kc, const float* vc, const float* sinks, float* p_all, int ctx_cap,
               float* out, int n, int heads, int kv_heads, int dim, int window, const u32* pos, float scale) {
    pdl_launch_next();
    pdl_wait();
    __shared__ float eb[GQA_THREADS];  // a chunk's probabilities
    __shared__ float red[GQA_THREADS / 32];
    __shared__ float bc;
    int t = blockIdx.x / heads, h = blockIdx.x % heads;
    int g = h / (heads / kv_heads), kw = kv_heads * dim;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    int upto = (int)*pos + t + 1;
    int first = window > 0 ? max(0, upto - window) : 0, len = upto - first;
    const float* qh = q + ((size_t)t * heads + h) * dim;
    const float* kh = kc + (size_t)first * kw + (size_t)g * dim;
    const float* vh = vc + (size_t)first * kw + (size_t)g * dim;
    float* p = p_all + (size_t)blockIdx.x * ctx_cap;
    float sink = sinks[h];
    // The maximum of the sink and the scores (fmaxf in any order: the serial maximum, see mla_attend).
    float mx = sink;
    for (int s = threadIdx.x; s < len; s += blockDim.x) {
        float sc = thread_dot(qh, kh + (size_t)s * kw, dim) * scale;
        p[s] = sc;
        mx = fmaxf(mx, sc);
    }
    for (int o = 16; o >= 1; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < warps; i++) mx = fmaxf(mx, red[i]);
        bc = mx;
    }
    __syncthreads();
    mx = bc;
    // exp(p_s − max), summed left to right by thread 0 a chunk at a time (thread i reads back only what it wrote).
    float sum = 0.0f;
    for (int s0 = 0; s0 < len; s0 += blockDim.x) {
        int s = s0 + threadIdx.x;
        if (s < len) {
            float e = expf(p[s] - mx);
            p[s] = e;
            eb[threadIdx.x] = e;
        }
        __syncthreads();
        if (threadIdx.x == 0)
            for (int i = 0; i < min((int)blockDim.x, len - s0); i++) sum += eb[i];
        __syncthreads();
    }
    if (threadIdx.x == 0) bc = 1.0f / (sum + expf(sink - mx));
    __syncthreads();
    float inv = bc, acc = 0.0f;
    int d = threadIdx.x;
    for (int s0 = 0; s0 < len; s0 += blockDim.x) {
        int s = s0 + threadIdx.x, m = min((int)blockDim.x, len - s0);
        if (s < len) eb[threadIdx.x] = p[s] * inv;
        __syncthreads();
        if (d < dim)
            for (int i = 0; i < m; i++) acc += eb[i] * vh[(size_t)(s0 + i) * kw + d];
        __syncthreads();
    }
    if (d < dim) out[((size_t)t * heads + h) * dim + d] = acc;
}

// out[t][i] = b[i] for n rows of len: a bias as a matmul's `add` rows. One block a row.
extern "C" __global__ void bias_rows(const float* b, float* out, int n, int len) {
    pdl_launch_next();
    pdl_wait();
    for (int i = threadIdx.x; i < len; i += blockDim.x) out[(size_t)blockIdx.x * len + i] = b[i];
}

// y[i] += x[i] (the routed experts' sum into the residual stream where no matmul follows them).
extern "C" __global__ void add_rows(float* y, const float* x, int len) {
    pdl_launch_next();
    pdl_wait();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) y[i] += x[i];
}

// The top k of e keys (total_key order; equal keys: the lower id) in ascending id: pick[i] whether i is one,
// sel[0..topk) the ids. Ranks by counting, no sort; the whole block calls it (it ends with a barrier).
__device__ void select_top(const int* key, int e, int topk, int* pick, int* sel) {
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        int ki = key[i], rank = 0;
        for (int j = 0; j < e; j++) rank += key[j] > ki || (key[j] == ki && j < i);
        pick[i] = rank < topk;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        if (pick[i]) {
            int p = 0;
            for (int j = 0; j < i; j++) p += pick[j];
            sel[p] = i;
        }
    }
    __syncthreads();
}

// gpt-oss's router for one row per block, as deltafin_models::moe::Router::softmax_top_k: l = logit + bias (the
// linear's); the top_k l; ids ascending; weights the softmax of their l in that order (max-subtracted, summed
// left to right). table/slots as in moe_route. Dynamic shared memory: 3 · e + 2 · topk words.
extern "C" __global__ void moe_route_softmax(const float* logits, const float* bias, int e, int topk, int* ids,
                                             float* wts, const u64* table, u64* slots) {
    pdl_launch_next();
    pdl_wait();
    extern __shared__ int rs[];
    int* key = rs;
    float* val = (float*)(rs + e);
    int* pick = rs + 2 * e;
    int* sel = rs + 3 * e;
    float* w = (float*)(sel + topk);
    int t = blockIdx.x;
    const float* l = logits + (size_t)t * e;
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        float v = l[i] + bias[i];
        val[i] = v;
        key[i] = total_key(v);
    }
    __syncthreads();
    select_top(key, e, topk, pick, sel);
    if (threadIdx.x == 0) {
        float mx = __int_as_float(0xff800000), sum = 0.0f;
        for (int k = 0; k < topk; k++) mx = fmaxf(mx, val[sel[k]]);
        for (int k = 0; k < topk; k++) {
            w[k] = expf(val[sel[k]] - mx);
            sum += w[k];
        }
        float inv = 1.0f / sum;
        for (int k = 0; k < topk; k++) w[k] *= inv;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < topk; k += blockDim.x) {
        int id = sel[k];
        ids[(size_t)t * topk + k] = id;
        wts[(size_t)t * topk + k] = w[k];
        if (table) slots[(size_t)t * topk + k] = table[id];
    }
}

// gpt-oss's activation: g = min(gate, limit), u = clamp(up, ±limit), (u + 1) · g · σ(1.702 g) (ops::Act).
__device__ __forceinline__ float clamped_swiglu(float g, float u, float limit) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return (u + 1.0f) * (g * sigmoidf_(1.702f * g));
}

// gpt-oss's routed experts (MXFP4 with BF16 biases), on the tensor cores as rows32_mx computes K3's; parts: byte
// offsets of gate_up's blocks, scales and bias, then down's. gate_up's 2·inter rows alternate gate (2j) and up
// (2j + 1); mx_repack keeps each 32-row group's rows where they are, so a group yields 16 (gate, up) pairs. Four
// warps a block: expert_up_biased's warp (half, sub) takes gate_up rows 64·x + 32·sub over half of the blocks,
// and the block writes intermediate rows 32·x .. 32·x + 31 (the halves added lo + hi, then the bias, as the CPU
// adds it after its matmul); expert_down_biased is expert_down with down's bias added to each output.
template <int R>
__device__ void expert_up_biased(const u64* slots, const int* row_off, const int* rows, const float* z, float* a,
                                 int width, int inter, float limit, Parts parts) {
    extern __shared__ uint4 dyn[];
    __shared__ float part[R][2][2][32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, sub = warp & 1, half = warp >> 1;
    int u = blockIdx.y;
    int nb = width / 32, b0 = half ? nb / 2 : 0, b1 = half ? nb : nb / 2;
    const u8* rec = (const u8*)slots[u];
    const u16* bias = (const u16*)(rec + parts.off[2]);
    int r0 = blockIdx.x * 64 + 32 * sub, j = blockIdx.x * 32 + lane;
    for (int e = row_off[u]; e < row_off[u + 1]; e += R) {
        bool two = R > 1 && e + 1 < row_off[u + 1];
        stage_mx_x<R>((float*)dyn, z + (size_t)rows[e] * width, two ? z + (size_t)rows[e + 1] * width : nullptr,
                      width);
        rows32_mx<R>(rec + parts.off[0], rec + parts.off[1], width, r0, b0, b1, (const float*)dyn, two,
                     part[0][sub][half], part[R - 1][sub][half]);
        __syncthreads();
        // Warp r writes row e + r: lane l's pair is row 2·(l % 16) of group l / 16.
        if (warp < (two ? 2 : 1)) {
            float(*p)[2][32] = part[warp];
            int s = lane >> 4, m = 2 * (lane & 15);
            float g = (p[s][0][m] + p[s][1][m]) + bf16f(bias[2 * j]);
            float up = (p[s][0][m + 1] + p[s][1][m + 1]) + bf16f(bias[2 * j + 1]);
            a[(size_t)(e + warp) * inter + j] = clamped_swiglu(g, up, limit);
        }
        __syncthreads();  // part is read before the next row writes it
    }
}

template <int R>
__device__ void expert_down_biased(const u64* slots, const int* row_off, const float* a, float* y, int width,
                                   int inter, Parts parts) {
    extern __shared__ uint4 dyn[];
    __shared__ float part[R][2][2][32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, pair = warp >> 1, half = warp & 1;
    int r0 = blockIdx.x * 64 + 32 * pair;
    bool live = r0 < width;
    int u = blockIdx.y;
    int nb = inter / 32, b0 = half ? nb / 2 : 0, b1 = half ? nb : nb / 2;
    const u8* rec = (const u8*)slots[u];
    const u16* bias = (const u16*)(rec + parts.off[5]);
    for (int e = row_off[u]; e < row_off[u + 1]; e += R) {
        bool two = R > 1 && e + 1 < row_off[u + 1];
        stage_mx_x<R>((float*)dyn, a + (size_t)e * inter, two ? a + (size_t)(e + 1) * inter : nullptr, inter);
        if (live)
            rows32_mx<R>(rec + parts.off[3], rec + parts.off[4], inter, r0, b0, b1, (const float*)dyn, two,
                         part[0][pair][half], part[R - 1][pair][half]);
        __syncthreads();
        if (live && half == 0) {
            float b = bf16f(bias[r0 + lane]);
            y[(size_t)e * width + r0 + lane] = (part[0][pair][0][lane] + part[0][pair][1][lane]) + b;
            if (two)
                y[(size_t)(e + 1) * width + r0 + lane] = (part[R - 1][pair][0][lane] + part[R - 1][pair][1][lane]) + b;
        }
    }
}

#define EXPERT_UP_BIASED_ARGS                                                                                 \
    const u64 *slots, const int *row_off, const int *rows, const float *z, float *a, int width, int inter, \
        float limit, Parts parts
extern "C" __global__ void expert_up_mxb(EXPERT_UP_BIASED_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_up_biased<1>(slots, row_off, rows, z, a, width, inter, limit, parts);
}
extern "C" __global__ void expert_up_mxb2(EXPERT_UP_BIASED_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_up_biased<2>(slots, row_off, rows, z, a, width, inter, limit, parts);
}
extern "C" __global__ void expert_down_mxb(EXPERT_DOWN_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_down_biased<1>(slots, row_off, a, y, width, inter, parts);
}
extern "C" __global__ void expert_down_mxb2(EXPERT_DOWN_ARGS) {
    pdl_launch_next();
    pdl_wait();
    expert_down_biased<2>(slots, row_off, a, y, width, inter, parts);
}
