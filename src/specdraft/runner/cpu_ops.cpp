// The decoder layer's glue and attention on CPU as operators (specdraft_cpu::*: five for the
// layer, pass_tables around it), each one loop over rows that computes a row the same way
// whatever else the call holds: row-invariant by construction, like the Triton kernels of
// cuda_kernels.py. Built once per machine by
// cpu_ops.py (torch's cpp_extension); see that module for what each one replaces.
//
// Arithmetic: float32 throughout, inputs widened from the tensor's dtype (float32, bfloat16 or
// float16), each output rounded once. Sums over a vector run in 16 fixed lanes added in a fixed
// tree; sums over key positions run in position order (or the order a tree pass gives).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t LANES = 16;
// row loops spread over torch's threads from this many rows on (each row wholly on one thread)
constexpr int64_t ROW_GRAIN = 8;
// how far ahead of its reads a product asks for its weights (_mm_prefetch): the hardware prefetcher
// alone stops at each 4 KiB page and ramps up again; 2 KiB ahead took a whole step's one-row
// products from 14.7 to 16.3 GB/s on a 2-core Xeon (family 6 model 85; 4 KiB and 8 KiB gained less)
constexpr int64_t PREFETCH_BYTES = 2048;

// the dtype's value as a float32 (bfloat16: its bits shifted, which the compiler vectorises)
inline float widen(float v) { return v; }
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(c10::BFloat16 v) {
    const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// V16: 16 float32 lanes, the unit of the panel products (one AVX-512 register, or two AVX2 ones
// holding lanes 0-7 and 8-15); each lane's arithmetic is the same instruction on either, so a
// product's bits do not depend on which of the two the machine has
#if defined(__AVX512F__)
#define SPECDRAFT_V16 512
using V16 = __m512;
// 16 values of the dtype as float32 lanes
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V16 v16_zero() { return _mm512_setzero_ps(); }
inline V16 v16_set1(float v) { return _mm512_set1_ps(v); }
inline V16 v16_fmadd(V16 a, V16 b, V16 c) { return _mm512_fmadd_ps(a, b, c); }
inline V16 v16_add(V16 a, V16 b) { return _mm512_add_ps(a, b); }
inline V16 v16_mul(V16 a, V16 b) { return _mm512_mul_ps(a, b); }
inline void v16_store(float* p, V16 v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECDRAFT_V16 256
struct V16 {
    __m256 lo, hi;
};
inline __m256 widen8(const c10::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 load16(const c10::BFloat16* p) { return {widen8(p), widen8(p + 8)}; }
inline V16 load16(const c10::Half* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline V16 v16_fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 v16_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 v16_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline void v16_store(float* p, V16 v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
// the sum of 16 lanes by the scalar tree of dot (lanes i + 8 and i, then i + 4, i + 2, i + 1) from
// the 4 lanes left after the first two steps: (h0 + h2) + (h1 + h3)
inline float sum4_tree(__m128 h) {
    const __m128 t = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline __m128 halves16(V16 v) {  // lanes i + 8 and i, then i + 4 and i
    const __m256 s = _mm256_add_ps(v.lo, v.hi);
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}
inline float reduce16(V16 v) { return sum4_tree(halves16(v)); }
#endif

#if defined(SPECDRAFT_V16)
// a kernel's choice by the processor's vendor, made once per process by its caller's static: whether
// the environment variable `name` equals `on` where it is set, else whether the processor is AMD's
// (x86 builds only, as the builtins are)
inline bool setting_or_amd(const char* name, const char* on) {
    if (const char* v = std::getenv(name)) return std::string(v) == on;
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_is("amd"));
}

// where the products' prefetches (PREFETCH_BYTES ahead) land: L1 (_MM_HINT_T0) on Intel, as measured
// on the Xeon there; L2 (_MM_HINT_T1) on AMD: on a 2-core Zen 4 EPYC (family 25 model 17) a step's
// 121 one-row bfloat16 products took 12.4-15.1 ms (medians, three processes) prefetching into L1 and
// 8.5-12.0 into L2, the step 13.4 ms against 12.3 (docs/benchmarks.md); SPECDRAFT_PREFETCH=T0 or T1
// chooses instead, to measure it (cpu_ops.py refuses any other value)
inline bool prefetch_to_l2() {
    static const bool l2 = setting_or_amd("SPECDRAFT_PREFETCH", "T1");
    return l2;
}

inline void prefetch_line(const void* line, bool l2) {
    if (l2)
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
    else
        _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T0);
}
#endif

// sum of a[i] * b[i]: 16 lanes, the lanes added in a fixed order at the end
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
#if defined(__AVX512F__)
    if (n % LANES == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#elif SPECDRAFT_V16 == 256
    if (n % LANES == 0) {
        V16 acc = v16_zero();
        for (int64_t i = 0; i < n; i += LANES) acc = v16_fmadd(load16(a + i), load16(b + i), acc);
        return reduce16(acc);
    }
#endif
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int64_t l = 0; l < LANES; ++l) acc[l] += a[i + l] * widen(b[i + l]);
    for (int64_t l = 0; i + l < n; ++l) acc[l] += a[i + l] * widen(b[i + l]);
    for (int64_t w = LANES / 2; w > 0; w /= 2)
        for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

// out[i] = sum over j < n of e[j] * rows[j][i] (rows at stride apart), j in order, for i < d
template <typename T>
inline void weighted_sum(const float* e, const T* const* rows, int64_t n, int64_t d, float* out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 4 * LANES <= d; i += 4 * LANES) {  // four independent chains (each lane still sums j in order)
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; ++j) {
            const __m512 ej = _mm512_set1_ps(e[j]);
            const T* r = rows[j] + i;
            a0 = _mm512_fmadd_ps(ej, load16(r), a0);
            a1 = _mm512_fmadd_ps(ej, load16(r + LANES), a1);
            a2 = _mm512_fmadd_ps(ej, load16(r + 2 * LANES), a2);
            a3 = _mm512_fmadd_ps(ej, load16(r + 3 * LANES), a3);
        }
        _mm512_storeu_ps(out + i, a0);
        _mm512_storeu_ps(out + i + LANES, a1);
        _mm512_storeu_ps(out + i + 2 * LANES, a2);
        _mm512_storeu_ps(out + i + 3 * LANES, a3);
    }
    for (; i + LANES <= d; i += LANES) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) acc = _mm512_fmadd_ps(_mm512_set1_ps(e[j]), load16(rows[j] + i), acc);
        _mm512_storeu_ps(out + i, acc);
    }
#elif SPECDRAFT_V16 == 256
    for (; i + 2 * LANES <= d; i += 2 * LANES) {  // two independent chains (each lane still sums j in order)
        V16 a0 = v16_zero(), a1 = a0;
        for (int64_t j = 0; j < n; ++j) {
            const V16 ej = v16_set1(e[j]);
            a0 = v16_fmadd(ej, load16(rows[j] + i), a0);
            a1 = v16_fmadd(ej, load16(rows[j] + i + LANES), a1);
        }
        v16_store(out + i, a0);
        v16_store(out + i + LANES, a1);
    }
    for (; i + LANES <= d; i += LANES) {
        V16 acc = v16_zero();
        for (int64_t j = 0; j < n; ++j) acc = v16_fmadd(v16_set1(e[j]), load16(rows[j] + i), acc);
        v16_store(out + i, acc);
    }
#endif
    for (; i < d; ++i) {
        float acc = 0.0f;
        for (int64_t j = 0; j < n; ++j) acc += e[j] * widen(rows[j][i]);
        out[i] = acc;
    }
}

// e^x of each element, the same steps for every element (so a value's result does not depend on
// where in a row it sits, or on the row's length): 2^n e^r, n = round(x / ln 2), r = x - n ln 2,
// e^r by Cephes' degree-6 polynomial; x clamped to [-88, 88]
#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#elif SPECDRAFT_V16 == 256
inline __m256 exp8(__m256 x) {  // exp16's steps; 2^n as the bits (n + 127) << 23 (0 for n = -127)
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

// a[i] = e^(a[i] - shift) for i < n (exp16's steps, a tail in masked lanes)
inline void exp_shifted(float* a, int64_t n, float shift) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 s = _mm512_set1_ps(shift);
    for (; i < n; i += LANES) {
        const __mmask16 k = n - i >= LANES ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(a + i, k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, a + i), s)));
    }
#elif SPECDRAFT_V16 == 256
    const __m256 s = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(a + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(a + i), s)));
    if (i < n) {  // the tail through exp8 too, so that a value's result never depends on where it sits
        alignas(32) float tail[8] = {0};
        std::memcpy(tail, a + i, (n - i) * sizeof(float));
        _mm256_store_ps(tail, exp8(_mm256_sub_ps(_mm256_load_ps(tail), s)));
        std::memcpy(a + i, tail, (n - i) * sizeof(float));
        i = n;
    }
#endif
    for (; i < n; ++i) a[i] = std::exp(a[i] - shift);
}

template <typename T>
inline float sum_squares(const float* a, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int64_t l = 0; l < LANES; ++l) acc[l] += a[i + l] * a[i + l];
    for (int64_t l = 0; i + l < n; ++l) acc[l] += a[i + l] * a[i + l];
    for (int64_t w = LANES / 2; w > 0; w /= 2)
        for (int64_t l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

// transformers' RMSNorm: normalised in float32, rounded to the dtype, times the weight (rounded)
template <typename T>
inline void norm_row(const float* h, const T* weight, float eps, int64_t n, T* out) {
    const float inv = 1.0f / std::sqrt(sum_squares<T>(h, n) / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(static_cast<T>(h[i] * inv)));
}

// f(T{}) for the tensor's dtype T: float32, bfloat16 or float16
template <typename F>
void dispatch(at::ScalarType type, F f) {
    switch (type) {
        case at::kFloat: return f(float{});
        case at::kBFloat16: return f(c10::BFloat16{});
        case at::kHalf: return f(c10::Half{});
        default: TORCH_CHECK(false, "specdraft_cpu: float32, bfloat16 or float16 only, not ", type);
    }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
    TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "specdraft_cpu: CPU tensors only");
    TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "specdraft_cpu: x and weight differ in dtype");
    TORCH_CHECK(x.size(-1) == weight.numel(), "specdraft_cpu: the weight's length is not x's last dimension");
}

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& weight_, double eps) {
    check_rows(x_, weight_);
    auto x = x_.contiguous();
    auto weight = weight_.contiguous();
    auto out = at::empty_like(x);
    const int64_t n = x.size(-1), rows = x.numel() / n;
    dispatch(x.scalar_type(), [&](auto tag) {
        using scalar_t = decltype(tag);
        const scalar_t* px = x.data_ptr<scalar_t>();
        const scalar_t* pw = weight.data_ptr<scalar_t>();
        scalar_t* po = out.data_ptr<scalar_t>();
        at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
            std::vector<float> h(n);
            for (int64_t r = r0; r < r1; ++r) {
                for (int64_t i = 0; i < n; ++i) h[i] = static_cast<float>(px[r * n + i]);
                norm_row<scalar_t>(h.data(), pw, static_cast<float>(eps), n, po + r * n);
            }
        });
    });
    return out;
}

