/* model_path.h: what --model names: a checkpoint directory, or a Hugging Face
 * model id ("openai/gpt-oss-20b", optionally "@REVISION") found in the local
 * Hugging Face cache, laid out as huggingface_hub writes it:
 *   HUB/models--ORG--NAME/refs/REVISION      (a file: the commit hash)
 *   HUB/models--ORG--NAME/snapshots/COMMIT/  (config.json, *.safetensors, ...;
 *                                             usually symlinks into blobs/)
 * where HUB is $HF_HUB_CACHE, else $HF_HOME/hub, else
 * $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (the
 * huggingface_hub defaults). Nothing is downloaded. */
#ifndef TW_COMMON_MODEL_PATH_H
#define TW_COMMON_MODEL_PATH_H

#include "common/base/status.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/** Resolve `spec` into a directory written to out (len bytes):
 *  - an existing directory, or anything that is not shaped like a Hugging
 *    Face id (an absolute path, a path with two or more '/', no '/'), is
 *    copied unchanged (loading it reports what is missing);
 *  - "ORG/NAME[@REVISION]" (letters, digits, '-', '_', '.'; REVISION default
 *    "main": a ref name, or a commit hash present under snapshots/) becomes
 *    the snapshot directory; when refs/REVISION is absent and snapshots/ holds
 *    exactly one snapshot, that one.
 *  Errors: TW_ERR_NOT_FOUND when an id is not in the cache, with a message
 *  that names the directory looked in and how to download the model
 *  (`hf download ORG/NAME`) or point at it (HF_HOME, HF_HUB_CACHE, a
 *  directory); TW_ERR_INVALID_ARGUMENT when the result does not fit in len. */
TW_NODISCARD tw_status_t tw_model_resolve(const char *spec, char *out, size_t len);

/** The model's name for clients and dashboards (/v1/models, the metrics'
 *  model_name label): maybe_served (--served-model-name) when not NULL or
 *  empty, else "ORG/NAME" for a Hugging Face cache snapshot dir
 *  (.../models--ORG--NAME/snapshots/COMMIT), else the last component of dir
 *  ("gpt-oss-20b" for /models/gpt-oss-20b/). Never fails; truncated to len. */
void tw_model_name(const char *maybe_served, const char *dir, char *out, size_t len);

/** The --model option's parser (common/base/opts.h TW_OPT_STR_FN; dst: const
 *  char **): resolves `text` with tw_model_resolve and stores the directory
 *  (kept for the life of the process). 0, or -1 with the reason in err. */
int tw_model_opt(const char *text, void *dst, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
