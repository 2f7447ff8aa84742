// deltafin CUDA kernels, compiled by NVRTC at run time for the GPU in hand (with --fmad=false, so a
// multiply followed by an add rounds twice, as in the CPU code; fmaf() is written where the CPU fuses).
//
// Every dot product follows the CPU kernels' fixed order (crates/kernels): element i of the 32-multiple
// prefix goes to lane i % 32 in increasing i with one fma, then the lanes fold by the tree
// acc[k] += acc[k + h], h = 16, 8, 4, 2, 1 — which is exactly a warp's shuffle-down reduction; the tail
// follows in order. One warp computes one (row, output) value, whatever the batch, so results do not
// depend on which other rows share a pass.

typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;
#define FULL 0xffffffffu

__device__ __forceinline__ float bf16f(u32 bits) { return __int_as_float((int)(bits << 16)); }

// E2M1 by its bits (a table in constant memory would serialise a warp's 16 distinct lookups):
// magnitude 1 is 0.5, magnitudes 2..7 are 2^(m/2 − 1)·(1 + (m&1)/2); bit 3 is the sign.
__device__ __forceinline__ float e2m1f(u32 nib) {
    u32 m = nib & 7;
    u32 bits = m < 2 ? (m ? 0x3f000000u : 0u) : ((((m >> 1) + 126u) << 23) | ((m & 1u) << 22));
    return __int_as_float((int)(bits | ((nib & 8u) << 28)));
}

__device__ __forceinline__ float e8m0f(u32 s) {
    if (s == 0) return __int_as_float(0x00400000);
    if (s == 255) return __int_as_float(0x7fc00000);
    return __int_as_float((int)(s << 23));
}

// The lane tree; lane 0 ends with the sum.
__device__ __forceinline__ float fold_lanes(float acc) {
    for (int h = 16; h >= 1; h >>= 1) acc += __shfl_down_sync(FULL, acc, h);
    return acc;
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

// Any-length dot of two f32 vectors in the fixed order; result valid in lane 0.
__device__ float warp_dot(const float* a, const float* b, int len, int lane) {
    int body = len / 32 * 32;
    float acc = 0.0f;
    for (int i = lane; i < body; i += 32) acc = fmaf(a[i], b[i], acc);
    acc = fold_lanes(acc);
    if (lane == 0)
        for (int i = body; i < len; i++) acc = fmaf(a[i], b[i], acc);
    return acc;
}

// Dot of BF16 row w (cols % 32 == 0, 4-byte aligned) with R rows of x (stride xs); acc[t] per x row.
// Each lane loads two weights (u32) of a 64-element chunk; shuffles hand element c + lane to lane `lane`.
template <int R>
__device__ __forceinline__ void dot_bf16_rows(const u16* w, const float* x, int xs, int cols, int nrows,
                                              int lane, float* acc) {
    const u32* w2 = (const u32*)w;
#pragma unroll
    for (int t = 0; t < R; t++) acc[t] = 0.0f;
#pragma unroll 2
    for (int c = 0; c < cols; c += 64) {
        u32 a = (c + 2 * lane < cols) ? __ldg(w2 + (c >> 1) + lane) : 0u;
        u32 va = __shfl_sync(FULL, a, lane >> 1);
        u32 vb = __shfl_sync(FULL, a, 16 + (lane >> 1));
        float w0 = bf16f((lane & 1) ? (va >> 16) : (va & 0xffff));
        float w1 = bf16f((lane & 1) ? (vb >> 16) : (vb & 0xffff));
        bool second = c + 32 < cols;
#pragma unroll
        for (int t = 0; t < R; t++) {
            if (t < nrows) {
                const float* xr = x + (size_t)t * xs + c;
                acc[t] = fmaf(w0, xr[lane], acc[t]);
                if (second) acc[t] = fmaf(w1, xr[32 + lane], acc[t]);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < R; t++) acc[t] = fold_lanes(acc[t]);
}

// MXFP4 row: packed cols/2 bytes, scales cols/32. Lane `lane` takes element 32b + lane of block b.
template <int R>
__device__ __forceinline__ void dot_mxfp4_rows(const u8* packed, const u8* scales, const float* x, int xs,
                                               int cols, int nrows, int lane, float* acc) {
#pragma unroll
    for (int t = 0; t < R; t++) acc[t] = 0.0f;
    int blocks = cols / 32;
    int b = 0;
    if ((((size_t)packed) & 3) == 0) {
        // Eight blocks (128 bytes) per step: lane loads bytes 4*lane..4*lane+3; element lane of block j is
        // byte lane/2 of that block, i.e. in lane 4j + lane/8, byte (lane/2) % 4.
        for (; b + 8 <= blocks; b += 8) {
            u32 a = __ldg((const u32*)(packed + (size_t)b * 16) + lane);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                u32 v = __shfl_sync(FULL, a, 4 * j + (lane >> 3));
                u32 byte = (v >> (8 * ((lane >> 1) & 3))) & 0xff;
                u32 nib = (lane & 1) ? (byte >> 4) : (byte & 15);
                float wv = e2m1f(nib) * e8m0f(__ldg(scales + b + j));
#pragma unroll
                for (int t = 0; t < R; t++)
                    if (t < nrows) acc[t] = fmaf(wv, x[(size_t)t * xs + (b + j) * 32 + lane], acc[t]);
            }
        }
    }
    for (; b < blocks; b++) {
        u32 byte = __ldg(packed + (size_t)b * 16 + (lane >> 1));
        u32 nib = (lane & 1) ? (byte >> 4) : (byte & 15);
        float wv = e2m1f(nib) * e8m0f(__ldg(scales + b));
#pragma unroll
        for (int t = 0; t < R; t++)
            if (t < nrows) acc[t] = fmaf(wv, x[(size_t)t * xs + b * 32 + lane], acc[t]);
    }
#pragma unroll
    for (int t = 0; t < R; t++) acc[t] = fold_lanes(acc[t]);
}

#define TILE 4

// y[t*rows + r] = W[r] . x[t] for t < n. One warp per output row r, x rows in tiles of TILE.
extern "C" __global__ void matmul_bf16(const u16* W, const float* x, float* y, int rows, int cols, int n) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;
    const u16* w = W + (size_t)r * cols;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        float acc[TILE];
        dot_bf16_rows<TILE>(w, x + (size_t)t0 * cols, cols, cols, n - t0, lane, acc);
        if (lane == 0)
            for (int t = 0; t < TILE && t0 + t < n; t++) y[(size_t)(t0 + t) * rows + r] = acc[t];
    }
}