// h = x + y (rounded to the dtype), and RMSNorm(h): the residual add and the next norm in one pass
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_, const at::Tensor& y_, const at::Tensor& weight_,
                                                double eps) {
    check_rows(x_, weight_);
    TORCH_CHECK(x_.sizes() == y_.sizes() && x_.scalar_type() == y_.scalar_type(), "specdraft_cpu: x and y differ");
    auto x = x_.contiguous();
    auto y = y_.contiguous();
    auto weight = weight_.contiguous();
    auto sum = at::empty_like(x);
    auto out = at::empty_like(x);
    const int64_t n = x.size(-1), rows = x.numel() / n;
    dispatch(x.scalar_type(), [&](auto tag) {
        using scalar_t = decltype(tag);
        const scalar_t* px = x.data_ptr<scalar_t>();
        const scalar_t* py = y.data_ptr<scalar_t>();
        const scalar_t* pw = weight.data_ptr<scalar_t>();
        scalar_t* ps = sum.data_ptr<scalar_t>();
        scalar_t* po = out.data_ptr<scalar_t>();
        at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
            std::vector<float> h(n);
            for (int64_t r = r0; r < r1; ++r) {
                for (int64_t i = 0; i < n; ++i) {
                    const scalar_t s = static_cast<scalar_t>(static_cast<float>(px[r * n + i]) + static_cast<float>(py[r * n + i]));
                    ps[r * n + i] = s;
                    h[i] = static_cast<float>(s);
                }
                norm_row<scalar_t>(h.data(), pw, static_cast<float>(eps), n, po + r * n);
            }
        });
    });
    return {sum, out};
}

// silu(gate) * up of g = [gate ; up] on the last dimension (the fused w13 product's output)
at::Tensor silu_mul(const at::Tensor& g_) {
    TORCH_CHECK(g_.device().is_cpu() && g_.size(-1) % 2 == 0, "specdraft_cpu::silu_mul: a CPU tensor of even width");
    auto g = g_.contiguous();
    const int64_t n = g.size(-1) / 2, rows = g.numel() / (2 * n);
    auto sizes = g.sizes().vec();
    sizes.back() = n;
    auto out = at::empty(sizes, g.options());
    dispatch(g.scalar_type(), [&](auto tag) {
        using scalar_t = decltype(tag);
        const scalar_t* pg = g.data_ptr<scalar_t>();
        scalar_t* po = out.data_ptr<scalar_t>();
        at::parallel_for(0, rows, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
            std::vector<float> e(n);
            for (int64_t r = r0; r < r1; ++r) {
                const scalar_t* gate = pg + r * 2 * n;
                const scalar_t* up = gate + n;
                for (int64_t i = 0; i < n; ++i) e[i] = -static_cast<float>(gate[i]);
                exp_shifted(e.data(), n, 0.0f);  // e^-gate
                for (int64_t i = 0; i < n; ++i) {
                    const float a = static_cast<float>(gate[i]);
                    po[r * n + i] = static_cast<scalar_t>(a / (1.0f + e[i]) * static_cast<float>(up[i]));
                }
            }
        });
    });
    return out;
}

