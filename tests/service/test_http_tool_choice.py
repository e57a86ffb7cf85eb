"""tool_choice "required" and a named function are enforced, not asked for:
twain-router with fake workers (fake_workers.py) that generate scripted ids
and record every prompt. A named function: the prompt is the conversation
(every tool declared) followed by the call's header as the model writes it
(<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>), so
what is generated is that call's arguments: one tool call naming it,
finish_reason tool_calls, in chat completions and responses, plain and
streamed, and on the protobuf API. "required" with one tool is the same;
with several, a short pass (prompt ending in "<|channel|>commentary to")
lets the model name the function and the call runs from a second prefill:
the model's choice is kept, an undeclared name falls back to the closest
declared one. A call cut by max_tokens is finish_reason length with the
arguments so far. Bad tool_choice values are a 400 naming it; the router
keeps serving."""
import json

import fake_workers
import http_client
import svc

from http_client import chat_text, finish_reason
from svc import check, finish

MODEL = "tiny-gptoss-wordnet-mxfp4"


def fn(name, desc, props):
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {p: {"type": "string"} for p in props}}}}


TOOLS = [fn("get_weather", "Current weather for a city.", ["city"]),
         fn("get_time", "Current time in a time zone.", ["tz"])]
RESP_TOOLS = [dict(type="function", **t["function"]) for t in TOOLS]
USER = [{"role": "user", "content": "What time is it in Tokyo?"}]
ARGS = '{"tz":"Asia/Tokyo"}'
NAMED = {"type": "function", "function": {"name": "get_time"}}
_tok_cache = {}


def tok(text):
    """Token ids of text (a copy; each distinct text tokenized once)."""
    if text not in _tok_cache:
        _tok_cache[text] = fake_workers.tokenize(text)
    return list(_tok_cache[text])



