/* Rotary launchers (CPU, and CUDA when built with OPSMITH_WITH_CUDA=1)
 * against the float64 scalar reference: both styles, partial rotary, the
 * [B,H,S,D] and [B,S,H,D] layouts and views into a fused qkv buffer,
 * grouped-query head counts, k absent, cos/sin per (b, s), shared over the
 * batch (stride 0) or a cache indexed by position_ids, forward and
 * backward, out of place and in place, every dtype (and float32 cos/sin
 * beside 16-bit q/k).
 *
 * Inputs are drawn in double and rounded into the storage dtype; the
 * reference sees the rounded values. Output buffers start as 0xFF bytes (NaN
 * in every float type): an element of a view that is not written fails, and
 * every element outside the views (the v part of a fused qkv row, padding)
 * must still be poison afterwards (or, in place, unchanged). Guard bytes
 * around each buffer catch writes past its ends. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#if defined(OPSMITH_WITH_CUDA) && OPSMITH_WITH_CUDA
#include <cuda_runtime_api.h>
#define TEST_CUDA 1
#else
#define TEST_CUDA 0
#endif

enum { LAYOUT_BHSD, LAYOUT_BSHD, LAYOUT_FUSED, LAYOUT_PADDED, LAYOUT_PAD8, LAYOUT_REVERSED, LAYOUT_COUNT };
enum { CS_PER_ROW, CS_SHARED, CS_CACHE, CS_COUNT };
static const char *const LAYOUT_NAMES[] = {"bhsd", "bshd", "fused-qkv", "padded-bhsd", "pad8-bhsd", "reversed-bshd"};
static const char *const CS_NAMES[] = {"[B,S,R]", "[S,R]", "cache+positions"};

typedef struct {
    opsmith_dtype dt, cs_dt;
    opsmith_rotary_style style;
    int64_t B, S, Hq, Hk, D, R; /* Hk 0: no k */
    int layout, cs, off;        /* off: elements the views start past 16-byte alignment */
} rcase;

static double tol_of(opsmith_dtype dt) {
    switch (dt) {
    case OPSMITH_DTYPE_F64: return 1e-12;
    case OPSMITH_DTYPE_F32: return 2e-6;
    case OPSMITH_DTYPE_F16: return 2e-3;
    default: return 1.6e-2;
    }
}

/* Everything one case needs on the host. */
typedef struct {
    opsmith_rotary_params p;
    int64_t q_at, k_at, elems;   /* view offsets and buffer size in elements */
    int64_t cs_elems, max_pos;
    guarded_buf x, cos, sin, pos;
    double *fwd_ref, *bwd_ref;   /* per view element, in (side, b, h, s, d) order */
    unsigned char *in_view;      /* 1 for every buffer element inside a view */
} rdata;

static int64_t view_index(const opsmith_rotary_view *v, int64_t at, int64_t b, int64_t h, int64_t s, int64_t d) {
    return at + b * v->batch_stride + s * v->seq_stride + h * v->head_stride + d;
}

static int64_t cs_row(const rdata *d, int64_t b, int64_t s) {
    if (d->p.cs_seq_stride == 0) return 0;
    if (d->pos.base) return ((const int64_t *)guarded_payload(&d->pos))[b * d->p.pos_batch_stride + s * d->p.pos_seq_stride] *
                            d->p.cs_seq_stride;
    return b * d->p.cs_batch_stride + s * d->p.cs_seq_stride;
}

static void set_view(opsmith_rotary_view *v, int64_t heads, int64_t bs, int64_t ss, int64_t hs) {
    v->heads = heads, v->batch_stride = bs, v->seq_stride = ss, v->head_stride = hs;
}

