/* AdamW's gradient-norm spans (csrc/cuda/adamw_spans.cuh) on the host, no
 * GPU: every element of every tensor is read by exactly one group of one
 * thread of one block, nothing else is read (a group's elements from the
 * tensor's end on are padding), the blocks fit the workspace (at most one a
 * chunk), and tensors past 2^28 elements and past 2^31 in a launch are cut
 * where they must be. The tensors' addresses are made up (never read): the
 * test follows the kernel's own group_at() to the element it would load. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "cuda/adamw_spans.cuh"

using namespace opsmith::adamw_spans;

static int failures = 0;
static long long checks = 0;
#define CHECK(cond, ...)                                                                                 \
    do {                                                                                                 \
        checks++;                                                                                        \
        if (!(cond)) {                                                                                   \
            if (failures++ < 20) {                                                                       \
                printf("FAIL %s:%d: ", __FILE__, __LINE__);                                              \
                printf(__VA_ARGS__);                                                                     \
                printf("\n");                                                                            \
            }                                                                                            \
        }                                                                                                \
    } while (0)

static const uintptr_t kSpacing = (uintptr_t)1 << 40; /* tensor t at (t + 1) << 40 */

/* Runs the tables of one call; `walk`: follow every group of every block
 * (the tensors' elements are counted in seen[t], a bit each). */
static void run_case(const char *name, const std::vector<int64_t> &numels, size_t elem, bool walk) {
    const int64_t count = (int64_t)numels.size();
    std::vector<const void *> grads(count);
    for (int64_t t = 0; t < count; t++) grads[t] = reinterpret_cast<const void *>((uintptr_t)(t + 1) * kSpacing);
    std::vector<std::vector<uint8_t>> seen(count);
    if (walk)
        for (int64_t t = 0; t < count; t++) seen[t].assign((size_t)((numels[t] + 7) / 8), 0);
    std::vector<int64_t> covered(count, 0); /* elements the tables hold, piece by piece */
    int64_t blocks_total = 0, chunks = 0, launches = 0;
    for (int64_t n : numels) chunks += (n + OPSMITH_ADAMW_CHUNK - 1) / OPSMITH_ADAMW_CHUNK;
    static Table tab;
    const opsmith_status st = tables(count, numels.data(), grads.data(), elem, &tab, [&](const Table &t, int32_t blocks) {
        launches++;
        blocks_total += blocks;
        CHECK(t.nt >= 1 && t.nt <= TENSORS, "%s: %d slots", name, t.nt);
        CHECK(t.at[0] == 0 && (int64_t)t.at[t.nt] <= (int64_t)INT32_MAX - SPAN, "%s: launch length %d", name,
              t.at[t.nt]);
        CHECK(blocks == (t.at[t.nt] + SPAN - 1) / SPAN, "%s: %d blocks for %d elements", name, blocks, t.at[t.nt]);
        for (int s = 0; s < t.nt; s++) {
            const uintptr_t g = reinterpret_cast<uintptr_t>(t.g[s]);
            const int64_t tensor = (int64_t)(g / kSpacing) - 1, first = (int64_t)((g % kSpacing) / elem);
            CHECK(tensor >= 0 && tensor < count && (g % kSpacing) % elem == 0, "%s: slot %d address", name, s);
            if (tensor < 0 || tensor >= count) continue;
            CHECK(first == covered[tensor], "%s: slot %d starts at %lld, not %lld", name, s, (long long)first,
                  (long long)covered[tensor]);
            CHECK(t.n[s] >= 1 && t.n[s] <= PIECE && first + t.n[s] <= numels[tensor], "%s: slot %d of %lld", name, s,
                  (long long)t.n[s]);
            CHECK(t.at[s] % 4 == 0 && t.at[s + 1] - t.at[s] == (t.n[s] + 3) / 4 * 4, "%s: slot %d at %d", name, s,
                  t.at[s]);
            covered[tensor] = first + t.n[s];
        }
        if (!walk) return OPSMITH_STATUS_SUCCESS;
        for (int b = 0; b < blocks; b++) {
            const BlockSlots bs = block_slots(t, b);
            for (int tid = 0; tid < THREADS; tid++)
                for (int k = 0; k < GROUPS; k++) {
                    Group grp;
                    const int32_t v = bs.lo + 4 * (tid + k * THREADS);
                    const bool in = group_at(t, bs, tid, k, &grp);
                    CHECK(in == (v < t.at[t.nt]), "%s: group at %d %s", name, v, in ? "past the end" : "dropped");
                    if (!in) continue;
                    CHECK(grp.slot >= bs.first && grp.slot <= bs.last && t.at[grp.slot] <= v &&
                              v < t.at[grp.slot + 1] && grp.i == v - t.at[grp.slot],
                          "%s: group at %d in slot %d", name, v, grp.slot);
                    const uintptr_t g = reinterpret_cast<uintptr_t>(t.g[grp.slot]);
                    const int64_t tensor = (int64_t)(g / kSpacing) - 1, first = (int64_t)((g % kSpacing) / elem);
                    for (int e = 0; e < 4; e++) {
                        if (grp.i + e >= t.n[grp.slot]) continue; /* padding: the kernel reads nothing */
                        const int64_t el = first + grp.i + e;
                        uint8_t &byte = seen[tensor][(size_t)(el / 8)];
                        const uint8_t bit = (uint8_t)(1u << (el % 8));
                        if (byte & bit) CHECK(false, "%s: tensor %lld element %lld read twice", name,
                                              (long long)tensor, (long long)el);
                        byte |= bit;
                    }
                }
        }
        return OPSMITH_STATUS_SUCCESS;
    });
    CHECK(st == OPSMITH_STATUS_SUCCESS, "%s: status %d", name, (int)st);
    CHECK(blocks_total <= chunks, "%s: %lld blocks for a workspace of %lld chunks", name, (long long)blocks_total,
          (long long)chunks);
    for (int64_t t = 0; t < count; t++) {
        CHECK(covered[t] == numels[t], "%s: tensor %lld covered to %lld of %lld", name, (long long)t,
              (long long)covered[t], (long long)numels[t]);
        if (!walk) continue;
        int64_t unread = 0;
        for (int64_t el = 0; el < numels[t]; el++) unread += !(seen[t][(size_t)(el / 8)] >> (el % 8) & 1);
        CHECK(unread == 0, "%s: tensor %lld: %lld elements unread", name, (long long)t, (long long)unread);
    }
    printf("%s: %lld launches, %lld blocks\n", name, (long long)launches, (long long)blocks_total);
}

