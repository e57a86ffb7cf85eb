/* harmony.h: the Harmony chat format of gpt-oss (spec §4): conversations, the
 * renderer (conversation -> prompt ids ending in <|start|>assistant) and the
 * streaming parser (generated ids -> message events).
 *
 * Promises:
 *  - rendering follows spec §4 byte for byte (the harmony-rs rules): system
 *    message §4.5, developer message with instructions and function tools in
 *    the TypeScript-like syntax §4.6, header order §4.2, <|call|> after an
 *    assistant message with a recipient, analysis dropping §4.9; every text
 *    piece is encoded as ordinary text, so user text never yields special ids;
 *  - the parser is incremental (one id at a time), tolerant of the header
 *    variants models produce (recipient before or after the channel,
 *    <|constrain|> content types, a repeated <|start|>assistant), and on an
 *    unexpected token reports an ERROR event and recovers; it never drops a
 *    token silently and never fails except for memory;
 *  - text deltas are whole UTF-8 (tokenizer's stream decoder).
 * Special ids are found in the tokenizer by content, so the tiny test model
 * (other ids) works the same. */
#ifndef TW_COMMON_HARMONY_H
#define TW_COMMON_HARMONY_H

#include "common/base/status.h"
#include "common/text/tokenizer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- enums ------------------------------------------------------------- */

typedef enum {
  TW_HARMONY_ROLE_SYSTEM = 0,
  TW_HARMONY_ROLE_DEVELOPER = 1,
  TW_HARMONY_ROLE_USER = 2,
  TW_HARMONY_ROLE_ASSISTANT = 3,
  TW_HARMONY_ROLE_TOOL = 4, /* author is the tool's name, e.g. functions.get_weather */
} tw_harmony_role_t;

typedef enum {
  TW_HARMONY_EFFORT_LOW = 0,
  TW_HARMONY_EFFORT_MEDIUM = 1, /* the default (spec §4.5) */
  TW_HARMONY_EFFORT_HIGH = 2,
} tw_harmony_effort_t;

/* Which earlier analysis messages the renderer leaves out (spec §4.9). */
typedef enum {
  /* harmony-rs auto_drop_analysis (the default): if the last assistant
   * message is on channel final, drop analysis messages before the first
   * final message */
  TW_HARMONY_DROP_HARMONY = 0,
  TW_HARMONY_DROP_NONE = 1, /* keep every message */
} tw_harmony_drop_t;

/* ---- conversation ------------------------------------------------------- */

/** One message. Strings are UTF-8, owned by the conversation (copied in by
 *  tw_harmony_conversation_add_message); NULL means absent. */
typedef struct {
  tw_harmony_role_t role;
  const char *name;         /* TOOL: required tool name ("functions.get_weather");
                               others: optional author name, rendered role:name */
  const char *recipient;    /* "functions.NAME" for a tool call, "assistant" for a
                               tool result, NULL otherwise */
  const char *channel;      /* analysis | commentary | final, or NULL */
  const char *content_type; /* "<|constrain|>json", "json", or NULL */
  const char *content;      /* text; never NULL once added ("" if empty) */
} tw_harmony_message_t;

/** A function tool of the developer message (namespace functions, spec §4.6). */
typedef struct {
  const char *name;
  const char *description;     /* "" if none */
  const char *parameters_json; /* JSON Schema object as text, or NULL: () => any */
} tw_harmony_tool_t;

/** A conversation to render. Initialise with tw_harmony_conversation_init and
 *  fill with the setters (which copy); free with _fini. Fields may be read. */
typedef struct {
  /* system message, spec §4.5; NULL strings take the defaults */
  int include_system;             /* 1 (default): render the system message */
  const char *model_identity;     /* NULL: "You are ChatGPT, a large language model trained by OpenAI." */
  const char *knowledge_cutoff;   /* NULL: "2024-06" */
  const char *current_date;       /* NULL: no "Current date:" line; else "YYYY-MM-DD" */
  tw_harmony_effort_t reasoning_effort;
  /* developer message, spec §4.6 (rendered when either is present) */
  const char *developer_instructions;
  tw_harmony_tool_t *tools;
  size_t n_tools;
  tw_harmony_message_t *messages;
  size_t n_messages;
  tw_harmony_drop_t drop_analysis;
  size_t cap_tools_, cap_messages_; /* internal */
} tw_harmony_conversation_t;

void tw_harmony_conversation_init(tw_harmony_conversation_t *conv);
void tw_harmony_conversation_fini(tw_harmony_conversation_t *conv);

/** Whether `date` is a real calendar date YYYY-MM-DD (Gregorian, leap years
 *  included), the only form the system message's "Current date:" line takes
 *  (spec §4.5). An empty string is not a date. */
