/* cli_text.c: `twain tokenize | detokenize | render | parse` (see cli_text.h):
 * the tokenizer (spec §5) and the Harmony renderer and parser (spec §4) on
 * stdin/stdout, for checking by hand and for scripts and tests. Ids are read
 * as a JSON array (or numbers separated by blanks or commas) and written as a
 * JSON array on one line. */
#include "router/cli/cli_text.h"

#include "common/base/install_paths.h"
#include "common/base/log.h"
#include "common/base/opts.h"
#include "common/model/model_path.h"
#include "common/text/harmony.h"
#include "common/text/tokenizer.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef TW_DEFAULT_MODEL_DIR
#define TW_DEFAULT_MODEL_DIR "tests/fixtures/tiny-gptoss-wordnet-mxfp4"
#endif

/* Options shared by the four commands. */
typedef struct {
  const char *cmd;
  char tokenizer[4096];
  bool allow_special, skip_special, text, conversation, events;
  size_t max_prompt_tokens;
} tw_text_opts_t;

/* Parse options (common/base/opts.h); returns TW_OPTS_RUN to continue, else the
 * exit code. Each command gets --tokenizer/--model plus its own rows. */
static int tw_text_args(int argc, char **argv, tw_text_opts_t *o) {
  memset(o, 0, sizeof *o);
  o->cmd = argv[0];
  const char *tokenizer = NULL, *model = tw_default_model_dir(TW_DEFAULT_MODEL_DIR);
  long long max_prompt = 0;
  tw_opt_t all[] = {
      TW_OPT_STR("tokenizer", &tokenizer, "FILE", "a Hugging Face tokenizer.json of gpt-oss's kind"),
      TW_OPT_STR_FN("model", &model, tw_model_opt, "DIR|ORG/NAME",
                    "use DIR/tokenizer.json;\n"
                    "or a Hugging Face id (ORG/NAME[@REV]) in the local cache (HF_HOME)"),
      TW_OPT_FLAG("allow-special", &o->allow_special,
                  "special-token strings in the text become their ids"),
      TW_OPT_FLAG("skip-special", &o->skip_special, "leave special tokens out of the text"),
      TW_OPT_LONG("max-prompt-tokens", &max_prompt, 0, INT32_MAX, "N",
                  "fail when the prompt is longer (0: no limit)"),
      TW_OPT_FLAG("text", &o->text, "print the prompt as text instead of ids"),
      TW_OPT_FLAG("conversation", &o->conversation,
                  "the ids start before any message (a rendered prompt)"),
      TW_OPT_FLAG("events", &o->events, "print each parser event as a JSON line instead"),
  };
  static const struct {
    const char *cmd, *env, *what;
  } cmds[] = {
      {"tokenize", "TWAIN_TOKENIZE_",
       "Read UTF-8 text on stdin, print the ids as a JSON array."},
      {"detokenize", "TWAIN_DETOKENIZE_",
       "Read ids (JSON array) on stdin, write the text's bytes."},
      {"render", "TWAIN_RENDER_",
       "Read a conversation as OpenAI chat JSON ({messages, tools, reasoning_effort,\n"
       "current_date}) on stdin, print the Harmony prompt ids (ending <|start|>assistant)."},
      {"parse", "TWAIN_PARSE_",
       "Read generated ids (JSON array) on stdin, print the parsed messages as JSON; by\n"
       "default the ids follow a prompt ending in <|start|>assistant."},
  };
  size_t c = 0;
  while (c + 1 < sizeof cmds / sizeof cmds[0] && strcmp(cmds[c].cmd, o->cmd)) c++;
  tw_opt_t opts[sizeof all / sizeof all[0]];
  size_t n = 0;
  /* the command each row of `all` belongs to (NULL: every command) */
  static const char *const row_cmd[] = {NULL, NULL, "tokenize", "detokenize", "render", "render",
                                        "parse", "parse"};
  _Static_assert(sizeof row_cmd / sizeof row_cmd[0] == sizeof all / sizeof all[0], "one per row");
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (!row_cmd[i] || !strcmp(row_cmd[i], cmds[c].cmd)) opts[n++] = all[i];
  char prog[32];
  snprintf(prog, sizeof prog, "twain %s", o->cmd);
  tw_opts_spec_t spec = {.prog = prog, .description = cmds[c].what, .env_prefix = cmds[c].env,
                         .opts = opts, .n_opts = n};
  int rc = tw_opts_parse(&spec, argc, argv, NULL);
  if (rc != TW_OPTS_RUN) return rc;
  o->max_prompt_tokens = (size_t)max_prompt;
  if (tokenizer)
    snprintf(o->tokenizer, sizeof o->tokenizer, "%s", tokenizer);
  else
    snprintf(o->tokenizer, sizeof o->tokenizer, "%s/tokenizer.json", model);
  return TW_OPTS_RUN;
}