/* A launch's status stops the call. */
static void test_stops_at_an_error(void) {
    std::vector<int64_t> numels(4000, 5);
    std::vector<const void *> grads(4000, reinterpret_cast<const void *>(kSpacing));
    static Table tab;
    int calls = 0;
    const opsmith_status st = tables(4000, numels.data(), grads.data(), 4, &tab, [&](const Table &, int32_t) {
        return ++calls == 2 ? OPSMITH_STATUS_CUDA_ERROR : OPSMITH_STATUS_SUCCESS;
    });
    CHECK(st == OPSMITH_STATUS_CUDA_ERROR && calls == 2, "error status %d after %d launches", (int)st, calls);
}

int main(void) {
    srand(7);
    std::vector<int64_t> tiny, mixed, edges;
    for (int i = 0; i < 5000; i++) tiny.push_back(1 + rand() % 40); /* four launches of slots, many a block */
    for (int i = 0; i < 3000; i++) mixed.push_back(i % 7 == 0 ? 0 : 1 + (int64_t)rand() % 20000);
    for (int64_t n : {1, 2, 3, 4, 5, 0, 8191, 8192, 8193, 16383, 16384, 16385, 12, 65536 + 3, 7}) edges.push_back(n);
    run_case("tiny (5000 tensors of 1-40)", tiny, 4, true);
    run_case("mixed (3000 tensors of 0-20000)", mixed, 2, true);
    run_case("edges", edges, 4, true);
    run_case("past 2^28 (a Llama 3 8B embedding's 525M elements)", {3, (int64_t)128256 * 4096, 5}, 2, true);
    run_case("past 2^31 in a launch (tables only)", {((int64_t)1 << 31) + 5, 7, ((int64_t)1 << 30) + 1}, 4, false);
    test_stops_at_an_error();
    printf("%lld checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
