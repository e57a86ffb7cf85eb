/* log.h: one line per event: "2026-11-29T08:12:00.123Z INFO  r0 engine: message".
 *
 * The level comes from TWAIN_LOG (error|warn|info|debug|trace, default info),
 * read once by tw_log_init() in main; TWAIN_LOG_SUBSYS=a,b limits debug/trace
 * output to those subsystems. The level is checked before the arguments are
 * evaluated. Lines go to stderr, written with one write() so processes that
 * share a terminal do not interleave within a line. */
#ifndef TW_COMMON_LOG_H
#define TW_COMMON_LOG_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  TW_LOG_ERROR = 0,
  TW_LOG_WARN = 1,
  TW_LOG_INFO = 2,
  TW_LOG_DEBUG = 3,
  TW_LOG_TRACE = 4,
} tw_log_level_t;

extern int tw_log_level_g; /* set once by tw_log_init; read by TW_LOG */

/** Read TWAIN_LOG / TWAIN_LOG_SUBSYS and set the process name and rank shown
 *  in each line. Call once from main before any thread starts. */
void tw_log_init(const char *process_name, int rank);

/** Internal: write one formatted line. Use TW_LOG. */
void tw_log_write(tw_log_level_t level, const char *subsys, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/** Whether `subsys` passes the TWAIN_LOG_SUBSYS filter at `level`. */
int tw_log_enabled(tw_log_level_t level, const char *subsys);

#define TW_LOG(level, subsys, ...)                                     \
  do {                                                                 \
    if ((int)(level) <= tw_log_level_g && tw_log_enabled(level, subsys)) \
      tw_log_write((level), (subsys), __VA_ARGS__);                    \
  } while (0)

#define TW_ERROR(subsys, ...) TW_LOG(TW_LOG_ERROR, subsys, __VA_ARGS__)
#define TW_WARN(subsys, ...) TW_LOG(TW_LOG_WARN, subsys, __VA_ARGS__)
#define TW_INFO(subsys, ...) TW_LOG(TW_LOG_INFO, subsys, __VA_ARGS__)
#define TW_DEBUG(subsys, ...) TW_LOG(TW_LOG_DEBUG, subsys, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
