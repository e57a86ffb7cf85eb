"""The official OpenAI Node SDK (npm `openai`, pinned in sdk/package-lock.json)
against twain's OpenAI-compatible HTTP API of `twain serve` (on by default;
ephemeral beside an ephemeral --listen; --api-key; CPU prefill and decode
workers, the default tiny model): models, chat completions plain and streamed (and the SDK's stream
helper), responses plain and streamed (and its stream helper), completions
plain and streamed, and tool_choice (a named function and "required" among
two tools) in chat completions and responses, plain and streamed. The SDK
must parse every answer and stream, and each text (each tool call's name and
arguments) must equal the protobuf API's answer to the same greedy request."""
import json
import os
import subprocess
import sys

import svc

from svc import check, finish

KEY = "sk-sdk-test"
QUESTION = "What does the word 'dog' mean?"
PROMPT = "The word dog means"
TOOL_QUESTION = "What is the weather in Paris?"
TOOLS = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": {p: {"type": "string"}}, "required": [p]}}}
    for n, d, p in (("get_weather", "Current weather for a city.", "city"),
                    ("get_time", "Current time in a time zone.", "tz"))]
SDK = os.environ.get("TW_SDK_DIR", os.path.join(svc.BUILD, "tests", "service", "sdk"))
if not os.path.exists(os.path.join(SDK, "node_modules", "openai")):
    print("FAIL: the OpenAI SDK is not installed in %s (the http_sdk_setup fixture does it)" % SDK)
    sys.exit(1)


def split(messages):
    """Protobuf messages as the HTTP API shows them: (content, reasoning)."""
    content = "".join(m.content for m in messages if m.channel != "analysis" and not m.recipient)
    reasoning = "".join(m.content for m in messages if m.channel == "analysis" and not m.recipient)
    return content, reasoning


def run(argv, data=None):
    return subprocess.run(argv, input=data, capture_output=True, text=True, timeout=120, check=True).stdout


serve = svc.Proc([svc.bin_path("router", "twain"), "serve", "--listen", "tcp://127.0.0.1:0", "--threads", "1",
                  "--metrics-port", "0", "--backend", "cpu", "--api-key", KEY] + svc.CALM_EXPIRE, "serve")