// out[t*rows + r] = act(G[r] . x[t], U[r] . x[t]): a gated MLP's first half, fused.
extern "C" __global__ void mlp_up_act(const u16* G, const u16* U, const float* x, float* out, int rows, int cols,
                                      int n, int act) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= rows) return;
    for (int t0 = 0; t0 < n; t0 += TILE) {
        float g[TILE], u[TILE];
        dot_bf16_rows<TILE>(G + (size_t)r * cols, x + (size_t)t0 * cols, cols, cols, n - t0, lane, g);
        dot_bf16_rows<TILE>(U + (size_t)r * cols, x + (size_t)t0 * cols, cols, cols, n - t0, lane, u);
        if (lane == 0)
            for (int t = 0; t < TILE && t0 + t < n; t++) out[(size_t)(t0 + t) * rows + r] = actf(act, g[t], u[t]);
    }
}

extern "C" __global__ void embed_rows(const u16* table, const u32* tokens, float* out, int n, int hd) {
    int t = blockIdx.x;
    if (t >= n) return;
    const u16* row = table + (size_t)tokens[t] * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) out[(size_t)t * hd + i] = bf16f(row[i]);
}

// out = w ⊙ (x · 1/sqrt(dot(x,x)/d + eps)) per row of d; out may alias x. One block (>= 32 threads) a row.
extern "C" __global__ void rms_norm_rows(const float* x, const float* w, float* out, int n, int d, float eps) {
    __shared__ float inv;
    int t = blockIdx.x;
    if (t >= n) return;
    const float* xr = x + (size_t)t * d;
    if (threadIdx.x < 32) {
        float ss = warp_dot(xr, xr, d, threadIdx.x);
        if (threadIdx.x == 0) inv = 1.0f / sqrtf(ss / (float)d + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[(size_t)t * d + i] = w[i] * (xr[i] * inv);
}

// AttnRes Mix for each row: values are na anchors ([na][n][hd]) then cur; α = softmax(inv_rms(v)·(v·w)).
extern "C" __global__ void attn_res_mix(const float* anchors, int na, const float* cur, const float* w, float* out,
                                        int n, int hd, float eps) {
    __shared__ float alpha[16];
    int t = blockIdx.x;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    int nv = na + 1;
    for (int i = warp; i < nv; i += warps) {
        const float* v = (i < na) ? anchors + ((size_t)i * n + t) * hd : cur + (size_t)t * hd;
        float ss = warp_dot(v, v, hd, lane);
        float s = warp_dot(v, w, hd, lane);
        if (lane == 0) alpha[i] = (1.0f / sqrtf(ss / (float)hd + eps)) * s;
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
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float o = 0.0f;
        for (int i = 0; i < nv; i++) {
            const float* v = (i < na) ? anchors + ((size_t)i * n + t) * hd : cur + (size_t)t * hd;
            o += alpha[i] * v[d];
        }
        out[(size_t)t * hd + d] = o;
    }
}

extern "C" __global__ void add_into(float* y, const float* x, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) y[i] += x[i];
}

extern "C" __global__ void mul_sigmoid(float* y, const float* g, int len) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) y[i] *= sigmoidf_(g[i]);
}