static void data_init(rdata *d, const rcase *c, test_rng *rng) {
    memset(d, 0, sizeof *d);
    opsmith_rotary_params *p = &d->p;
    p->style = c->style, p->dtype = c->dt, p->cs_dtype = c->cs_dt;
    p->batch = c->B, p->seq = c->S, p->head_dim = c->D, p->rotary_dim = c->R;
    const int64_t B = c->B, S = c->S, D = c->D, Hq = c->Hq, Hk = c->Hk;
    d->q_at = c->off;
    switch (c->layout) {
    case LAYOUT_BHSD:
        set_view(&p->q, Hq, Hq * S * D, D, S * D), set_view(&p->k, Hk, Hk * S * D, D, S * D);
        d->k_at = d->q_at + B * Hq * S * D + 8, d->elems = d->k_at + B * Hk * S * D + 8;
        break;
    case LAYOUT_BSHD:
        set_view(&p->q, Hq, S * Hq * D, Hq * D, D), set_view(&p->k, Hk, S * Hk * D, Hk * D, D);
        d->k_at = d->q_at + B * Hq * S * D + 8, d->elems = d->k_at + B * Hk * S * D + 8;
        break;
    case LAYOUT_FUSED: { /* [B, S, (Hq + 2 Hk) D + 8]: q heads, k heads, v heads, padding */
        const int64_t row = (Hq + 2 * Hk) * D + 8;
        set_view(&p->q, Hq, S * row, row, D), set_view(&p->k, Hk, S * row, row, D);
        d->k_at = d->q_at + Hq * D, d->elems = d->q_at + B * S * row;
        break;
    }
    case LAYOUT_PAD8: { /* bhsd with head vectors a whole number of 8 elements apart, past D: 16-byte
                         * packs fit every stride while D - R need not be whole packs */
        const int64_t dp = (D + 7) / 8 * 8 + 8;
        set_view(&p->q, Hq, Hq * S * dp, dp, S * dp), set_view(&p->k, Hk, Hk * S * dp, dp, S * dp);
        d->k_at = d->q_at + B * Hq * S * dp + 8, d->elems = d->k_at + B * Hk * S * dp + 8;
        break;
    }
    case LAYOUT_REVERSED: /* bshd with the tokens in reverse memory order: a negative seq stride, which
                           * the C ABI takes and CUDA's row plan leaves to the flat plan (its offsets
                           * are unsigned) */
        set_view(&p->q, Hq, S * Hq * D, -Hq * D, D), set_view(&p->k, Hk, S * Hk * D, -Hk * D, D);
        d->q_at = c->off + (S - 1) * Hq * D;
        d->k_at = c->off + B * S * Hq * D + 8 + (S - 1) * Hk * D;
        d->elems = c->off + B * S * Hq * D + 8 + B * S * Hk * D + 8;
        break;
    default: /* bhsd with every head vector D + 3 apart: odd strides */
        set_view(&p->q, Hq, Hq * S * (D + 3), D + 3, S * (D + 3)), set_view(&p->k, Hk, Hk * S * (D + 3), D + 3, S * (D + 3));
        d->k_at = d->q_at + B * Hq * S * (D + 3) + 5, d->elems = d->k_at + B * Hk * S * (D + 3) + 5;
        break;
    }
    if (!Hk) p->k.heads = 0;
    p->q_out = p->q, p->k_out = p->k;
    const size_t es = opsmith_dtype_size(c->dt), cs_es = opsmith_dtype_size(c->cs_dt);
    d->x = guarded_new((size_t)d->elems * es, POISON_BYTE);
    d->in_view = calloc((size_t)d->elems, 1);
    /* cos/sin */
    d->max_pos = S + 5;
    const int64_t cs_rows = c->cs == CS_PER_ROW ? B * S : c->cs == CS_SHARED ? S : d->max_pos;
    p->cs_seq_stride = c->R + (c->cs == CS_CACHE ? 2 : 0); /* a padded cache row */
    p->cs_batch_stride = c->cs == CS_PER_ROW ? S * p->cs_seq_stride : 0;
    d->cs_elems = cs_rows * p->cs_seq_stride;
    d->cos = guarded_new((size_t)d->cs_elems * cs_es, 0), d->sin = guarded_new((size_t)d->cs_elems * cs_es, 0);
    for (int64_t i = 0; i < d->cs_elems; i++) { /* any values: the kernels must read each one as given */
        opsmith_store_from_double(c->cs_dt, guarded_payload(&d->cos), i, rng_value(rng) / 2);
        opsmith_store_from_double(c->cs_dt, guarded_payload(&d->sin), i, rng_value(rng) / 2);
    }
    if (c->cs == CS_CACHE) {
        d->pos = guarded_new((size_t)(B * S) * sizeof(int64_t), 0);
        p->pos_batch_stride = S, p->pos_seq_stride = 1, p->max_pos = d->max_pos;
        for (int64_t i = 0; i < B * S; i++) /* per batch row: packed sequences restart anywhere */
            ((int64_t *)guarded_payload(&d->pos))[i] = (int64_t)(rng_uniform(rng) * (double)d->max_pos);
    }
    /* inputs and references */
    const int64_t per = (B * (Hq + Hk) * S) * D;
    d->fwd_ref = malloc(sizeof(double) * (size_t)(per + 1)), d->bwd_ref = malloc(sizeof(double) * (size_t)(per + 1));
    double *xv = malloc(sizeof(double) * (size_t)D), *cv = malloc(sizeof(double) * (size_t)c->R),
           *sv = malloc(sizeof(double) * (size_t)c->R);
    if (!d->fwd_ref || !d->bwd_ref || !xv || !cv || !sv || !d->in_view) {
        fprintf(stderr, "out of host memory\n");
        exit(2);
    }
    int64_t n = 0;
    for (int side = 0; side < (Hk ? 2 : 1); side++) {
        const opsmith_rotary_view *v = side ? &p->k : &p->q;
        const int64_t at = side ? d->k_at : d->q_at;
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < v->heads; h++)
                for (int64_t s = 0; s < S; s++) {
                    const int64_t row = cs_row(d, b, s);
                    for (int64_t j = 0; j < c->R; j++)
                        cv[j] = opsmith_load_as_double(c->cs_dt, guarded_payload(&d->cos), row + j),
                        sv[j] = opsmith_load_as_double(c->cs_dt, guarded_payload(&d->sin), row + j);
                    for (int64_t j = 0; j < D; j++) {
                        const int64_t e = view_index(v, at, b, h, s, j);
                        opsmith_store_from_double(c->dt, guarded_payload(&d->x), e, rng_value(rng));
                        xv[j] = opsmith_load_as_double(c->dt, guarded_payload(&d->x), e);
                        d->in_view[e] = 1;
                    }
                    opsmith_rotary_reference(c->style, 0, 1, D, c->R, xv, cv, sv, d->fwd_ref + n);
                    opsmith_rotary_reference(c->style, 1, 1, D, c->R, xv, cv, sv, d->bwd_ref + n);
                    n += D;
                }
    }
    free(xv), free(cv), free(sv);
}