try:
    m = serve.wait_line(r"twain serve: ready: .*, OpenAI API at (http://127\.0\.0\.1:\d+/v1), clients at (\S+)", 120)
    url, ep = m.group(1), m.group(2)
    # the protobuf API's answers to the same greedy requests
    c = svc.Client(ep)
    req = svc.chat(QUESTION, 96, stream=False, date="", reasoning="low")
    req.api_key = KEY
    ref = c.wait([c.send(req)], 180)[0][-1]
    check(ref.error.code == 0, "protobuf chat answered (%s)" % ref.error.message)
    content, reasoning = split(ref.messages)
    ids = json.loads(run([svc.bin_path("router", "twain"), "tokenize", "--model", svc.MODEL], PROMPT))
    g = svc.generate(ids, 16, stream=False)
    g.api_key = KEY
    gref = c.wait([c.send(g)], 180)[0][-1]
    ctext = run([svc.bin_path("router", "twain"), "detokenize", "--model", svc.MODEL, "--skip-special"],
                json.dumps(list(gref.token_ids)))
    # ... and to the same tool_choice requests (ChatRequest.tool_choice)
    tool_refs = {}
    for label, choice, name in (("named", "TOOL_CHOICE_FUNCTION", "get_time"),
                                ("required", "TOOL_CHOICE_REQUIRED", "")):
        treq = svc.chat(TOOL_QUESTION, 96, stream=False, date="")
        treq.api_key = KEY
        treq.chat.sampling.explicit_max_tokens = True
        for t in TOOLS:
            ft = treq.chat.tools.add()
            ft.name, ft.description = t["function"]["name"], t["function"]["description"]
            ft.parameters_json = json.dumps(t["function"]["parameters"])
        treq.chat.tool_choice = svc.E[choice]
        treq.chat.tool_choice_name = name
        tool_refs[label] = c.wait([c.send(treq)], 180)[0][-1]
        tr = tool_refs[label]
        check(tr.error.code == 0 and len(tr.tool_calls) == 1 and
              tr.tool_calls[0].recipient in ("functions.get_weather", "functions.get_time") and
              (not name or tr.tool_calls[0].recipient == "functions." + name) and
              tr.finish_reason == svc.E["FINISH_TOOL_CALL"],
              "protobuf tool_choice %s: one call to %s, FINISH_TOOL_CALL (%s %s)" % (
                  label, tr.tool_calls[0].recipient if tr.tool_calls else None, tr.error.message,
                  tr.finish_reason))
    c.close()
    check(len(content + reasoning) > 0 and len(ctext) > 0, "the references are not empty (%r / %r / %r)" % (
        reasoning[:40], content[:40], ctext[:40]))

    p = subprocess.run(["node", os.path.join(SDK, "http_sdk.mjs"), url, "tiny-gptoss-wordnet-mxfp4", KEY,
                        QUESTION, PROMPT, TOOL_QUESTION, json.dumps(TOOLS)], capture_output=True, text=True, timeout=600)
    check(p.returncode == 0, "the SDK parsed every answer and stream (exit %d)%s" % (
        p.returncode, "" if p.returncode == 0 else ": " + p.stderr[-2000:]))
    out = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {}
    print("openai node SDK %s" % out.get("sdk"))
    check(out.get("models") == ["tiny-gptoss-wordnet-mxfp4"], "models.list (%s)" % out.get("models"))
    ch = out.get("chat", {})
    check(ch.get("content") == content and (ch.get("reasoning") or "") == reasoning,
          "chat.completions.create: content and reasoning_content equal the protobuf answer")
    check(ch.get("usage", {}).get("completion_tokens") == ref.usage.completion_tokens and
          ch.get("usage", {}).get("prompt_tokens") == ref.usage.prompt_tokens,
          "chat usage equals the protobuf usage (%s vs %d/%d)" % (
              ch.get("usage"), ref.usage.prompt_tokens, ref.usage.completion_tokens))
    cs = out.get("chat_stream", {})
    check(cs.get("content") == content and cs.get("reasoning") == reasoning and cs.get("chunks", 0) > 3 and
          cs.get("finish") == ch.get("finish") and cs.get("usage") == ch.get("usage"),
          "chat stream (%d chunks): the same text, finish_reason %s and usage" % (cs.get("chunks", 0), cs.get("finish")))
    check(out.get("chat_helper", {}).get("content") == ch.get("content"),
          "chat.completions.stream(...).finalChatCompletion(): the same content")
    rs = out.get("responses", {})
    check(rs.get("text") == content and rs.get("reasoning") == reasoning,
          "responses.create: output_text and reasoning equal the protobuf answer")
    check(rs.get("usage", {}).get("output_tokens") == ref.usage.completion_tokens, "responses usage")
    st = out.get("responses_stream", {})
    types = st.get("types", [])
    check(st.get("text") == content and st.get("reasoning") == reasoning and
          types[:2] == ["response.created", "response.in_progress"] and
          types[-1] in ("response.completed", "response.incomplete"),
          "responses stream: the same text, created ... %s" % (types[-1] if types else None))
    check(out.get("responses_helper", {}).get("text") == content and
          out.get("responses_helper", {}).get("reasoning") == reasoning,
          "responses.stream(...).finalResponse(): the snapshot it rebuilt from the events has the same "
          "text (%r)" % out.get("responses_helper", {}).get("text"))
    cm = out.get("completions", {})
    check(cm.get("text") == ctext and cm.get("usage", {}).get("completion_tokens") == len(gref.token_ids),
          "completions.create: text equals the protobuf generate answer (%r)" % cm.get("text"))
    check(out.get("completions_stream", {}).get("text") == ctext, "completions stream: the same text")
    for label, tr in tool_refs.items():
        want = [(tc.recipient[len("functions."):], tc.arguments) for tc in tr.tool_calls]
        t = out.get("tools", {}).get(label, {})
        for part in ("chat", "chat_stream", "chat_helper", "responses", "responses_helper"):
            calls = (t.get(part) or {}).get("calls") or []
            got = [(x.get("name"), x.get("arguments")) for x in calls]
            check(got == want and all(isinstance(x.get("arguments"), str) and x.get("id") and
                                      x.get("type") in ("function", "function_call") for x in calls),
                  "tool_choice %s, %s: the SDK parsed one call %s with string arguments equal to the "
                  "protobuf answer's (%s)" % (label, part, want[0][0] if want else None, got))
        for part in ("chat", "chat_stream", "chat_helper"):
            check((t.get(part) or {}).get("finish") == "tool_calls",
                  "tool_choice %s, %s: finish_reason tool_calls" % (label, part))
        check((t.get("chat") or {}).get("content") is None, "tool_choice %s: no content beside the call" % label)
finally:
    rc = serve.stop()
check(rc == 0, "twain serve stops cleanly (%s)" % rc)
finish()