// KDA decay: g[t][i] = lower·sigmoid(exp(A_log[h])·raw) (kind 0) or −exp(A_log[h])·softplus(raw) (kind 1),
// raw = g[t][i] + dt_bias[i], h = i / dim. beta = sigmoid(beta) too.
extern "C" __global__ void kda_gates(float* g, const float* dt_bias, const float* a_log, float* beta, int n, int w,
                                     int dim, int heads, int kind, float lower) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < n * w) {
        int i = idx % w, h = i / dim;
        float raw = g[idx] + dt_bias[i];
        g[idx] = kind == 0 ? lower * sigmoidf_(expf(a_log[h]) * raw) : -expf(a_log[h]) * softplusf_(raw);
    }
    if (idx < n * heads) beta[idx] = sigmoidf_(beta[idx]);
}

// The KDA recurrence over n rows in order, one block per head, one thread per channel (blockDim == dim).
// q, k, v: [n][w] projections (overwritten by their conv+SiLU values); conv: 3 windows [w][kern-1];
// S: [heads][dim][dim]; gate: [n][w] pre-sigmoid output gate; out: [n][w].
extern "C" __global__ void kda_recurrence(float* q, float* k, float* v, const float* g, const float* beta,
                                          const float* gate, const float* conv_w, float* conv_state, float* S,
                                          const float* o_norm, float* out, int n, int heads, int dim, int kern,
                                          int norm_kind, float eps) {
    extern __shared__ float sh[];
    float* qs = sh;            // dim
    float* ks = sh + dim;      // dim
    float* gs = sh + 2 * dim;  // dim
    float* os = sh + 3 * dim;  // dim
    __shared__ float red[2];
    int h = blockIdx.x, j = threadIdx.x;
    int w = heads * dim;
    int c = h * dim + j;
    float* Sh = S + (size_t)h * dim * dim;
    float scale = 1.0f / sqrtf((float)dim);
    for (int t = 0; t < n; t++) {
        float* proj[3] = {q + (size_t)t * w, k + (size_t)t * w, v + (size_t)t * w};
        // 2. causal short conv, then SiLU.
        for (int p = 0; p < 3; p++) {
            const float* wt = conv_w + ((size_t)p * w + c) * kern;
            float* win = conv_state + ((size_t)p * w + c) * (kern - 1);
            float xv = proj[p][c];
            float acc = 0.0f;
            for (int jj = 0; jj < kern - 1; jj++) acc += wt[jj] * win[jj];
            acc += wt[kern - 1] * xv;
            for (int jj = 0; jj + 1 < kern - 1; jj++) win[jj] = win[jj + 1];
            if (kern > 1) win[kern - 2] = xv;
            proj[p][c] = siluf_(acc);
        }
        qs[j] = proj[0][c];
        ks[j] = proj[1][c];
        gs[j] = g[(size_t)t * w + c];
        __syncthreads();
        // 3. per-head L2 normalisation (sum of squares left to right, like the CPU).
        if (j < 2) {
            float* x = j == 0 ? qs : ks;
            float ss = 0.0f;
            for (int i = 0; i < dim; i++) ss += x[i] * x[i];
            float nrm = norm_kind == 0 ? fmaxf(sqrtf(ss), 1e-12f) : sqrtf(ss + 1e-6f);
            red[j] = (j == 0 ? scale : 1.0f) / nrm;
        }
        __syncthreads();
        qs[j] *= red[0];
        ks[j] *= red[1];
        __syncthreads();
        // 6. S ← S ⊙ exp(g)[:,None]; δ = v − Sᵀk; S ← S + (β·k) ⊗ δ; o = Sᵀq (column j of S per thread).
        float d = proj[2][c];
        for (int i = 0; i < dim; i++) {
            float decay = expf(gs[i]);
            float s = Sh[(size_t)i * dim + j] * decay;
            Sh[(size_t)i * dim + j] = s;
            d -= s * ks[i];
        }
        float bt = beta[(size_t)t * heads + h];
        float o = 0.0f;
        for (int i = 0; i < dim; i++) {
            float bk = bt * ks[i];
            float s = Sh[(size_t)i * dim + j] + bk * d;
            Sh[(size_t)i * dim + j] = s;
            o += s * qs[i];
        }
        os[j] = o;
        __syncthreads();
        // 7. RMS over the head, then the output gate.
        if (j < 32) {
            float ss = warp_dot(os, os, dim, j);
            if (j == 0) red[0] = 1.0f / sqrtf(ss / (float)dim + eps);
        }
        __syncthreads();
        float r = o_norm[j] * (o * red[0]);
        out[(size_t)t * w + c] = r * sigmoidf_(gate[(size_t)t * w + c]);
        __syncthreads();
    }
}