bool tw_harmony_date_valid(const char *date);

/** Set (copy) one of the conversation's string fields, e.g.
 *  tw_harmony_conversation_set(&c, &c.current_date, "2025-06-28"). `value` NULL
 *  clears it. TW_ERR_INVALID_ARGUMENT if value is not UTF-8; TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_harmony_conversation_set(tw_harmony_conversation_t *conv,
                                                     const char **field, const char *value);

/** Append a copy of *msg. Errors: TW_ERR_INVALID_ARGUMENT (a role outside the
 *  enum, a TOOL message without a name, content NULL, a string that is not
 *  UTF-8: the message says which field), TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_harmony_conversation_add_message(tw_harmony_conversation_t *conv,
                                                             const tw_harmony_message_t *msg);

/** Append a copy of a function tool. Errors: TW_ERR_INVALID_ARGUMENT (no name,
 *  parameters_json that is not JSON or not a JSON object, not UTF-8),
 *  TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_harmony_conversation_add_tool(tw_harmony_conversation_t *conv,
                                                          const tw_harmony_tool_t *tool);

/** Fill an initialised conversation from OpenAI chat-completions JSON:
 *  {"messages":[{role, content (string or [{type:text,text}]), name,
 *  thinking | reasoning_content | reasoning, channel, tool_calls:[{id,
 *  function:{name, arguments}}], tool_call_id}], "tools":[{type:function,
 *  function:{name, description, parameters}}], "reasoning_effort":
 *  low|medium|high, and the extensions "current_date", "knowledge_cutoff",
 *  "model_identity", "developer_instructions"}.
 *  Mapping: leading system/developer messages become the developer
 *  instructions (joined by a blank line); later ones become developer
 *  messages; assistant thinking -> channel analysis; assistant content ->
 *  channel final (commentary when the message also has tool calls, or the
 *  message's "channel"); each tool call -> an assistant message to
 *  functions.NAME on commentary with content type <|constrain|>json; a tool
 *  message -> author functions.NAME (from "name" or the matching tool call's
 *  id) to=assistant on commentary (spec §4.8).
 *  Errors (TW_ERR_INVALID_ARGUMENT, message naming the JSON path): not JSON,
 *  unknown role, missing content, a tool whose parameters are not an object,
 *  a string that is not UTF-8, a tool result whose tool cannot be found, a bad
 *  reasoning_effort. TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_harmony_conversation_from_openai_json(tw_harmony_conversation_t *conv,
                                                                  const char *json, size_t len);

/* ---- renderer ----------------------------------------------------------- */

typedef struct tw_harmony tw_harmony_t;

/** The format bound to a tokenizer (borrowed; must outlive it): looks up the
 *  special tokens by content (spec §4.1). TW_ERR_FORMAT if one of <|start|>,
 *  <|end|>, <|message|>, <|channel|>, <|constrain|>, <|return|>, <|call|> is
 *  missing. Read-only after creation: may be shared by threads. */
TW_NODISCARD tw_status_t tw_harmony_create(const tw_tokenizer_t *tok, tw_harmony_t **h_p);
void tw_harmony_destroy(tw_harmony_t *h);

/** The tokenizer it was created with. */
const tw_tokenizer_t *tw_harmony_tokenizer(const tw_harmony_t *h);

/** Special token ids, by content: "<|start|>" etc. -1 for an unknown name. */
int32_t tw_harmony_token(const tw_harmony_t *h, const char *content);

/** Render `conv` for completion (spec §4.7): all messages, then <|start|>assistant.
 *  Appends to `out`. maybe_enc: an encoder of the same tokenizer to use (this
 *  thread's), or NULL for a temporary one. max_prompt_tokens: 0 for no limit;
 *  else TW_ERR_OUT_OF_RANGE when the prompt is longer (the message gives both
 *  numbers). Other errors: TW_ERR_INVALID_ARGUMENT (a TOOL message without a
 *  name, tool parameters that are not a JSON object), TW_ERR_NO_MEMORY. On
 *  error `out` is left as it was. */
TW_NODISCARD tw_status_t tw_harmony_render(const tw_harmony_t *h,
                                           const tw_harmony_conversation_t *conv,
                                           tw_tok_encoder_t *maybe_enc, size_t max_prompt_tokens,
                                           tw_token_ids_t *out);

/** The header of an assistant message to a function, as the model writes it
 *  after <|start|>assistant (spec §4.2, the recipient in the channel part):
 *  <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>,
 *  appended to `out`; the text between the special ids is one ordinary piece
 *  (as `twain tokenize --allow-special` encodes the same string). A prompt
 *  that ends with it makes the next generated ids that call's arguments
 *  (tool_choice, docs/api.md). name NULL: only "<|channel|>commentary to",
 *  for the model to write "=functions.NAME" itself. enc: an encoder of h's
 *  tokenizer (this thread's). Errors: TW_ERR_INVALID_ARGUMENT (name empty or
 *  not UTF-8), TW_ERR_NO_MEMORY; on error `out` is left as it was. */
