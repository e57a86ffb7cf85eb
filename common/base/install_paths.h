/* install_paths.h: files found relative to the running executable, so a
 * relocated bundle (deploy/bundle.sh: bin/, lib/, share/twain/) works from
 * wherever it is unpacked. */
#ifndef TW_COMMON_INSTALL_PATHS_H
#define TW_COMMON_INSTALL_PATHS_H

#ifdef __cplusplus
extern "C" {
#endif

/** Relative to the executable's directory (/proc/self/exe), where a bundle
 *  installs the default model. */
#define TW_BUNDLE_MODEL_SUBDIR "../share/twain/models/tiny-gptoss-wordnet-mxfp4"

/** The default model directory: <dir of this executable>/
 *  TW_BUNDLE_MODEL_SUBDIR when it holds a config.json, else `fallback` (the
 *  source-tree path compiled in). The result is a static buffer (or
 *  `fallback` itself), valid for the life of the process; call it from one
 *  thread at start-up. Never fails. */
const char *tw_default_model_dir(const char *fallback);

#ifdef __cplusplus
}
#endif
#endif
