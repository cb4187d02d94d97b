/* Gated activations, the specification: plain loops over double, no threads.
 * gate, up, y, dy, dgate, dup, h are (rows, n) contiguous. */
#include <math.h>

#include "opsmith.h"

#define GELU_TANH_K 0.7978845608028654 /* sqrt(2 / pi) */
#define GELU_TANH_C 0.044715
#define INV_SQRT2 0.7071067811865476
#define INV_SQRT_2PI 0.3989422804014327

/* act(g) and act'(g) in double. */
static void act_ref(opsmith_glu_activation a, double g, double *value, double *slope) {
    switch (a) {
    case OPSMITH_GLU_ACTIVATION_SILU: {
        const double s = 1.0 / (1.0 + exp(-g));
        *value = g * s;
        *slope = s * (1.0 + g * (1.0 - s));
        return;
    }
    case OPSMITH_GLU_ACTIVATION_GELU: {
        const double cdf = 0.5 * erfc(-g * INV_SQRT2);
        *value = g * cdf;
        *slope = cdf + g * INV_SQRT_2PI * exp(-0.5 * g * g);
        return;
    }
    default: { /* OPSMITH_GLU_ACTIVATION_GELU_TANH */
        const double t = tanh(GELU_TANH_K * (g + GELU_TANH_C * g * g * g));
        *value = 0.5 * g * (1.0 + t);
        *slope = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * GELU_TANH_K * (1.0 + 3.0 * GELU_TANH_C * g * g);
        return;
    }
    }
}

void opsmith_glu_fwd_reference(opsmith_glu_activation activation, int64_t rows, int64_t n, const double *gate,
                               const double *up, double *y) {
    for (int64_t i = 0; i < rows * n; i++) {
        double v, d;
        act_ref(activation, gate[i], &v, &d);
        y[i] = v * up[i];
    }
}

void opsmith_glu_bwd_reference(opsmith_glu_activation activation, int64_t rows, int64_t n, const double *dy,
                               const double *gate, const double *up, double *dgate, double *dup, double *h) {
    for (int64_t i = 0; i < rows * n; i++) {
        double v, d;
        act_ref(activation, gate[i], &v, &d);
        dgate[i] = dy[i] * up[i] * d;
        dup[i] = dy[i] * v;
        if (h) h[i] = v * up[i];
    }
}
