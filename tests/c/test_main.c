/* Entry point of the C tests: runs every group and prints the tally.
 * The last line is always "<P> passed, <F> failed, <S> skipped" and the exit
 * status is nonzero when any check failed. */
#include <stdarg.h>
#include <stdio.h>

#include "harness.h"

static long g_passed;
static long g_failed;
static long g_skipped;

int harness_check(int ok, const char *file, int line, const char *fmt, ...)
{
    if (ok) {
        g_passed++;
        return 1;
    }
    g_failed++;
    printf("FAIL %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
    fflush(stdout);
    return 0;
}

void harness_skip(int count)
{
    g_skipped += count;
}

int main(void)
{
    test_types();
    test_rms_norm();
    printf("%ld passed, %ld failed, %ld skipped\n", g_passed, g_failed, g_skipped);
    return g_failed != 0;
}