static int tw_read_stdin(tw_tok_buf_t *b) {
  char chunk[65536];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, stdin)) > 0)
    if (tw_tok_buf_append(b, chunk, n) != TW_OK) return 0;
  if (ferror(stdin)) return 0;
  return tw_tok_buf_append(b, "", 0) == TW_OK;
}

static int tw_fail(const tw_text_opts_t *o, const char *what) {
  fprintf(stderr, "twain %s: %s: %s\n", o->cmd, what, tw_last_error());
  return 1;
}

int tw_cli_parse_ids(const char *cmd, const char *s, tw_token_ids_t *ids) {
  const char *p = s;
  while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
  if (*p == '[') {
    cJSON *arr = cJSON_Parse(p);
    if (!cJSON_IsArray(arr)) {
      cJSON_Delete(arr);
      fprintf(stderr, "twain %s: the ids are not a JSON array (of non-negative integers)\n", cmd);
      return 0;
    }
    int i = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, arr) {
      if (!cJSON_IsNumber(v) || v->valuedouble != (double)(int32_t)v->valuedouble ||
          v->valuedouble < 0) {
        fprintf(stderr, "twain %s: element %d of the id array is not a non-negative integer\n", cmd,
                i);
        cJSON_Delete(arr);
        return 0;
      }
      if (tw_token_ids_push(ids, (int32_t)v->valuedouble) != TW_OK) {
        cJSON_Delete(arr);
        return 0;
      }
      i++;
    }
    cJSON_Delete(arr);
    return 1;
  }
  char prog[64], *buf = strdup(p), *save = NULL;
  if (!buf) return 0;
  snprintf(prog, sizeof prog, "twain %s", cmd);
  int ok = 1; /* each item whole: "12abc" or "2]" is refused, not read as 12 or 2 */
  for (char *t = strtok_r(buf, " ,\n\t\r", &save); t && ok; t = strtok_r(NULL, " ,\n\t\r", &save)) {
    long long v;
    ok = !tw_opts_int(prog, "token id", t, 0, INT32_MAX, &v) &&
         tw_token_ids_push(ids, (int32_t)v) == TW_OK;
  }
  free(buf);
  return ok;
}

static void tw_print_ids(const tw_token_ids_t *ids) {
  putchar('[');
  for (size_t i = 0; i < ids->n; i++) printf(i ? ", %d" : "%d", ids->ids[i]);
  puts("]");
}

/* Load the tokenizer named by the options. */
static int tw_load(const tw_text_opts_t *o, tw_tokenizer_t **tok_p) {
  if (tw_tokenizer_load(o->tokenizer, tok_p) != TW_OK) return tw_fail(o, "cannot load tokenizer");
  return 0;
}

int tw_cli_tokenize(int argc, char **argv) {
  tw_text_opts_t o;
  int rc = tw_text_args(argc, argv, &o);
  if (rc >= 0) return rc;
  tw_tokenizer_t *tok;
  if ((rc = tw_load(&o, &tok))) return rc;
  tw_tok_buf_t in;
  tw_token_ids_t ids;
  tw_tok_buf_init(&in);
  tw_token_ids_init(&ids);
  if (!tw_read_stdin(&in)) {
    rc = 1;
    fprintf(stderr, "twain tokenize: cannot read stdin\n");
  } else if (tw_tokenizer_encode(tok, in.data, in.len, o.allow_special ? TW_TOK_ALLOW_SPECIAL : 0,
                                 &ids) != TW_OK) {
    rc = tw_fail(&o, "cannot tokenize stdin");
  } else {
    tw_print_ids(&ids);
  }
  tw_tok_buf_fini(&in);
  tw_token_ids_fini(&ids);
  tw_tokenizer_destroy(tok);
  return rc;
}