// The fused q/k/v product's output rotated (rotary tables cos, sin # [B, 1, W, D], the model's dtype
// or float32, widened where read); k and v written into the layer's cache buffers
// k_buf, v_buf # [slots, kvH, L, D] at slot[b], positions[b, w]; returns q # [B, H, W, D]. Tokens
// are written from several threads: no two may share a slot and position (the runner's rows are
// distinct slots, a row's positions distinct).
at::Tensor rope_write(const at::Tensor& qkv_, const at::Tensor& cos_, const at::Tensor& sin_, at::Tensor k_buf,
                      at::Tensor v_buf, const at::Tensor& slot_, const at::Tensor& positions_, int64_t heads,
                      int64_t kv_heads) {
    auto qkv = qkv_.contiguous();
    auto cos = cos_.contiguous();  // the tables in the model's dtype (or float32), widened where read
    auto sin = sin_.contiguous();
    TORCH_CHECK(cos.scalar_type() == sin.scalar_type() && (cos.scalar_type() == qkv.scalar_type() ||
                cos.scalar_type() == at::kFloat), "specdraft_cpu::rope_write: the tables' dtype");
    auto slot = slot_.to(at::kLong).contiguous();
    auto positions = positions_.to(at::kLong).contiguous();
    const int64_t B = qkv.size(0), W = qkv.size(1), D = k_buf.size(3), half = D / 2;
    TORCH_CHECK(qkv.size(2) == (heads + 2 * kv_heads) * D, "specdraft_cpu::rope_write: qkv's width");
    TORCH_CHECK(k_buf.stride(3) == 1 && v_buf.stride(3) == 1, "specdraft_cpu::rope_write: cache rows not contiguous");
    TORCH_CHECK(qkv.scalar_type() == k_buf.scalar_type(), "specdraft_cpu::rope_write: dtypes differ");
    auto q = at::empty({B, heads, W, D}, qkv.options());
    dispatch(qkv.scalar_type(), [&](auto tag) {
        using scalar_t = decltype(tag);
        const scalar_t* pqkv = qkv.data_ptr<scalar_t>();
        scalar_t* pq = q.data_ptr<scalar_t>();
        scalar_t* pk = k_buf.data_ptr<scalar_t>();
        scalar_t* pv = v_buf.data_ptr<scalar_t>();
        const int64_t* pslot = slot.data_ptr<int64_t>();
        const int64_t* ppos = positions.data_ptr<int64_t>();
        const auto ks = k_buf.strides();
        const auto vs = v_buf.strides();
        const int64_t width = (heads + 2 * kv_heads) * D;
        auto rotate = [&](const scalar_t* src, const auto* c, const auto* s, scalar_t* dst) {
            for (int64_t i = 0; i < half; ++i) {
                const float a = static_cast<float>(src[i]), b = static_cast<float>(src[i + half]);
                dst[i] = static_cast<scalar_t>(a * widen(c[i]) - b * widen(s[i]));
                dst[i + half] = static_cast<scalar_t>(b * widen(c[i + half]) + a * widen(s[i + half]));
            }
        };
        auto run = [&](const auto* pc, const auto* ps) {
            at::parallel_for(0, B * W, ROW_GRAIN, [&](int64_t i0, int64_t i1) {
                for (int64_t bw = i0; bw < i1; ++bw) {
                    const int64_t b = bw / W, w = bw % W;
                    const scalar_t* row = pqkv + (b * W + w) * width;
                    const auto* c = pc + (b * W + w) * D;
                    const auto* s = ps + (b * W + w) * D;
                    const int64_t pos = ppos[b * W + w], sl = pslot[b];
                    for (int64_t h = 0; h < heads; ++h) rotate(row + h * D, c, s, pq + ((b * heads + h) * W + w) * D);
                    for (int64_t h = 0; h < kv_heads; ++h) {
                        rotate(row + (heads + h) * D, c, s, pk + sl * ks[0] + h * ks[1] + pos * ks[2]);
                        const scalar_t* v = row + (heads + kv_heads + h) * D;
                        scalar_t* dst = pv + sl * vs[0] + h * vs[1] + pos * vs[2];
                        for (int64_t i = 0; i < D; ++i) dst[i] = v[i];
                    }
                }
            });
        };
        if (cos.scalar_type() == at::kFloat) run(cos.data_ptr<float>(), sin.data_ptr<float>());
        else run(cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
    });
    return q;
}

#if defined(__AVX512F__)
inline __mmask16 columns_left(int64_t left) {
    return left >= LANES ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
}

// the sums of a[0..15]'s lanes, sum m in lane m, each by the tree of GCC's _mm512_reduce_add_ps
// (lanes i + 8 and i, then i + 4 and i, then i + 2 and i, then the two left), four transposing
// steps for 16 vectors where one vector at a time takes four extracts and adds each
inline __m512 sum_lanes16(const __m512* a) {
    __m512 s1[8], s2[4], s3[2];
    for (int k = 0; k < 8; ++k)  // lanes i + 8 and i: vector 2k's 8 sums, then 2k + 1's
        s1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                              _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int k = 0; k < 4; ++k)  // i + 4 and i: 128-bit lane c holds vector 4k + c's 4 sums
        s2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * k], s1[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                              _mm512_shuffle_f32x4(s1[2 * k], s1[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int k = 0; k < 2; ++k)  // i + 2 and i: lane c holds vectors 8k + c's and 8k + 4 + c's 2 sums
        s3[k] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    // the last two: element e of 128-bit lane c is vector c + 4e's sum; back in order
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
#endif

// One token's attention for the G query heads sharing a KV head (qf: their G rows of D, float32):
// scores over the visible positions (in order, or in `ord`'s order), softmax, weighted sum of the
// values; acc gets G rows of D, total the G softmax sums (top: scratch for the G maxima); returns
// how many positions were visible. Each key and value row is read once for the G heads, and each
// head's arithmetic is step for step what one head alone would do: dot's 16
// lanes and their fixed tree, exp_shifted, the sum in order, weighted_sum's chains (G is a template
// argument so that the G heads' accumulators stay in registers; 0: any G, one head at a time).
template <typename T, int G_>
inline int64_t attend(const float* qf, int64_t G, int64_t D, const T* keys, int64_t kstride, const T* values,
                   int64_t vstride, const bool* visible, const int64_t* ord, int64_t L, float scale, float* scores,
                   const T** seen, float* acc, float* total, float* top) {
    constexpr int64_t GB = G_ > 0 ? G_ : 1;
    int64_t n = 0;
    for (int64_t g = 0; g < G; ++g) top[g] = -INFINITY;
#if defined(__AVX512F__)
    if (G_ > 0 && D % LANES == 0) {
        // 16 visible positions at a time: each head's 16 dot products as 16 independent chains, then
        // their 16 lane sums at once by sum_lanes16 (the tree of _mm512_reduce_add_ps, so the same
        // scores as one position at a time), the maxima in registers
        __m512 high[GB];
        for (int64_t g = 0; g < GB; ++g) high[g] = _mm512_set1_ps(-INFINITY);
        const __m512 vscale = _mm512_set1_ps(scale);
        int64_t j = 0;
        while (true) {
            int64_t ps[LANES];
            int64_t count = 0;
            for (; j < L && count < LANES; ++j) {
                const int64_t p = ord ? ord[j] : j;
                if (visible[p]) ps[count++] = p;
            }
            if (count == 0) break;
            const T* krows[LANES];
            for (int64_t m = 0; m < LANES; ++m) krows[m] = keys + ps[m < count ? m : 0] * kstride;  // padding: any row
            const __mmask16 kept = columns_left(count);
            for (int64_t g = 0; g < GB; ++g) {
                __m512 a[LANES];
                for (int m = 0; m < LANES; ++m) a[m] = _mm512_setzero_ps();
                for (int64_t i = 0; i < D; i += LANES) {
                    const __m512 qi = _mm512_loadu_ps(qf + g * D + i);
                    for (int m = 0; m < LANES; ++m) a[m] = _mm512_fmadd_ps(qi, load16(krows[m] + i), a[m]);
                }
                const __m512 s = _mm512_mul_ps(sum_lanes16(a), vscale);
                _mm512_mask_storeu_ps(scores + g * L + n, kept, s);
                high[g] = _mm512_mask_max_ps(high[g], kept, high[g], s);
            }
            for (int64_t m = 0; m < count; ++m) seen[n + m] = values + ps[m] * vstride;
            n += count;
        }
        for (int64_t g = 0; g < GB; ++g) top[g] = _mm512_reduce_max_ps(high[g]);
    } else
#elif SPECDRAFT_V16 == 256
    if (G_ > 0 && D % LANES == 0) {
        // 4 visible positions at a time: each head's 4 dot products as independent chains, then
        // their lane sums by dot's tree (halves16 each, the last two steps of the 4 side by side:
        // the same scores as one position at a time)
        constexpr int64_t PB = 4;
        float high[GB];
        for (int64_t g = 0; g < GB; ++g) high[g] = -INFINITY;
        int64_t j = 0;
        while (true) {
            int64_t ps[PB];
            int64_t count = 0;
            for (; j < L && count < PB; ++j) {
                const int64_t p = ord ? ord[j] : j;
                if (visible[p]) ps[count++] = p;
            }
            if (count == 0) break;
            const T* krows[PB];
            for (int64_t m = 0; m < PB; ++m) krows[m] = keys + ps[m < count ? m : 0] * kstride;  // padding: any row
            for (int64_t g = 0; g < GB; ++g) {
                V16 a[PB];
                for (int m = 0; m < PB; ++m) a[m] = v16_zero();
                for (int64_t i = 0; i < D; i += LANES) {
                    const V16 qi = load16(qf + g * D + i);
                    for (int m = 0; m < PB; ++m) a[m] = v16_fmadd(qi, load16(krows[m] + i), a[m]);
                }
                __m128 h0 = halves16(a[0]), h1 = halves16(a[1]), h2 = halves16(a[2]), h3 = halves16(a[3]);
                _MM_TRANSPOSE4_PS(h0, h1, h2, h3);  // hk's lane m: lane k of a[m]'s four
                alignas(16) float sc[PB];
                _mm_store_ps(sc, _mm_mul_ps(_mm_add_ps(_mm_add_ps(h0, h2), _mm_add_ps(h1, h3)), _mm_set1_ps(scale)));
                for (int64_t m = 0; m < count; ++m) {
                    scores[g * L + n + m] = sc[m];
                    high[g] = sc[m] > high[g] ? sc[m] : high[g];
                }
            }
            for (int64_t m = 0; m < count; ++m) seen[n + m] = values + ps[m] * vstride;
            n += count;
        }
        for (int64_t g = 0; g < GB; ++g) top[g] = high[g];
    } else
#endif
    for (int64_t j = 0; j < L; ++j) {
        const int64_t p = ord ? ord[j] : j;
        if (!visible[p]) continue;
        const T* krow = keys + p * kstride;
        for (int64_t g = 0; g < G; ++g) {
            const float s = dot<T>(qf + g * D, krow, D) * scale;
            scores[g * L + n] = s;
            top[g] = s > top[g] ? s : top[g];
        }
        seen[n++] = values + p * vstride;
    }
    for (int64_t g = 0; g < G; ++g) exp_shifted(scores + g * L, n, top[g]);
    if constexpr (G_ > 0) {  // each head's sum in order, the G heads' chains side by side
        float t[GB];
        for (int64_t g = 0; g < GB; ++g) t[g] = 0.0f;
        for (int64_t j = 0; j < n; ++j)
            for (int64_t g = 0; g < GB; ++g) t[g] += scores[g * L + j];
        for (int64_t g = 0; g < GB; ++g) total[g] = t[g];
    } else {
        for (int64_t g = 0; g < G; ++g) {
            float t = 0.0f;
            for (int64_t j = 0; j < n; ++j) t += scores[g * L + j];
            total[g] = t;
        }
    }
    int64_t i = 0;
#if defined(__AVX512F__)
    if (G_ > 0) {  // weighted_sum's four chains per head, each value row read once for the G heads
        for (; i + 4 * LANES <= D; i += 4 * LANES) {
            __m512 a[GB][4];
            for (int64_t g = 0; g < GB; ++g)
                for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; ++j) {
                const T* r = seen[j] + i;
                const __m512 v0 = load16(r), v1 = load16(r + LANES), v2 = load16(r + 2 * LANES), v3 = load16(r + 3 * LANES);
                for (int64_t g = 0; g < GB; ++g) {
                    const __m512 e = _mm512_set1_ps(scores[g * L + j]);
                    a[g][0] = _mm512_fmadd_ps(e, v0, a[g][0]);
                    a[g][1] = _mm512_fmadd_ps(e, v1, a[g][1]);
                    a[g][2] = _mm512_fmadd_ps(e, v2, a[g][2]);
                    a[g][3] = _mm512_fmadd_ps(e, v3, a[g][3]);
                }
            }
            for (int64_t g = 0; g < GB; ++g)
                for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * D + i + c * LANES, a[g][c]);
        }
    }
#elif SPECDRAFT_V16 == 256
    if (G_ > 0) {  // weighted_sum's chains 16 columns at a time, each value row's read once for the G heads
        for (; i + LANES <= D; i += LANES) {
            V16 a[GB];
            for (int64_t g = 0; g < GB; ++g) a[g] = v16_zero();
            for (int64_t j = 0; j < n; ++j) {
                const V16 v = load16(seen[j] + i);
                for (int64_t g = 0; g < GB; ++g) a[g] = v16_fmadd(v16_set1(scores[g * L + j]), v, a[g]);
            }
            for (int64_t g = 0; g < GB; ++g) v16_store(acc + g * D + i, a[g]);
        }
    }
#endif
    if (i < D) {  // the rest (or every column) through weighted_sum itself, which continues where i is
        for (int64_t j = 0; j < n; ++j) seen[j] += i;
        for (int64_t g = 0; g < G; ++g) weighted_sum<T>(scores + g * L, seen, n, D - i, acc + g * D + i);
    }
    return n;
}

// What a pass without a tree attends with, in one call (run_blocks' pass_positions, attention_mask and
// rope_lookup: the same values, a tenth of their dispatch): starts # [B] long, each row's length
// before the pass; table # [2, T, D], cos and sin at every position below T; window, a sliding
// window of that many positions (the query's own included) or none. Returns positions # [B, W]
// long (starts + 0..W-1), mask # [B, 1, W, span] bool (a query sees the positions at or before its
// own, within the window) and cos, sin # [B, 1, W, D], the table's rows at the positions.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pass_tables(const at::Tensor& starts_, int64_t width,
                                                                       int64_t span, const at::Tensor& table_,
                                                                       c10::optional<int64_t> window) {
    auto starts = starts_.to(at::kLong).contiguous();
    auto table = table_.contiguous();
    TORCH_CHECK(starts.dim() == 1 && table.dim() == 3 && table.size(0) == 2, "specdraft_cpu::pass_tables: shapes");
    const int64_t B = starts.size(0), T = table.size(1), D = table.size(2);
    auto positions = at::empty({B, width}, starts.options());
    auto mask = at::empty({B, 1, width, span}, starts.options().dtype(at::kBool));
    auto cos = at::empty({B, 1, width, D}, table.options());
    auto sin = at::empty({B, 1, width, D}, table.options());
    const int64_t row = D * table.element_size();
    const char* pt = static_cast<const char*>(table.data_ptr());
    const int64_t* ps = starts.data_ptr<int64_t>();
    int64_t* pp = positions.data_ptr<int64_t>();
    bool* pm = mask.data_ptr<bool>();
    char* pc = static_cast<char*>(cos.data_ptr());
    char* pn = static_cast<char*>(sin.data_ptr());
    for (int64_t b = 0; b < B; ++b) {
        for (int64_t w = 0; w < width; ++w) {
            const int64_t i = b * width + w, p = ps[b] + w;
            TORCH_CHECK(p >= 0 && p < T, "specdraft_cpu::pass_tables: position ", p, " outside the rotary table of ", T);
            pp[i] = p;
            const int64_t first = window.has_value() ? std::max<int64_t>(p - *window + 1, 0) : 0;
            bool* visible = pm + i * span;
            for (int64_t c = 0; c < span; ++c) visible[c] = c <= p && c >= first;
            std::memcpy(pc + i * row, pt + p * row, row);
            std::memcpy(pn + i * row, pt + (T + p) * row, row);
        }
    }
    return {positions, mask, cos, sin};
}