static void data_free(rdata *d) {
    free(d->x.base), free(d->cos.base), free(d->sin.base), free(d->pos.base);
    free(d->fwd_ref), free(d->bwd_ref), free(d->in_view);
}

static void describe(char *out, size_t size, const rcase *c) {
    snprintf(out, size, "%s cs=%s %s B=%lld S=%lld Hq=%lld Hk=%lld D=%lld R=%lld %s cos/sin %s off=%d",
             opsmith_dtype_name(c->dt), opsmith_dtype_name(c->cs_dt), opsmith_rotary_style_name(c->style),
             (long long)c->B, (long long)c->S, (long long)c->Hq, (long long)c->Hk, (long long)c->D,
             (long long)c->R, LAYOUT_NAMES[c->layout], CS_NAMES[c->cs], c->off);
}

/* out against ref over the views; outside them out must equal `outside`
 * (the poison of a fresh buffer, or the input in place). */
static void check_out(const rcase *c, const rdata *d, const char *what, const guarded_buf *out, const double *ref,
                      const guarded_buf *outside) {
    const opsmith_rotary_params *p = &d->p;
    double err = 0.0, scale = 1.0;
    int unwritten = 0;
    int64_t n = 0;
    for (int side = 0; side < (c->Hk ? 2 : 1); side++) {
        const opsmith_rotary_view *v = side ? &p->k : &p->q;
        const int64_t at = side ? d->k_at : d->q_at;
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t h = 0; h < v->heads; h++)
                for (int64_t s = 0; s < c->S; s++)
                    for (int64_t j = 0; j < c->D; j++, n++) {
                        const double got = opsmith_load_as_double(c->dt, guarded_payload(out), view_index(v, at, b, h, s, j));
                        if (isnan(got)) unwritten = 1;
                        err = fmax(err, fabs(got - ref[n]));
                        scale = fmax(scale, fabs(ref[n]));
                    }
    }
    const size_t es = opsmith_dtype_size(c->dt);
    int stray = 0;
    for (int64_t e = 0; e < d->elems && !stray; e++)
        if (!d->in_view[e])
            for (size_t k = 0; k < es; k++)
                stray |= ((unsigned char *)guarded_payload(out))[e * es + k] !=
                         (outside ? ((unsigned char *)guarded_payload(outside))[e * es + k] : POISON_BYTE);
    char name[256];
    describe(name, sizeof name, c);
    CHECK(!unwritten, "%s %s: an element was not written (NaN)", what, name);
    CHECK(err <= tol_of(c->dt) * scale, "%s %s: max err %.3e > %.3e", what, name, err, tol_of(c->dt) * scale);
    CHECK(!stray && guarded_ok(out), "%s %s: wrote outside the views", what, name);
}

