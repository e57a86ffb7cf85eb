/* harmony_openai.c: OpenAI chat-completions JSON -> tw_harmony_conversation_t
 * (used by `twain render` and the router). The mapping is documented at
 * tw_harmony_conversation_from_openai_json in harmony.h; tool calls and tool
 * results follow spec §4.8, the system/developer split spec §4.5-§4.6.
 * Every error names the JSON path of the bad field. */
#include "common/text/harmony.h"

#include "common/base/log.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BAD(...) tw_err_quiet(TW_ERR_INVALID_ARGUMENT, __VA_ARGS__)

static TW_NODISCARD tw_status_t tw_check_utf8(const char *s, const char *path) {
  size_t bad;
  if (s && !tw_utf8_valid(s, strlen(s), &bad))
    return BAD("%s is not valid UTF-8 (bad byte 0x%02x at offset %zu)", path,
               (unsigned char)s[bad], bad);
  return TW_OK;
}

/* Message content: a string, null, or text parts ({type: text | input_text |
 * output_text, text}, or bare strings) joined with "\n" between them, as
 * vLLM does (an instruction part and a document part stay apart); a part of
 * another type (an image, audio, a file) is refused. The result (malloc'd, ""
 * for null/absent) goes to *out_p. */
static TW_NODISCARD tw_status_t tw_content_text(const cJSON *content, const char *path,
                                                char **out_p) {
  tw_tok_buf_t b;
  tw_tok_buf_init(&b);
  tw_status_t st = TW_OK;
  if (cJSON_IsString(content)) {
    st = tw_tok_buf_append(&b, content->valuestring, strlen(content->valuestring));
  } else if (cJSON_IsArray(content)) {
    int i = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, content) {
      const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
      const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
      if (cJSON_IsString(part)) text = part;
      if (!cJSON_IsString(text) ||
          (type && !(cJSON_IsString(type) && (!strcmp(type->valuestring, "text") ||
                                              !strcmp(type->valuestring, "input_text") ||
                                              !strcmp(type->valuestring, "output_text"))))) {
        st =
            BAD("%s[%d]: only text parts are supported ({\"type\":\"text\",\"text\":...}%s%.40s%s)",
                path, i, cJSON_IsString(type) ? "; not \"" : "",
                cJSON_IsString(type) ? type->valuestring : "", cJSON_IsString(type) ? "\"" : "");
        break;
      }
      if (i > 0) st = tw_tok_buf_append(&b, "\n", 1);
      if (st == TW_OK) st = tw_tok_buf_append(&b, text->valuestring, strlen(text->valuestring));
      if (st < 0) break;
      i++;
    }
  } else if (content && !cJSON_IsNull(content)) {
    st = BAD("%s must be a string or an array of text parts", path);
  }
  if (st == TW_OK) st = tw_tok_buf_append(&b, "", 0);
  if (st == TW_OK) st = tw_check_utf8(b.data, path);
  if (st < 0) {
    tw_tok_buf_fini(&b);
    return st;
  }
  *out_p = b.data;
  return TW_OK;
}