// Attention of q # [B, H, W, D] over the cache buffers k_buf, v_buf # [slots, kvH, L, D] of the
// slots slot # [B], read in place (grouped heads share their KV head; no copy), where mask
// # [B, 1, W, L] says; order # [B, W, L] (a tree pass, optional): the positions in the order its
// one-token step meets them. Scores, softmax and the weighted sum in float32, positions in order,
// masked ones skipped: a token's result does not depend on the pass's width, its masked tail or its
// batch. One work item per sequence, KV head and token (its G query heads: attend), items spread
// over the threads. Returns [B, W, H * D] (the layout the output projection reads).
at::Tensor attention(const at::Tensor& q_, const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& slot_,
                     const at::Tensor& mask_, double scale, const c10::optional<at::Tensor>& order_) {
    auto q = q_.contiguous();
    auto slot = slot_.to(at::kLong).contiguous();
    auto mask = mask_.contiguous();
    const int64_t B = q.size(0), H = q.size(1), W = q.size(2), D = q.size(3);
    const int64_t kvH = k_buf.size(1), L = mask.size(3), G = H / kvH;
    TORCH_CHECK(k_buf.stride(3) == 1 && v_buf.stride(3) == 1, "specdraft_cpu::attention: cache rows not contiguous");
    TORCH_CHECK(q.scalar_type() == k_buf.scalar_type(), "specdraft_cpu::attention: dtypes differ");
    TORCH_CHECK(mask.scalar_type() == at::kBool && L <= k_buf.size(2), "specdraft_cpu::attention: the mask");
    TORCH_CHECK(G * kvH == H, "specdraft_cpu::attention: heads not a multiple of the KV heads");
    at::Tensor order;
    if (order_.has_value()) order = order_->to(at::kLong).contiguous();
    const int64_t* pord = order.defined() ? order.data_ptr<int64_t>() : nullptr;
    auto out = at::empty({B, W, H * D}, q.options());
    dispatch(q.scalar_type(), [&](auto tag) {
        using scalar_t = decltype(tag);
        const scalar_t* pq = q.data_ptr<scalar_t>();
        const scalar_t* pk = k_buf.data_ptr<scalar_t>();
        const scalar_t* pv = v_buf.data_ptr<scalar_t>();
        const bool* pm = mask.data_ptr<bool>();
        const int64_t* pslot = slot.data_ptr<int64_t>();
        scalar_t* po = out.data_ptr<scalar_t>();
        const auto ks = k_buf.strides();
        const auto vs = v_buf.strides();
        at::parallel_for(0, B * kvH * W, 1, [&](int64_t begin, int64_t end) {
            std::vector<float> qf(G * D), acc(G * D), scores(G * L), total(G), top(G);
            std::vector<const scalar_t*> seen(L);
            for (int64_t item = begin; item < end; ++item) {
                const int64_t b = item / (kvH * W), kh = item / W % kvH, w = item % W;
                for (int64_t g = 0; g < G; ++g) {
                    const scalar_t* qrow = pq + ((b * H + kh * G + g) * W + w) * D;
                    for (int64_t i = 0; i < D; ++i) qf[g * D + i] = static_cast<float>(qrow[i]);
                }
                const scalar_t* keys = pk + pslot[b] * ks[0] + kh * ks[1];
                const scalar_t* values = pv + pslot[b] * vs[0] + kh * vs[1];
                const bool* visible = pm + (b * W + w) * L;
                const int64_t* ord = pord ? pord + (b * W + w) * L : nullptr;
                int64_t n = 0;
                auto run = [&](auto heads) {
                    n = attend<scalar_t, decltype(heads)::value>(qf.data(), G, D, keys, ks[2], values, vs[2], visible, ord,
                                                             L, static_cast<float>(scale), scores.data(), seen.data(),
                                                             acc.data(), total.data(), top.data());
                };
                switch (G) {
                    case 1: run(std::integral_constant<int, 1>{}); break;
                    case 2: run(std::integral_constant<int, 2>{}); break;
                    case 3: run(std::integral_constant<int, 3>{}); break;
                    case 4: run(std::integral_constant<int, 4>{}); break;
                    default: run(std::integral_constant<int, 0>{}); break;
                }
                for (int64_t g = 0; g < G; ++g) {
                    scalar_t* orow = po + (b * W + w) * H * D + (kh * G + g) * D;
                    for (int64_t i = 0; i < D; ++i) orow[i] = static_cast<scalar_t>(n ? acc[g * D + i] / total[g] : 0.0f);
                }
            }
        });
    });
    return out;
}

// --- the products ------------------------------------------------------------------------------
//
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]): each output one float32 accumulator, one fused
// multiply-add per k in order (k = 0, 1, ...), then the bias added and the result rounded once to
// the dtype: the same arithmetic whatever the row count, the tile a row falls in or the thread that
// runs it, so row-invariant by construction (and equal to the scalar loop below, bit for bit: a
// fused multiply-add rounds once). The weight is stored as panels of 16 output columns,
// [ceil(N / 16), K, 16] (cpu_ops.pack_panels): a tile of MB rows x NB panels keeps MB * NB
// accumulators of 16 columns in registers, streams its panels once and broadcasts each x[m, k]; no
// sum across lanes. A decode step's one row reads the weight once, at the memory's speed.

// rows are taken this many at a time (their x stays in the cache while the panels stream past)
constexpr int64_t PANEL_ROW_CHUNK = 96;

#if defined(SPECDRAFT_V16)
// out[col + i] = v's lane i (+ bias[col + i]) for the columns left before N (16 at most), each
// rounded once to the dtype
template <typename T>
inline void store_columns(V16 v, const T* bias, T* out, int64_t col, int64_t N) {
    const int64_t count = std::min<int64_t>(LANES, N - col);
    alignas(64) float lanes[LANES];
    if (bias) {
        for (int64_t i = 0; i < LANES; ++i) lanes[i] = i < count ? widen(bias[col + i]) : 0.0f;
        v = v16_add(v, load16(static_cast<const float*>(lanes)));
    }
    if constexpr (std::is_same_v<T, float>) {
        if (count == LANES) {
            v16_store(out + col, v);
            return;
        }
    }
    v16_store(lanes, v);
    for (int64_t i = 0; i < count; ++i) out[col + i] = static_cast<T>(lanes[i]);
}
#endif

#if defined(SPECDRAFT_V16)
// a tile's MB x NB sums (and the bias) into rows out .. out + (MB - 1) N, columns n0 .. (fewer past N)
template <typename T, int MB, int NB>
inline void store_tile(const V16 (&acc)[MB][NB], const T* bias, T* out, int64_t N, int64_t n0) {
    for (int j = 0; j < NB; ++j) {
        const int64_t col = n0 + LANES * j;
        if (col >= N) break;
        for (int m = 0; m < MB; ++m) store_columns(acc[m][j], bias, out + m * N, col, N);
    }
}

// MB rows x NB panels from panel p (output columns n0 .. n0 + 16 * NB, fewer past N)
template <typename T, int MB, int NB>
inline void panel_tile(const float* x, int64_t K, const T* p, T* out, int64_t N, const T* bias, int64_t n0) {
    V16 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = v16_zero();
    const int64_t ps = K * LANES;
    constexpr int64_t per_line = 64 / (LANES * sizeof(T));  // k steps per cache line of a panel
    const bool l2 = prefetch_to_l2();
    for (int64_t k = 0; k < K; ++k) {
        V16 w[NB];
        if (k % per_line == 0)  // each panel's line PREFETCH_BYTES ahead (the next panel's, near its end)
            for (int j = 0; j < NB; ++j)
                prefetch_line(reinterpret_cast<const char*>(p + j * ps + k * LANES) + PREFETCH_BYTES, l2);
        for (int j = 0; j < NB; ++j) w[j] = load16(p + j * ps + k * LANES);
        for (int m = 0; m < MB; ++m) {
            const V16 xb = v16_set1(x[m * K + k]);
            for (int j = 0; j < NB; ++j) acc[m][j] = v16_fmadd(xb, w[j], acc[m][j]);
        }
    }
    store_tile(acc, bias, out, N, n0);
}

// the walk of M rows over NB panels: 12 x 2 tiles while there are 12 rows and NB is even (the most
// work per load), then 6 x NB, then what is left; tile(MB, NBt, m, j), both counts as
// std::integral_constant, does rows m .. m + MB against panels j .. j + NBt
template <int NB, typename Tile>
inline void walk_tiles(int64_t M, Tile&& tile) {
    using std::integral_constant;
    int64_t m = 0;
    if constexpr (NB % 2 == 0) {
        for (; m + 12 <= M; m += 12)
            for (int j = 0; j < NB; j += 2) tile(integral_constant<int, 12>{}, integral_constant<int, 2>{}, m, j);
    }
    const integral_constant<int, NB> nb{};
    for (; m + 6 <= M; m += 6) tile(integral_constant<int, 6>{}, nb, m, 0);
    switch (M - m) {
        case 5: tile(integral_constant<int, 5>{}, nb, m, 0); break;
        case 4: tile(integral_constant<int, 4>{}, nb, m, 0); break;
        case 3: tile(integral_constant<int, 3>{}, nb, m, 0); break;
        case 2: tile(integral_constant<int, 2>{}, nb, m, 0); break;
        case 1: tile(integral_constant<int, 1>{}, nb, m, 0); break;
        default: break;
    }
}

// all M rows against NB panels. AVX-512 (32 registers): 12 rows x 2 panels while there are 12 rows
// (the most work per load), then 6 x NB, then what is left. AVX2 (16 registers, two per V16): one
// row against all NB panels, two against 2 panels at a time, more rows 6 at a time against one
// panel. The tiles differ, the arithmetic of each output does not. (A verify pass of 2-6 rows
// costs about 1.2 one-row steps on a Zen 2 EPYC whatever the tile: 3 x 2 tiles, 2 x 2 ones over
// the same panels twice, loads in split lane order and prefetching further ahead gained nothing
// over these; 2 x 2 for two rows did, about 8%.)
template <typename T, int NB>
inline void panel_rows(int64_t M, const float* x, int64_t K, const T* p, T* out, int64_t N, const T* bias,
                       int64_t n0) {
#if SPECDRAFT_V16 == 256
    if (M == 1) {
        panel_tile<T, 1, NB>(x, K, p, out, N, bias, n0);
        return;
    }
    if constexpr (NB % 2 == 0) {  // two rows: 2 x 2 tiles, twice the independent chains of 2 x 1
        if (M == 2) {
            for (int j = 0; j < NB; j += 2) panel_tile<T, 2, 2>(x, K, p + j * K * LANES, out, N, bias, n0 + LANES * j);
            return;
        }
    }
    for (int i = 0; i < NB; ++i)  // each panel alone, 6 rows at a time
        walk_tiles<1>(M, [&](auto mb, auto, int64_t m, int) {
            panel_tile<T, decltype(mb)::value, 1>(x + m * K, K, p + i * K * LANES, out + m * N, N, bias, n0 + LANES * i);
        });
#else
    walk_tiles<NB>(M, [&](auto mb, auto nb, int64_t m, int j) {
        panel_tile<T, decltype(mb)::value, decltype(nb)::value>(x + m * K, K, p + j * K * LANES, out + m * N, N, bias,
                                                                n0 + LANES * j);
    });
#endif
}
#endif