TW_NODISCARD tw_status_t tw_harmony_render_call_header(const tw_harmony_t *h, const char *name,
                                                       tw_tok_encoder_t *enc, tw_token_ids_t *out);

/** The system message text (spec §4.5) and the developer message text (spec
 *  §4.6, "" if there is none) of `conv`, appended to `out` (for tests/tools). */
TW_NODISCARD tw_status_t tw_harmony_system_text(const tw_harmony_conversation_t *conv,
                                                tw_tok_buf_t *out);
TW_NODISCARD tw_status_t tw_harmony_developer_text(const tw_harmony_conversation_t *conv,
                                                   tw_tok_buf_t *out);

/** JSON Schema -> the TypeScript-like type of spec §4.6 (harmony-rs
 *  json_schema_to_typescript), appended to `out`. `indent` is the current
 *  indentation ("" at the top). TW_ERR_NO_MEMORY. */
struct cJSON;
TW_NODISCARD tw_status_t tw_harmony_schema_to_ts(const struct cJSON *schema, const char *indent,
                                                 tw_tok_buf_t *out);

/* ---- parser ------------------------------------------------------------- */

typedef enum {
  TW_HARMONY_EV_MESSAGE_START = 1, /* header parsed: role, author, recipient, channel, content_type */
  TW_HARMONY_EV_TEXT_DELTA = 2,    /* text: new content (whole UTF-8) */
  TW_HARMONY_EV_MESSAGE_END = 3,   /* text: the whole content; header fields again */
  TW_HARMONY_EV_TOOL_CALL = 4,     /* an assistant message with a recipient ended:
                                      recipient = the tool, text = arguments */
  TW_HARMONY_EV_STOP = 5,          /* <|return|> or <|call|>: stop says which */
  TW_HARMONY_EV_ERROR = 6,         /* text: what was unexpected; parsing goes on */
} tw_harmony_event_kind_t;

typedef enum {
  TW_HARMONY_STOP_NONE = 0,
  TW_HARMONY_STOP_RETURN = 1, /* <|return|> (200002) */
  TW_HARMONY_STOP_CALL = 2,   /* <|call|> (200012) */
} tw_harmony_stop_t;

/** An event. Pointers are valid only during the callback. */
typedef struct {
  tw_harmony_event_kind_t kind;
  size_t message_index;     /* 0-based count of messages started so far */
  tw_harmony_role_t role;
  const char *author;       /* as written: "assistant", "functions.get_weather" */
  const char *recipient;    /* NULL if none */
  const char *channel;      /* NULL if none */
  const char *content_type; /* NULL if none; "<|constrain|>json" keeps its marker */
  const char *text;         /* see the kinds; NUL-terminated */
  size_t text_len;
  tw_harmony_stop_t stop;   /* STOP */
  int32_t token;            /* the id that caused the event; -1 from finish */
} tw_harmony_event_t;

typedef void (*tw_harmony_event_fn)(void *user, const tw_harmony_event_t *ev);

typedef struct tw_harmony_parser tw_harmony_parser_t;

/** A parser for one generation. If `in_header_of` is a role (>= 0) the parser
 *  starts inside that role's header, as after a prompt that ends in
 *  <|start|>assistant (pass TW_HARMONY_ROLE_ASSISTANT); pass -1 to start
 *  before any message (parsing a whole rendered conversation). Events go to
 *  fn(user, ev) during push/finish. TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_harmony_parser_create(const tw_harmony_t *h, int in_header_of,
                                                  tw_harmony_event_fn fn, void *user,
                                                  tw_harmony_parser_t **p_p);
void tw_harmony_parser_destroy(tw_harmony_parser_t *p);

/** Feed one generated id. Unexpected ids become ERROR events, never a failure;
 *  the only error is TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_harmony_parser_push(tw_harmony_parser_t *p, int32_t token);

/** End of generation (e.g. max tokens): an unfinished message is reported
 *  (ERROR, then MESSAGE_END with what it had; no TOOL_CALL for cut-off
 *  arguments). TW_ERR_NO_MEMORY. */
TW_NODISCARD tw_status_t tw_harmony_parser_finish(tw_harmony_parser_t *p);

/** Name of a role ("system" ... "tool"). Never NULL. */
const char *tw_harmony_role_str(tw_harmony_role_t role);

#ifdef __cplusplus
}
#endif
#endif