def render(conv):
    import subprocess
    out = subprocess.run([svc.bin_path("router", "twain"), "render", "--model", svc.MODEL],
                         input=json.dumps(conv), capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


def header(name):
    return tok("<|channel|>commentary to=functions.%s <|constrain|>json<|message|>" % name)


PASS_TAIL = tok("<|channel|>commentary to")

router, fw, ep, url = fake_workers.router_with_fakes([0])
api = http_client.Api(url)


def prompts():
    with fw.lock:
        return [fw.prompts[k] for k in sorted(fw.prompts)]


def _wait(cond, timeout=10):
    import time
    end = svc.deadline(timeout)
    while time.time() < end and not cond():
        time.sleep(0.02)
    return cond()


def chooser(pick_text, args=ARGS + "<|call|>"):
    """A script for 'required': the choice pass writes pick_text, the call
    writes args (tokenized here: the fake workers' thread must never wait on
    a subprocess, or it misses its heartbeats on a loaded machine)."""
    pick, call = tok(pick_text), tok(args)

    def f(prompt):
        return pick if prompt[-len(PASS_TAIL):] == PASS_TAIL else call
    return f


try:
    base = render({"messages": USER, "tools": TOOLS})

    # ---- a named function: chat, plain ----
    fw.script, fw.token_delay = tok(ARGS + "<|call|>"), 0.0
    st, r = api.post("/v1/chat/completions", {"model": MODEL, "messages": USER, "tools": TOOLS,
                                               "tool_choice": NAMED})
    msg = r["choices"][0]["message"] if st == 200 else {}
    calls = msg.get("tool_calls") or []
    check(st == 200 and len(calls) == 1 and calls[0]["function"]["name"] == "get_time" and
          calls[0]["function"]["arguments"] == ARGS and calls[0]["type"] == "function" and
          calls[0]["id"].startswith("call_") and msg["content"] is None and
          r["choices"][0]["finish_reason"] == "tool_calls",
          "named function: one call get_time with the generated arguments, finish_reason tool_calls (%s)" % r)
    check(prompts()[-1] == base + header("get_time"),
          "named function: the prompt declares every tool and ends with get_time's call header")
    check(st == 200 and r["usage"]["prompt_tokens"] == len(base) + len(header("get_time")) and
          r["usage"]["completion_tokens"] == len(fw.script),
          "named function: usage counts the header as prompt, the arguments as completion (%s)" % r.get("usage"))

    # ---- a named function: chat, streamed over many tokens ----
    long_args = '{"tz":"Asia/Tokyo","format":"24h","note":"the time in Tokyo now, please"}'
    fw.script, fw.token_delay = tok(long_args + "<|return|>"), 0.003
    st, ev = api.stream("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": NAMED})
    content, reasoning, calls = chat_text(ev)
    heads = [tc for _, d in ev if d != "[DONE]" and d.get("choices")
             for tc in d["choices"][0]["delta"].get("tool_calls") or [] if tc.get("id")]
    n_args = sum(1 for _, d in ev if d != "[DONE]" and d.get("choices")
                 for tc in d["choices"][0]["delta"].get("tool_calls") or []
                 if (tc.get("function") or {}).get("arguments"))
    check(st == 200 and list(calls) == [0] and calls[0]["name"] == "get_time" and
          calls[0]["arguments"] == long_args and content == "" and reasoning == "",
          "named, streamed: one call get_time, arguments reassembled exactly (%s)" % calls)
    check(len(heads) == 1 and heads[0]["function"]["name"] == "get_time" and heads[0]["index"] == 0 and
          n_args >= 10, "named, streamed: name once in the first call delta, %d argument deltas" % n_args)
    check(finish_reason(ev) == "tool_calls" and ev[-1] == (None, "[DONE]"),
          "named, streamed, ended by <|return|>: finish_reason tool_calls, [DONE]")

    # ---- the forced call ends the answer, even by <|end|> with more after it ----
    fw.script, fw.token_delay = tok(ARGS + "<|end|><|start|>assistant<|channel|>final<|message|>Noon.<|return|>"), 0.01
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": NAMED})
    msg = r["choices"][0]["message"] if st == 200 else {}
    check(st == 200 and [c["function"]["name"] for c in msg.get("tool_calls") or []] == ["get_time"] and
          msg["tool_calls"][0]["function"]["arguments"] == ARGS and msg["content"] is None and
          r["choices"][0]["finish_reason"] == "tool_calls" and
          r["usage"]["completion_tokens"] == len(tok(ARGS + "<|end|>")),
          "named, the call ended by <|end|>: the answer is the call alone, generation stopped there (%s)" % r)
    with fw.lock:
        rid = max(fw.prompts)
    check(_wait(lambda: rid in fw.cancelled), "... and the workers were told to stop (cancel)")

    # ---- cut by max_tokens: finish_reason length, the arguments so far ----
    fw.script, fw.token_delay = tok(long_args + "<|call|>"), 0.0
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": NAMED,
                                               "max_tokens": 4})
    calls = r["choices"][0]["message"].get("tool_calls") or [] if st == 200 else []
    partial = None
    if st == 200 and calls:
        partial = calls[0]["function"]["arguments"]
    check(st == 200 and r["choices"][0]["finish_reason"] == "length" and len(calls) == 1 and
          calls[0]["function"]["name"] == "get_time" and isinstance(partial, str) and
          partial and long_args.startswith(partial) and partial != long_args and
          r["usage"]["completion_tokens"] == 4,
          "named, max_tokens 4: finish_reason length, the call with its arguments so far (%s)" % r.get("choices"))
    st, ev = api.stream("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": NAMED,
                                                 "max_tokens": 4})
    check(st == 200 and finish_reason(ev) == "length" and chat_text(ev)[2].get(0, {}).get("name") == "get_time",
          "streamed, max_tokens 4: finish_reason length")

    # ---- responses: named ({"type":"function","name"}) plain and streamed ----
    fw.script, fw.token_delay = tok(ARGS + "<|call|>"), 0.0
    rreq = {"input": "What time is it in Tokyo?", "tools": RESP_TOOLS,
            "tool_choice": {"type": "function", "name": "get_time"}}
    st, r = api.post("/v1/responses", rreq)
    out = r.get("output", []) if st == 200 else []
    check(st == 200 and [o["type"] for o in out] == ["function_call"] and out[0]["name"] == "get_time" and
          out[0]["arguments"] == ARGS and r["status"] == "completed" and
          r["tool_choice"] == {"type": "function", "name": "get_time"},
          "/v1/responses named: one function_call item get_time, tool_choice echoed (%s)" % r)
    st, ev = api.stream("/v1/responses", rreq)
    names = [n for n, _ in ev]
    added = [d["item"] for n, d in ev if n == "response.output_item.added"]
    args = "".join(d["delta"] for n, d in ev if n == "response.function_call_arguments.delta")
    check(st == 200 and names[:2] == ["response.created", "response.in_progress"] and
          names[-1] == "response.completed" and len(added) == 1 and added[0]["type"] == "function_call" and
          added[0]["name"] == "get_time" and args == ARGS and
          "response.function_call_arguments.done" in names and "response.output_item.done" in names,
          "/v1/responses named, streamed: function_call added, argument deltas, done, completed (%s)" % names)

    # ---- required, one tool: that tool's header at once ----
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS[1:], "tool_choice": "required"})
    calls = r["choices"][0]["message"].get("tool_calls") or [] if st == 200 else []
    check(st == 200 and len(calls) == 1 and calls[0]["function"]["name"] == "get_time" and
          r["choices"][0]["finish_reason"] == "tool_calls" and
          prompts()[-1] == render({"messages": USER, "tools": TOOLS[1:]}) + header("get_time"),
          "required with one tool: that tool's call header, one call (%s)" % r.get("choices"))

    # ---- required, several tools: the model names one in a short pass ----
    fw.script = chooser("=functions.get_time <|constrain|>json<|message|>")
    n_before = len(prompts())
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    calls = r["choices"][0]["message"].get("tool_calls") or [] if st == 200 else []
    ps = prompts()[n_before:]
    check(st == 200 and len(calls) == 1 and calls[0]["function"]["name"] == "get_time" and
          calls[0]["function"]["arguments"] == ARGS and r["choices"][0]["finish_reason"] == "tool_calls",
          "required, two tools: the call the model named (%s)" % r.get("choices"))
    check(len(ps) == 2 and ps[0] == base + PASS_TAIL and ps[1] == base + header("get_time"),
          "required: the pass's prompt ends in 'commentary to', the call's in get_time's header (%d prompts)" %
          len(ps))
    check(st == 200 and r["usage"]["completion_tokens"] == len(tok(ARGS + "<|call|>")) and
          r["usage"]["prompt_tokens"] == len(ps[-1]),
          "required: usage is the call's (the pass is not generated output) (%s)" % r.get("usage"))
    # a long conversation with no max_tokens: the default shrinks to what the
    # context leaves, again once the call's header is known (it used to fail
    # the request there: prompt + the shrunk default exceeded the context)
    fw.script = chooser("=functions.get_time <|constrain|>json<|message|>",
                        '{"tz":"' + "Asia/Tokyo " * 300)  # longer than what is left
    long_user = [{"role": "user", "content": "Once " * 1250}]
    st, r = api.post("/v1/chat/completions", {"messages": long_user, "tools": TOOLS, "tool_choice": "required"})
    u = r.get("usage", {})
    check(st == 200 and u.get("prompt_tokens", 0) + 512 > 4096 and
          u["prompt_tokens"] + u["completion_tokens"] == 4096 and r["choices"][0]["finish_reason"] == "length",
          "required after a long prompt, default max_tokens: cut to the context after the call's header (%s %s)" %
          (st, u or r))
    for pick, want in (("=functions.get_weather<|message|>", "get_weather"),
                       ("=functions.get_tim", "get_time"),          # cut: the closest name
                       ("=functions.get_timezone ", "get_time"),   # longest shared prefix
                       ("hello there", "get_weather")):            # nothing like a name: the first
        fw.script = chooser(pick)
        st, ev = api.stream("/v1/chat/completions", {"messages": USER, "tools": TOOLS,
                                                     "tool_choice": "required"})
        calls = chat_text(ev)[2] if st == 200 else {}
        check(st == 200 and list(calls) == [0] and calls[0]["name"] == want and
              calls[0]["arguments"] == ARGS and finish_reason(ev) == "tool_calls" and
              ev[0][1]["choices"][0]["delta"].get("role") == "assistant",
              "required, streamed, the pass wrote %r: a call to %s (%s)" % (pick, want, calls))
    fw.script = chooser("=functions.get_time<|constrain|>")
    st, r = api.post("/v1/responses", {"input": "Time?", "tools": RESP_TOOLS, "tool_choice": "required"})
    out = r.get("output", []) if st == 200 else []
    check(st == 200 and [o["type"] for o in out] == ["function_call"] and out[0]["name"] == "get_time" and
          r["tool_choice"] == "required", "/v1/responses required: a function_call item (%s)" % out)

    # ---- auto and none are left alone ----
    fw.script = tok("<|channel|>final<|message|>It is noon.<|return|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "auto"})
    check(st == 200 and r["choices"][0]["message"]["content"] == "It is noon." and prompts()[-1] == base,
          "auto: the rendered conversation as is, the model may answer")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    check(st == 200 and prompts()[-1] == render({"messages": USER}), "none: no tools rendered")

    # ---- the protobuf API: ChatRequest.tool_choice ----
    c = svc.Client(ep)
    req = svc.chat("What time is it in Tokyo?", 64, stream=False, date="")
    for t in TOOLS:
        ft = req.chat.tools.add()
        ft.name = t["function"]["name"]
        ft.description = t["function"]["description"]
        ft.parameters_json = json.dumps(t["function"]["parameters"])
    req.chat.tool_choice = svc.E["TOOL_CHOICE_FUNCTION"]
    req.chat.tool_choice_name = "get_weather"
    fw.script = tok('{"city":"Tokyo"}<|call|>')
    rep = c.wait([c.send(req)], 60)[0][-1]
    check(rep.error.code == 0 and [t.recipient for t in rep.tool_calls] == ["functions.get_weather"] and
          rep.tool_calls[0].arguments == '{"city":"Tokyo"}' and
          rep.finish_reason == svc.E["FINISH_TOOL_CALL"],
          "protobuf FUNCTION: tool_calls [functions.get_weather], FINISH_TOOL_CALL (%s)" % rep)
    req.chat.tool_choice_name = "nope"
    req.request_id = 0
    rep = c.wait([c.send(req)], 60)[0][-1]
    check(rep.error.code == svc.E["INVALID_ARGUMENT"] and "nope" in rep.error.message,
          "protobuf FUNCTION with an undeclared name: INVALID_ARGUMENT (%s)" % rep.error.message)
    del req.chat.tools[:]
    req.chat.tool_choice = svc.E["TOOL_CHOICE_REQUIRED"]
    req.request_id = 0
    rep = c.wait([c.send(req)], 60)[0][-1]
    check(rep.error.code == svc.E["INVALID_ARGUMENT"] and "no tools" in rep.error.message,
          "protobuf REQUIRED without tools: INVALID_ARGUMENT (%s)" % rep.error.message)
    c.close()

    # ---- bad tool_choice: a 400 naming it, then still serving ----
    for tc, tools in (("required", None), ("sometimes", TOOLS), (7, TOOLS), ({"type": "function"}, TOOLS),
                      ({"type": "function", "function": {"name": "nope"}}, TOOLS), (NAMED, None)):
        body = {"messages": USER, "tool_choice": tc}
        if tools:
            body["tools"] = tools
        st, r = api.post("/v1/chat/completions", body)
        check(st == 400 and r["error"]["param"] == "tool_choice",
              "tool_choice %s%s: 400 naming tool_choice (%s)" % (json.dumps(tc), "" if tools else " without tools", r))
    # ---- a tool name OpenAI's API would refuse ([a-zA-Z0-9_-]{1,64}): it
    # becomes functions.NAME in the prompt, so spaces or Harmony tokens there
    # would change what the model reads
    for bad in ("a b", "get_weather<|end|>", "", "x" * 65, "f.g"):
        tools = [{"type": "function", "function": dict(TOOLS[0]["function"], name=bad)}]
        st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": tools})
        check(st == 400 and "tools[0]" in r["error"]["message"] and "name" in r["error"]["message"] and
              r["error"]["param"] == "tools",
              "tool name %r: 400 (%s)" % (bad[:20], r))
    fw.script = tok(ARGS + "<|call|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS, "tool_choice": NAMED})
    check(st == 200 and r["choices"][0]["finish_reason"] == "tool_calls", "the router still serves")
finally:
    fw.close()
    rc = router.stop()
check(rc == 0, "router stops cleanly (%s)" % rc)
finish()
