/* Rotary position embedding, the specification: plain loops over double.
 * x, out are contiguous [rows, head_dim]; cos, sin [rows, rotary_dim]. */
#include "opsmith.h"

void opsmith_rotary_reference(opsmith_rotary_style style, int backward, int64_t rows, int64_t head_dim,
                              int64_t rotary_dim, const double *x, const double *cos, const double *sin,
                              double *out) {
    const int64_t half = rotary_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const double *xr = x + r * head_dim, *c = cos + r * rotary_dim, *s = sin + r * rotary_dim;
        double *o = out + r * head_dim;
        for (int64_t i = 0; i < half; i++) {
            const int64_t a = style == OPSMITH_ROTARY_STYLE_HALF ? i : 2 * i;
            const int64_t b = style == OPSMITH_ROTARY_STYLE_HALF ? i + half : 2 * i + 1;
            if (!backward) {
                o[a] = xr[a] * c[a] - xr[b] * s[a];
                o[b] = xr[b] * c[b] + xr[a] * s[b];
            } else {
                o[a] = xr[a] * c[a] + xr[b] * s[b];
                o[b] = xr[b] * c[b] - xr[a] * s[a];
            }
        }
        for (int64_t j = rotary_dim; j < head_dim; j++) o[j] = xr[j];
    }
}
