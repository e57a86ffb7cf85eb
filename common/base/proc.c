/* proc.c: a process and where it runs (see proc.h). */
#include "common/base/proc.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void tw_proc_boot_id(char out[40]) {
  memset(out, 0, 40);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return;
  if (!fgets(out, 40, f)) out[0] = 0;
  fclose(f);
  out[strcspn(out, "\n")] = 0;
}

void tw_proc_self(tw_proc_t *p) {
  memset(p, 0, sizeof *p);
  tw_proc_boot_id(p->boot_id);
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) == 0) p->pid_ns = (uint64_t)st.st_ino;
  p->pid = (int32_t)getpid();
}

bool tw_proc_local(const tw_proc_t *self, tw_proc_t *other) {
  other->boot_id[sizeof other->boot_id - 1] = 0;
  return self->boot_id[0] && self->pid_ns && other->pid > 0 &&
         strcmp(other->boot_id, self->boot_id) == 0 && other->pid_ns == self->pid_ns;
}

bool tw_proc_alive(const tw_proc_t *p) {
  if (kill(p->pid, 0) != 0 && errno == ESRCH) return false;
  char path[64], buf[256];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)p->pid);
  FILE *f = fopen(path, "r");
  if (!f) return true; /* no /proc: kill's answer stands */
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char *rp = strrchr(buf, ')'); /* "pid (comm) S ..." */
  return !(rp && rp[1] == ' ' && (rp[2] == 'Z' || rp[2] == 'X'));
}