// MLA: normalise each row's latent into the cache at position start + t and copy its k_pe.
extern "C" __global__ void mla_append(const float* c, const float* kv_norm, float* lat, float* pe, int start,
                                      int n, int kvl, int rope, float eps) {
    __shared__ float inv;
    int t = blockIdx.x;
    const float* row = c + (size_t)t * (kvl + rope);
    if (threadIdx.x < 32) {
        float ss = warp_dot(row, row, kvl, threadIdx.x);
        if (threadIdx.x == 0) inv = 1.0f / sqrtf(ss / (float)kvl + eps);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kvl; i += blockDim.x)
        lat[(size_t)(start + t) * kvl + i] = kv_norm[i] * (row[i] * inv);
    for (int i = threadIdx.x; i < rope; i += blockDim.x) pe[(size_t)(start + t) * rope + i] = row[kvl + i];
}

// Absorbed MLA for one (row t, head): q_lat = W_UKᵀ q_nope; p_s = softmax((q_lat·lat_s + q_pe·pe_s)·scale) over
// s ≤ start + t; ctx = Σ p_s lat_s; out = W_UV ctx. kv_b: [heads·(nope+dv)][kvl] BF16. Scratch: p [n·heads][ctx_cap],
// shared: q_lat and ctx (2·kvl floats).
extern "C" __global__ void mla_attend(const float* q, const u16* kv_b, const float* lat, const float* pe, float* p_all,
                                      int ctx_cap, float* out, int n, int heads, int nope, int rope, int dv, int kvl,
                                      int start, float scale) {
    extern __shared__ float sh[];
    float* q_lat = sh;
    float* ctx = sh + kvl;
    __shared__ float red[2];
    int t = blockIdx.x / heads, hd = blockIdx.x % heads;
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
    int qd = nope + rope;
    const float* qh = q + (size_t)t * heads * qd + (size_t)hd * qd;
    size_t base = (size_t)hd * (nope + dv);
    for (int cc = threadIdx.x; cc < kvl; cc += blockDim.x) {
        float acc = 0.0f;
        for (int r = 0; r < nope; r++) acc = fmaf(bf16f(kv_b[(base + r) * kvl + cc]), qh[r], acc);
        q_lat[cc] = acc;
    }
    __syncthreads();
    int upto = start + t + 1;
    float* p = p_all + (size_t)blockIdx.x * ctx_cap;
    for (int s = warp; s < upto; s += warps) {
        float a = warp_dot(q_lat, lat + (size_t)s * kvl, kvl, lane);
        float b = warp_dot(qh + nope, pe + (size_t)s * rope, rope, lane);
        if (lane == 0) p[s] = (a + b) * scale;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float mx = __int_as_float(0xff800000);
        for (int s = 0; s < upto; s++) mx = fmaxf(mx, p[s]);
        red[0] = mx;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < upto; s += blockDim.x) p[s] = expf(p[s] - red[0]);
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int s = 0; s < upto; s++) sum += p[s];
        red[1] = 1.0f / sum;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < upto; s += blockDim.x) p[s] *= red[1];
    __syncthreads();
    for (int cc = threadIdx.x; cc < kvl; cc += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < upto; s++) acc += p[s] * lat[(size_t)s * kvl + cc];
        ctx[cc] = acc;
    }
    __syncthreads();
    for (int i = warp; i < dv; i += warps) {
        float acc[1];
        dot_bf16_rows<1>(kv_b + (base + nope + i) * kvl, ctx, kvl, kvl, 1, lane, acc);
        if (lane == 0) out[(size_t)t * heads * dv + (size_t)hd * dv + i] = acc[0];
    }
}

