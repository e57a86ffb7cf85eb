/* model_path.c: --model as a directory or a Hugging Face id (model_path.h). */
#include "common/model/model_path.h"

#include "common/base/opts.h"

#include <dirent.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static bool tw_is_dir(const char *p) {
  struct stat st;
  return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* "ORG/NAME" or "ORG/NAME@REV": one '/', id characters only. */
static bool tw_hf_id_shaped(const char *s) {
  const char *slash = strchr(s, '/');
  if (!slash || slash == s || strchr(slash + 1, '/') || !slash[1] || s[0] == '.') return false;
  for (const char *p = s; *p && *p != '@'; p++)
    if (p != slash && !(('a' <= *p && *p <= 'z') || ('A' <= *p && *p <= 'Z') ||
                        ('0' <= *p && *p <= '9') || *p == '-' || *p == '_' || *p == '.'))
      return false;
  return true;
}

/* The hub cache directory, as huggingface_hub finds it. */
static void tw_hf_hub_dir(char *out, size_t len) {
  const char *e;
  if ((e = getenv("HF_HUB_CACHE")) && *e) snprintf(out, len, "%s", e);
  else if ((e = getenv("HF_HOME")) && *e) snprintf(out, len, "%s/hub", e);
  else if ((e = getenv("XDG_CACHE_HOME")) && *e) snprintf(out, len, "%s/huggingface/hub", e);
  else snprintf(out, len, "%s/.cache/huggingface/hub", (e = getenv("HOME")) && *e ? e : "/root");
}

/* The only directory under `dir`, into name (NAME_MAX + 1); false if not exactly one. */
static bool tw_only_subdir(const char *dir, char *name, size_t len) {
  DIR *d = opendir(dir);
  if (!d) return false;
  int n = 0;
  char path[PATH_MAX + 300];
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    if (!tw_is_dir(path)) continue;
    if (n++ == 0) snprintf(name, len, "%s", e->d_name);
  }
  closedir(d);
  return n == 1;
}

TW_NODISCARD tw_status_t tw_model_resolve(const char *spec, char *out, size_t len) {
  if (!spec || !*spec) return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "empty model name");
  if (tw_is_dir(spec) || !tw_hf_id_shaped(spec)) {
    if ((size_t)snprintf(out, len, "%s", spec) >= len)
      return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "model path longer than %zu bytes", len - 1);
    return TW_OK;
  }
  char id[512], rev[256] = "main";
  snprintf(id, sizeof id, "%s", spec);
  char *at = strchr(id, '@');
  if (at) {
    *at = '\0';
    snprintf(rev, sizeof rev, "%s", at + 1);
  }
  char hub[1024], repo[2048], path[PATH_MAX], commit[256] = "";
  tw_hf_hub_dir(hub, sizeof hub);
  char *slash = strchr(id, '/');
  snprintf(repo, sizeof repo, "%s/models--%.*s--%.200s", hub, (int)(slash - id), id, slash + 1);
  /* refs/REV holds the commit; REV may also be a commit itself */
  snprintf(path, sizeof path, "%s/refs/%s", repo, rev);
  FILE *f = strchr(rev, '/') || strstr(rev, "..") ? NULL : fopen(path, "r");
  if (f) {
    if (!fgets(commit, sizeof commit, f)) commit[0] = '\0';
    fclose(f);
    commit[strcspn(commit, " \r\n")] = '\0';
  } else {
    snprintf(path, sizeof path, "%s/snapshots/%s", repo, rev);
    if (!strchr(rev, '/') && tw_is_dir(path)) snprintf(commit, sizeof commit, "%s", rev);
  }
  if (!commit[0] && !at) { /* no refs (a copied cache): a single snapshot is the one */
    snprintf(path, sizeof path, "%s/snapshots", repo);
    if (!tw_only_subdir(path, commit, sizeof commit)) commit[0] = '\0';
  }
  if (commit[0]) {
    snprintf(path, sizeof path, "%s/snapshots/%s", repo, commit);
    if (tw_is_dir(path)) {
      if ((size_t)snprintf(out, len, "%s", path) >= len)
        return tw_err_quiet(TW_ERR_INVALID_ARGUMENT, "model path longer than %zu bytes", len - 1);
      return TW_OK;
    }
  }
  return tw_err_quiet(TW_ERR_NOT_FOUND,
                      "'%s' is not a directory, and not in the Hugging Face cache (%s%s%s%s): "
                      "download it with `hf download %s%s%s` (pip install -U huggingface_hub; "
                      "older: huggingface-cli download), set HF_HOME or HF_HUB_CACHE to the "
                      "cache that holds it, or pass the checkpoint directory",
                      spec, repo, tw_is_dir(repo) ? ": no snapshot for revision " : " is missing",
                      tw_is_dir(repo) ? rev : "", "", id, at ? " --revision " : "", at ? rev : "");
}

void tw_model_name(const char *maybe_served, const char *dir, char *out, size_t len) {
  if (maybe_served && *maybe_served) {
    snprintf(out, len, "%s", maybe_served);
    return;
  }
  char buf[PATH_MAX];
  snprintf(buf, sizeof buf, "%s", dir && *dir ? dir : "model");
  size_t n = strlen(buf);
  while (n > 1 && buf[n - 1] == '/') buf[--n] = '\0';
  char *snap = strstr(buf, "/snapshots/");
  if (snap) { /* .../models--ORG--NAME/snapshots/COMMIT */
    *snap = '\0';
    char *repo = strrchr(buf, '/');
    repo = repo ? repo + 1 : buf;
    char *sep = strncmp(repo, "models--", 8) == 0 ? strstr(repo + 8, "--") : NULL;
    if (sep) {
      snprintf(out, len, "%.*s/%s", (int)(sep - (repo + 8)), repo + 8, sep + 2);
      return;
    }
    *snap = '/';
  }
  const char *last = strrchr(buf, '/');
  snprintf(out, len, "%s", last && last[1] ? last + 1 : buf);
}

int tw_model_opt(const char *text, void *dst, char *err, size_t errlen) {
  char out[PATH_MAX];
  if (tw_model_resolve(text, out, sizeof out) != TW_OK) {
    snprintf(err, errlen, "%s", tw_last_error());
    return -1;
  }
  const char *kept = tw_opts_keep(out);
  if (!kept) {
    snprintf(err, errlen, "out of memory");
    return -1;
  }
  *(const char **)dst = kept;
  return 0;
}
