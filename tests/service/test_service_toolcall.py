"""The router with fake workers (no engine): a Chat request with a function
tool renders a longer prompt (the developer message with the tool, spec
§4.6), and a scripted generation -- analysis, then a commentary message to
functions.get_weather with <|constrain|>json arguments ending in <|call|>
(spec §4.8) -- comes back as per-channel deltas, one tool call, the parsed
messages and finish reason TOOL_CALL. The fake decode worker streams exactly
the ids it was given, so this checks the router's Harmony streaming path and
its protocol handling with workers it did not start."""
import fake_workers
import fixtures
import svc

from svc import check, finish


SCRIPT_TEXT = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
               "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
               "{\"city\":\"Paris\"}<|call|>")
SCRIPT = fake_workers.tokenize(SCRIPT_TEXT)
assert SCRIPT[-1] == fixtures.CALL


router = svc.Proc([svc.bin_path("router", "twain-router"), "--model", svc.MODEL, "--listen", "tcp://127.0.0.1:0",
                   "--workers", "tcp://127.0.0.1:0", "--metrics-port", "-1", "--expire-ms", "10000",
                   "--expect-prefill", "1",
                   "--expect-decode", "1"], "router")
fw = None
try:
    m = router.wait_line(r"listening clients=(\S+) workers=(\S+)", 30)
    fw = fake_workers.FakeWorkers(m.group(2), SCRIPT)
    fw.start()
    router.wait_line(r"twain-router: ready", 30)
    cl = svc.Client(m.group(1))
    plain = cl.wait([cl.send(svc.chat("What is the weather in Paris?", 64, reasoning="low"))], 30)[0][-1]
    req = svc.chat("What is the weather in Paris?", 64, reasoning="low")
    t = req.chat.tools.add()
    t.name = "get_weather"
    t.description = "Current weather for a city."
    t.parameters_json = '{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}'
    reps = cl.wait([cl.send(req)], 30)[0]
    last = reps[-1]
    check(last.error.code == 0, "tool chat served by fake workers (%s)" % last.error.message)
    check(last.usage.prompt_tokens > plain.usage.prompt_tokens + 10,
          "the tool is rendered into the prompt (%d vs %d tokens without it)" % (
              last.usage.prompt_tokens, plain.usage.prompt_tokens))
    check(svc.tokens_of(reps) == SCRIPT, "every scripted id streamed back, in order")
    deltas = [(d.channel, d.recipient, d.content) for r in reps for d in r.deltas]
    analysis = "".join(c for ch, _, c in deltas if ch == "analysis")
    args = "".join(c for ch, rc, c in deltas if ch == "commentary" and rc == "functions.get_weather")
    check(analysis == "Need the weather.", "analysis deltas: %r" % analysis)
    check(args == '{"city":"Paris"}', "commentary deltas to functions.get_weather: %r" % args)
    calls = [c for r in reps for c in r.tool_calls]
    check(len(calls) == 1 and calls[0].recipient == "functions.get_weather" and
          calls[0].arguments == '{"city":"Paris"}' and "json" in calls[0].content_type,
          "one tool call: %s" % [(c.recipient, c.content_type, c.arguments) for c in calls])
    check(last.finish_reason == svc.E["FINISH_TOOL_CALL"], "finish reason TOOL_CALL (%d)" % last.finish_reason)
    msgs = [(m.channel, m.recipient, m.content) for m in last.messages]
    check(msgs == [("analysis", "", "Need the weather."),
                   ("commentary", "functions.get_weather", '{"city":"Paris"}')], "parsed messages: %s" % msgs)
    check({"reserve", "prefill", "decode"} <= set(fw.seen), "fake workers saw reserve, prefill, decode")
    cl.close()
finally:
    if fw:
        fw.stop = True
        fw.join(5)
    rc = router.stop()
check(rc == 0, "router stops cleanly (%s)" % rc)
finish()
