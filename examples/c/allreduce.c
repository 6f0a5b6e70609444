/* A peer of a shoal run, in C: joins the master at argv[1], waits until argv[2] peers are in,
 * then runs an all-reduce, an all-gather and a broadcast, retrying what a lost peer interrupts,
 * then gathers a number from each rank at rank 0 with receives from any member, reduces within
 * the groups of a split and a new group, and checks every result. Prints "ok RANK" and exits 0, or names what failed and exits 1.
 *
 *   cc allreduce.c -I crates/ffi/include target/release/libshoal.a -lpthread -ldl -lm -o allreduce
 *   ./allreduce 127.0.0.1:48148 4      (one process per peer)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "shoal.h"

#define N 1000

static int fail(const char *what, ShoalStatus status) {
    fprintf(stderr, "%s failed (status %d): %s\n", what, (int)status, shoal_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MASTER_ADDR PEERS\n", argv[0]);
        return 2;
    }
    size_t peers = (size_t)atoi(argv[2]);
    ShoalComm *comm = NULL;
    ShoalStatus s = shoal_comm_new(argv[1], 0, &comm);
    if (s != SHOAL_STATUS_OK) return fail("shoal_comm_new", s);
    s = shoal_comm_connect(comm, 60.0, 1);
    if (s != SHOAL_STATUS_OK) return fail("shoal_comm_connect", s);
    /* Admit newcomers until everyone is in: every accepted peer votes. */
    size_t rank = 0, world = 0;
    for (;;) {
        if ((s = shoal_comm_rank(comm, &rank, &world)) != SHOAL_STATUS_OK) return fail("shoal_comm_rank", s);
        if (world == peers) break;
        bool pending = false;
        if ((s = shoal_comm_peers_pending(comm, &pending)) != SHOAL_STATUS_OK) return fail("peers_pending", s);
        if (pending && (s = shoal_comm_update_topology(comm)) != SHOAL_STATUS_OK) return fail("update_topology", s);
    }

    float x[N];
    for (;;) {
        for (int i = 0; i < N; i++) x[i] = (float)(rank + 1) * (float)i;
        s = shoal_comm_all_reduce(comm, x, N, SHOAL_DTYPE_F32, SHOAL_OP_SUM, 0);
        if (s == SHOAL_STATUS_OK) break;
        if (!shoal_status_retryable(s)) return fail("shoal_comm_all_reduce", s);
    }
    float total = (float)(world * (world + 1) / 2);
    for (int i = 0; i < N; i++) {
        if (x[i] != total * (float)i) {
            fprintf(stderr, "all_reduce: x[%d] = %f, expected %f\n", i, x[i], total * (float)i);
            return 1;
        }
    }

    int32_t mine = (int32_t)rank * 10, all[64];
    if (world > 64) return 1;
    s = shoal_comm_all_gather(comm, all, world, &mine, 1, SHOAL_DTYPE_I32, 1);
    if (s != SHOAL_STATUS_OK) return fail("shoal_comm_all_gather", s);
    for (size_t r = 0; r < world; r++) {
        if (all[r] != (int32_t)r * 10) {
            fprintf(stderr, "all_gather: block %zu = %d\n", r, all[r]);
            return 1;
        }
    }

    double word = rank == 0 ? 42.5 : 0.0;
    s = shoal_comm_broadcast(comm, &word, 1, SHOAL_DTYPE_F64, 0, 2);
    if (s != SHOAL_STATUS_OK) return fail("shoal_comm_broadcast", s);
    if (word != 42.5) {
        fprintf(stderr, "broadcast: %f\n", word);
        return 1;
    }

    /* Every other rank sends rank 0 its own number; rank 0 takes them as they come. */
    if (rank == 0) {
        size_t seen = 0;
        for (size_t k = 1; k < world; k++) {
            uint64_t got = 0;
            size_t source = 0;
            s = shoal_comm_recv_any(comm, &got, 1, SHOAL_DTYPE_U64, 4, &source);
            if (s != SHOAL_STATUS_OK) return fail("shoal_comm_recv_any", s);
            if (got != source * 7 || source == 0 || source >= world || (seen >> source & 1)) {
                fprintf(stderr, "recv_any: %llu from rank %zu\n", (unsigned long long)got, source);
                return 1;
            }
            seen |= (size_t)1 << source;
        }
    } else {
        uint64_t mine = rank * 7;
        s = shoal_comm_send(comm, &mine, 1, SHOAL_DTYPE_U64, 0, 4);
        if (s != SHOAL_STATUS_OK) return fail("shoal_comm_send", s);
    }

    /* Even and odd ranks split into two groups, each summing its members' ranks; the first and
     * last ranks form another, which broadcasts the last one's number. */
    ShoalComm *half = NULL, *ends = NULL;
    s = shoal_comm_split(comm, (int64_t)(rank % 2), 0, &half);
    if (s != SHOAL_STATUS_OK || half == NULL) return fail("shoal_comm_split", s);
    size_t half_rank = 0, half_world = 0;
    if ((s = shoal_comm_rank(half, &half_rank, &half_world)) != SHOAL_STATUS_OK) return fail("shoal_comm_rank", s);
    uint64_t sum = rank, want = 0;
    for (size_t r = rank % 2; r < world; r += 2) want += r;
    s = shoal_comm_all_reduce(half, &sum, 1, SHOAL_DTYPE_U64, SHOAL_OP_SUM, 5);
    if (s != SHOAL_STATUS_OK) return fail("shoal_comm_all_reduce on a split", s);
    if (sum != want || half_rank != rank / 2 || half_world != (world + 1 - rank % 2) / 2) {
        fprintf(stderr, "split: sum %llu (want %llu), rank %zu of %zu\n", (unsigned long long)sum,
                (unsigned long long)want, half_rank, half_world);
        return 1;
    }
    size_t both[2] = {0, world - 1};
    s = shoal_comm_new_group(comm, both, 2, &ends);
    if (s != SHOAL_STATUS_OK) return fail("shoal_comm_new_group", s);
    if ((ends != NULL) != (rank == 0 || rank == world - 1)) {
        fprintf(stderr, "new_group: rank %zu %s a member\n", rank, ends ? "is" : "is not");
        return 1;
    }
    if (ends != NULL) {
        uint64_t last = rank == world - 1 ? 1234 : 0;
        s = shoal_comm_broadcast(ends, &last, 1, SHOAL_DTYPE_U64, 1, 6);
        if (s != SHOAL_STATUS_OK || last != 1234) return fail("shoal_comm_broadcast on a new group", s);
    }
    shoal_comm_free(ends);
    shoal_comm_free(half);

    /* Bad input is an error that names the problem, not a crash. */
    s = shoal_comm_all_reduce(comm, x, N, 77, SHOAL_OP_SUM, 3);
    if (s != SHOAL_STATUS_INVALID_ARGUMENT) return fail("an unknown dtype was not refused", s);

    /* Nobody leaves before everyone is done: a member leaving re-forms the run, which fails the
     * operations still in flight elsewhere (the group of the ends' broadcast, say). */
    s = shoal_comm_barrier(comm, 7);
    if (s != SHOAL_STATUS_OK) return fail("shoal_comm_barrier", s);
    printf("ok %zu\n", rank);
    shoal_comm_free(comm);
    return 0;
}
