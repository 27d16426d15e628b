/* The converter's per-element loops in C (project issue 20), loaded through ctypes by convert/native.py.
 *
 * NumPy reaches the int8 quantizer's result in about ten passes over each block (widen, shift, divide, round, narrow,
 * subtract, abs, two reductions); these functions make one pass over the source instead. They compute what
 * quantize.py's NumPy loops compute, value for value: IEEE float32 division by the group's scale, rounding half to
 * even, and error statistics that do not depend on the order of the elements (a float32 maximum and an exact integer
 * sum), so either path writes the same bytes. Built without -ffast-math (the compiler may not reassociate), with an
 * AVX2 clone chosen at load time where the CPU has it.
 *
 * Every function takes `groups` runs of `g` contiguous elements (a chunk's rows cut into quantization groups).
 */
#include <stdint.h>
#include <string.h>

/* 1.5 x 2^23: for |x| < 2^22, (x + ROUNDER) - ROUNDER is x rounded to an integer, ties to even (the sum lies in
 * [2^23, 2^24), where the float32 spacing is 1, and ROUNDER is even). |x| <= 127 here. */
#define ROUNDER 12582912.0f
/* The error |x - rint(x)| (at most 0.5) is counted in units of 2^-24 of the scale, truncated: an exact integer sum
 * whatever the order (quantize.py: ERROR_UNITS). */
#define ERROR_UNITS 16777216.0f
#define F16_SMALLEST_STEPS 16777216.0f /* 2^24: float16's subnormals are k x 2^-24 */
/* Elements summed in int32 before the int64 total: 128 x 2^23 = 2^30 cannot overflow. */
#define INT32_RUN 128

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The largest magnitude bits (the bits below the sign) of each group: colibri_group_max_bits16 for 16-bit floats
 * (bf16 or float16 patterns), colibri_group_max_bits32 for float32 patterns. */
#define GROUP_MAX_BITS(name, type, mask)                                                                               \
    CLONES void name(const type *src, int64_t groups, int64_t g, type *out) {                                         \
        for (int64_t j = 0; j < groups; j++) {                                                                         \
            const type *p = src + j * g;                                                                               \
            type top = 0;                                                                                              \
            for (int64_t k = 0; k < g; k++) {                                                                          \
                type v = p[k] & (mask);                                                                                \
                top = v > top ? v : top;                                                                               \
            }                                                                                                          \
            out[j] = top;                                                                                              \
        }                                                                                                              \
    }
GROUP_MAX_BITS(colibri_group_max_bits16, uint16_t, 0x7FFFu)
GROUP_MAX_BITS(colibri_group_max_bits32, uint32_t, 0x7FFFFFFFu)

/* One run of n <= INT32_RUN values w (float32) of a group with scale s: q = rint(w / s) into `q`; returns the int32
 * error units (|w / s - q| x `units`, truncated: at most 2^23 each) and raises *top_bits to the largest |w / s - q|
 * seen (as bits: non-negative floats order as their patterns do, which keeps the maximum an integer one). */
static inline int32_t quantize_run(const float *w, int64_t n, float s, float units_per_step, int8_t *q,
                                   uint32_t *top_bits) {
    int32_t units = 0;
    uint32_t top = *top_bits;
    for (int64_t k = 0; k < n; k++) {
        float x = w[k] / s;
        float r = (x + ROUNDER) - ROUNDER;
        q[k] = (int8_t)(int32_t)r;
        uint32_t b = float_bits(x - r) & 0x7FFFFFFFu;  /* |x - r|, +0 for a -0 difference */
        top = b > top ? b : top;
        units += (int32_t)(bits_float(b) * units_per_step);
    }
    *top_bits = top;
    return units;
}

/* Two int4 codes in one byte: `lo` (input 2k) in the low nibble, `hi` (input 2k + 1) in the high one, two's
 * complement. */
static inline uint8_t nibble_pair(int32_t lo, int32_t hi) {
    return (uint8_t)(((uint32_t)lo & 0xFu) | (((uint32_t)hi & 0xFu) << 4));
}

/* int4_group: one run of n (even, <= INT32_RUN) float32 values w of a group with scale s (|w / s| <= 7: the scale
 * is max|w| / 7 rounded up): the int8 codes q = rint(w / s) as quantize_run makes them (its loop vectorizes), then
 * packed two a byte into `packed` (nibble_pair). */
