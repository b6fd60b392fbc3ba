/* The fan-out benchmark's reference (bench/run-fanout): MPI_Bcast of SIZE bytes from rank 0 (the
 * trainer's host) to every other rank (one per rollout host), started together after a barrier.
 * Each receiving rank reports how long it stalled, as a rollout's replicate() does; rank 0 prints
 * one "RESULT mpi_seconds=..." line per rank. Built by bench/run-fanout with mpicc. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc != 2) {
    if (rank == 0) fprintf(stderr, "usage: mpi_bcast BYTES\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const long bytes = atol(argv[1]);
  char* buffer = malloc((size_t)bytes);
  if (buffer == NULL) MPI_Abort(MPI_COMM_WORLD, 1);
  memset(buffer, rank == 0 ? 7 : 0, (size_t)bytes);  /* memory in use, as the rollouts' */
  MPI_Barrier(MPI_COMM_WORLD);
  const double started = MPI_Wtime();
  if (rank == 0) {  /* bench/run-change times a failure or a join from here */
    printf("STARTED\n");
    fflush(stdout);
  }
  /* In pieces of at most 1 GiB: MPI counts are ints. */
  for (long offset = 0; offset < bytes; offset += 1L << 30) {
    const long piece = bytes - offset < (1L << 30) ? bytes - offset : (1L << 30);
    MPI_Bcast(buffer + offset, (int)piece, MPI_BYTE, 0, MPI_COMM_WORLD);
  }
  double seconds = MPI_Wtime() - started;
  const int ok = buffer[bytes - 1] == 7;
  double* all = rank == 0 ? malloc(sizeof(double) * (size_t)size) : NULL;
  int* oks = rank == 0 ? malloc(sizeof(int) * (size_t)size) : NULL;
  MPI_Gather(&seconds, 1, MPI_DOUBLE, all, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  MPI_Gather(&ok, 1, MPI_INT, oks, 1, MPI_INT, 0, MPI_COMM_WORLD);
  if (rank == 0) {
    for (int r = 1; r < size; ++r) printf("RESULT mpi_seconds=%.3f rank=%d ok=%d\n", all[r], r, oks[r]);
    free(all);
    free(oks);
  }
  free(buffer);
  MPI_Finalize();
  return 0;
}
