/* Open MPI's side of bench/compare_mpi.py: the same loop as shoal.bench's workers (warm-up, then
 * each iteration timed alone, no barrier between), writing the same JSON lines, one file per rank.
 *
 *   mpirun -np N mpi_bench OP OUTDIR SIZE:WARM:TIMED...
 *
 * OP is all_reduce (float32 sum, in place) or sendrecv (each rank sends SIZE bytes to the next
 * rank while it receives as much from the previous one). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (argc < 4 || (strcmp(argv[1], "all_reduce") != 0 && strcmp(argv[1], "sendrecv") != 0)) {
        if (rank == 0) fprintf(stderr, "usage: mpi_bench all_reduce|sendrecv OUTDIR SIZE:WARM:TIMED...\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    int reduce = strcmp(argv[1], "all_reduce") == 0;
    char path[4096];
    snprintf(path, sizeof path, "%s/rank%d.jsonl", argv[2], rank);
    FILE *out = fopen(path, "w");
    if (!out) {
        perror(path);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int a = 3; a < argc; a++) {
        long size, warm, timed;
        if (sscanf(argv[a], "%ld:%ld:%ld", &size, &warm, &timed) != 3 || size < 4 || timed < 1) {
            fprintf(stderr, "bad size spec %s\n", argv[a]);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
        long count = size / 4;
        float *x = malloc(count * sizeof(float)), *y = malloc(count * sizeof(float));
        double *times = malloc(timed * sizeof(double));
        if (!x || !y || !times) MPI_Abort(MPI_COMM_WORLD, 1);
        for (long i = 0; i < count; i++) x[i] = y[i] = 1.0f;
        int next = (rank + 1) % world, prev = (rank + world - 1) % world;
        for (long i = 0; i < warm + timed; i++) {
            double t0 = MPI_Wtime();
            if (reduce)
                MPI_Allreduce(MPI_IN_PLACE, x, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else
                MPI_Sendrecv(x, (int)count, MPI_FLOAT, next, 0, y, (int)count, MPI_FLOAT, prev, 0, MPI_COMM_WORLD,
                             MPI_STATUS_IGNORE);
            double t = MPI_Wtime() - t0;
            if (i >= warm) times[i - warm] = t;
        }
        fprintf(out, "{\"size\": %ld, \"count\": %ld, \"in_flight\": 1, \"times\": [", count * 4, count);
        for (long i = 0; i < timed; i++) fprintf(out, "%s%.9f", i ? ", " : "", times[i]);
        fprintf(out, "]}\n");
        free(x);
        free(y);
        free(times);
    }
    fclose(out);
    MPI_Finalize();
    return 0;
}