static inline int32_t quantize4_run(const float *w, int64_t n, float s, float units_per_step, uint8_t *packed,
                                    uint32_t *top_bits) {
    int8_t codes[INT32_RUN];
    int32_t units = quantize_run(w, n, s, units_per_step, codes, top_bits);
    for (int64_t k = 0; k < n / 2; k++)
        packed[k] = nibble_pair(codes[2 * k], codes[2 * k + 1]);
    return units;
}

/* A run of float32 weights as they are, or of bf16 patterns widened into `buf` (exact: the pattern's top 16 bits). */
static inline const float *as_f32(const float *p, int64_t n, float *buf) {
    (void)n, (void)buf;
    return p;
}

static inline const float *widen_bf16(const uint16_t *p, int64_t n, float *buf) {
    for (int64_t i = 0; i < n; i++)
        buf[i] = bits_float((uint32_t)p[i] << 16);
    return buf;
}

#define BYTE_OF_INT8(i) (i)
#define BYTE_OF_INT4(i) ((i) / 2)

/* The quantizers: each group's values, in runs of at most INT32_RUN, through RUN (quantize_run: int8 codes;
 * quantize4_run: int4 codes two a byte, g even) from the source type's WIDEN; err_max gets each group's max
 * |w/s - q| and err_units the sum of its truncated error units, STEP_UNITS a step (int8: ERROR_UNITS; int4: the
 * caller's `group_units[j]`, which quantize.py makes finer for groups far below their float16 scale). */
#define QUANTIZE_GROUPS(name, src_type, q_type, widen, run, byte_of, units_param, step_units)                          \
    CLONES void name(const src_type *src, const float *scale units_param, int64_t groups, int64_t g, q_type *q,      \
                     float *err_max, int64_t *err_units) {                                                             \
        float buf[INT32_RUN];                                                                                          \
        for (int64_t j = 0; j < groups; j++) {                                                                         \
            uint32_t top = 0;                                                                                          \
            int64_t units = 0;                                                                                         \
            for (int64_t k = 0; k < g; k += INT32_RUN) {                                                               \
                int64_t n = g - k < INT32_RUN ? g - k : INT32_RUN;                                                     \
                units += run(widen(src + j * g + k, n, buf), n, scale[j], step_units, q + byte_of(j * g + k), &top);   \
            }                                                                                                          \
            err_max[j] = bits_float(top);                                                                              \
            err_units[j] = units;                                                                                      \
        }                                                                                                              \
    }
#define UNITS4_PARAM , const float *group_units
QUANTIZE_GROUPS(colibri_quantize_f32, float, int8_t, as_f32, quantize_run, BYTE_OF_INT8, , ERROR_UNITS)
QUANTIZE_GROUPS(colibri_quantize_bf16, uint16_t, int8_t, widen_bf16, quantize_run, BYTE_OF_INT8, , ERROR_UNITS)
QUANTIZE_GROUPS(colibri_quantize4_f32, float, uint8_t, as_f32, quantize4_run, BYTE_OF_INT4, UNITS4_PARAM,
                group_units[j])
QUANTIZE_GROUPS(colibri_quantize4_bf16, uint16_t, uint8_t, widen_bf16, quantize4_run, BYTE_OF_INT4, UNITS4_PARAM,
                group_units[j])

/* int4_group with quantize.py's `search` (quantize_int4_into): each group's scale is the least-squared-error one of
 * the round-to-nearest scale, max|w| / d for the caller's divisors, -w_m / 8 and one least-squares refit, each a
 * float16, q = rint(w / s) clipped to [-8, 7]. Every float32 operation is quantize.py's (_search_scales,
 * _group_sse, _lane_sum, _as_f16), in the same order, so both write the same scales and codes. */
#define SEARCH_LANES 8      /* quantize.py SEARCH_LANES: sums in interleaved lanes, then a fixed tree */
#define F16_OVERFLOW 0x477FF000u  /* 65520: from here float16 rounds to infinity */
#define F16_MIN_NORMAL 0x38800000u /* 2^-14 */

/* v's float16 image, as a float32 (round to nearest even; infinity from 65520 up, as NumPy's astype). Normal
 * values are rounded to their float16 step by adding and subtracting 1.5 x 2^(e + 13), whose float32 step it is;
 * subnormal ones to steps of 2^-24 (scaled by 2^24: exact). */