typedef opsmith_status (*cpu_fn)(const opsmith_rotary_params *, const void *, void *, const void *, void *,
                                 const void *, const void *, const int64_t *);

static void run_cpu(const rcase *c, const rdata *d) {
    const size_t es = opsmith_dtype_size(c->dt);
    const cpu_fn fns[2] = {opsmith_rotary_fwd_cpu, opsmith_rotary_bwd_cpu};
    const char *names[2][2] = {{"cpu fwd", "cpu fwd in place"}, {"cpu bwd", "cpu bwd in place"}};
    for (int dir = 0; dir < 2; dir++) {
        const double *ref = dir ? d->bwd_ref : d->fwd_ref;
        for (int inplace = 0; inplace < 2; inplace++) {
            guarded_buf out = guarded_new(d->x.bytes, POISON_BYTE);
            if (inplace) memcpy(out.base, d->x.base, d->x.bytes + 2 * GUARD);
            const char *src = inplace ? guarded_payload(&out) : guarded_payload(&d->x);
            char *dst = guarded_payload(&out);
            opsmith_status st = fns[dir](&d->p, src + d->q_at * es, dst + d->q_at * es,
                                         c->Hk ? src + d->k_at * es : NULL, c->Hk ? dst + d->k_at * es : NULL,
                                         guarded_payload(&d->cos), guarded_payload(&d->sin), d->pos.base ? guarded_payload(&d->pos) : NULL);
            if (CHECK(st == OPSMITH_STATUS_SUCCESS, "%s: %s (%s)", names[dir][inplace], opsmith_status_string(st),
                      opsmith_last_error()))
                check_out(c, d, names[dir][inplace], &out, ref, inplace ? &d->x : NULL);
            free(out.base);
        }
    }
}

#if TEST_CUDA
static int cuda_ok(cudaError_t e, const char *what) {
    return CHECK(e == cudaSuccess, "cuda %s: %s", what, cudaGetErrorString(e));
}

typedef opsmith_status (*cuda_fn)(const opsmith_rotary_params *, const void *, void *, const void *, void *,
                                  const void *, const void *, const int64_t *, opsmith_cuda_stream);

/* Whole buffers (poison and guards included) go to the device and back. */
static void *upload(const guarded_buf *b) {
    void *dev = NULL;
    if (!b->base) return NULL;
    if (!cuda_ok(cudaMalloc(&dev, b->bytes + 2 * GUARD), "malloc")) return NULL;
    cuda_ok(cudaMemcpy(dev, b->base, b->bytes + 2 * GUARD, cudaMemcpyHostToDevice), "upload");
    return dev;
}

static void run_cuda(const rcase *c, const rdata *d) {
    const size_t es = opsmith_dtype_size(c->dt);
    const cuda_fn fns[2] = {opsmith_rotary_fwd_cuda, opsmith_rotary_bwd_cuda};
    const char *names[2][2] = {{"cuda fwd", "cuda fwd in place"}, {"cuda bwd", "cuda bwd in place"}};
    unsigned char *dx = upload(&d->x), *dcos = upload(&d->cos), *dsin = upload(&d->sin), *dpos = upload(&d->pos);
    for (int dir = 0; dir < 2 && dx; dir++) {
        const double *ref = dir ? d->bwd_ref : d->fwd_ref;
        for (int inplace = 0; inplace < 2; inplace++) {
            guarded_buf out = guarded_new(d->x.bytes, POISON_BYTE);
            if (inplace) memcpy(out.base, d->x.base, d->x.bytes + 2 * GUARD);
            unsigned char *dout = upload(&out);
            if (!dout) { free(out.base); continue; }
            const unsigned char *src = (inplace ? dout : dx) + GUARD;
            unsigned char *dst = dout + GUARD;
            opsmith_status st = fns[dir](&d->p, src + d->q_at * es, dst + d->q_at * es,
                                         c->Hk ? src + d->k_at * es : NULL, c->Hk ? dst + d->k_at * es : NULL,
                                         dcos + GUARD, dsin + GUARD, dpos ? (const int64_t *)(dpos + GUARD) : NULL,
                                         NULL);
            if (CHECK(st == OPSMITH_STATUS_SUCCESS, "%s: %s (%s)", names[dir][inplace], opsmith_status_string(st),
                      opsmith_last_error()) &&
                cuda_ok(cudaMemcpy(out.base, dout, out.bytes + 2 * GUARD, cudaMemcpyDeviceToHost), "download"))
                check_out(c, d, names[dir][inplace], &out, ref, inplace ? &d->x : NULL);
            cudaFree(dout);
            free(out.base);
        }
    }
    cudaFree(dx), cudaFree(dcos), cudaFree(dsin), cudaFree(dpos);
}

