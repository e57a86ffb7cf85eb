"""The OpenAI-compatible HTTP API against exact model output: twain-router
with fake workers (fake_workers.py) that generate scripted Harmony ids, so
every known way gpt-oss output goes wrong in OpenAI-compatible servers is
driven through the real router, its Harmony parser and the HTTP layer:
tool calls ending in <|call|> or <|return|>, arguments streamed over many
tokens, a final answer after analysis, output only on commentary, a
recipient in the channel part of the header (or the role part), earlier
reasoning and tool results carried into the next prompt, reasoning effort
in the system message, an unexpected token inside a header. Then bad input:
malformed JSON, wrong types, unknown fields, unsupported parameters, wrong
model, unknown paths; the router keeps serving throughout. Last, the
parameters reach the request: temperature, top_p and seed (recorded by the
fake prefill worker), max_completion_tokens, chat stop strings, Responses
max_output_tokens (incomplete) and instructions."""
import json
import re
import time
import subprocess

import fake_workers
import http_client
import svc

from http_client import chat_text, finish_reason
from svc import check, finish

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
RESP_TOOLS = [dict(type="function", **TOOLS[0]["function"])]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        "{\"city\":\"Paris\"}")


def render(conv, text=False):
    """The prompt `twain render` makes of an OpenAI chat conversation."""
    argv = [svc.bin_path("router", "twain"), "render", "--model", svc.MODEL] + (["--text"] if text else [])
    out = subprocess.run(argv, input=json.dumps(conv), capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return out if text else json.loads(out)


def detok(ids):
    return subprocess.run([svc.bin_path("router", "twain"), "detokenize", "--model", svc.MODEL],
                          input=json.dumps(ids), capture_output=True, text=True, timeout=60,
                          check=True).stdout


router, fw, ep, url = fake_workers.router_with_fakes([0])
api = http_client.Api(url)
mport = int(router.wait_line(r"metrics port (\d+)", 10).group(1))


def script(text, delay=0.0):
    fw.script = fake_workers.tokenize(text)
    fw.token_delay = delay


def last_prompt():
    with fw.lock:
        return fw.prompts[max(fw.prompts)]


try:
    # ---- models, health ----
    st, models = api.get("/v1/models")
    check(st == 200 and models["object"] == "list" and
          [m["id"] for m in models["data"]] == ["tiny-gptoss-wordnet-mxfp4"],
          "GET /v1/models lists the model directory's name (%s)" % models)
    st, one = api.get("/v1/models/tiny-gptoss-wordnet-mxfp4")
    check(st == 200 and one["id"] == "tiny-gptoss-wordnet-mxfp4", "GET /v1/models/ID")
    st, h = api.get("/health")
    check(st == 200 and h["status"] == "ok", "GET /health: 200 with workers registered (%s)" % h)

    # ---- 1. a tool call ending with <|call|> ----
    script(CALL + "<|call|>")
    st, r = api.post("/v1/chat/completions", {"model": "tiny-gptoss-wordnet-mxfp4", "messages": USER,
                                               "tools": TOOLS})
    msg = r["choices"][0]["message"] if st == 200 else {}
    calls = msg.get("tool_calls") or []
    check(st == 200 and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather" and
          json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"} and
          calls[0]["type"] == "function" and calls[0]["id"],
          "<|call|>: one tool call get_weather {city: Paris} (%s)" % r)
    check(st == 200 and msg.get("content") is None and msg.get("reasoning_content") == "Need the weather.",
          "<|call|>: no content, the analysis as reasoning_content (%r, %r)" % (
              msg.get("content"), msg.get("reasoning_content")))
    check(st == 200 and r["choices"][0]["finish_reason"] == "tool_calls", "<|call|>: finish_reason tool_calls")
    st2, r2 = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    ids = [x.get("id", "") for x in (r, r2)] + [x["choices"][0]["message"]["tool_calls"][0]["id"]
                                               for x in (r, r2) if x.get("choices")]
    # this process's random 8-hex tag, then a counter: ids do not repeat after a restart
    check(st2 == 200 and len(set(ids)) == 4 and all(re.fullmatch(p, i) for p, i in zip(
        [r"chatcmpl-[0-9a-f]{9,}"] * 2 + [r"call_[0-9a-f]{13,}"] * 2, ids)) and ids[0][9:17] == ids[1][9:17],
          "answer and call ids: distinct, a random tag of the process first (%s)" % ids)
    n_script = len(fw.script)
    check(st == 200 and r["usage"]["completion_tokens"] == n_script and
          r["usage"]["prompt_tokens"] == len(last_prompt()) and
          r["usage"]["total_tokens"] == n_script + len(last_prompt()),
          "usage counts the real ids: %s (script %d, prompt %d)" % (r.get("usage"), n_script, len(last_prompt())))
    check(last_prompt() == render({"messages": USER, "tools": TOOLS}),
          "the prompt with the tool is what `twain render` makes of the same JSON")

    # ---- 2. a tool call ending with <|return|> ----
    script(CALL + "<|return|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    calls = r["choices"][0]["message"].get("tool_calls") or [] if st == 200 else []
    check(st == 200 and len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
          and r["choices"][0]["finish_reason"] == "tool_calls" and r["choices"][0]["message"]["content"] is None,
          "<|return|> after a tool call: still a tool call, not content (%s)" % r)
    st, r = api.post("/v1/responses", {"input": "What is the weather in Paris?", "tools": RESP_TOOLS})
    fcs = [o for o in r.get("output", []) if o["type"] == "function_call"]
    check(st == 200 and len(fcs) == 1 and fcs[0]["name"] == "get_weather" and
          json.loads(fcs[0]["arguments"]) == {"city": "Paris"} and fcs[0]["call_id"] and
          [o["type"] for o in r["output"]] == ["reasoning", "function_call"],
          "/v1/responses: reasoning then one function_call item (%s)" % r.get("output"))

    # ---- 3. tool-call arguments streamed across many tokens ----
    args = '{"city":"San Francisco","unit":"celsius","days":[1,2,3],"note":"bring an umbrella"}'
    script("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + args + "<|call|>",
           delay=0.005)
    st, ev = api.stream("/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    content, reasoning, calls = chat_text(ev)
    arg_chunks = [tc for _, d in ev if d != "[DONE]" and d.get("choices")
                  for tc in d["choices"][0]["delta"].get("tool_calls") or []
                  if (tc.get("function") or {}).get("arguments")]
    check(st == 200 and len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == args,
          "streamed tool call: name once, arguments reassembled exactly (%s)" % calls)
    check(len(arg_chunks) >= 10 and all(tc["index"] == 0 for tc in arg_chunks),
          "arguments arrive as they are generated: %d argument deltas, all index 0" % len(arg_chunks))
    head = [tc for _, d in ev if d != "[DONE]" and d.get("choices")
            for tc in d["choices"][0]["delta"].get("tool_calls") or [] if tc.get("id")]
    check(len(head) == 1 and head[0]["type"] == "function" and head[0]["function"]["name"] == "get_weather",
          "the first tool-call delta has index, id, type and name")
    check(finish_reason(ev) == "tool_calls" and ev[-1] == (None, "[DONE]") and content == "",
          "stream ends with finish_reason tool_calls and [DONE]")
    st, ev = api.stream("/v1/responses", {"input": "Weather?", "tools": RESP_TOOLS})
    deltas = [d["delta"] for n, d in ev if n == "response.function_call_arguments.delta"]
    done = [d["arguments"] for n, d in ev if n == "response.function_call_arguments.done"]
    check(st == 200 and len(deltas) >= 10 and "".join(deltas) == args and done == [args],
          "/v1/responses streams function_call_arguments deltas (%d) and done" % len(deltas))

    # ---- 4. a final answer after analysis ----
    script("<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant"
           "<|channel|>final<|message|>Hello there, friend.<|return|>", delay=0.002)
    st, r = api.post("/v1/chat/completions", {"messages": USER})
    msg = r["choices"][0]["message"] if st == 200 else {}
    check(st == 200 and msg["content"] == "Hello there, friend." and msg["reasoning_content"] == "The user greets."
          and "tool_calls" not in msg and r["choices"][0]["finish_reason"] == "stop",
          "final after analysis: content and reasoning_content apart (%s)" % msg)
    n_reasoning = len(fake_workers.tokenize("The user greets."))
    check(st == 200 and r["usage"]["completion_tokens_details"]["reasoning_tokens"] == n_reasoning,
          "usage.completion_tokens_details.reasoning_tokens counts the analysis text ids (%s, want %d)" % (
              r.get("usage"), n_reasoning))
    st, ev = api.stream("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}})
    content, reasoning, calls = chat_text(ev)
    first = ev[0][1]["choices"][0]["delta"] if ev else {}
    usage = [d["usage"] for _, d in ev if d != "[DONE]" and d.get("usage")]
    check(st == 200 and content == "Hello there, friend." and reasoning == "The user greets." and not calls,
          "streamed: reasoning_content deltas then content deltas (%r / %r)" % (reasoning, content))
    order = ["r" if d["choices"][0]["delta"].get("reasoning_content") else "c"
             for _, d in ev if d != "[DONE]" and d.get("choices") and
             (d["choices"][0]["delta"].get("reasoning_content") or d["choices"][0]["delta"].get("content"))]
    check(first.get("role") == "assistant" and len(order) > 4 and order == sorted(order, reverse=True),
          "role first, every reasoning delta before the first content delta (%s)" % "".join(order))
    check(len(usage) == 1 and usage[0]["completion_tokens"] == len(fw.script) and
          ev[-2][1]["choices"] == [], "stream_options.include_usage: one usage chunk, real counts (%s)" % usage)
    st, r = api.post("/v1/responses", {"input": "Hi", "instructions": "Be brief."})
    check(st == 200 and [o["type"] for o in r["output"]] == ["reasoning", "message"] and
          r["output"][1]["content"][0]["text"] == "Hello there, friend." and
          r["output"][0]["content"][0]["text"] == "The user greets." and r["status"] == "completed" and
          r["usage"]["output_tokens"] == len(fw.script) and
          r["usage"]["output_tokens_details"]["reasoning_tokens"] == n_reasoning,
          "/v1/responses: reasoning item, message item with output_text, usage (%s)" % r.get("output"))
    st, ev = api.stream("/v1/responses", {"input": "Hi"})
    names = [n for n, _ in ev]
    text = "".join(d["delta"] for n, d in ev if n == "response.output_text.delta")
    rtext = "".join(d["delta"] for n, d in ev if n == "response.reasoning_text.delta")
    seqs = [d["sequence_number"] for _, d in ev]
    check(st == 200 and names[:2] == ["response.created", "response.in_progress"] and
          names[-1] == "response.completed" and names.count("response.output_item.added") == 2 and
          names.count("response.output_item.done") == 2 and text == "Hello there, friend." and
          rtext == "The user greets." and seqs == list(range(len(seqs))),
          "/v1/responses stream: created, in_progress, items added/done, deltas, completed, sequence numbers")
    fin = ev[-1][1]["response"] if ev else {}
    check(fin.get("usage", {}).get("output_tokens") == len(fw.script) and len(fin.get("output", [])) == 2,
          "response.completed carries the output and usage")

    # ---- 5. output only on commentary, no tools ----
    script("<|channel|>commentary<|message|>Only commentary here.<|end|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER})
    check(st == 200 and r["choices"][0]["message"]["content"] == "Only commentary here." and
          r["choices"][0]["finish_reason"] == "stop",
          "commentary without a recipient is content, not lost (%s)" % r.get("choices"))
    st, ev = api.stream("/v1/chat/completions", {"messages": USER})
    check(chat_text(ev)[0] == "Only commentary here.", "streamed commentary is content too")

    # ---- 6. multi-turn: earlier reasoning and tool results reach the prompt ----
    script("<|channel|>final<|message|>It is sunny in Paris.<|return|>")
    turns = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\":\"sunny\"}"}]
    st, r = api.post("/v1/chat/completions", {"messages": turns, "tools": TOOLS})
    prompt = last_prompt()
    text = detok(prompt)
    check(st == 200 and r["choices"][0]["message"]["content"] == "It is sunny in Paris.",
          "multi-turn answer (%s)" % r.get("choices"))
    check(prompt == render({"messages": turns, "tools": TOOLS}),
          "multi-turn prompt equals `twain render` of the same conversation")
    check("Need the weather." in text and "to=functions.get_weather" in text and '{"sky":"sunny"}' in text
          and "functions.get_weather to=assistant" in text,
          "the prompt carries the earlier reasoning, the call and the tool result")
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Need the weather."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": "{\"city\":\"Paris\"}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "{\"sky\":\"sunny\"}"}]
    st, r = api.post("/v1/responses", {"input": items, "tools": RESP_TOOLS})
    check(st == 200 and last_prompt() == prompt,
          "/v1/responses items (reasoning, function_call, function_call_output) render the same prompt")

    # ---- 7. a recipient in the channel part of the header (and in the role part) ----
    script("<|channel|>analysis to=functions.get_weather<|message|>{\"city\":\"Oslo\"}<|call|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    calls = r["choices"][0]["message"].get("tool_calls") or [] if st == 200 else []
    check(len(calls) == 1 and calls[0]["function"]["name"] == "get_weather" and
          json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and
          r["choices"][0]["message"]["reasoning_content"] is None,
          "recipient after the channel (even on analysis): a tool call, not reasoning (%s)" % r.get("choices"))
    script("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
           "{\"city\":\"Rome\"}<|call|>")
    st, ev = api.stream("/v1/chat/completions", {"messages": USER, "tools": TOOLS})
    content, reasoning, calls = chat_text(ev)
    check(len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city":"Rome"}'
          and content == "", "recipient in the role part, streamed: a tool call (%s)" % calls)

    # ---- 8. reasoning_effort reaches the system message ----
    script("<|channel|>final<|message|>ok<|return|>")
    for effort in ("low", "high"):
        st, r = api.post("/v1/chat/completions", {"messages": USER, "reasoning_effort": effort})
        text = detok(last_prompt())
        check(st == 200 and ("Reasoning: %s" % effort) in text and
              last_prompt() == render({"messages": USER, "reasoning_effort": effort}),
              "reasoning_effort %s: 'Reasoning: %s' in the system message" % (effort, effort))
    st, r = api.post("/v1/responses", {"input": "Hi", "reasoning": {"effort": "high"}})
    check(st == 200 and "Reasoning: high" in detok(last_prompt()), "/v1/responses reasoning.effort high")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "reasoning_effort": "extreme"})
    check(st == 400 and "reasoning_effort" in r["error"]["message"], "reasoning_effort extreme: 400")

    # ---- 9. an unexpected token in the middle of a header ----
    before = svc.metrics(mport).get("twain_router_harmony_unexpected_total", 0)
    script("<|channel|>final<|end|><|start|>assistant<|channel|>final<|message|>Recovered answer.<|return|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER})
    check(st == 200 and r["choices"][0]["message"]["content"] == "Recovered answer.",
          "<|end|> inside a header: 200 with what was generated, never a 500 (%s %s)" % (st, r))
    st, ev = api.stream("/v1/chat/completions", {"messages": USER})
    check(st == 200 and chat_text(ev)[0] == "Recovered answer." and ev[-1][1] == "[DONE]",
          "streamed: the same text, the stream ends normally")
    after = svc.metrics(mport).get("twain_router_harmony_unexpected_total", 0)
    check(after >= before + 2, "router_harmony_unexpected_total counts them (%s -> %s)" % (before, after))
    check(router.seen(r"unexpected model output .*inside a message header", 5),
          "the router logs the unexpected output")
    m = svc.metrics(mport)
    check(m.get("twain_router_http_requests_total", 0) == 25 and m.get("twain_router_http_errors_total") == 1,
          "router_http_requests_total / _errors_total (%s / %s: one 400 so far)" % (
              m.get("twain_router_http_requests_total"), m.get("twain_router_http_errors_total")))
    script("<|channel|>final<|message|>Cut off in the mid")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "max_tokens": 7})
    check(st == 200 and r["choices"][0]["finish_reason"] == "length" and
          r["usage"]["completion_tokens"] == 7 and r["choices"][0]["message"]["content"],
          "max_tokens: finish_reason length, partial content kept (%s)" % r.get("choices"))

    # ---- completions ----
    script("The dog barked.<|return|>")
    st, r = api.post("/v1/completions", {"prompt": "Once", "max_tokens": 50})
    check(st == 200 and r["object"] == "text_completion" and r["choices"][0]["text"] == "The dog barked." and
          r["choices"][0]["finish_reason"] == "stop" and r["usage"]["prompt_tokens"] == len(last_prompt()),
          "/v1/completions: text, finish_reason, usage (%s)" % r)
    ids = fake_workers.tokenize("Once upon")
    K_STOP = 'twain_request_success_total{finished_reason="stop"}'
    K_ABORT = 'twain_request_success_total{finished_reason="abort"}'
    K_CANCEL = 'twain_request_errors_total{code="CANCELLED"}'
    m0 = svc.metrics(mport)
    # generation goes on past the stop string (a token each 20 ms): the cut ends it
    script("The dog barked at the cat and ran and ran far away from home.<|return|>", 0.02)
    st, r = api.post("/v1/completions", {"prompt": ids, "max_tokens": 50, "stop": [" barked"]})
    check(st == 200 and last_prompt() == ids and r["choices"][0]["text"] == "The dog" and
          r["choices"][0]["finish_reason"] == "stop" and r["usage"]["prompt_tokens"] == len(ids),
          "/v1/completions: token-id prompt, stop string cuts the text, usage counts the prompt (%s %s)"
          % (r.get("choices"), r.get("usage")))
    # the generation is stopped after the reply: wait (bounded) for the router to count it
    for _ in range(50):
        m1 = svc.metrics(mport)
        if m1.get(K_STOP, 0) + m1.get(K_ABORT, 0) > m0.get(K_STOP, 0) + m0.get(K_ABORT, 0):
            break
        time.sleep(0.1)
    check(m1.get(K_STOP, 0) == m0.get(K_STOP, 0) + 1 and m1.get(K_ABORT, 0) == m0.get(K_ABORT, 0) and
          m1.get(K_CANCEL, 0) == m0.get(K_CANCEL, 0),
          "/v1/completions cut by a stop string counts as finished by stop, not as a cancel "
          "(stop %s -> %s, abort %s -> %s, CANCELLED %s -> %s)" % (
              m0.get(K_STOP, 0), m1.get(K_STOP, 0), m0.get(K_ABORT, 0), m1.get(K_ABORT, 0),
              m0.get(K_CANCEL, 0), m1.get(K_CANCEL, 0)))
    # an id the model can sample but the tokenizer has no bytes for (the
    # embedding is larger than the tokenizer, 8,064 against 8,021 ids here;
    # gpt-oss: 201,088 against 200,019): no text, as Hugging Face's decoder;
    # it was a 500, and a stream cut off without its error event
    pad = 8039
    fw.script = fake_workers.tokenize("The dog") + [pad] + fake_workers.tokenize(" barked.<|return|>")
    st, r = api.post("/v1/completions", {"prompt": "Once", "max_tokens": 50})
    check(st == 200 and r["choices"][0]["text"] == "The dog barked." and
          r["usage"]["completion_tokens"] == len(fw.script),
          "/v1/completions with id %d (no bytes) in the output: 200, no text for it (%s %s)" % (
              pad, st, r.get("choices", r)))
    st, ev = api.stream("/v1/completions", {"prompt": "Once", "max_tokens": 50})
    text = "".join(d["choices"][0]["text"] for _, d in ev if d != "[DONE]" and d.get("choices"))
    check(st == 200 and text == "The dog barked." and ev and ev[-1][1] == "[DONE]",
          "the same streamed: the text, then [DONE] (%s)" % ev[-3:])
    fw.script = fake_workers.tokenize("<|channel|>final<|message|>The dog") + [pad] + \
        fake_workers.tokenize(" barked.<|return|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER})
    check(st == 200 and r["choices"][0]["message"]["content"] == "The dog barked.",
          "chat with id %d in the final message: its content without it (%s)" % (pad, r.get("choices", r)))
    script("The dog barked.<|return|>")
    st, ev = api.stream("/v1/completions", {"prompt": "Once", "max_tokens": 3})
    text = "".join(d["choices"][0]["text"] for _, d in ev if d != "[DONE]" and d["choices"])
    fr = [d["choices"][0]["finish_reason"] for _, d in ev if d != "[DONE]" and d["choices"]][-1]
    check(st == 200 and text == detok(fw.script[:3]) and fr == "length" and ev[-1][1] == "[DONE]",
          "/v1/completions streamed, max_tokens 3: finish_reason length (%r)" % text)

    # ---- bad input: a clear 4xx, the router keeps serving ----
    st, r = api.post("/v1/chat/completions", raw='{"messages": [{"role": "user", "content": "hi"}')
    check(st == 400 and r["error"]["type"] == "invalid_request_error" and "not valid JSON" in r["error"]["message"],
          "malformed JSON: 400 (%s)" % r)
    st, r = api.post("/v1/chat/completions", raw='{"messages": [{"role": "user", "content": "hi"}]} xyz')
    check(st == 400 and "more after the object" in r["error"]["message"],
          "a JSON object followed by more text: 400 (it was accepted) (%s)" % r)
    st, r = api.post("/v1/chat/completions", raw='{"messages": [{"role": "user", "content": "hi"}],'
                     ' "max_tokens": 1} \r\n ')
    check(st == 200, "a JSON object followed by whitespace only: accepted (%d)" % st)
    st, r = api.post("/v1/chat/completions", raw="")
    check(st == 400 and r["error"]["type"] == "invalid_request_error" and
          "request body is empty" in r["error"]["message"], "empty body: 400 saying so (%s)" % r)
    for body, param in (({"messages": "hi"}, "messages"), ({"messages": USER, "max_tokens": "5"}, "max_tokens"),
                        ({"messages": USER, "stream": "yes"}, "stream"),
                        ({"messages": USER, "temperature": "hot"}, "temperature"),
                        ({"messages": USER, "n": 2}, "n"),
                        ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
                        ({"messages": USER, "logprobs": True}, "logprobs"),
                        ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "nope"}},
                          "tools": TOOLS}, "tool_choice"),
                        ({"messages": USER, "reasoning_effort": "max"}, "reasoning_effort")):
        st, r = api.post("/v1/chat/completions", body)
        check(st == 400 and r["error"]["param"] == param and param in r["error"]["message"],
              "%s: 400 naming %s (%s)" % (json.dumps(body)[:60], param, r))
    st, r = api.post("/v1/chat/completions", {"messages": USER, "current_date": "2026-13-01"})
    check(st == 400 and r["error"]["param"] == "current_date" and "YYYY-MM-DD" in r["error"]["message"],
          "current_date 2026-13-01: 400 with param current_date (%s)" % r)
    st, r = api.post("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"})
    check(st == 400 and r["error"]["param"] == "previous_response_id", "previous_response_id: 400 (%s)" % r)
    st, r = api.post("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                          "schema": {"type": "object"}}}})
    check(st == 400 and r["error"]["param"] == "text.format", "text.format json_schema: 400 (%s)" % r)
    st, r = api.post("/v1/completions", {"prompt": [5, 999999999]})
    check(st == 400 and r["error"]["param"] == "prompt" and "999999999" in r["error"]["message"],
          "a prompt id outside the vocabulary: 400 with param prompt (%s)" % r)
    st, r = api.post("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    check(st == 400 and "wizard" in r["error"]["message"], "unknown role: 400 (%s)" % r)
    # text parts are joined with a newline between them (vLLM's way; they ran
    # together: "Summarize:<document>"), in chat and in Responses input; a part
    # that is not text is refused, naming its type (it was read if it had a "text")
    script("<|channel|>final<|message|>ok<|return|>")
    joined = render({"messages": [{"role": "user", "content": "Summarize this:\nThe dog barked."}]})
    st, r = api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Summarize this:"}, {"type": "text", "text": "The dog barked."}]}]})
    check(st == 200 and last_prompt() == joined, "chat text parts: joined with a newline (%s)" % st)
    st, r = api.post("/v1/responses", {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Summarize this:"}, {"type": "input_text", "text": "The dog barked."}]}]})
    check(st == 200 and last_prompt() == joined, "responses input_text parts: the same prompt (%s)" % st)
    st, r = api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "text": "x",
                                                     "image_url": {"url": "data:image/png;base64,AA=="}}]}]})
    check(st == 400 and "image_url" in r["error"]["message"] and "content[1]" in r["error"]["message"],
          "an image part: 400 naming it (%s)" % r)
    st, r = api.post("/v1/chat/completions", {"model": "gpt-4o", "messages": USER})
    check(st == 404 and r["error"]["code"] == "model_not_found", "another model: 404 model_not_found")
    # bytes cJSON would pass through or cut: refused, and every answer is UTF-8 JSON (.decode() in post)
    for raw, why in ((b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8 (byte 46)"),
                     (b'{"model": "\xff", "messages": []}', "not valid UTF-8 (byte 11)"),
                     (b'{"messages": [{"role": "user", "content": "a\x00b"}]}', "NUL byte (byte 44)"),
                     (b'{"messages": [{"role": "user", "content": "a\\u0000b"}]}', "U+0000 (\\u0000 at byte 44)")):
        st, r = api.post("/v1/chat/completions", raw=raw)
        check(st == 400 and why in r["error"]["message"], "%r: 400 %r (%s)" % (raw[:50], why, r))
    st, r = api.get("/v1/nothing")
    check(st == 404 and r["error"]["type"] == "not_found_error", "unknown path: 404")
    st, r = api.get("/v1/chat/completions")
    check(st == 405, "GET on a POST endpoint: 405")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "max_tokens": 100000})
    check(st == 400 and "max_tokens" in r["error"]["message"], "max_tokens over the limit: 400 from the router")
    # a long answer in one message of the decode worker: 1,200 text pieces of one Harmony
    # message in one feed of the router's parser (they once overflowed its string table)
    script("<|channel|>final<|message|>" + " dog" * 1200 + "<|return|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "max_tokens": 1300})
    check(st == 200 and r["choices"][0]["message"]["content"] == " dog" * 1200 and
          r["usage"]["completion_tokens"] == len(fw.script),
          "1,200 pieces of text in one worker message: all of them answered (%d of %d characters, "
          "%s of %d tokens, finish %s)" % (len(r["choices"][0]["message"]["content"] or ""), 4 * 1200,
                                           r["usage"]["completion_tokens"], len(fw.script),
                                           r["choices"][0]["finish_reason"]))
    script("<|channel|>final<|message|>Still here.<|return|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "user": "u1", "metadata": {"a": "b"},
                                               "some_future_field": [1, 2], "tool_choice": "none",
                                               "tools": TOOLS, "temperature": 0.5, "seed": 7, "top_p": 0.9})
    check(st == 200 and r["choices"][0]["message"]["content"] == "Still here." and
          last_prompt() == render({"messages": USER}),
          "unknown fields ignored; tool_choice none renders no tools; the router still serves")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "tools": TOOLS,
                                               "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    check(st == 200 and last_prompt() == render({"messages": USER, "tools": TOOLS}) + fake_workers.tokenize(
              "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"),
          "a named tool_choice ends the prompt with that call's header (test_http_tool_choice covers it all)")

    # ---- parameters reach the request: sampling, max tokens, stop, instructions ----
    def last_sampling():
        with fw.lock:
            return fw.sampling[max(fw.sampling)]

    def near(a, b):
        return abs(a - b) < 1e-6

    st, r = api.post("/v1/chat/completions", {"messages": USER, "temperature": 0.5, "top_p": 0.9, "seed": 7})
    t, p, k, seed = last_sampling()
    check(st == 200 and near(t, 0.5) and near(p, 0.9) and seed == 7,
          "chat temperature / top_p / seed reach the workers (%s)" % (last_sampling(),))
    st, r = api.post("/v1/chat/completions", {"messages": USER})
    check(st == 200 and near(last_sampling()[0], 1.0) and near(last_sampling()[1], 1.0),
          "chat without temperature samples at 1, OpenAI's default (%s)" % (last_sampling(),))
    st, r = api.post("/v1/responses", {"input": "Hi", "temperature": 0, "top_p": 0.8})
    check(st == 200 and near(last_sampling()[0], 0.0) and near(last_sampling()[1], 0.8),
          "responses temperature / top_p reach the workers (%s)" % (last_sampling(),))
    st, r = api.post("/v1/completions", {"prompt": "Once", "seed": 123, "temperature": 0.7})
    check(st == 200 and last_sampling()[3] == 123 and near(last_sampling()[0], 0.7),
          "completions seed / temperature reach the workers (%s)" % (last_sampling(),))
    st, r = api.post("/v1/completions", {"prompt": "Once", "seed": 0, "temperature": 0.7})
    check(st == 200 and last_sampling()[3] == 0, "completions seed 0 is a seed (%s)" % (last_sampling(),))
    # top_p 0 is OpenAI's "only the most likely token" (the sampler's 0 is "no
    # nucleus": it sampled from everything); vLLM's top_k is served, and its
    # other sampling fields are refused unless they say "off" (they were dropped)
    st, r = api.post("/v1/chat/completions", {"messages": USER, "top_p": 0, "temperature": 1.2})
    check(st == 200 and near(last_sampling()[0], 0.0), "top_p 0: greedy, temperature 0 (%s)" % (last_sampling(),))
    st, r = api.post("/v1/chat/completions", {"messages": USER, "top_p": 0, "temperature": 500})
    check(st == 400 and "temperature" in r["error"]["message"],
          "top_p 0 does not hide a temperature out of range: 400 (%s)" % r)
    st, r = api.post("/v1/completions", {"prompt": "Once", "top_k": 5})
    check(st == 200 and last_sampling()[2] == 5, "top_k 5 reaches the workers (%s)" % (last_sampling(),))
    st, r = api.post("/v1/chat/completions", {"messages": USER, "top_k": -1})
    check(st == 200 and last_sampling()[2] == 0, "top_k -1: no cut (%s)" % (last_sampling(),))
    for body, key in (({"top_k": -2}, "top_k"), ({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 1.3},
                      "repetition_penalty"), ({"min_tokens": 4}, "min_tokens"), ({"ignore_eos": True},
                                                                                   "ignore_eos")):
        st, r = api.post("/v1/chat/completions", dict(body, messages=USER))
        check(st == 400 and r["error"]["param"] == key, "%s: 400 naming it (%s %s)" % (body, st, r))
    st, r = api.post("/v1/completions", {"prompt": "Once", "min_p": 0, "repetition_penalty": 1,
                                         "ignore_eos": False, "min_tokens": 0})
    check(st == 200, "the same fields saying off: served (%s)" % st)
    drawn = []
    for body in ({"prompt": "Once", "temperature": 0.7}, {"prompt": "Once", "temperature": 0.7},
                 {"messages": USER}, {"messages": USER, "seed": None}):
        st, r = api.post("/v1/chat/completions" if "messages" in body else "/v1/completions", body)
        drawn.append(last_sampling()[3] if st == 200 else None)
    check(None not in drawn and len(set(drawn)) == len(drawn) and 0 not in drawn,
          "requests without a seed sample with fresh seeds, one each: %s" % drawn)

    # a default max_tokens is cut to what the 4,096-position context leaves
    # after the prompt; a client's own number that does not fit is a 400
    script("<|channel|>final<|message|>" + "Hello there, friend. " * 8 + "<|return|>")
    long_ids = fake_workers.tokenize("Once")[:1] * 4092
    st, r = api.post("/v1/completions", {"prompt": long_ids})
    check(st == 200 and r["usage"]["prompt_tokens"] == 4092 and r["usage"]["completion_tokens"] == 4 and
          r["choices"][0]["finish_reason"] == "length",
          "completions, default max_tokens 16 after 4,092 prompt ids: 4 tokens, length (%s %s)" %
          (st, r.get("usage", r)))
    st, r = api.post("/v1/completions", {"prompt": long_ids, "max_tokens": 16})
    check(st == 400 and "exceeds the model context" in r["error"]["message"] and
          r["error"]["param"] == "prompt" and r["error"]["code"] == "context_length_exceeded",
          "completions, max_tokens 16 given after 4,092 prompt ids: 400, context_length_exceeded (%s %s)" % (st, r))
    for path, body, param in (("/v1/responses", {"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
                              ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": -1},
                               "max_completion_tokens"),
                              ("/v1/completions", {"prompt": "Once", "max_tokens": 0}, "max_tokens")):
        st, r = api.post(path, body)
        check(st == 400 and r["error"]["param"] == param and ("'%s' must be at least 1" % param) in r["error"]["message"],
              "%s %s: 400 naming it (%s)" % (path, param, r))
    st, r = api.post("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 100000})
    check(st == 400 and r["error"]["param"] == "max_completion_tokens" and "limit" in r["error"]["message"],
          "chat, max_completion_tokens over the server's limit: 400 naming it as sent (%s)" % r)
    st, r = api.post("/v1/completions", {"prompt": ""})
    check(st == 400 and r["error"]["param"] == "prompt" and r["error"]["message"] == "'prompt' is empty",
          "completions, an empty prompt: 400 naming it (%s)" % r)
    script("<|channel|>final<|message|>" + "Hello there, friend. " * 100)  # longer than what is left
    st, r = api.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Once " * 1300}]})
    u = r.get("usage", {})
    check(st == 200 and u.get("prompt_tokens", 0) + 512 > 4096 and
          u["prompt_tokens"] + u["completion_tokens"] == 4096 and r["choices"][0]["finish_reason"] == "length",
          "chat, default max_tokens 512 after a %s-token prompt: cut to the context (%s %s)" %
          (u.get("prompt_tokens"), st, u or r))
    script("<|channel|>final<|message|>" + "Hello there, friend. " * 8 + "<|return|>")

    script("<|channel|>final<|message|>Hello there, friend, how are you today?<|return|>")
    st, r = api.post("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 5})
    check(st == 200 and r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length",
          "max_completion_tokens 5: 5 ids, finish_reason length (%s)" % r.get("usage"))
    st, r = api.post("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 6, "max_tokens": 50})
    check(st == 200 and r["usage"]["completion_tokens"] == 6,
          "max_completion_tokens wins over the older max_tokens (%s)" % r.get("usage"))
    st, r = api.post("/v1/chat/completions", {"messages": USER, "stop": [" friend", "zzz"]})
    check(st == 200 and r["choices"][0]["message"]["content"] == "Hello there," and
          r["choices"][0]["finish_reason"] == "stop", "chat stop strings cut the final text (%s)" % r.get("choices"))
    st, ev = api.stream("/v1/chat/completions", {"messages": USER, "stop": " there"})
    check(st == 200 and chat_text(ev)[0] == "Hello" and finish_reason(ev) == "stop",
          "streamed chat with a stop string: the text before it (%r)" % chat_text(ev)[0])
    # a stop string over several tokens (" there", ",", " friend"): none of
    # its bytes reach the client, not even those that came before the rest
    # (they were sent as they came: "Hello there,")
    st, ev = api.stream("/v1/chat/completions", {"messages": USER, "stop": "there, friend"})
    check(st == 200 and chat_text(ev)[0] == "Hello " and finish_reason(ev) == "stop",
          "streamed chat, a stop string over three tokens: the text before it only (%r)" % chat_text(ev)[0])
    st, r = api.post("/v1/chat/completions", {"messages": USER, "stop": ["zzz", "there, friend"]})
    check(st == 200 and r["choices"][0]["message"]["content"] == "Hello " and
          r["choices"][0]["finish_reason"] == "stop",
          "chat, a stop string over three tokens: the text before it only (%s)" % r.get("choices"))
    st, ev = api.stream("/v1/chat/completions", {"messages": USER, "stop": "there, fz"})
    check(st == 200 and chat_text(ev)[0] == "Hello there, friend, how are you today?",
          "streamed chat, a stop string whose start appears but not the rest: the whole text (%r)"
          % chat_text(ev)[0])

    st, r = api.post("/v1/responses", {"input": "Hi", "max_output_tokens": 5})
    check(st == 200 and r["status"] == "incomplete" and
          r["incomplete_details"] == {"reason": "max_output_tokens"} and r["usage"]["output_tokens"] == 5,
          "responses max_output_tokens 5: status incomplete, 5 output tokens (%s)" % r.get("usage"))
    check(st == 200 and [(o["type"], o["status"]) for o in r["output"]] == [("message", "incomplete")],
          "responses: the message cut by max_output_tokens is incomplete (%s)" % r.get("output"))
    st, ev = api.stream("/v1/responses", {"input": "Hi", "max_output_tokens": 5})
    check(st == 200 and ev[-1][0] == "response.incomplete" and ev[-1][1]["response"]["status"] == "incomplete",
          "streamed: ends with response.incomplete")
    done = [d["item"]["status"] for n, d in ev if n == "response.output_item.done"]
    check(done == ["incomplete"], "streamed: its output_item.done says incomplete (%s)" % done)
    # cut inside the next message's header: the reasoning before it had ended
    head = fake_workers.tokenize("<|channel|>analysis<|message|>Hmm.<|end|>")
    script("<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hello")
    st, r = api.post("/v1/responses", {"input": "Hi", "max_output_tokens": len(head) + 2})
    check(st == 200 and r["status"] == "incomplete" and
          [(o["type"], o["status"]) for o in r["output"]] == [("reasoning", "completed")],
          "responses cut in the next header: the reasoning that ended is completed (%s)" % r.get("output"))
    script("<|channel|>final<|message|>Hello there, friend, how are you today?<|return|>")
    st, r = api.post("/v1/responses", {"input": "Hi", "instructions": "Answer in one word."})
    check(st == 200 and last_prompt() == render({"messages": [{"role": "developer", "content": "Answer in one word."},
                                                              {"role": "user", "content": "Hi"}]}) and
          "# Instructions\n\nAnswer in one word." in detok(last_prompt()),
          "responses instructions become the developer message's instructions")
    roles = [{"role": "system", "content": "You answer about weather."},
             {"role": "developer", "content": "Use metric units."}] + USER
    st, r = api.post("/v1/chat/completions", {"messages": roles})
    text = detok(last_prompt())
    check(st == 200 and last_prompt() == render({"messages": roles}) and
          "You answer about weather.\n\nUse metric units." in text and text.count("<|start|>developer") == 1,
          "chat system and developer messages become the developer message's instructions")
finally:
    fw.close()
    rc = router.stop()
check(rc == 0, "router stops cleanly (%s)" % rc)
finish()
