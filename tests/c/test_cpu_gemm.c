/* cpu_gemm.h's matrix product against a float64 reference: sizes around
 * the micro-tile and the cache blocks (1, 7, 17, MR +- 1, NR +- 1, k past a
 * KC block, m past MC, n past NC), either operand transposed or with rows
 * strided, 16-bit operands, every output option (scale, bias, accumulate,
 * 16-bit output), on every micro-kernel path the CPU can run (SSE2, AVX2,
 * AVX-512, bf16 pairs). Outputs start poisoned (NaN) and the gaps between their
 * rows must stay so; results must not change with the thread count. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "convert.h"
#include "cpu_gemm.h"
#include "harness.h"

static void store(opsmith_dtype dt, void *p, int64_t i, double v) {
    switch (dt) {
    case OPSMITH_DTYPE_F64: ((double *)p)[i] = v; break;
    case OPSMITH_DTYPE_F32: ((float *)p)[i] = (float)v; break;
    case OPSMITH_DTYPE_F16: ((uint16_t *)p)[i] = opsmith_f32_to_f16((float)v); break;
    default: ((uint16_t *)p)[i] = opsmith_f32_to_bf16((float)v); break;
    }
}

static double load(opsmith_dtype dt, const void *p, int64_t i) {
    switch (dt) {
    case OPSMITH_DTYPE_F64: return ((const double *)p)[i];
    case OPSMITH_DTYPE_F32: return ((const float *)p)[i];
    case OPSMITH_DTYPE_F16: return opsmith_f16_to_f32(((const uint16_t *)p)[i]);
    default: return opsmith_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

static double unit(opsmith_dtype dt) {
    switch (dt) {
    case OPSMITH_DTYPE_F64: return ldexp(1.0, -53);
    case OPSMITH_DTYPE_F32: return ldexp(1.0, -24);
    case OPSMITH_DTYPE_F16: return ldexp(1.0, -11);
    default: return ldexp(1.0, -8);
    }
}

typedef struct {
    int64_t m, n, k;
    int a_trans, b_trans; /* operand stored transposed (stride 1 along rows) */
    int64_t pad;          /* extra elements per stored row of A, B and out */
    opsmith_dtype in_dt, out_dt;
    double alpha;
    int bias, accumulate;
} gemm_case;

/* one operand of r x c stored row-major (or transposed), rows padded */
static opsmith_gemm_operand make_operand(test_rng *rng, opsmith_dtype dt, int64_t r, int64_t c, int trans,
                                         int64_t pad, void **mem) {
    const int64_t outer = trans ? c : r, inner = (trans ? r : c) + pad;
    const size_t size = opsmith_dtype_size(dt);
    *mem = malloc((size_t)(outer * inner) * size + 1);
    for (int64_t i = 0; i < outer * inner; i++) store(dt, *mem, i, rng_value(rng));
    opsmith_gemm_operand o = {*mem, dt, trans ? 1 : inner, trans ? inner : 1};
    return o;
}

static void run_case(const gemm_case *c, test_rng *rng) {
    const int f64 = c->in_dt == OPSMITH_DTYPE_F64;
    void *am, *bm;
    const opsmith_gemm_operand a = make_operand(rng, c->in_dt, c->m, c->k, c->a_trans, c->pad, &am);
    const opsmith_gemm_operand b = make_operand(rng, c->in_dt, c->k, c->n, c->b_trans, c->pad, &bm);
    const size_t osize = opsmith_dtype_size(c->out_dt);
    const int64_t ld = c->n + c->pad, count = c->m * ld;
    void *bias = malloc((size_t)c->n * osize + 1), *init = malloc((size_t)count * osize + 1);
    for (int64_t j = 0; j < c->n; j++) store(c->out_dt, bias, j, rng_value(rng));
    for (int64_t i = 0; i < count; i++) store(c->out_dt, init, i, rng_value(rng));
    guarded_buf out[2];
    for (int t = 0; t < 2; t++) {
        out[t] = guarded_new((size_t)count * osize, POISON_BYTE);
        unsigned char *p = guarded_payload(&out[t]);
        if (c->accumulate) /* the gaps keep the poison */
            for (int64_t i = 0; i < c->m; i++) memcpy(p + (size_t)(i * ld) * osize, (char *)init + (size_t)(i * ld) * osize,
                                                     (size_t)c->n * osize);
        const opsmith_gemm_out o = {p, c->out_dt, ld, c->alpha, c->bias ? bias : NULL, c->out_dt, c->accumulate};
        if (f64) opsmith_cpu_gemm_f64(c->m, c->n, c->k, a, b, &o, t + 1);
        else opsmith_cpu_gemm_f32(c->m, c->n, c->k, a, b, &o, t + 1);
    }
    const char *what = "m=%lld n=%lld k=%lld trans=%d%d pad=%lld in=%s out=%s alpha=%g bias=%d acc=%d";
#define ARGS (long long)c->m, (long long)c->n, (long long)c->k, c->a_trans, c->b_trans, (long long)c->pad, \
             opsmith_dtype_name(c->in_dt), opsmith_dtype_name(c->out_dt), c->alpha, c->bias, c->accumulate
    const double acc_unit = f64 ? ldexp(1.0, -53) : ldexp(1.0, -24);
    int bad = 0, gap = 0;
    double worst = 0;
    const unsigned char *p1 = guarded_payload(&out[0]);
    for (int64_t i = 0; i < c->m; i++) {
        for (int64_t j = 0; j < c->n; j++) {
            double ref = 0, mag = 0;
            for (int64_t q = 0; q < c->k; q++) {
                const double x = load(c->in_dt, a.p, i * a.rs + q * a.cs), y = load(c->in_dt, b.p, q * b.rs + j * b.cs);
                ref += x * y, mag += fabs(x * y);
            }
            ref *= c->alpha, mag *= fabs(c->alpha);
            if (c->bias) ref += load(c->out_dt, bias, j), mag += fabs(load(c->out_dt, bias, j));
            if (c->accumulate) ref += load(c->out_dt, init, i * ld + j), mag += fabs(load(c->out_dt, init, i * ld + j));
            const double got = load(c->out_dt, p1, i * ld + j);
            const double tol = 2.0 * (double)(c->k + 3) * acc_unit * mag + unit(c->out_dt) * fabs(ref) + 1e-300;
            const double err = fabs(got - ref);
            if (!(err <= tol)) bad++;
            if (err / tol > worst || got != got) worst = got != got ? INFINITY : err / tol;
        }
        for (int64_t j = c->n; j < ld; j++)
            for (size_t byte = 0; byte < osize; byte++) gap |= p1[(size_t)(i * ld + j) * osize + byte] != POISON_BYTE;
    }
    if (!CHECK(bad == 0, "gemm: %d elements off the float64 reference (worst err/tol %.3g)", bad, worst))
        printf(what, ARGS), printf("\n");
    if (!CHECK(!gap, "gemm wrote between output rows")) printf(what, ARGS), printf("\n");
    CHECK(guarded_ok(&out[0]) && guarded_ok(&out[1]), "gemm wrote outside the output");
    CHECK(memcmp(guarded_payload(&out[0]), guarded_payload(&out[1]), (size_t)count * osize) == 0,
          "gemm: 1 and 2 threads differ (m=%lld n=%lld k=%lld)", (long long)c->m, (long long)c->n, (long long)c->k);
#undef ARGS
    for (int t = 0; t < 2; t++) free(out[t].base);
    free(am), free(bm), free(bias), free(init);
}