/* A position outside the cache on CUDA: the rotated part of that row is NaN. */
static void cuda_bad_position(void) {
    float *q = NULL, *cs = NULL;
    int64_t *pos = NULL, hpos[2] = {1, 7};
    float hq[2 * 8], hcs[4 * 8];
    for (int i = 0; i < 16; i++) hq[i] = 1.0f + (float)i;
    for (int i = 0; i < 32; i++) hcs[i] = 0.5f;
    opsmith_rotary_params p = {OPSMITH_ROTARY_STYLE_HALF, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 1, 2, 8, 4,
                               {1, 16, 8, 8}, {1, 16, 8, 8}, {0, 0, 0, 0}, {0, 0, 0, 0}, 0, 8, 2, 1, 4};
    if (cuda_ok(cudaMalloc((void **)&q, sizeof hq), "malloc") && cuda_ok(cudaMalloc((void **)&cs, sizeof hcs), "malloc") &&
        cuda_ok(cudaMalloc((void **)&pos, sizeof hpos), "malloc")) {
        cudaMemcpy(q, hq, sizeof hq, cudaMemcpyHostToDevice), cudaMemcpy(cs, hcs, sizeof hcs, cudaMemcpyHostToDevice);
        cudaMemcpy(pos, hpos, sizeof hpos, cudaMemcpyHostToDevice);
        opsmith_status st = opsmith_rotary_fwd_cuda(&p, q, q, NULL, NULL, cs, cs, pos, NULL);
        CHECK(st == OPSMITH_STATUS_SUCCESS, "cuda bad position: %s", opsmith_last_error());
        float out[16];
        cuda_ok(cudaMemcpy(out, q, sizeof out, cudaMemcpyDeviceToHost), "download");
        CHECK(!isnan(out[0]) && isnan(out[8]) && isnan(out[11]) && out[12] == 13.0f,
              "cuda bad position: row 0 finite, row 1's rotated part NaN, its tail copied");
    }
    cudaFree(q), cudaFree(cs), cudaFree(pos);
}

static int cuda_begin(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        cudaGetLastError();
        return 0;
    }
    cuda_bad_position();
    return 1;
}
#else
static int cuda_begin(void) {
    static float x[32];
    opsmith_rotary_params p = {OPSMITH_ROTARY_STYLE_HALF, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 1, 2, 8, 8,
                               {1, 16, 8, 8}, {1, 16, 8, 8}, {0, 0, 0, 0}, {0, 0, 0, 0}, 0, 8, 0, 0, 0};
    opsmith_status st = opsmith_rotary_fwd_cuda(&p, x, x, NULL, NULL, x, x, NULL, NULL);
    CHECK(opsmith_has_cuda() || (st == OPSMITH_STATUS_CUDA_UNAVAILABLE && strstr(opsmith_last_error(), "without CUDA")),
          "CUDA-less rotary_fwd_cuda returned \"%s\" (%s)", opsmith_status_string(st), opsmith_last_error());
    st = opsmith_rotary_bwd_cuda(&p, x, x, NULL, NULL, x, x, NULL, NULL);
    CHECK(opsmith_has_cuda() || st == OPSMITH_STATUS_CUDA_UNAVAILABLE, "CUDA-less rotary_bwd_cuda returned \"%s\"",
          opsmith_status_string(st));
    return -1;
}
static void run_cuda(const rcase *c, const rdata *d) { (void)c, (void)d; }
#endif

static void expect(opsmith_status got, opsmith_status want, const char *needle, const char *what) {
    CHECK(got == want && strstr(opsmith_last_error(), needle) != NULL,
          "%s: got \"%s\" (%s), want \"%s\" naming \"%s\"", what, opsmith_status_string(got), opsmith_last_error(),
          opsmith_status_string(want), needle);
}

