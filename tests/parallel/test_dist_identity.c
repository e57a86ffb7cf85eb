/* test_dist_identity.c: a rank's identity from the launcher conventions
 * (dist.h): mpirun's OMPI_COMM_WORLD_*, torchrun-style RANK / WORLD_SIZE /
 * LOCAL_RANK with TWAIN_RENDEZVOUS or MASTER_ADDR + MASTER_PORT, Slurm's
 * SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, precedence between them, and
 * the errors for malformed or inconsistent values. */
#include "common/base/log.h"
#include "common/comm/dist.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/test_expect.h"

static const char *const all_vars[] = {
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "RANK",
    "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "TWAIN_RENDEZVOUS", "MASTER_ADDR", "MASTER_PORT"};

static void clear_env(void) {
  for (size_t i = 0; i < sizeof all_vars / sizeof all_vars[0]; i++) unsetenv(all_vars[i]);
}

int main(void) {
  tw_log_init("test_dist_identity", 0);
  tw_dist_identity_t id;

  clear_env();
  EXPECT(tw_dist_identity_from_env(&id) == TW_OK && id.launch == TW_DIST_LAUNCH_NONE &&
             id.rank == 0 && id.size == 1 && id.rendezvous[0] == '\0',
         "no launcher: a group of one");

  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("TWAIN_RENDEZVOUS", "tcp://node0:29500", 1);
  EXPECT(tw_dist_identity_from_env(&id) == TW_OK && id.launch == TW_DIST_LAUNCH_ENV &&
             id.rank == 3 && id.size == 4 && id.local_rank == 1 &&
             strcmp(id.rendezvous, "tcp://node0:29500") == 0,
         "RANK/WORLD_SIZE/LOCAL_RANK + TWAIN_RENDEZVOUS");

  unsetenv("TWAIN_RENDEZVOUS");
  setenv("MASTER_ADDR", "10.0.0.7", 1);
  setenv("MASTER_PORT", "6000", 1);
  EXPECT(tw_dist_identity_from_env(&id) == TW_OK && strcmp(id.rendezvous, "tcp://10.0.0.7:6000") == 0,
         "MASTER_ADDR/MASTER_PORT give the rendezvous (%s)", id.rendezvous);

  unsetenv("MASTER_ADDR");
  unsetenv("MASTER_PORT");
  EXPECT(tw_dist_identity_from_env(&id) == TW_ERR_INVALID_ARGUMENT,
         "RANK/WORLD_SIZE of 4 without a rendezvous is refused");

  setenv("OMPI_COMM_WORLD_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  EXPECT(tw_dist_identity_from_env(&id) == TW_OK && id.launch == TW_DIST_LAUNCH_MPI &&
             id.rank == 1 && id.size == 2,
         "mpirun's variables win over RANK/WORLD_SIZE, no rendezvous needed");

  clear_env();
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_NTASKS", "8", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("MASTER_ADDR", "gpu-a", 1);
  setenv("MASTER_PORT", "7100", 1);
  EXPECT(tw_dist_identity_from_env(&id) == TW_OK && id.launch == TW_DIST_LAUNCH_SLURM &&
             id.rank == 5 && id.size == 8 && id.local_rank == 1 &&
             strcmp(id.rendezvous, "tcp://gpu-a:7100") == 0,
         "Slurm SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID");

  clear_env();
  setenv("RANK", "4", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("TWAIN_RENDEZVOUS", "tcp://h:1", 1);
  EXPECT(tw_dist_identity_from_env(&id) == TW_ERR_INVALID_ARGUMENT, "RANK 4 of 4 is refused");
  setenv("RANK", "x1", 1);
  EXPECT(tw_dist_identity_from_env(&id) == TW_ERR_INVALID_ARGUMENT, "RANK=x1 is refused");
  setenv("RANK", "0", 1);
  unsetenv("LOCAL_RANK");
  EXPECT(tw_dist_identity_from_env(&id) == TW_OK && id.local_rank == 0,
         "LOCAL_RANK defaults to RANK");

  clear_env();
  int rc = -1;
  tw_dist_identity_t sid;
  EXPECT(tw_dist_spawn(0, NULL, 0, 1, &sid, &rc) == TW_ERR_INVALID_ARGUMENT && rc == -1,
         "--tp 0 is refused");
  EXPECT(tw_dist_spawn(0, NULL, 65, 1, &sid, &rc) == TW_ERR_INVALID_ARGUMENT,
         "--tp 65 is refused");

  if (fails) fprintf(stderr, "test_dist_identity: %d failure(s)\n", fails);
  else printf("test_dist_identity: all checks passed\n");
  return fails ? 1 : 0;
}
