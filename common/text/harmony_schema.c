/* harmony_schema.c: JSON Schema -> the TypeScript-like parameter types of the
 * Harmony tools section (spec §4.6), following harmony-rs
 * json_schema_to_typescript rule for rule: objects with one commented line per
 * property (title, description, examples), `name?:` for optional properties,
 * trailing `// default: X`, string enums as unions, integer -> number, arrays
 * as T[] or Array<any>, type lists as unions, nullable -> | null, oneOf
 * variants on ` | ` lines. Property order is the schema's order. */
#include "common/text/harmony.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define APPEND(s) TW_CHECK(tw_tok_buf_append(out, (s), strlen(s)))

static int tw_schema_is_enum(const cJSON *s) {
  const cJSON *e = cJSON_GetObjectItemCaseSensitive(s, "enum");
  return cJSON_IsArray(e) && cJSON_GetArraySize(e) > 0;
}

static const char *tw_schema_str(const cJSON *s, const char *key) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, key);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int tw_schema_nullable(const cJSON *s) {
  return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(s, "nullable"));
}

/* "default: X" per the rules: quoted for a string on a non-enum schema, bare
 * for a string on an enum, compact JSON otherwise. */
static TW_NODISCARD tw_status_t tw_schema_default(const cJSON *schema, const cJSON *def,
                                                  tw_tok_buf_t *out) {
  APPEND("default: ");
  if (cJSON_IsString(def)) {
    if (!tw_schema_is_enum(schema)) APPEND("\"");
    APPEND(def->valuestring);
    if (!tw_schema_is_enum(schema)) APPEND("\"");
    return TW_OK;
  }
  char *js = cJSON_PrintUnformatted(def);
  if (!js) return tw_err(TW_ERR_NO_MEMORY, "tool schema: cannot print a default value");
  tw_status_t st = tw_tok_buf_append(out, js, strlen(js));
  free(js);
  return st;
}

/* The type of `variant` with " | null" added when it is nullable. */
static TW_NODISCARD tw_status_t tw_schema_variant(const cJSON *variant, const char *indent,
                                                  tw_tok_buf_t *out) {
  size_t start = out->len;
  TW_CHECK(tw_harmony_schema_to_ts(variant, indent, out));
  if (tw_schema_nullable(variant) && !strstr(out->data + start, "null")) APPEND(" | null");
  return TW_OK;
}

/* Top-level oneOf: "\n<indent> | T // comments" per variant. */
static TW_NODISCARD tw_status_t tw_schema_one_of_top(const cJSON *arr, const char *indent,
                                                     tw_tok_buf_t *out) {
  char sub[512];
  snprintf(sub, sizeof sub, "%s   ", indent);
  const cJSON *v;
  cJSON_ArrayForEach(v, arr) {
    APPEND("\n");
    APPEND(indent);
    APPEND(" | ");
    TW_CHECK(tw_schema_variant(v, sub, out));
    const char *desc = tw_schema_str(v, "description");
    const cJSON *def = cJSON_GetObjectItemCaseSensitive(v, "default");
    if (desc || def) {
      APPEND(" // ");
      if (desc) APPEND(desc);
      if (desc && def) APPEND(" ");
      if (def) TW_CHECK(tw_schema_default(v, def, out));
    }
  }
  return TW_OK;
}

/* A property whose schema has oneOf: comments above, "name?:" then variant lines. */
static TW_NODISCARD tw_status_t tw_schema_one_of_prop(const cJSON *val, const cJSON *arr,
                                                      const char *key, int required,
                                                      const char *indent, tw_tok_buf_t *out) {
  const char *prop_desc = tw_schema_str(val, "description");
  const cJSON *first = cJSON_GetArrayItem(arr, 0);
  const char *first_desc = first ? tw_schema_str(first, "description") : NULL;
  int skip_desc = prop_desc && first_desc && strcmp(prop_desc, first_desc) == 0;
  int desc_above = 0;
  if (!skip_desc && prop_desc) {
    APPEND(indent);
    APPEND("// ");
    APPEND(prop_desc);
    APPEND("\n");
    desc_above = 1;
  }
  const cJSON *def = cJSON_GetObjectItemCaseSensitive(val, "default");
  if (def) {
    APPEND(indent);
    APPEND("// ");
    TW_CHECK(tw_schema_default(val, def, out));
    APPEND("\n");
  }
  APPEND(indent);
  APPEND(key);
  APPEND(required ? ":\n" : "?:\n");
  char sub[512];
  snprintf(sub, sizeof sub, "%s   ", indent);
  int i = 0;
  const cJSON *v;
  cJSON_ArrayForEach(v, arr) {
    APPEND(indent);
    APPEND(" | ");
    TW_CHECK(tw_schema_variant(v, sub, out));
    const char *vdesc = (i == 0 && desc_above) ? NULL : tw_schema_str(v, "description");
    if (vdesc && prop_desc && strcmp(vdesc, prop_desc) == 0) vdesc = NULL;
    const cJSON *vdef = cJSON_GetObjectItemCaseSensitive(v, "default");
    if (vdesc || vdef) {
      APPEND(" // ");
      if (vdesc) APPEND(vdesc);
      if (vdesc && vdef) APPEND(" ");
      if (vdef) TW_CHECK(tw_schema_default(v, vdef, out));
    }
    APPEND("\n");
    i++;
  }
  APPEND(indent);
  APPEND(",\n");
  return TW_OK;
}