static void test_bad_args(void) {
    static float buf[4096], cs[256];
    static int64_t pos[4] = {0, 1, 2, 3};
    const opsmith_status INVALID = OPSMITH_STATUS_INVALID_ARGUMENT, DTYPE = OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    /* q [1, 2, 4, 8] bhsd at buf, k [1, 1, 4, 8] at buf + 512 */
    const opsmith_rotary_params good = {OPSMITH_ROTARY_STYLE_HALF, OPSMITH_DTYPE_F32, OPSMITH_DTYPE_F32, 1, 4, 8, 8,
                                        {2, 64, 8, 32}, {2, 64, 8, 32}, {1, 32, 8, 32}, {1, 32, 8, 32}, 0, 8, 4, 1, 4};
    float *q = buf, *k = buf + 512, *qo = buf + 1024, *ko = buf + 1536;
    opsmith_rotary_params p = good;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, NULL), OPSMITH_STATUS_SUCCESS, "", "valid fwd");
    expect(opsmith_rotary_fwd_cpu(&p, q, q, k, k, cs, cs, NULL), OPSMITH_STATUS_SUCCESS, "", "valid in place");
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, NULL, NULL, cs, cs, NULL), OPSMITH_STATUS_SUCCESS, "", "no k");
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, pos), OPSMITH_STATUS_SUCCESS, "", "positions");
    expect(opsmith_rotary_fwd_cpu(NULL, q, qo, k, ko, cs, cs, NULL), INVALID, "params is NULL", "NULL params");
    p.style = (opsmith_rotary_style)5;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, NULL), INVALID, "style", "bad style");
    p = good, p.dtype = OPSMITH_DTYPE_I32;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, NULL), DTYPE, "i32", "integer dtype");
    p = good, p.cs_dtype = OPSMITH_DTYPE_F64;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, NULL), DTYPE, "cs_dtype", "f64 cos beside f32 q");
    p = good, p.rotary_dim = 7;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, NULL), INVALID, "rotary_dim (7)", "odd rotary_dim");
    p = good, p.rotary_dim = 10;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, NULL), INVALID, "rotary_dim (10)", "rotary_dim > D");
    p = good, p.seq = -1;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, NULL), INVALID, "seq (-1)", "seq < 0");
    p = good;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, NULL, cs, cs, NULL), INVALID, "k and k_out", "k without k_out");
    expect(opsmith_rotary_fwd_cpu(&p, NULL, qo, k, ko, cs, cs, NULL), INVALID, "q is NULL", "q NULL");
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, NULL, cs, NULL), INVALID, "cos is NULL", "cos NULL");
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, NULL, NULL), INVALID, "sin is NULL", "sin NULL");
    expect(opsmith_rotary_fwd_cpu(&p, (char *)q + 2, qo, k, ko, cs, cs, NULL), OPSMITH_STATUS_MISALIGNED, "q (",
           "misaligned q");
    expect(opsmith_rotary_fwd_cpu(&p, q, q + 1, k, ko, cs, cs, NULL), INVALID, "q_out overlaps q", "partial alias");
    expect(opsmith_rotary_fwd_cpu(&p, q, k, k, ko, cs, cs, NULL), INVALID, "q_out overlaps k", "q_out = k");
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, qo, cs, cs, NULL), INVALID, "overlaps", "k_out = q_out");
    p.k_out.heads = 2;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, NULL), INVALID, "k heads", "k_out heads differ");
    p = good, p.max_pos = 3;
    expect(opsmith_rotary_fwd_cpu(&p, q, qo, k, ko, cs, cs, pos), INVALID, "position_ids[0, 3] = 3", "position");
    p = good, p.batch = 0;
    expect(opsmith_rotary_fwd_cpu(&p, NULL, NULL, NULL, NULL, NULL, NULL, NULL), OPSMITH_STATUS_SUCCESS, "",
           "empty batch");
    p = good;
    expect(opsmith_rotary_bwd_cpu(&p, q, qo, k, NULL, cs, cs, NULL), INVALID, "dk_out and dk", "bwd dk missing");
    expect(opsmith_rotary_bwd_cpu(&p, q, q + 1, k, ko, cs, cs, NULL), INVALID, "dq overlaps dq_out", "bwd alias");
    CHECK(strcmp(opsmith_rotary_style_name(OPSMITH_ROTARY_STYLE_INTERLEAVED), "interleaved") == 0 &&
              strcmp(opsmith_rotary_style_name((opsmith_rotary_style)9), "?") == 0,
          "style names");
}

/* The reference's backward is the forward's transpose: <fwd(x), y> = <x, bwd(y)>
 * for any cos/sin (not just cos^2 + sin^2 = 1, halves duplicated). */