int tw_cli_detokenize(int argc, char **argv) {
  tw_text_opts_t o;
  int rc = tw_text_args(argc, argv, &o);
  if (rc >= 0) return rc;
  tw_tokenizer_t *tok;
  if ((rc = tw_load(&o, &tok))) return rc;
  tw_tok_buf_t in, out;
  tw_token_ids_t ids;
  tw_tok_buf_init(&in);
  tw_tok_buf_init(&out);
  tw_token_ids_init(&ids);
  if (!tw_read_stdin(&in) || !tw_cli_parse_ids(o.cmd, in.data, &ids)) {
    rc = 1;
  } else if (tw_tokenizer_decode(tok, ids.ids, ids.n, o.skip_special ? TW_TOK_SKIP_SPECIAL : 0,
                                 &out) != TW_OK) {
    rc = tw_fail(&o, "cannot detokenize");
  } else if (out.len && fwrite(out.data, 1, out.len, stdout) != out.len) {
    rc = 1;
  }
  tw_tok_buf_fini(&in);
  tw_tok_buf_fini(&out);
  tw_token_ids_fini(&ids);
  tw_tokenizer_destroy(tok);
  return rc;
}

int tw_cli_render(int argc, char **argv) {
  tw_text_opts_t o;
  int rc = tw_text_args(argc, argv, &o);
  if (rc >= 0) return rc;
  tw_tokenizer_t *tok;
  if ((rc = tw_load(&o, &tok))) return rc;
  tw_harmony_t *h = NULL;
  tw_harmony_conversation_t conv;
  tw_harmony_conversation_init(&conv);
  tw_tok_buf_t in, text;
  tw_token_ids_t ids;
  tw_tok_buf_init(&in);
  tw_tok_buf_init(&text);
  tw_token_ids_init(&ids);
  if (tw_harmony_create(tok, &h) != TW_OK) {
    rc = tw_fail(&o, "not a Harmony tokenizer");
  } else if (!tw_read_stdin(&in)) {
    rc = 1;
    fprintf(stderr, "twain render: cannot read stdin\n");
  } else if (tw_harmony_conversation_from_openai_json(&conv, in.data, in.len) != TW_OK) {
    rc = tw_fail(&o, "bad conversation");
  } else if (tw_harmony_render(h, &conv, NULL, o.max_prompt_tokens, &ids) != TW_OK) {
    rc = tw_fail(&o, "cannot render");
  } else if (o.text) {
    if (tw_tokenizer_decode(tok, ids.ids, ids.n, 0, &text) != TW_OK) rc = tw_fail(&o, "decode");
    else fwrite(text.data, 1, text.len, stdout);
  } else {
    tw_print_ids(&ids);
  }
  tw_tok_buf_fini(&in);
  tw_tok_buf_fini(&text);
  tw_token_ids_fini(&ids);
  tw_harmony_conversation_fini(&conv);
  tw_harmony_destroy(h);
  tw_tokenizer_destroy(tok);
  return rc;
}

/* ---- parse -------------------------------------------------------------- */

typedef struct {
  int events;
  cJSON *messages, *tool_calls, *errors, *stop;
  int oom;
} tw_parse_out_t;

static cJSON *tw_str_or_null(const char *s) { return s ? cJSON_CreateString(s) : cJSON_CreateNull(); }

static const char *tw_ev_name(tw_harmony_event_kind_t k) {
  switch (k) {
    case TW_HARMONY_EV_MESSAGE_START: return "message_start";
    case TW_HARMONY_EV_TEXT_DELTA: return "text_delta";
    case TW_HARMONY_EV_MESSAGE_END: return "message_end";
    case TW_HARMONY_EV_TOOL_CALL: return "tool_call";
    case TW_HARMONY_EV_STOP: return "stop";
    case TW_HARMONY_EV_ERROR: return "error";
  }
  return "?";
}