#if defined(__AVX512BF16__) && SPECDRAFT_V16 == 512
// bfloat16 products by pairs of inputs (avx512_bf16's vdpbf16ps: 32 products an instruction, twice
// the fused multiply-adds of widened lanes). The instruction computes, per float32 lane,
//     acc = fma(a.odd, b.odd, acc); acc = fma(a.even, b.even, acc)
// (each bfloat16 product exact in float32, each add rounded once: checked bit for bit, 16M lanes, on
// a Zen 4 and a Zen 5 EPYC, and so the Intel SDM's pseudo-code), so a pair is stored with input
// k + 1 in the even half and input k in the odd one (pack_panels), and x's pairs swapped to match:
// the odd half goes first, and the sum is the panels' own, input k then k + 1, fused multiply-add by
// fused multiply-add.
// The one difference: the instruction reads bfloat16 subnormals as zero and flushes a subnormal
// float32 sum to zero, as the same instruction does for every row, so rows stay invariant.
// Layout of a weight with an even K: [P, K / 2, 16, 2], viewed as [P, K, 16].
constexpr bool BF16_PAIRS = true;

// whether bfloat16 products go by pairs on this processor: on AMD, where vdpbf16ps does twice the
// work of a fused multiply-add (a step's 121 one-row products 12.1 ms by pairs against 15.2 widened
// on a 2-core Zen 4 EPYC); not on Intel, where it ran at a third of fma's rate (a 2-core Xeon with
// AMX, family 6 model 167: the products about even at one row, 20.2 ms widened against 24.6 by pairs
// at 16 rows, 227 against 318 at 256). SPECDRAFT_BF16_PAIRS=1 or 0 chooses instead, to measure and
// test both (cpu_ops.py refuses any other value). Either way each output is the same sequential sum,
// but for subnormals, which only the instruction flushes.
inline bool pairs_here() {
    static const bool on = setting_or_amd("SPECDRAFT_BF16_PAIRS", "1");
    return on;
}

// MB rows x NB panels of pairs (walked as panel_rows' AVX-512 tiles are); xs: each row's K / 2
// pairs, swapped (x[k + 1] low, x[k] high)
template <int MB, int NB>
inline void pair_tile(const uint32_t* xs, int64_t K2, const c10::BFloat16* p, c10::BFloat16* out, int64_t N,
                      const c10::BFloat16* bias, int64_t n0) {
    V16 acc[MB][NB];  // __m512 here
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
    const int64_t ps = K2 * 2 * LANES;  // a panel's bfloat16 values
    const bool l2 = prefetch_to_l2();
    for (int64_t i = 0; i < K2; ++i) {  // one 64-byte line of each panel a pair
        __m512bh w[NB];
        for (int j = 0; j < NB; ++j) {
            const c10::BFloat16* line = p + j * ps + i * 2 * LANES;
            prefetch_line(reinterpret_cast<const char*>(line) + PREFETCH_BYTES, l2);
            w[j] = (__m512bh)_mm512_loadu_si512(line);
        }
        for (int m = 0; m < MB; ++m) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xs[m * K2 + i]));
            for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, w[j]);
        }
    }
    store_tile(acc, bias, out, N, n0);
}

#else
constexpr bool BF16_PAIRS = false;
inline bool pairs_here() { return false; }
#endif

// whether a bfloat16 weight of K inputs is stored and multiplied by pairs (pack_panels asks through
// specdraft_cpu::bf16_pairs)
bool bf16_pairs(int64_t K) { return BF16_PAIRS && K % 2 == 0 && pairs_here(); }

// f(std::integral_constant<int, nb>) for a group of nb = 1..4 panels: the tiles' panel count is a
// template argument
template <typename F>
inline void with_panels(int64_t nb, F&& f) {
    switch (nb) {
        case 4: f(std::integral_constant<int, 4>{}); break;
        case 3: f(std::integral_constant<int, 3>{}); break;
        case 2: f(std::integral_constant<int, 2>{}); break;
        default: f(std::integral_constant<int, 1>{}); break;
    }
}

// x # [M, K], panels # [P, K, 16] (pack_panels of a [N, K] weight), bias # [N] or None: one dtype,
// float32 or bfloat16
at::Tensor linear(const at::Tensor& x_, const at::Tensor& panels_, const c10::optional<at::Tensor>& bias_,
                  int64_t N) {
    auto x = x_.contiguous();
    auto panels = panels_.contiguous();
    TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "specdraft_cpu::linear: CPU tensors only");
    TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == LANES, "specdraft_cpu::linear: shapes");
    TORCH_CHECK(x.scalar_type() == panels.scalar_type() &&
                (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "specdraft_cpu::linear: float32 or bfloat16, one dtype");
    const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
    TORCH_CHECK(panels.size(1) == K && P * LANES >= N && (P - 1) * LANES < N, "specdraft_cpu::linear: panels");
    at::Tensor bias;
    if (bias_.has_value()) bias = bias_->contiguous();
    TORCH_CHECK(!bias.defined() || (bias.scalar_type() == x.scalar_type() && bias.numel() == N),
                "specdraft_cpu::linear: bias");
    auto out = at::empty({M, N}, x.options());
    if (M == 0) return out;
    dispatch(x.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        if constexpr (std::is_same_v<T, c10::Half>) {
            TORCH_CHECK(false, "specdraft_cpu::linear: float32 or bfloat16");
        } else {
            const T* px = x.data_ptr<T>();
            const T* pp = panels.data_ptr<T>();
            const T* pb = bias.defined() ? bias.data_ptr<T>() : nullptr;
            T* po = out.data_ptr<T>();
#if defined(SPECDRAFT_V16)
            // panels in groups of NB, the groups spread over the threads (2 where there are few)
            const int64_t NB = P >= 64 ? 4 : 2;
            const int64_t groups = (P + NB - 1) / NB;
            // rows in chunks: prepare(r0, rows) gives the chunk's inputs as its tiles read them, then
            // run(nb, rows, inputs, panels, out, n0) does each group of nb panels on some thread
            auto chunks = [&](auto&& prepare, auto&& run) {
                for (int64_t r0 = 0; r0 < M; r0 += PANEL_ROW_CHUNK) {
                    const int64_t rows = std::min(PANEL_ROW_CHUNK, M - r0);
                    const auto* xr = prepare(r0, rows);
                    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
                        for (int64_t g = begin; g < end; ++g) {
                            const int64_t p0 = g * NB;
                            with_panels(std::min(NB, P - p0), [&](auto nb) {
                                run(nb, rows, xr, pp + p0 * K * LANES, po + r0 * N, p0 * LANES);
                            });
                        }
                    });
                }
            };
#if defined(__AVX512BF16__) && SPECDRAFT_V16 == 512
            if constexpr (std::is_same_v<T, c10::BFloat16>) {
                if (bf16_pairs(K)) {
                    // x's pairs swapped once per chunk of rows (pair_tile: input k goes first)
                    const int64_t K2 = K / 2;
                    std::vector<uint32_t> swapped(std::min(PANEL_ROW_CHUNK, M) * K2);
                    const uint32_t* x32 = reinterpret_cast<const uint32_t*>(px);
                    chunks([&](int64_t r0, int64_t rows) {
                               for (int64_t i = 0; i < rows * K2; ++i) {
                                   const uint32_t v = x32[r0 * K2 + i];
                                   swapped[i] = (v >> 16) | (v << 16);
                               }
                               return static_cast<const uint32_t*>(swapped.data());
                           },
                           [&](auto nb, int64_t rows, const uint32_t* xs, const T* pg, T* orow, int64_t n0) {
                               walk_tiles<decltype(nb)::value>(rows, [&](auto mt, auto nt, int64_t m, int j) {
                                   pair_tile<decltype(mt)::value, decltype(nt)::value>(
                                       xs + m * K2, K2, pg + j * K * LANES, orow + m * N, N, pb, n0 + LANES * j);
                               });
                           });
                    return;
                }
            }
#endif
            // a chunk's rows widened to float32 once (exact), so that a tile broadcasts each x[m, k]
            // straight from memory rather than widening it again for every group of panels
            std::vector<float> widened(std::is_same_v<T, float> ? 0 : std::min(PANEL_ROW_CHUNK, M) * K);
            chunks([&](int64_t r0, int64_t rows) -> const float* {
                       if constexpr (std::is_same_v<T, float>) {
                           return px + r0 * K;
                       } else {
                           for (int64_t i = 0; i < rows * K; ++i) widened[i] = widen(px[r0 * K + i]);
                           return widened.data();
                       }
                   },
                   [&](auto nb, int64_t rows, const float* xr, const T* pg, T* orow, int64_t n0) {
                       panel_rows<T, decltype(nb)::value>(rows, xr, K, pg, orow, N, pb, n0);
                   });
#else
            // the same arithmetic, one output at a time (correct anywhere; cpu_ops.py uses it with AVX-512 or AVX2 only)
            at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
                for (int64_t n = begin; n < end; ++n) {
                    const T* w = pp + (n / LANES) * K * LANES + n % LANES;
                    for (int64_t m = 0; m < M; ++m) {
                        float acc = 0.0f;
                        for (int64_t k = 0; k < K; ++k) acc = std::fma(widen(px[m * K + k]), widen(w[k * LANES]), acc);
                        po[m * N + n] = static_cast<T>(pb ? acc + widen(pb[n]) : acc);
                    }
                }
            });
#endif
        }
    });
    return out;
}