static void test_reference_transpose(void) {
    test_rng rng = {77};
    enum { D = 12, R = 10 };
    for (int style = 0; style < 2; style++) {
        double x[D], y[D], c[R], s[R], fx[D], by[D], l = 0, r = 0;
        for (int i = 0; i < D; i++) x[i] = rng_value(&rng), y[i] = rng_value(&rng);
        for (int i = 0; i < R; i++) c[i] = rng_value(&rng), s[i] = rng_value(&rng);
        opsmith_rotary_reference((opsmith_rotary_style)style, 0, 1, D, R, x, c, s, fx);
        opsmith_rotary_reference((opsmith_rotary_style)style, 1, 1, D, R, y, c, s, by);
        for (int i = 0; i < D; i++) l += fx[i] * y[i], r += x[i] * by[i];
        CHECK(fabs(l - r) <= 1e-12 * (fabs(l) + 1), "reference %s: <fwd x, y> %.17g != <x, bwd y> %.17g",
              opsmith_rotary_style_name((opsmith_rotary_style)style), l, r);
    }
}

/* one case of the shape tables: batch, sequence, q and k heads, head dim,
 * rotary dim, layout, cos/sin form, offset */
typedef struct {
    int64_t B, S, Hq, Hk, D, R;
    int layout, cs, off;
} rotary_shape;

static rcase case_of(opsmith_dtype dt, opsmith_dtype cs_dt, int style, const rotary_shape *h) {
    const rcase c = {dt, cs_dt, (opsmith_rotary_style)style, h->B, h->S, h->Hq, h->Hk, h->D, h->R,
                     h->layout, h->cs, h->off};
    return c;
}