static inline float round_to_f16(float v) {
    uint32_t sign = float_bits(v) & 0x80000000u, mag = float_bits(v) & 0x7FFFFFFFu;
    float a = bits_float(mag), r;
    if (mag >= F16_OVERFLOW)
        return bits_float(sign | 0x7F800000u);
    if (mag < F16_MIN_NORMAL) {
        r = ((a * F16_SMALLEST_STEPS + ROUNDER) - ROUNDER) / F16_SMALLEST_STEPS;
    } else {
        float c = bits_float((((mag >> 23) + 13u) << 23) | 0x400000u);
        r = (a + c) - c;
    }
    return bits_float(sign | float_bits(r));
}

static inline float clipped_rint(float t) {
    float r = (t + ROUNDER) - ROUNDER; /* beyond 2^22 not rint, but still past the clip */
    return r < -8.0f ? -8.0f : (r > 7.0f ? 7.0f : r);
}

/* The sum of v[0..g) over SEARCH_LANES lanes (v padded with +0 to whole rounds), then ((l0+l1)+(l2+l3))+(...). */
static inline float lane_sum(const float *v, int64_t g) {
    float acc[SEARCH_LANES];
    int64_t whole = g / SEARCH_LANES * SEARCH_LANES;
    for (int l = 0; l < SEARCH_LANES; l++)
        acc[l] = l < g ? v[l] : 0.0f;
    for (int64_t k = SEARCH_LANES; k < whole; k += SEARCH_LANES) /* whole rounds: no test, so it vectorizes */
        for (int l = 0; l < SEARCH_LANES; l++)
            acc[l] += v[k + l];
    if (whole >= SEARCH_LANES && whole < g)
        for (int l = 0; l < SEARCH_LANES; l++)
            acc[l] += whole + l < g ? v[whole + l] : 0.0f;
    float p0 = acc[0] + acc[1], p1 = acc[2] + acc[3], p2 = acc[4] + acc[5], p3 = acc[6] + acc[7];
    return (p0 + p1) + (p2 + p3);
}

/* The squared error of x[0..g) with scale s (infinity for a zero or non-finite s); q gets the clipped codes. */
static inline float group_sse(const float *x, int64_t g, float s, float *q) {
    if (s == 0.0f || (float_bits(s) & 0x7F800000u) == 0x7F800000u)
        return bits_float(0x7F800000u);
    float sq[INT32_RUN];
    for (int64_t k = 0; k < g; k++) {
        q[k] = clipped_rint(x[k] / s);
        float d = x[k] - q[k] * s;
        sq[k] = d * d;
    }
    return lane_sum(sq, g);
}

static inline float search_scale(const float *x, int64_t g, float base, const float *divisors, int64_t n_divisors) {
    float q[INT32_RUN], t[INT32_RUN], amax = bits_float(float_bits(x[0]) & 0x7FFFFFFFu), wm = x[0];
    for (int64_t k = 1; k < g; k++) {
        float m = bits_float(float_bits(x[k]) & 0x7FFFFFFFu);
        if (m > amax) {
            amax = m;
            wm = x[k];
        }
    }
    float best = base, best_err = group_sse(x, g, base, q);
    for (int64_t i = 0; i <= n_divisors; i++) {
        float s = round_to_f16(i < n_divisors ? amax / divisors[i] : -wm / 8.0f);
        float err = group_sse(x, g, s, q);
        if (err < best_err) {
            best = s;
            best_err = err;
        }
    }
    group_sse(x, g, best, q);
    for (int64_t k = 0; k < g; k++)
        t[k] = q[k] * q[k];
    float den = lane_sum(t, g);
    for (int64_t k = 0; k < g; k++)
        t[k] = x[k] * q[k];
    float fit = round_to_f16(lane_sum(t, g) / (den > 0.0f ? den : 1.0f));
    return group_sse(x, g, fit, q) < best_err && den > 0.0f ? fit : best;
}

/* Each group (g <= INT32_RUN, even): its searched scale into scale[j] (the round-to-nearest one on entry), its
 * codes two a byte into q, err_max and err_units (int64: a clipped error may pass half a step) as above. */
