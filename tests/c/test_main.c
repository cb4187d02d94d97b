/* Entry point of the C tests: runs every group (or, given arguments, the
 * groups whose names contain one of them: `build/test_c rms_norm glu`) and
 * prints the tally. The last line is always "<P> passed, <F> failed, <S> skipped" and the exit
 * status is nonzero when any check failed. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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

enum { MAX_GROUPS = 256 };
static struct {
    const char *name;
    harness_group_fn fn;
} g_groups[MAX_GROUPS];
static int g_group_count;

void harness_register(const char *name, harness_group_fn fn)
{
    if (g_group_count == MAX_GROUPS) {
        fprintf(stderr, "harness: more than %d test groups; %s not run\n", MAX_GROUPS, name);
        g_failed++;
        return;
    }
    g_groups[g_group_count].name = name;
    g_groups[g_group_count].fn = fn;
    g_group_count++;
}

static int selected(const char *name, int argc, char **argv)
{
    if (argc < 2) return 1;
    for (int a = 1; a < argc; a++)
        if (strstr(name, argv[a])) return 1;
    return 0;
}

int main(int argc, char **argv)
{
    /* in name order, so every build runs the groups in the same order */
    for (int i = 1; i < g_group_count; i++)
        for (int j = i; j > 0 && strcmp(g_groups[j - 1].name, g_groups[j].name) > 0; j--) {
            const char *n = g_groups[j].name;
            harness_group_fn f = g_groups[j].fn;
            g_groups[j] = g_groups[j - 1];
            g_groups[j - 1].name = n, g_groups[j - 1].fn = f;
        }
    int ran = 0;
    for (int i = 0; i < g_group_count; i++) {
        if (!selected(g_groups[i].name, argc, argv)) continue;
        ran++;
        const long before = g_failed;
        g_groups[i].fn();
        printf("group %s: %s\n", g_groups[i].name, g_failed == before ? "ok" : "FAILED");
    }
    if (ran == 0) {
        printf(g_group_count ? "no test group matches the arguments\n" : "no test groups registered\n");
        g_failed++;
    }
    printf("%ld passed, %ld failed, %ld skipped\n", g_passed, g_failed, g_skipped);
    return g_failed != 0;
}