HARNESS_GROUP(test_rotary) {
    const int cuda = cuda_begin();
    test_reference_transpose();
    test_bad_args();
    /* (B, S, Hq, Hk, D, R, layout, cs, off): full and partial rotary, head
     * dims the 16-byte packs fit and odd ones, GQA and MHA, no k, decode
     * (S = 1), widths past the CPU's tile of 128 pairs */
    const rotary_shape shapes[] = {
        {2, 5, 4, 2, 64, 64, LAYOUT_BHSD, CS_PER_ROW, 0},   {2, 5, 4, 2, 64, 64, LAYOUT_BSHD, CS_SHARED, 0},
        {2, 7, 4, 1, 32, 16, LAYOUT_FUSED, CS_CACHE, 0},    {3, 3, 3, 3, 16, 16, LAYOUT_FUSED, CS_PER_ROW, 0},
        {1, 4, 2, 0, 128, 128, LAYOUT_BSHD, CS_CACHE, 0},   {2, 3, 5, 1, 20, 12, LAYOUT_PADDED, CS_PER_ROW, 1},
        {1, 1, 8, 2, 128, 128, LAYOUT_BHSD, CS_CACHE, 0},   {2, 2, 2, 2, 6, 2, LAYOUT_BSHD, CS_SHARED, 3},
        {1, 3, 2, 1, 512, 384, LAYOUT_BHSD, CS_PER_ROW, 0}, {1, 6, 4, 2, 80, 64, LAYOUT_FUSED, CS_CACHE, 1},
        {0, 3, 2, 1, 16, 16, LAYOUT_BHSD, CS_PER_ROW, 0},   {2, 5, 4, 2, 64, 64, LAYOUT_REVERSED, CS_PER_ROW, 0},
        /* more packs than a block's threads (the CUDA pack loop); more heads than fit in one pass of y */
        {1, 2, 2, 1, 2048, 2048, LAYOUT_BSHD, CS_SHARED, 0}, {1, 2, 300, 7, 2, 2, LAYOUT_BSHD, CS_PER_ROW, 0},
    };
    /* CUDA only (too slow for the CPU run of `make test`): the kernel's item
     * grid of (row, head group, pack or copy slot) at the head
     * counts (32 + 8 heads) and D = 64/128/256; head counts
     * that leave a partial group (20, 12, 7, 3); decode (S = 1); odd and
     * prime sequence lengths; partial rotary with the pass-through copied as
     * 16-byte packs, and (pad8 layout, 16-bit types) element by element
     * beside 16-byte rotation packs; the scalar kernel (odd strides) */
    const rotary_shape cuda_shapes[] = {
        {2, 37, 32, 8, 128, 128, LAYOUT_BHSD, CS_PER_ROW, 0}, {1, 19, 32, 8, 64, 64, LAYOUT_BSHD, CS_SHARED, 0},
        {2, 9, 16, 4, 256, 256, LAYOUT_FUSED, CS_CACHE, 0},   {3, 1, 32, 8, 128, 128, LAYOUT_BHSD, CS_CACHE, 0},
        {1, 33, 12, 4, 128, 64, LAYOUT_BSHD, CS_PER_ROW, 0},  {2, 5, 5, 2, 76, 64, LAYOUT_PAD8, CS_PER_ROW, 0},
        {1, 7, 3, 0, 256, 128, LAYOUT_FUSED, CS_CACHE, 0},    {1, 11, 9, 3, 64, 32, LAYOUT_PADDED, CS_SHARED, 1},
        {2, 3, 40, 0, 128, 128, LAYOUT_BHSD, CS_PER_ROW, 0},  {1, 5, 17, 3, 128, 128, LAYOUT_BSHD, CS_CACHE, 0},
        {4, 1, 32, 8, 64, 64, LAYOUT_FUSED, CS_SHARED, 0},    {1, 3, 2, 1, 256, 256, LAYOUT_PAD8, CS_CACHE, 0},
        {2, 13, 8, 8, 256, 192, LAYOUT_BHSD, CS_SHARED, 0},   {1, 6, 4, 2, 80, 16, LAYOUT_PAD8, CS_PER_ROW, 0},
        /* a short batch's row plan (a block a row) at two heads a thread where
         * one a thread passes its 512 threads (16-bit rotate-half: 8 packs x
         * 72 heads; 73 leave a partial 2-head group; 64-wide heads at 72:
         * interleaved's 8 packs a head, rotate-half's 4 at one head a
         * thread), and a row too wide for that plan's block (2048-wide
         * heads): the flat 2-head launch */
        {2, 3, 64, 8, 128, 128, LAYOUT_BHSD, CS_CACHE, 0},   {1, 3, 8, 2, 2048, 2048, LAYOUT_BSHD, CS_PER_ROW, 0},
        {2, 3, 65, 8, 128, 128, LAYOUT_BSHD, CS_PER_ROW, 0}, {1, 2, 64, 8, 64, 64, LAYOUT_BSHD, CS_SHARED, 0},
        /* a short batch whose seq stride is negative: the flat plan's 2-head launch */
        {2, 3, 32, 8, 128, 128, LAYOUT_REVERSED, CS_CACHE, 0}, {4, 2, 32, 8, 64, 64, LAYOUT_REVERSED, CS_SHARED, 0},
        /* past 132 x 512 items: the 16-byte kernel's wide launch (rotate-half
         * 8 heads a thread, 6 with float32 cos/sin for 16-bit x; interleaved
         * 16, or 8); everything above is small enough for the short-batch plans;
         * 29 + 8 heads leave partial groups */
        {2, 1031, 32, 8, 128, 128, LAYOUT_BSHD, CS_CACHE, 0}, {1, 4099, 29, 8, 64, 64, LAYOUT_BHSD, CS_PER_ROW, 0},
        {1, 1031, 32, 8, 256, 192, LAYOUT_FUSED, CS_SHARED, 0},
    };
    for (int di = 0; di < 4; di++) {
        const opsmith_dtype dt = (opsmith_dtype)di;
        for (int fcs = 0; fcs < ((dt == OPSMITH_DTYPE_F16 || dt == OPSMITH_DTYPE_BF16) ? 2 : 1); fcs++)
            for (int style = 0; style < 2; style++) {
                test_rng rng = {0x5EEDull * (uint64_t)(di + 1) + 31u * (uint64_t)style + 7u * (uint64_t)fcs};
                for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
                    const rcase c = case_of(dt, fcs ? OPSMITH_DTYPE_F32 : dt, style, &shapes[k]);
                    rdata d;
                    data_init(&d, &c, &rng);
                    run_cpu(&c, &d);
                    if (cuda > 0)
                        run_cuda(&c, &d);
                    else if (cuda == 0)
                        harness_skip(1);
                    data_free(&d);
                }
                for (size_t k = 0; k < sizeof cuda_shapes / sizeof cuda_shapes[0]; k++) {
                    if (cuda <= 0) {
                        if (cuda == 0) harness_skip(1);
                        continue;
                    }
                    const rcase c = case_of(dt, fcs ? OPSMITH_DTYPE_F32 : dt, style, &cuda_shapes[k]);
                    rdata d;
                    data_init(&d, &c, &rng);
                    run_cuda(&c, &d);
                    data_free(&d);
                }
            }
    }
}
