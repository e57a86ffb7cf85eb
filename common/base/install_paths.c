/* install_paths.c: see install_paths.h. */
#include "common/base/install_paths.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

const char *tw_default_model_dir(const char *fallback) {
  static char dir[PATH_MAX];
  char self[PATH_MAX / 2];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return fallback;
  self[n] = '\0';
  char *slash = strrchr(self, '/');
  if (!slash) return fallback;
  *slash = '\0';
  /* <exe dir>/../share/...: drop the last component by text (symlinks kept) */
  char *up = strrchr(self, '/');
  if (!up) return fallback;
  *up = '\0';
  const char *sub = &TW_BUNDLE_MODEL_SUBDIR[3]; /* after "../" */
  char probe[PATH_MAX];
  snprintf(probe, sizeof probe, "%s/%s/config.json", self, sub);
  if (access(probe, R_OK) != 0) return fallback;
  snprintf(dir, sizeof dir, "%s/%s", self, sub);
  return dir;
}