// --- products with a GGUF file's own blocks -----------------------------------------------------
//
// The weights are llama.cpp's blocks as they are: per group g of 32 inputs and output n, w = d * q + m
// (Q4_1: q 4-bit unsigned; Q4_0 as Q4_1 with m = -8 d) or w = d * q (Q8_0: q 8-bit signed), d and m
// float16. As llama.cpp does, each row of x is quantised per group to 8 bits (sx = max |x| / 127,
// qx = round(x / sx), ties to even), the integers multiplied and summed exactly in int32 (AVX-512
// VNNI: 64 products per instruction; AVX2: 32, in two steps, see dot4), and each group's sum
// scaled in float32:
//
//     out[m, n] = sum over g in order of (d[n, g] * sx[m, g]) * isum[m, n, g] + m[n, g] * xs[m, g]
//
// with isum = sum_i qx[m, 32g + i] * q[n, 32g + i] and xs the group's float32 sum of x (in order).
// Integer sums are exact in any order and the float steps run in a fixed order, so each output is
// the same whatever the row count, tile or thread: row-invariant by construction, and the scalar
// loop (neither) gives the same bits. Layout (cpu_ops.pack_blocks): panels of 16 output columns;
// per panel and group, chunks of 64 bytes, column c's 4 bytes at 4c of a chunk: for 4-bit blocks 4
// chunks, chunk r holding q[c, 32g + 4r + j] in the low and q[c, 32g + 16 + 4r + j] in the high
// nibble of byte j; for 8-bit blocks 8 chunks, chunk r holding q[c, 32g + 4r + j] + 128 (unsigned,
// so that the activations stay the signed operand; the 128 * sum(qx) it adds is taken off).

// a row's groups: its 8-bit values, their scale, the float32 sum of x and the sum of the 8-bit values
struct QuantRows {
    std::vector<int8_t> q;     // [M, K]
    std::vector<float> scale;  // [M, G]
    std::vector<float> xsum;   // [M, G]
    std::vector<int32_t> qsum; // [M, G]
};

template <typename T>
QuantRows quantise_rows(const T* x, int64_t M, int64_t K) {
    const int64_t G = K / 32;
    QuantRows r{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G),
                std::vector<int32_t>(M * G)};
    for (int64_t m = 0; m < M; ++m)
        for (int64_t g = 0; g < G; ++g) {
            float v[32], amax = 0.0f, sum = 0.0f;
            for (int i = 0; i < 32; ++i) {
                v[i] = widen(x[m * K + 32 * g + i]);
                amax = std::max(amax, std::fabs(v[i]));
                sum += v[i];
            }
            const float scale = amax / 127.0f, inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
            int32_t qs = 0;
            for (int i = 0; i < 32; ++i) {
                const float qv = std::min(127.0f, std::max(-127.0f, std::nearbyint(v[i] * inverse)));
                r.q[m * K + 32 * g + i] = static_cast<int8_t>(qv);
                qs += static_cast<int32_t>(qv);
            }
            r.scale[m * G + g] = scale;
            r.xsum[m * G + g] = sum;
            r.qsum[m * G + g] = qs;
        }
    return r;
}

// one output's group: d * sx * isum (+ m * xs); the same expression in the vector and scalar paths
inline float group_term(float acc, int32_t isum, float d, float sx, const c10::Half* mn, int64_t mi, float xs) {
    acc = std::fma(static_cast<float>(isum), d * sx, acc);
    return mn ? std::fma(static_cast<float>(mn[mi]), xs, acc) : acc;
}