static int tw_schema_required(const cJSON *schema, const char *key) {
  const cJSON *req = cJSON_GetObjectItemCaseSensitive(schema, "required");
  const cJSON *r;
  cJSON_ArrayForEach(r, req) {
    if (cJSON_IsString(r) && strcmp(r->valuestring, key) == 0) return 1;
  }
  return 0;
}

static TW_NODISCARD tw_status_t tw_schema_object(const cJSON *schema, const char *indent,
                                                 tw_tok_buf_t *out) {
  const char *desc = tw_schema_str(schema, "description");
  if (desc) {
    APPEND(indent);
    APPEND("// ");
    APPEND(desc);
    APPEND("\n");
  }
  APPEND("{\n");
  const cJSON *props = cJSON_GetObjectItemCaseSensitive(schema, "properties");
  char sub[512];
  snprintf(sub, sizeof sub, "%s    ", indent);
  const cJSON *val;
  if (cJSON_IsObject(props)) {
    cJSON_ArrayForEach(val, props) {
      const char *key = val->string;
      int required = tw_schema_required(schema, key);
      const char *title = tw_schema_str(val, "title");
      if (title) {
        APPEND(indent);
        APPEND("// ");
        APPEND(title);
        APPEND("\n");
        APPEND(indent);
        APPEND("//\n");
      }
      const cJSON *one_of = cJSON_GetObjectItemCaseSensitive(val, "oneOf");
      const char *pdesc = tw_schema_str(val, "description");
      if (!one_of && pdesc) {
        APPEND(indent);
        APPEND("// ");
        APPEND(pdesc);
        APPEND("\n");
      }
      const cJSON *examples = cJSON_GetObjectItemCaseSensitive(val, "examples");
      if (cJSON_IsArray(examples) && cJSON_GetArraySize(examples) > 0) {
        APPEND(indent);
        APPEND("// Examples:\n");
        const cJSON *ex;
        cJSON_ArrayForEach(ex, examples) {
          if (!cJSON_IsString(ex)) continue;
          APPEND(indent);
          APPEND("// - \"");
          APPEND(ex->valuestring);
          APPEND("\"\n");
        }
      }
      if (cJSON_IsArray(one_of)) {
        TW_CHECK(tw_schema_one_of_prop(val, one_of, key, required, indent, out));
        continue;
      }
      APPEND(indent);
      APPEND(key);
      APPEND(required ? ": " : "?: ");
      TW_CHECK(tw_schema_variant(val, sub, out));
      APPEND(",");
      const cJSON *def = cJSON_GetObjectItemCaseSensitive(val, "default");
      if (!one_of && def) {
        APPEND(" // ");
        TW_CHECK(tw_schema_default(val, def, out));
      }
      APPEND("\n");
    }
  }
  APPEND(indent);
  APPEND("}");
  return TW_OK;
}

TW_NODISCARD tw_status_t tw_harmony_schema_to_ts(const cJSON *schema, const char *indent,
                                                 tw_tok_buf_t *out) {
  if (strlen(indent) > 400) {
    APPEND("any"); /* absurdly deep nesting: stop (keeps the indent buffers bounded) */
    return TW_OK;
  }
  const cJSON *one_of = cJSON_GetObjectItemCaseSensitive(schema, "oneOf");
  if (cJSON_IsArray(one_of)) return tw_schema_one_of_top(one_of, indent, out);
  const cJSON *type = cJSON_GetObjectItemCaseSensitive(schema, "type");
  if (cJSON_IsArray(type)) {
    int n = 0;
    const cJSON *t;
    cJSON_ArrayForEach(t, type) {
      if (!cJSON_IsString(t)) continue;
      if (n++) APPEND(" | ");
      APPEND(strcmp(t->valuestring, "integer") == 0 ? "number" : t->valuestring);
    }
    if (n) return TW_OK;
  }
  if (!cJSON_IsString(type)) {
    APPEND("any");
    return TW_OK;
  }
  const char *ty = type->valuestring;
  if (strcmp(ty, "object") == 0) return tw_schema_object(schema, indent, out);
  if (strcmp(ty, "string") == 0) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(schema, "enum");
    int n = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, e) {
      if (!cJSON_IsString(v)) continue;
      if (n++) APPEND(" | ");
      APPEND("\"");
      APPEND(v->valuestring);
      APPEND("\"");
    }
    if (!n) APPEND("string");
    return TW_OK;
  }
  if (strcmp(ty, "number") == 0 || strcmp(ty, "integer") == 0) {
    APPEND("number");
    return TW_OK;
  }
  if (strcmp(ty, "boolean") == 0) {
    APPEND("boolean");
    return TW_OK;
  }
  if (strcmp(ty, "array") == 0) {
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(schema, "items");
    if (items) {
      TW_CHECK(tw_harmony_schema_to_ts(items, indent, out));
      APPEND("[]");
    } else {
      APPEND("Array<any>");
    }
    return TW_OK;
  }
  APPEND("any");
  return TW_OK;
}