static void tw_on_event(void *user, const tw_harmony_event_t *ev) {
  tw_parse_out_t *out = user;
  const char *stop = ev->stop == TW_HARMONY_STOP_RETURN ? "return"
                     : ev->stop == TW_HARMONY_STOP_CALL ? "call" : NULL;
  if (out->events) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "event", tw_ev_name(ev->kind));
    cJSON_AddNumberToObject(j, "token", ev->token);
    if (ev->kind != TW_HARMONY_EV_STOP && ev->kind != TW_HARMONY_EV_ERROR) {
      cJSON_AddNumberToObject(j, "message", (double)ev->message_index);
      cJSON_AddStringToObject(j, "role", tw_harmony_role_str(ev->role));
      cJSON_AddItemToObject(j, "author", tw_str_or_null(ev->author));
      cJSON_AddItemToObject(j, "recipient", tw_str_or_null(ev->recipient));
      cJSON_AddItemToObject(j, "channel", tw_str_or_null(ev->channel));
      cJSON_AddItemToObject(j, "content_type", tw_str_or_null(ev->content_type));
    }
    if (ev->kind == TW_HARMONY_EV_STOP) cJSON_AddStringToObject(j, "stop", stop ? stop : "none");
    if (ev->kind != TW_HARMONY_EV_MESSAGE_START && ev->kind != TW_HARMONY_EV_STOP)
      cJSON_AddStringToObject(j, "text", ev->text);
    char *s = cJSON_PrintUnformatted(j);
    if (s) puts(s);
    else out->oom = 1;
    free(s);
    cJSON_Delete(j);
    return;
  }
  if (ev->kind == TW_HARMONY_EV_MESSAGE_END) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", tw_harmony_role_str(ev->role));
    cJSON_AddItemToObject(m, "author", tw_str_or_null(ev->author));
    cJSON_AddItemToObject(m, "recipient", tw_str_or_null(ev->recipient));
    cJSON_AddItemToObject(m, "channel", tw_str_or_null(ev->channel));
    cJSON_AddItemToObject(m, "content_type", tw_str_or_null(ev->content_type));
    cJSON_AddStringToObject(m, "content", ev->text);
    cJSON_AddItemToArray(out->messages, m);
  } else if (ev->kind == TW_HARMONY_EV_TOOL_CALL) {
    cJSON *c = cJSON_CreateObject();
    const char *name = ev->recipient;
    if (!strncmp(name, "functions.", 10)) name += 10;
    cJSON_AddStringToObject(c, "recipient", ev->recipient);
    cJSON_AddStringToObject(c, "name", name);
    cJSON_AddItemToObject(c, "channel", tw_str_or_null(ev->channel));
    cJSON_AddItemToObject(c, "content_type", tw_str_or_null(ev->content_type));
    cJSON_AddStringToObject(c, "arguments", ev->text);
    cJSON_AddItemToArray(out->tool_calls, c);
  } else if (ev->kind == TW_HARMONY_EV_ERROR) {
    cJSON_AddItemToArray(out->errors, cJSON_CreateString(ev->text));
  } else if (ev->kind == TW_HARMONY_EV_STOP) {
    cJSON_Delete(out->stop);
    out->stop = tw_str_or_null(stop);
  }
}

int tw_cli_parse(int argc, char **argv) {
  tw_text_opts_t o;
  int rc = tw_text_args(argc, argv, &o);
  if (rc >= 0) return rc;
  tw_tokenizer_t *tok;
  if ((rc = tw_load(&o, &tok))) return rc;
  tw_harmony_t *h = NULL;
  tw_harmony_parser_t *p = NULL;
  tw_tok_buf_t in;
  tw_token_ids_t ids;
  tw_tok_buf_init(&in);
  tw_token_ids_init(&ids);
  tw_parse_out_t out = {.events = o.events,
                        .messages = cJSON_CreateArray(),
                        .tool_calls = cJSON_CreateArray(),
                        .errors = cJSON_CreateArray(),
                        .stop = cJSON_CreateNull()};
  if (tw_harmony_create(tok, &h) != TW_OK) {
    rc = tw_fail(&o, "not a Harmony tokenizer");
  } else if (!tw_read_stdin(&in) || !tw_cli_parse_ids(o.cmd, in.data, &ids)) {
    rc = 1;
  } else if (tw_harmony_parser_create(h, o.conversation ? -1 : TW_HARMONY_ROLE_ASSISTANT,
                                      tw_on_event, &out, &p) != TW_OK) {
    rc = tw_fail(&o, "parser");
  } else {
    for (size_t i = 0; i < ids.n && rc == 0; i++)
      if (tw_harmony_parser_push(p, ids.ids[i]) != TW_OK) rc = tw_fail(&o, "parse");
    if (rc == 0 && tw_harmony_parser_finish(p) != TW_OK) rc = tw_fail(&o, "parse");
    if (rc == 0 && !o.events) {
      cJSON *root = cJSON_CreateObject();
      cJSON_AddItemToObject(root, "messages", out.messages);
      cJSON_AddItemToObject(root, "tool_calls", out.tool_calls);
      cJSON_AddItemToObject(root, "stop", out.stop);
      cJSON_AddItemToObject(root, "errors", out.errors);
      out.messages = out.tool_calls = out.stop = out.errors = NULL;
      char *s = cJSON_Print(root);
      if (s) puts(s);
      else rc = 1;
      free(s);
      cJSON_Delete(root);
    }
    if (out.oom) rc = 1;
  }
  cJSON_Delete(out.messages);
  cJSON_Delete(out.tool_calls);
  cJSON_Delete(out.errors);
  cJSON_Delete(out.stop);
  tw_harmony_parser_destroy(p);
  tw_harmony_destroy(h);
  tw_tok_buf_fini(&in);
  tw_token_ids_fini(&ids);
  tw_tokenizer_destroy(tok);
  return rc;
}
