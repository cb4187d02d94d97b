/* fused_linear_cross_entropy, the specification: the whole logits in
 * float64, cross_entropy's own reference on them, then the two products of
 * their gradient. Plain loops, no threads, no chunks; formulas in
 * include/opsmith/fused_linear_cross_entropy.h. */
#include <stdlib.h>

#include "opsmith.h"

void opsmith_fused_linear_cross_entropy_fwd_reference(int64_t rows, int64_t dim, int64_t vocab, const double *hidden,
                                                       const double *weight, const double *bias, const int64_t *target,
                                                       int64_t ignore_index, double ls, double z_loss, double softcap,
                                                       opsmith_cross_entropy_reduction reduction, double *loss,
                                                       double *z_out, double *dhidden, double *dweight,
                                                       double *dbias) {
    const size_t cells = (size_t)(rows > 0 ? rows : 1) * (size_t)vocab;
    double *logits = calloc(cells, sizeof(double)), *dl = calloc(cells, sizeof(double));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t v = 0; v < vocab; v++) {
            double s = bias ? bias[v] : 0.0;
            for (int64_t k = 0; k < dim; k++) s += hidden[r * dim + k] * weight[v * dim + k];
            logits[r * vocab + v] = s;
        }
    opsmith_cross_entropy_fwd_reference(rows, vocab, logits, target, NULL, ignore_index, ls, z_loss, softcap,
                                        reduction, loss, z_out, NULL, dl);
    if (dhidden)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t k = 0; k < dim; k++) {
                double s = 0.0;
                for (int64_t v = 0; v < vocab; v++) s += dl[r * vocab + v] * weight[v * dim + k];
                dhidden[r * dim + k] = s;
            }
    if (dweight)
        for (int64_t v = 0; v < vocab; v++)
            for (int64_t k = 0; k < dim; k++) {
                double s = 0.0;
                for (int64_t r = 0; r < rows; r++) s += dl[r * vocab + v] * hidden[r * dim + k];
                dweight[v * dim + k] = s;
            }
    if (dbias)
        for (int64_t v = 0; v < vocab; v++) {
            double s = 0.0;
            for (int64_t r = 0; r < rows; r++) s += dl[r * vocab + v];
            dbias[v] = s;
        }
    free(logits);
    free(dl);
}