// Routed experts of one layer, a group of union entries at a time. For group entry u (blockIdx.y):
// slots[u] = the record in VRAM; its rows are entries row_off[u] .. row_off[u+1] of rows[] (token rows).
// enc 0: MXFP4 (w1p w1s w2p w2s w3p w3s); enc 1: BF16 (w1 w2 w3). part[] = byte offsets of those tensors.
struct Parts { u64 off[6]; };

extern "C" __global__ void expert_up(const u64* slots, const int* row_off, const int* rows, const float* z,
                                     float* a, int width, int inter, int enc, int act, Parts parts) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int u = blockIdx.y;
    if (r >= inter) return;
    const u8* rec = (const u8*)slots[u];
    for (int e = row_off[u]; e < row_off[u + 1]; e++) {
        const float* x = z + (size_t)rows[e] * width;
        float g[1], up[1];
        if (enc == 0) {
            dot_mxfp4_rows<1>(rec + parts.off[0] + (size_t)r * width / 2, rec + parts.off[1] + (size_t)r * width / 32,
                              x, width, width, 1, lane, g);
            dot_mxfp4_rows<1>(rec + parts.off[4] + (size_t)r * width / 2, rec + parts.off[5] + (size_t)r * width / 32,
                              x, width, width, 1, lane, up);
        } else {
            dot_bf16_rows<1>((const u16*)(rec + parts.off[0]) + (size_t)r * width, x, width, width, 1, lane, g);
            dot_bf16_rows<1>((const u16*)(rec + parts.off[2]) + (size_t)r * width, x, width, width, 1, lane, up);
        }
        if (lane == 0) a[(size_t)e * inter + r] = actf(act, g[0], up[0]);
    }
}

extern "C" __global__ void expert_down(const u64* slots, const int* row_off, const float* a, float* y, int width,
                                       int inter, int enc, Parts parts) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int u = blockIdx.y;
    if (r >= width) return;
    const u8* rec = (const u8*)slots[u];
    for (int e = row_off[u]; e < row_off[u + 1]; e++) {
        float acc[1];
        if (enc == 0)
            dot_mxfp4_rows<1>(rec + parts.off[2] + (size_t)r * inter / 2, rec + parts.off[3] + (size_t)r * inter / 32,
                              a + (size_t)e * inter, inter, inter, 1, lane, acc);
        else
            dot_bf16_rows<1>((const u16*)(rec + parts.off[1]) + (size_t)r * inter, a + (size_t)e * inter, inter,
                             inter, 1, lane, acc);
        if (lane == 0) y[(size_t)e * width + r] = acc[0];
    }
}

// acc[t] = Σ_k w[t][k] · y[entry[t][k]], k over the row's experts in ascending id order (the canonical order).
extern "C" __global__ void moe_combine(const float* y, const int* entry, const float* wts, float* acc, int n, int topk,
                                       int width) {
    int t = blockIdx.x;
    for (int d = threadIdx.x; d < width; d += blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < topk; k++) s += wts[t * topk + k] * y[(size_t)entry[t * topk + k] * width + d];
        acc[(size_t)t * width + d] = s;
    }
}