static const char *tw_str(const cJSON *obj, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

static TW_NODISCARD tw_status_t tw_add(tw_harmony_conversation_t *c, tw_harmony_role_t role,
                                       const char *name, const char *recipient, const char *channel,
                                       const char *ctype, const char *content) {
  tw_harmony_message_t m = {.role = role, .name = name, .recipient = recipient,
                            .channel = channel, .content_type = ctype, .content = content};
  return tw_harmony_conversation_add_message(c, &m);
}

static TW_NODISCARD tw_status_t tw_tools(tw_harmony_conversation_t *c, const cJSON *tools) {
  if (!tools || cJSON_IsNull(tools)) return TW_OK;
  if (!cJSON_IsArray(tools)) return BAD("tools must be an array");
  int i = 0;
  const cJSON *t;
  cJSON_ArrayForEach(t, tools) {
    char path[64];
    snprintf(path, sizeof path, "tools[%d]", i);
    const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
    if (!fn) fn = t; /* {"name":...} directly */
    const char *type = tw_str(t, "type");
    if (type && strcmp(type, "function") != 0)
      return BAD("%s.type \"%s\" is not supported (only \"function\")", path, type);
    const char *name = tw_str(fn, "name");
    if (!name || !name[0]) return BAD("%s.function.name is missing", path);
    TW_CHECK(tw_check_utf8(name, path));
    const char *desc = tw_str(fn, "description");
    TW_CHECK(tw_check_utf8(desc, path));
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    char *pjson = NULL;
    if (params && !cJSON_IsNull(params)) {
      if (!cJSON_IsObject(params))
        return BAD("%s.function.parameters must be a JSON Schema object, got %s", path,
                   cJSON_IsArray(params) ? "an array" : cJSON_IsString(params) ? "a string"
                                                                               : "a scalar");
      pjson = cJSON_PrintUnformatted(params);
      if (!pjson) return tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", path);
    }
    tw_harmony_tool_t tool = {name, desc ? desc : "", pjson};
    tw_status_t st = tw_harmony_conversation_add_tool(c, &tool);
    free(pjson);
    TW_CHECK(st);
    i++;
  }
  return TW_OK;
}

/* The function name of the earlier tool call with this id, or NULL. */
static const char *tw_call_name(const cJSON *messages, const cJSON *upto, const char *id) {
  const cJSON *m;
  cJSON_ArrayForEach(m, messages) {
    if (m == upto) break;
    const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
    const cJSON *call;
    cJSON_ArrayForEach(call, calls) {
      const char *cid = tw_str(call, "id");
      if (cid && !strcmp(cid, id))
        return tw_str(cJSON_GetObjectItemCaseSensitive(call, "function"), "name");
    }
  }
  return NULL;
}

static TW_NODISCARD tw_status_t tw_assistant(tw_harmony_conversation_t *c, const cJSON *m,
                                             const char *path, const char *content) {
  const char *thinking = tw_str(m, "thinking");
  if (!thinking) thinking = tw_str(m, "reasoning_content");
  if (!thinking) thinking = tw_str(m, "reasoning");
  const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
  int n_calls = cJSON_IsArray(calls) ? cJSON_GetArraySize(calls) : 0;
  const char *channel = tw_str(m, "channel");
  char p2[160];
  snprintf(p2, sizeof p2, "%s.thinking", path);
  TW_CHECK(tw_check_utf8(thinking, p2));
  TW_CHECK(tw_check_utf8(channel, path));
  if (thinking && thinking[0])
    TW_CHECK(tw_add(c, TW_HARMONY_ROLE_ASSISTANT, NULL, NULL, "analysis", NULL, thinking));
  if (content[0] || (!n_calls && !(thinking && thinking[0])))
    TW_CHECK(tw_add(c, TW_HARMONY_ROLE_ASSISTANT, NULL, NULL,
                    channel ? channel : n_calls ? "commentary" : "final", NULL, content));
  for (int i = 0; i < n_calls; i++) {
    const cJSON *call = cJSON_GetArrayItem(calls, i);
    const cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
    const char *name = tw_str(fn, "name");
    snprintf(p2, sizeof p2, "%s.tool_calls[%d].function", path, i);
    if (!name || !name[0]) return BAD("%s.name is missing", p2);
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
    char *args_s = NULL;
    if (cJSON_IsString(args)) args_s = strdup(args->valuestring);
    else if (args && !cJSON_IsNull(args)) args_s = cJSON_PrintUnformatted(args);
    else args_s = strdup("{}");
    if (!args_s) return tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", p2);
    size_t rn = strlen(name) + 11;
    char *recipient = malloc(rn);
    if (!recipient) {
      free(args_s);
      return tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", p2);
    }
    snprintf(recipient, rn, "functions.%s", name);
    tw_status_t st = tw_check_utf8(recipient, p2);
    if (st == TW_OK) st = tw_check_utf8(args_s, p2);
    if (st == TW_OK)
      st = tw_add(c, TW_HARMONY_ROLE_ASSISTANT, NULL, recipient, "commentary",
                  "<|constrain|>json", args_s);
    free(recipient);
    free(args_s);
    TW_CHECK(st);
  }
  return TW_OK;
}

static TW_NODISCARD tw_status_t tw_messages(tw_harmony_conversation_t *c, const cJSON *messages) {
  if (!cJSON_IsArray(messages)) return BAD("messages must be an array");
  tw_tok_buf_t instr;
  tw_tok_buf_init(&instr);
  int leading = 1, i = 0, n_instr = 0;
  tw_status_t st = TW_OK;
  const cJSON *m;
  cJSON_ArrayForEach(m, messages) {
    char path[64];
    snprintf(path, sizeof path, "messages[%d]", i++);
    const char *role = tw_str(m, "role");
    if (!cJSON_IsObject(m) || !role) {
      st = BAD("%s.role is missing", path);
      break;
    }
    char cpath[80];
    snprintf(cpath, sizeof cpath, "%s.content", path);
    char *content = NULL;
    st = tw_content_text(cJSON_GetObjectItemCaseSensitive(m, "content"), cpath, &content);
    if (st < 0) break;
    const char *name = tw_str(m, "name");
    if (!strcmp(role, "system") || !strcmp(role, "developer")) {
      if (leading) { /* the developer instructions, spec §4.6 */
        if (n_instr++) st = tw_tok_buf_append(&instr, "\n\n", 2);
        if (st == TW_OK) st = tw_tok_buf_append(&instr, content, strlen(content));
      } else {
        st = tw_add(c, TW_HARMONY_ROLE_DEVELOPER, NULL, NULL, NULL, NULL, content);
      }
    } else if (!strcmp(role, "user")) {
      leading = 0;
      st = tw_check_utf8(name, path);
      if (st == TW_OK) st = tw_add(c, TW_HARMONY_ROLE_USER, name, NULL, NULL, NULL, content);
    } else if (!strcmp(role, "assistant")) {
      leading = 0;
      st = tw_assistant(c, m, path, content);
    } else if (!strcmp(role, "tool") || !strcmp(role, "function")) {
      leading = 0;
      const char *tname = name;
      const char *call_id = tw_str(m, "tool_call_id");
      if (!tname && call_id) tname = tw_call_name(messages, m, call_id);
      if (!tname) {
        st = BAD("%s: a tool result needs \"name\" or a \"tool_call_id\" of an earlier tool call",
                 path);
      } else {
        size_t an = strlen(tname) + 11;
        char *author = malloc(an);
        if (!author) {
          st = tw_err(TW_ERR_NO_MEMORY, "%s: out of memory", path);
        } else {
          snprintf(author, an, "%s%s", strncmp(tname, "functions.", 10) ? "functions." : "", tname);
          st = tw_check_utf8(author, path);
          if (st == TW_OK)
            st = tw_add(c, TW_HARMONY_ROLE_TOOL, author, "assistant", "commentary", NULL, content);
          free(author);
        }
      }
    } else {
      st = BAD("%s.role \"%s\" is unknown (expected system, developer, user, assistant or tool)",
               path, role);
    }
    free(content);
    if (st < 0) break;
  }
  if (st == TW_OK && n_instr) {
    st = tw_tok_buf_append(&instr, "", 0);
    if (st == TW_OK) st = tw_harmony_conversation_set(c, &c->developer_instructions, instr.data);
  }
  tw_tok_buf_fini(&instr);
  return st;
}

TW_NODISCARD tw_status_t tw_harmony_conversation_from_openai_json(tw_harmony_conversation_t *c,
                                                                  const char *json, size_t len) {
  cJSON *root = cJSON_ParseWithLength(json, len);
  if (!root) {
    const char *at = cJSON_GetErrorPtr();
    return BAD("the conversation is not valid JSON (near byte %ld)",
               at && at >= json && at <= json + len ? (long)(at - json) : -1L);
  }
  tw_status_t st = TW_OK;
  if (!cJSON_IsObject(root)) {
    st = BAD("the conversation must be a JSON object with \"messages\"");
    goto done;
  }
  const char *effort = tw_str(root, "reasoning_effort");
  if (effort) {
    if (!strcmp(effort, "low")) c->reasoning_effort = TW_HARMONY_EFFORT_LOW;
    else if (!strcmp(effort, "medium")) c->reasoning_effort = TW_HARMONY_EFFORT_MEDIUM;
    else if (!strcmp(effort, "high")) c->reasoning_effort = TW_HARMONY_EFFORT_HIGH;
    else {
      st = BAD("reasoning_effort \"%s\" is not low, medium or high", effort);
      goto done;
    }
  }
  static const char *const keys[] = {"current_date", "knowledge_cutoff", "model_identity",
                                     "developer_instructions"};
  const char **fields[] = {&c->current_date, &c->knowledge_cutoff, &c->model_identity,
                           &c->developer_instructions};
  for (int k = 0; k < 4; k++) {
    const char *v = tw_str(root, keys[k]);
    if (!v) continue;
    TW_CHECK_GOTO(tw_check_utf8(v, keys[k]), st, done);
    TW_CHECK_GOTO(tw_harmony_conversation_set(c, fields[k], v), st, done);
  }
  TW_CHECK_GOTO(tw_tools(c, cJSON_GetObjectItemCaseSensitive(root, "tools")), st, done);
  TW_CHECK_GOTO(tw_messages(c, cJSON_GetObjectItemCaseSensitive(root, "messages")), st, done);
done:
  cJSON_Delete(root);
  return st;
}