/* the sizes and options on the path in use */
static void sweep(test_rng *rng) {
    for (int f64 = 0; f64 < 2; f64++) {
        int mr, nr;
        opsmith_cpu_gemm_tile(f64, &mr, &nr);
        const opsmith_dtype acc = f64 ? OPSMITH_DTYPE_F64 : OPSMITH_DTYPE_F32;
        /* m around MR and past the 144 (72) rows of a task; n around NR and past 384; k past the 128 block */
        const int64_t ms[] = {1, 7, mr - 1, mr + 1, 17, f64 ? 73 : 145};
        const int64_t ns[] = {1, 7, nr - 1, nr + 1, 17, 385};
        const int64_t ks[] = {1, 7, 17, 129, 300};
        int count = 0;
        for (size_t im = 0; im < sizeof ms / sizeof ms[0]; im++)
            for (size_t in = 0; in < sizeof ns / sizeof ns[0]; in++)
                for (size_t ik = 0; ik < sizeof ks / sizeof ks[0]; ik++, count++) {
                    if (ms[im] < 1 || ns[in] < 1) continue;
                    if (ms[im] * ns[in] * ks[ik] > 4000000) continue;
                    gemm_case c = {ms[im], ns[in], ks[ik], count % 2, (count / 2) % 2, (count % 3) * 5, acc, acc,
                                   1.0, 0, 0};
                    run_case(&c, rng);
                }
        /* bf16 x bf16 (the AVX512-BF16 pair kernel where the CPU has it): odd k, k one past a block */
        if (!f64) {
            const int64_t bm[] = {1, 9, 17, 145}, bn[] = {1, 31, 33, 385}, bk[] = {1, 2, 3, 129, 256};
            for (size_t im = 0; im < 4; im++)
                for (size_t in = 0; in < 4; in++)
                    for (size_t ik = 0; ik < 5; ik++, count++) {
                        gemm_case c = {bm[im], bn[in], bk[ik], count % 2, (count / 2) % 2, (count % 3) * 5,
                                       OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F32, 1.0, 0, 0};
                        run_case(&c, rng);
                    }
        }
        /* the options, the 16-bit operands and outputs (float product only) */
        for (int opt = 0; opt < 12; opt++) {
            gemm_case c = {mr + 1 + opt, nr * 2 + 3, 131 + opt, opt % 2, (opt / 2) % 2, opt % 3, acc, acc,
                           opt % 4 == 1 ? 0.37 : 1.0, opt % 3 == 0, opt % 4 == 2};
            if (!f64) {
                static const opsmith_dtype dts[] = {OPSMITH_DTYPE_F32, OPSMITH_DTYPE_BF16, OPSMITH_DTYPE_F16};
                c.in_dt = dts[opt % 3], c.out_dt = dts[(opt / 3) % 3];
            }
            run_case(&c, rng);
        }
    }
}

/* every path this CPU can run: SSE2, AVX2 + FMA, AVX-512 (+ bf16 pairs) */
HARNESS_GROUP(test_cpu_gemm) {
    test_rng rng = {0x6E33ull};
    const int top = opsmith_cpu_gemm_cap_path(-1);
    for (int level = 0; level <= top; level++) {
        CHECK(opsmith_cpu_gemm_cap_path(level) == level, "gemm: path %d not taken", level);
        sweep(&rng);
    }
    opsmith_cpu_gemm_cap_path(-1);
}