// I16: 16 int32 lanes, one per output column of a panel, and the 64-byte chunks that feed them
// (column c's 4 bytes at 4c); dot4(acc, w, x): each lane plus the sum of its 4 products of w's
// unsigned bytes and x's signed ones, exactly (integers: any instruction gives the same sums).
// AVX-512 VNNI: one vpdpbusd. AVX2: vpmaddubsw then vpmaddwd, whose 16-bit pair sums saturate
// above 32767, so each byte is taken as its two nibbles (15 * 127 * 2 fits) and the high one's sum
// shifted by 4; a 4-bit block's bytes are nibbles already (dot4_nibbles).
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define SPECDRAFT_BLOCKS 512
using I16 = __m512i;
inline I16 i16_zero() { return _mm512_setzero_si512(); }
inline I16 i16_chunk(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline I16 i16_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline I16 i16_sub(I16 a, I16 b) { return _mm512_sub_epi32(a, b); }
inline I16 low_nibbles(I16 v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline I16 high_nibbles(I16 v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline I16 dot4_nibbles(I16 acc, I16 w, I16 x) { return _mm512_dpbusd_epi32(acc, w, x); }
inline I16 dot4(I16 acc, I16 w, I16 x) { return _mm512_dpbusd_epi32(acc, w, x); }
inline V16 i16_float(I16 a) { return _mm512_cvtepi32_ps(a); }
#elif SPECDRAFT_V16 == 256
#define SPECDRAFT_BLOCKS 256
struct I16 {
    __m256i lo, hi;
};
inline I16 i16_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I16 i16_chunk(const uint8_t* p) {
    return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline I16 i16_set1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I16 i16_sub(I16 a, I16 b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline I16 low_nibbles(I16 v) { return {low_nibbles(v.lo), low_nibbles(v.hi)}; }
inline I16 high_nibbles(I16 v) { return {high_nibbles(v.lo), high_nibbles(v.hi)}; }
inline __m256i sum4(__m256i w, __m256i x) {  // w's bytes below 16: no 16-bit sum saturates
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
inline I16 dot4_nibbles(I16 acc, I16 w, I16 x) {
    return {_mm256_add_epi32(acc.lo, sum4(w.lo, x.lo)), _mm256_add_epi32(acc.hi, sum4(w.hi, x.hi))};
}
inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
    const __m256i low = sum4(low_nibbles(w), x), high = sum4(high_nibbles(w), x);
    return _mm256_add_epi32(acc, _mm256_add_epi32(low, _mm256_slli_epi32(high, 4)));
}
inline I16 dot4(I16 acc, I16 w, I16 x) { return {dot4(acc.lo, w.lo, x.lo), dot4(acc.hi, w.hi, x.hi)}; }
inline V16 i16_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
#endif

#if defined(SPECDRAFT_BLOCKS)
// MB rows x NB panels (output columns n0 .. n0 + 16 * NB, fewer past N)
template <typename T, int MB, int NB, int BITS>
inline void block_tile(const QuantRows& xr, int64_t m0, int64_t K, const uint8_t* q, const c10::Half* d,
                       const c10::Half* mn, T* out, int64_t N, const T* bias, int64_t n0) {
    const int64_t G = K / 32, gq = BITS == 4 ? 256 : 512;
    V16 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
        for (int j = 0; j < NB; ++j) acc[m][j] = v16_zero();
    for (int64_t g = 0; g < G; ++g) {
        I16 isum[MB][NB];
        for (int m = 0; m < MB; ++m)
            for (int j = 0; j < NB; ++j) isum[m][j] = i16_zero();
        const int8_t* qx = xr.q.data() + m0 * K + 32 * g;
        if constexpr (BITS == 4) {
            for (int r = 0; r < 4; ++r) {
                I16 lo[NB], hi[NB];
                for (int j = 0; j < NB; ++j) {
                    const I16 v = i16_chunk(q + (j * G + g) * gq + 64 * r);
                    lo[j] = low_nibbles(v);
                    hi[j] = high_nibbles(v);
                }
                for (int m = 0; m < MB; ++m) {
                    int32_t a, b;
                    std::memcpy(&a, qx + m * K + 4 * r, 4);
                    std::memcpy(&b, qx + m * K + 16 + 4 * r, 4);
                    const I16 xa = i16_set1(a), xb = i16_set1(b);
                    for (int j = 0; j < NB; ++j) {
                        isum[m][j] = dot4_nibbles(isum[m][j], lo[j], xa);
                        isum[m][j] = dot4_nibbles(isum[m][j], hi[j], xb);
                    }
                }
            }
        } else {
            for (int r = 0; r < 8; ++r) {
                I16 w[NB];
                for (int j = 0; j < NB; ++j) w[j] = i16_chunk(q + (j * G + g) * gq + 64 * r);
                for (int m = 0; m < MB; ++m) {
                    int32_t a;
                    std::memcpy(&a, qx + m * K + 4 * r, 4);
                    const I16 xa = i16_set1(a);
                    for (int j = 0; j < NB; ++j) isum[m][j] = dot4(isum[m][j], w[j], xa);
                }
            }
        }
        for (int j = 0; j < NB; ++j) {
            const V16 dj = load16(d + (j * G + g) * LANES);
            const V16 mj = mn ? load16(mn + (j * G + g) * LANES) : v16_zero();
            for (int m = 0; m < MB; ++m) {
                const int64_t mg = (m0 + m) * G + g;
                I16 si = isum[m][j];
                if constexpr (BITS == 8) si = i16_sub(si, i16_set1(128 * xr.qsum[mg]));
                const V16 scale = v16_mul(dj, v16_set1(xr.scale[mg]));
                acc[m][j] = v16_fmadd(i16_float(si), scale, acc[m][j]);
                if (mn) acc[m][j] = v16_fmadd(mj, v16_set1(xr.xsum[mg]), acc[m][j]);
            }
        }
    }
    for (int j = 0; j < NB; ++j) {
        const int64_t col = n0 + LANES * j;
        if (col >= N) break;
        for (int m = 0; m < MB; ++m) store_columns(acc[m][j], bias, out + (m0 + m) * N, col, N);
    }
}

// all M rows against NB panels: one row against all NB, more rows 6 (AVX2: 3) at a time against one panel
template <typename T, int NB, int BITS>
inline void block_rows(int64_t M, const QuantRows& xr, int64_t K, const uint8_t* q, const c10::Half* d,
                       const c10::Half* mn, T* out, int64_t N, const T* bias, int64_t n0) {
    if (M == 1) {
        block_tile<T, 1, NB, BITS>(xr, 0, K, q, d, mn, out, N, bias, n0);
        return;
    }
    const int64_t G = K / 32, gq = BITS == 4 ? 256 : 512;
    for (int j = 0; j < NB; ++j) {
        const uint8_t* qj = q + j * G * gq;
        const c10::Half* dj = d + j * G * LANES;
        const c10::Half* mj = mn ? mn + j * G * LANES : nullptr;
        const int64_t nj = n0 + j * LANES;
        int64_t m = 0;
#if SPECDRAFT_BLOCKS == 512
        for (; m + 6 <= M; m += 6) block_tile<T, 6, 1, BITS>(xr, m, K, qj, dj, mj, out, N, bias, nj);
#else  // AVX2's 16 registers: 3 rows' float and integer sums
        for (; m + 3 <= M; m += 3) block_tile<T, 3, 1, BITS>(xr, m, K, qj, dj, mj, out, N, bias, nj);
#endif
        switch (M - m) {
            case 5: block_tile<T, 5, 1, BITS>(xr, m, K, qj, dj, mj, out, N, bias, nj); break;
            case 4: block_tile<T, 4, 1, BITS>(xr, m, K, qj, dj, mj, out, N, bias, nj); break;
            case 3: block_tile<T, 3, 1, BITS>(xr, m, K, qj, dj, mj, out, N, bias, nj); break;
            case 2: block_tile<T, 2, 1, BITS>(xr, m, K, qj, dj, mj, out, N, bias, nj); break;
            case 1: block_tile<T, 1, 1, BITS>(xr, m, K, qj, dj, mj, out, N, bias, nj); break;
            default: break;
        }
    }
}
#endif

// x # [M, K] (float32 or bfloat16), q # uint8 [P, G, 256] (4-bit) or [P, G, 512] (8-bit), d and mn
// (or None) # float16 [P, G, 16], bias # [N] of x's dtype or None
at::Tensor block_linear(const at::Tensor& x_, const at::Tensor& q_, const at::Tensor& d_,
                        const c10::optional<at::Tensor>& mn_, const c10::optional<at::Tensor>& bias_, int64_t N) {
    auto x = x_.contiguous();
    auto q = q_.contiguous();
    auto d = d_.contiguous();
    at::Tensor mn, bias;
    if (mn_.has_value()) mn = mn_->contiguous();
    if (bias_.has_value()) bias = bias_->contiguous();
    TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && d.device().is_cpu(), "specdraft_cpu::block_linear: CPU tensors only");
    TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "specdraft_cpu::block_linear: x # [M, K], float32 or bfloat16");
    const int64_t M = x.size(0), K = x.size(1), G = K / 32;
    TORCH_CHECK(K % 32 == 0 && q.scalar_type() == at::kByte && q.dim() == 3 && q.size(1) == G &&
                (q.size(2) == 256 || q.size(2) == 512), "specdraft_cpu::block_linear: q # uint8 [P, K / 32, 256 or 512]");
    const int64_t P = q.size(0);
    const int BITS = q.size(2) == 256 ? 4 : 8;
    TORCH_CHECK(P * LANES >= N && (P - 1) * LANES < N, "specdraft_cpu::block_linear: panels");
    TORCH_CHECK(d.scalar_type() == at::kHalf && d.sizes() == at::IntArrayRef({P, G, LANES}) &&
                (!mn.defined() || (mn.scalar_type() == at::kHalf && mn.sizes() == d.sizes())),
                "specdraft_cpu::block_linear: d, mn # float16 [P, K / 32, 16]");
    TORCH_CHECK(!bias.defined() || (bias.scalar_type() == x.scalar_type() && bias.numel() == N),
                "specdraft_cpu::block_linear: bias");
    auto out = at::empty({M, N}, x.options());
    if (M == 0) return out;
    QuantRows xr;
    dispatch(x.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        xr = quantise_rows(x.data_ptr<T>(), M, K);
    });
    const uint8_t* pq = q.data_ptr<uint8_t>();
    const c10::Half* pd = d.data_ptr<c10::Half>();
    const c10::Half* pm = mn.defined() ? mn.data_ptr<c10::Half>() : nullptr;
    const int64_t gq = q.size(2);
    dispatch(x.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        if constexpr (std::is_same_v<T, c10::Half>) {
            TORCH_CHECK(false, "specdraft_cpu::block_linear: float32 or bfloat16");
        } else {
            const T* pb = bias.defined() ? bias.data_ptr<T>() : nullptr;
            T* po = out.data_ptr<T>();
#if defined(SPECDRAFT_BLOCKS)
            // panels in groups of 4 (AVX2: 2), the groups spread over the threads
            const int64_t NB = SPECDRAFT_BLOCKS == 512 ? 4 : 2;
            const int64_t groups = (P + NB - 1) / NB;
            at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                    const int64_t p0 = NB * r;
                    const uint8_t* qp = pq + p0 * G * gq;
                    const c10::Half* dp = pd + p0 * G * LANES;
                    const c10::Half* mp = pm ? pm + p0 * G * LANES : nullptr;
                    const int64_t n0 = p0 * LANES;
                    const int64_t left = std::min(NB, P - p0);
                    if (BITS == 4) {
                        switch (left) {
                            case 4: block_rows<T, 4, 4>(M, xr, K, qp, dp, mp, po, N, pb, n0); break;
                            case 3: block_rows<T, 3, 4>(M, xr, K, qp, dp, mp, po, N, pb, n0); break;
                            case 2: block_rows<T, 2, 4>(M, xr, K, qp, dp, mp, po, N, pb, n0); break;
                            default: block_rows<T, 1, 4>(M, xr, K, qp, dp, mp, po, N, pb, n0); break;
                        }
                    } else {
                        switch (left) {
                            case 4: block_rows<T, 4, 8>(M, xr, K, qp, dp, mp, po, N, pb, n0); break;
                            case 3: block_rows<T, 3, 8>(M, xr, K, qp, dp, mp, po, N, pb, n0); break;
                            case 2: block_rows<T, 2, 8>(M, xr, K, qp, dp, mp, po, N, pb, n0); break;
                            default: block_rows<T, 1, 8>(M, xr, K, qp, dp, mp, po, N, pb, n0); break;
                        }
                    }
                }
            });
#else
            // the same arithmetic, one output at a time (exact integer sums, the float steps in the
            // same order): correct anywhere, and the same bits as the vector paths
            at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
                for (int64_t n = begin; n < end; ++n) {
                    const int64_t p = n / LANES, c = n % LANES;
                    for (int64_t m = 0; m < M; ++m) {
                        float acc = 0.0f;
                        for (int64_t g = 0; g < G; ++g) {
                            const uint8_t* b = pq + (p * G + g) * gq;
                            const int8_t* qx = xr.q.data() + m * K + 32 * g;
                            int32_t isum = 0;
                            if (BITS == 4) {
                                for (int r = 0; r < 4; ++r)
                                    for (int j = 0; j < 4; ++j) {
                                        const uint8_t v = b[64 * r + 4 * c + j];
                                        isum += (v & 0xF) * qx[4 * r + j] + (v >> 4) * qx[16 + 4 * r + j];
                                    }
                            } else {
                                for (int r = 0; r < 8; ++r)
                                    for (int j = 0; j < 4; ++j) isum += b[64 * r + 4 * c + j] * qx[4 * r + j];
                                isum -= 128 * xr.qsum[m * G + g];
                            }
                            const int64_t mi = (p * G + g) * LANES + c;
                            acc = group_term(acc, isum, static_cast<float>(pd[mi]), xr.scale[m * G + g], pm, mi,
                                             xr.xsum[m * G + g]);
                        }
                        po[m * N + n] = static_cast<T>(pb ? acc + widen(pb[n]) : acc);
                    }
                }
            });
#endif
        }
    });
    return out;
}

// --- a whole decoder layer ------------------------------------------------------------------------
//
// The operators above in the order TransformerBlock.forward runs them (norm, q/k/v product,
// rotation and cache write, attention, output product, residual add with the second norm, gate/up
// product, silu * up, down product, residual add), called here one after another: the same
// functions on the same tensors, so the same bits, without a return to Python between them (about
// 10 microseconds each on a 2-core Xeon, a quarter of a step). A product is given as its kind
// (0: panels, specdraft_cpu::linear; 1: blocks, specdraft_cpu::block_linear) and its tensors
// ([panels, bias] or [q, d, mn, bias], absent ones None); no attention norm: the layer's input as it is.

at::Tensor product(const at::Tensor& x, int64_t kind, const c10::List<c10::optional<at::Tensor>>& w, int64_t N) {
    const int64_t K = x.size(-1);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    const auto flat = x.reshape({-1, K});
    at::Tensor out;
    if (kind == 0) {
        TORCH_CHECK(w.size() == 2, "specdraft_cpu::decoder_layer: panels take [panels, bias]");
        out = linear(flat, *w.get(0), w.get(1), N);
    } else {
        TORCH_CHECK(w.size() == 4, "specdraft_cpu::decoder_layer: blocks take [q, d, mn, bias]");
        out = block_linear(flat, *w.get(0), *w.get(1), w.get(2), w.get(3), N);
    }
    return out.view(shape);
}

at::Tensor decoder_layer(const at::Tensor& x, const c10::optional<at::Tensor>& attention_norm, const at::Tensor& ffn_norm, double eps,
                         at::IntArrayRef kinds, at::IntArrayRef outs, const c10::List<c10::optional<at::Tensor>>& wqkv,
                         const c10::List<c10::optional<at::Tensor>>& wo, const c10::List<c10::optional<at::Tensor>>& w13,
                         const c10::List<c10::optional<at::Tensor>>& w2, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor k_buf, at::Tensor v_buf, const at::Tensor& slot, const at::Tensor& positions,
                         const at::Tensor& mask, double scale, const c10::optional<at::Tensor>& order, int64_t heads,
                         int64_t kv_heads) {
    TORCH_CHECK(kinds.size() == 4 && outs.size() == 4, "specdraft_cpu::decoder_layer: four products");
    // (no attention norm: EAGLE's layer reads its input as it is)
    const auto qkv = product(attention_norm.has_value() ? rms_norm(x, *attention_norm, eps) : x, kinds[0], wqkv, outs[0]);
    const auto q = rope_write(qkv, cos, sin, k_buf, v_buf, slot, positions, heads, kv_heads);
    const auto attended = product(attention(q, k_buf, v_buf, slot, mask, scale, order), kinds[1], wo, outs[1]);
    const auto [h, normed] = add_rms_norm(x, attended, ffn_norm, eps);
    return h + product(silu_mul(product(normed, kinds[2], w13, outs[2])), kinds[3], w2, outs[3]);
}