#define QUANTIZE4_SEARCH(name, src_type, widen)                                                                        \
    CLONES void name(const src_type *src, float *scale, const float *group_units, const float *divisors,              \
                     int64_t n_divisors, int64_t groups, int64_t g, uint8_t *q, float *err_max, int64_t *err_units) { \
        float buf[INT32_RUN];                                                                                          \
        for (int64_t j = 0; j < groups; j++) {                                                                         \
            const float *x = widen(src + j * g, g, buf);                                                               \
            float s = search_scale(x, g, scale[j], divisors, n_divisors);                                              \
            uint32_t top = 0;                                                                                          \
            int64_t units = 0;                                                                                         \
            for (int64_t k = 0; k < g; k += 2) {                                                                       \
                float t0 = x[k] / s, t1 = x[k + 1] / s, r0 = clipped_rint(t0), r1 = clipped_rint(t1);                  \
                q[(j * g + k) / 2] = nibble_pair((int32_t)r0, (int32_t)r1);                                            \
                uint32_t b0 = float_bits(t0 - r0) & 0x7FFFFFFFu, b1 = float_bits(t1 - r1) & 0x7FFFFFFFu;               \
                top = b0 > top ? b0 : top;                                                                             \
                top = b1 > top ? b1 : top;                                                                             \
                units += (int64_t)(int32_t)(bits_float(b0) * group_units[j]);                                          \
                units += (int64_t)(int32_t)(bits_float(b1) * group_units[j]);                                          \
            }                                                                                                          \
            scale[j] = s;                                                                                              \
            err_max[j] = bits_float(top);                                                                              \
            err_units[j] = units;                                                                                      \
        }                                                                                                              \
    }
QUANTIZE4_SEARCH(colibri_quantize4_search_f32, float, as_f32)
QUANTIZE4_SEARCH(colibri_quantize4_search_bf16, uint16_t, widen_bf16)

/* FP8 sources (convert/derived.py Fp8Blocks): rows of e4m3 bytes q [rows, cols] to float32, out = table[q] x the
 * scale of the row's and column's block, scales [.., ceil(cols / bn)] starting at the block of row `first` (the
 * table is derived.py's E4M3: one multiply, as NumPy's). */
CLONES void colibri_fp8_rows(const uint8_t *q, int64_t rows, int64_t cols, const float *scales, int64_t first,
                             int64_t bm, int64_t bn, const float *table, float *out) {
    int64_t scale_cols = (cols + bn - 1) / bn;
    for (int64_t i = 0; i < rows; i++) {
        const float *row_scales = scales + ((first + i) / bm - first / bm) * scale_cols;
        for (int64_t c0 = 0; c0 < cols; c0 += bn) {
            int64_t c1 = c0 + bn < cols ? c0 + bn : cols;
            float s = row_scales[c0 / bn];
            for (int64_t c = c0; c < c1; c++)
                out[i * cols + c] = table[q[i * cols + c]] * s;
        }
    }
}

/* The smallest bf16 magnitude (bits & 0x7FFF) whose float16 image is a normal number, and the first one beyond
 * float16 (65536 and up, inf, NaN): cast.py's constants. */
#define F16_NORMAL_LO 0x3880u
#define F16_OUT_OF_RANGE 0x4780u
#define CAST_RUN 4096                   /* elements counted in int32 before the int64 total */

/* bf16 patterns to float16 patterns. Normal-range values are rebiased (bf16's 7 mantissa bits fit float16's 10:
 * exact); smaller ones become k x 2^-24 with k = their value x 2^24 (exact) rounded to an integer, ties to even, as
 * IEEE float32 -> float16 rounds them (k = 1024 is the smallest normal, whose pattern is 0x0400 = 1024 too).
 * Values beyond float16 (65536 and up, inf, NaN) are left to the caller, which converts them as NumPy does: their
 * outputs here are the signed float16 infinity, and the function returns how many there are. */
CLONES int64_t colibri_bf16_to_f16(const uint16_t *src, int64_t n, uint16_t *dst) {
    int64_t beyond = 0;
    for (int64_t start = 0; start < n; start += CAST_RUN) {
        int64_t stop = n - start < CAST_RUN ? n : start + CAST_RUN;
        int32_t run_beyond = 0;
        for (int64_t i = start; i < stop; i++) { /* branch-free (masks, not branches), so that it vectorizes */
            uint32_t mag = src[i] & 0x7FFFu;
            uint32_t is_normal = 0u - (uint32_t)(mag >= F16_NORMAL_LO);
            uint32_t is_beyond = 0u - (uint32_t)(mag >= F16_OUT_OF_RANGE);
            uint32_t normal = ((mag - 0x3800u) << 3) & 0x7FFFu;
            float small = bits_float((mag & ~is_normal) << 16);
            uint32_t below = (uint32_t)(int32_t)((small * F16_SMALLEST_STEPS + ROUNDER) - ROUNDER);
            uint32_t out = (is_beyond & 0x7C00u) | (~is_beyond & ((is_normal & normal) | (~is_normal & below)));
            run_beyond -= (int32_t)is_beyond;
            dst[i] = (uint16_t)((src[i] & 0x8000u) | out);
        }
        beyond += run_beyond;
    }
    return beyond;
}