// Every layer of a model in one call: decoder_layer for layer 0, 1, ... on the cache's buffers of
// each layer cut to the pass's span, as run_blocks calls it layer by layer from Python (the same
// functions on the same tensors: the same bits), without the 20-40 microseconds a layer's call
// from Python costs (the block's module call, the buffers' views, the dispatcher's arguments): a
// millisecond of a 30-layer step. The layers' tensors come flattened: per layer one entry of
// attention_norms and ffn_norms, four of kinds and outs, and each product's tensors in turn (two
// for panels, four for blocks, by its kind). `collect`: the layers whose input (the residual stream
// entering them) is also returned, in order.
std::tuple<at::Tensor, std::vector<at::Tensor>> decoder_layers(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& attention_norms,
                          at::TensorList ffn_norms, double eps, at::IntArrayRef kinds, at::IntArrayRef outs,
                          const c10::List<c10::optional<at::Tensor>>& weights, const at::Tensor& cos,
                          const at::Tensor& sin, at::TensorList k_bufs, at::TensorList v_bufs, int64_t span,
                          const at::Tensor& slot, const at::Tensor& positions, const at::Tensor& mask, double scale,
                          const c10::optional<at::Tensor>& order, int64_t heads, int64_t kv_heads,
                          at::IntArrayRef collect) {
    const int64_t layers = static_cast<int64_t>(ffn_norms.size());
    TORCH_CHECK(static_cast<int64_t>(attention_norms.size()) == layers && static_cast<int64_t>(k_bufs.size()) == layers &&
                static_cast<int64_t>(v_bufs.size()) == layers && static_cast<int64_t>(kinds.size()) == 4 * layers &&
                static_cast<int64_t>(outs.size()) == 4 * layers, "specdraft_cpu::decoder_layers: per-layer lists of one length");
    at::Tensor h = x;
    std::vector<at::Tensor> collected;
    size_t next = 0;  // the next product's first tensor in `weights`
    for (int64_t i = 0; i < layers; ++i) {
        if (std::find(collect.begin(), collect.end(), i) != collect.end()) collected.push_back(h);
        c10::List<c10::optional<at::Tensor>> w[4];
        for (int j = 0; j < 4; ++j) {
            const size_t count = kinds[4 * i + j] == 0 ? 2 : 4;
            TORCH_CHECK(next + count <= weights.size(), "specdraft_cpu::decoder_layers: too few weights");
            for (size_t t = 0; t < count; ++t) w[j].push_back(weights.get(next + t));
            next += count;
        }
        h = decoder_layer(h, attention_norms.get(i), ffn_norms[i], eps, kinds.slice(4 * i, 4), outs.slice(4 * i, 4),
                          w[0], w[1], w[2], w[3], cos, sin, k_bufs[i].slice(2, 0, span), v_bufs[i].slice(2, 0, span),
                          slot, positions, mask, scale, order, heads, kv_heads);
    }
    TORCH_CHECK(next == weights.size(), "specdraft_cpu::decoder_layers: too many weights");
    return {h, collected};
}

// --- greedy drafting through a copy gate ---------------------------------------------------------
//
// CopyDrafting.choose (drafters/common/copy_gate.py) for rows of a head's logits in one call: each
// row's copy candidate (the token after the most recent earlier occurrence of its trailing n-gram,
// longest n first: the prompt-lookup rule of device_candidates), the gate
// g = sigmoid(w.h + b + match[n] + agree * max(log p(candidate), -30)) (0 without a candidate) and
// the mixture's most likely token: the candidate when g + (1 - g) p(candidate) >= (1 - g) max p.
// Drafting only (no row of the target's output depends on it); in Python it is some fifty small
// operators per drafted token, about a millisecond on a 2-core Xeon.

std::tuple<at::Tensor, at::Tensor> copy_choose(const at::Tensor& small, const at::Tensor& hidden, const at::Tensor& ids,
                                               const at::Tensor& lengths, const c10::optional<at::Tensor>& slot,
                                               const c10::optional<at::Tensor>& head_ids, const at::Tensor& proj,
                                               double proj_bias, const at::Tensor& match_bias, double agree,
                                               int64_t min_ngram, int64_t max_ngram) {
    TORCH_CHECK(small.dim() == 2 && hidden.dim() == 2 && ids.dim() == 2, "specdraft_cpu::copy_choose: 2-D rows");
    const int64_t B = small.size(0), N = small.size(1), H = hidden.size(1), L = ids.size(1);
    const auto logits = small.to(at::kFloat).contiguous();
    const auto h = hidden.to(at::kFloat).contiguous();
    const auto w = proj.to(at::kFloat).contiguous();
    const auto mb = match_bias.to(at::kFloat).contiguous();
    const auto tok = ids.to(at::kLong).contiguous();
    const auto len = lengths.to(at::kLong).contiguous();
    const auto sl = slot.has_value() ? slot->to(at::kLong).contiguous() : at::Tensor();
    const auto hi = head_ids.has_value() ? head_ids->to(at::kLong).contiguous() : at::Tensor();
    auto token = at::empty({B}, at::kLong);
    auto confidence = at::empty({B}, at::kFloat);
    for (int64_t b = 0; b < B; ++b) {
        const int64_t* row = tok.data_ptr<int64_t>() + b * L;
        const int64_t n_row = std::min(len.data_ptr<int64_t>()[b], L);
        int64_t candidate = -1, match = 0;
        for (int64_t n = max_ngram; n >= min_ngram && candidate < 0; --n) {
            for (int64_t s = n_row - 1 - n; s >= 0; --s) {  // the most recent earlier occurrence
                int64_t i = 0;
                while (i < n && row[s + i] == row[n_row - n + i]) ++i;
                if (i == n) {
                    candidate = row[s + n];
                    match = n;
                    break;
                }
            }
        }
        const float* x = logits.data_ptr<float>() + b * N;
        int64_t top = 0;
        for (int64_t j = 1; j < N; ++j)
            if (x[j] > x[top]) top = j;
        float total = 0.f;
        for (int64_t j = 0; j < N; ++j) total += std::exp(x[j] - x[top]);
        const float top_p = 1.f / total;
        const int64_t best = hi.defined() ? hi.data_ptr<int64_t>()[top] : top;
        float gate = 0.f, p_copy = 0.f;
        if (match > 0) {
            const int64_t column = !sl.defined() ? candidate : (candidate < sl.size(0) ? sl.data_ptr<int64_t>()[candidate] : -1);
            if (column >= 0 && column < N) p_copy = std::exp(x[column] - x[top]) / total;
            float z = static_cast<float>(proj_bias) + mb.data_ptr<float>()[match];
            z += dot(h.data_ptr<float>() + b * H, w.data_ptr<float>(), H);
            z += static_cast<float>(agree) * std::max(p_copy > 0.f ? std::log(p_copy) : -30.f, -30.f);
            gate = 1.f / (1.f + std::exp(-z));
        }
        const float copy_weight = gate + (1.f - gate) * p_copy, top_weight = (1.f - gate) * top_p;
        token.data_ptr<int64_t>()[b] = gate > 0.f && copy_weight >= top_weight ? candidate : best;
        confidence.data_ptr<float>()[b] = std::max(copy_weight, top_weight);
    }
    return {token, confidence};
}

// the width of the vector unit the panel products were built for: 512 (AVX-512), 256 (AVX2 with
// FMA) or 0 (the scalar loop: correct, too slow to use)
int64_t vector_bits() {
#if defined(SPECDRAFT_V16)
    return SPECDRAFT_V16;
#else
    return 0;
#endif
}

// the cache level the panel products prefetch their weights into: 1, 2 (see prefetch_to_l2), or 0
// (the scalar loop, which does not prefetch)
int64_t prefetch_level() {
#if defined(SPECDRAFT_V16)
    return prefetch_to_l2() ? 2 : 1;
#else
    return 0;
#endif
}

}  // namespace

TORCH_LIBRARY(specdraft_cpu, m) {
    m.def("vector_bits() -> int", &vector_bits);
    m.def("prefetch_level() -> int", &prefetch_level);
    m.def("bf16_pairs(int inputs) -> bool", &bf16_pairs);
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("add_rms_norm(Tensor x, Tensor y, Tensor weight, float eps) -> (Tensor, Tensor)");
    m.def("silu_mul(Tensor g) -> Tensor");
    m.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor slot, "
          "Tensor positions, int heads, int kv_heads) -> Tensor");
    m.def("attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor slot, Tensor mask, float scale, "
          "Tensor? order) -> Tensor");
    m.def("pass_tables(Tensor starts, int width, int span, Tensor table, int? window) -> (Tensor, Tensor, Tensor, Tensor)");
    m.def("linear(Tensor x, Tensor panels, Tensor? bias, int out_features) -> Tensor");
    m.def("block_linear(Tensor x, Tensor q, Tensor d, Tensor? mn, Tensor? bias, int out_features) -> Tensor");
    m.def("copy_choose(Tensor small, Tensor hidden, Tensor ids, Tensor lengths, Tensor? slot, Tensor? head_ids, "
          "Tensor proj, float proj_bias, Tensor match_bias, float agree, int min_ngram, int max_ngram) -> (Tensor, Tensor)");
    m.def("decoder_layer(Tensor x, Tensor? attention_norm, Tensor ffn_norm, float eps, int[] kinds, int[] outs, "
          "Tensor?[] wqkv, Tensor?[] wo, Tensor?[] w13, Tensor?[] w2, Tensor cos, Tensor sin, Tensor(a!) k_buf, "
          "Tensor(b!) v_buf, Tensor slot, Tensor positions, Tensor mask, float scale, Tensor? order, int heads, "
          "int kv_heads) -> Tensor");
    m.def("decoder_layers(Tensor x, Tensor?[] attention_norms, Tensor[] ffn_norms, float eps, int[] kinds, int[] outs, "
          "Tensor?[] weights, Tensor cos, Tensor sin, Tensor(a!)[] k_bufs, Tensor(b!)[] v_bufs, int span, Tensor slot, "
          "Tensor positions, Tensor mask, float scale, Tensor? order, int heads, int kv_heads, int[] collect) -> "
          "(Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(specdraft_cpu, CPU, m) {
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("silu_mul", &silu_mul);
    m.impl("rope_write", &rope_write);
    m.impl("attention", &attention);
    m.impl("pass_tables", &pass_tables);
    m.impl("linear", &linear);
    m.impl("block_linear", &block_linear);
    m.impl("decoder_layer", &decoder_layer);
    m.impl("decoder_layers", &decoder_layers);
    m.impl("copy_choose", &copy_choose);
}
