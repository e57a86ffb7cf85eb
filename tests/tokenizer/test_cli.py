#!/usr/bin/env python3
"""test_cli.py: `twain tokenize | detokenize | render | parse` end to end.

    python3 test_cli.py TWAIN TINY_TOKENIZER_JSON REAL_TOKENIZER_JSON

With the real tokenizer (skipped if setup.sh could not fetch it): the spec §5.3
vectors, and the spec §4.10 example given as OpenAI chat JSON renders to exactly
its listed 170 ids. With the tiny model's tokenizer (always): round trips, the
parse of a rendered multi-turn conversation with tool calls and results, and
every bad input of issue 3 (unknown role, a tool schema that is not an object,
a message that is not UTF-8, a conversation over the context limit, ...), each
a clear error with exit code 1 and nothing on stdout.
"""
import json
import os
import subprocess
import sys

TWAIN, TINY, REAL = sys.argv[1:4]
failures = []

SPEC_4_10 = [
    200006, 17360, 200008, 3575, 553, 17554, 162016, 11, 261, 4410, 6439, 2359, 22203, 656, 7788,
    17527, 558, 87447, 100594, 25, 220, 1323, 19, 12, 3218, 198, 6576, 3521, 25, 220, 1323, 20, 12,
    3218, 12, 2029, 279, 30377, 289, 25, 14093, 279, 2, 13888, 18403, 25, 8450, 11, 49159, 11, 1721,
    13, 21030, 2804, 413, 7360, 395, 1753, 3176, 558, 63446, 316, 1879, 8437, 2804, 810, 316, 290,
    49159, 9334, 25, 461, 44580, 6120, 200007, 200006, 77944, 200008, 2, 68406, 279, 48258, 9570,
    306, 151829, 1032, 279, 2, 20574, 279, 877, 9964, 279, 4797, 9964, 95359, 21733, 290, 2208,
    11122, 306, 290, 5181, 5100, 558, 2493, 717, 23981, 170154, 314, 11350, 25, 10168, 623, 5030,
    326, 2608, 11, 319, 1940, 13, 6610, 18826, 11, 13180, 198, 7693, 25, 1621, 412, 4078, 8528, 392,
    66, 63110, 1, 1022, 392, 40364, 11732, 672, 602, 2787, 25, 274, 63110, 198, 9263, 871, 1062,
    502, 92, 602, 9819, 9964, 200007, 200006, 1428, 200008, 4827, 382, 290, 11122, 1299, 306, 38371,
    30, 200007, 200006, 173781]

CONV_4_10 = {
    "messages": [
        {"role": "system", "content": "Always respond in riddles"},
        {"role": "user", "content": "What is the weather like in SF?"}],
    "tools": [{"type": "function", "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string",
                         "description": "The city and state, e.g. San Francisco, CA"},
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"],
                       "default": "celsius"}},
            "required": ["location"]}}}],
    "reasoning_effort": "medium",
    "current_date": "2025-06-28"}


def twain(args, stdin):
    if isinstance(stdin, str):
        stdin = stdin.encode()
    p = subprocess.run([TWAIN] + args, input=stdin, capture_output=True, timeout=120)
    return p.returncode, p.stdout, p.stderr.decode(errors="replace")


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, file=sys.stderr)


def expect_error(args, stdin, needle, what):
    rc, out, err = twain(args, stdin)
    check(rc == 1 and not out and needle in err,
          "%s: want exit 1 and %r on stderr, got rc=%d stdout=%r stderr=%r"
          % (what, needle, rc, out[:80], err[-300:]))


def real_tokenizer_cases():
    t = ["--tokenizer", REAL]
    for text, ids, extra in [("Hello, world!", [13225, 11, 2375, 0], []),
                             (" 12345", [220, 7633, 2548], []),
                             ("don't", [91418], []),
                             ("a\n\n  b", [64, 279, 220, 287], []),
                             ("héllo wörld", [79163, 72807, 286, 2877, 582], []),
                             ("<|end|>", [27, 91, 419, 91, 29], []),
                             ("<|end|>", [200007], ["--allow-special"])]:
        rc, out, err = twain(["tokenize"] + t + extra, text)
        check(rc == 0 and json.loads(out) == ids, "tokenize %r %s: %r %s" % (text, extra, out, err))
    rc, out, err = twain(["render"] + t, json.dumps(CONV_4_10))
    got = json.loads(out) if rc == 0 else None
    check(got == SPEC_4_10, "render spec 4.10 via OpenAI JSON: rc=%d %s" % (rc, err[-300:]))
    print("real tokenizer: spec 4.10 rendered through `twain render`: %s"
          % ("identical (170 ids)" if got == SPEC_4_10 else "DIFFERENT"))
    rc, out, err = twain(["detokenize"] + t, json.dumps(SPEC_4_10))
    check(rc == 0 and out.startswith(b"<|start|>system<|message|>You are ChatGPT")
          and out.endswith(b"<|end|><|start|>assistant"), "detokenize spec 4.10")


def tiny_cases():
    t = ["--tokenizer", TINY]
    text = "Wörds, numbers 12345 and emoji 👍🏽 — 中文 \r\n\ttabs"
    rc, out, err = twain(["tokenize"] + t, text)
    check(rc == 0, "tokenize tiny: " + err)
    rc2, back, err2 = twain(["detokenize"] + t, out)
    check(rc2 == 0 and back == text.encode(), "detokenize(tokenize(x)) == x: %r" % back)
    # special ids are found by content: the tiny model's <|start|> is 8008, <|end|> 8009
    rc, out, err = twain(["tokenize", "--allow-special"] + t, "<|start|><|end|>")
    check(rc == 0 and json.loads(out) == [8008, 8009], "tiny specials by content: %r" % out)

    conv = {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": "Call the tool.", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"sunny\":true}"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks!"}],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                                                   "parameters": {"type": "object"}}}],
        "reasoning_effort": "high"}
    rc, prompt, err = twain(["render", "--text"] + t, json.dumps(conv))
    check(rc == 0, "render tiny: " + err)
    p = prompt.decode()
    check("Reasoning: high" in p, "effort high reaches the system message")
    check("<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in p,
          "developer message: " + p)
    check("Call the tool." not in p, "analysis before the first final dropped (spec 4.9)")
    check("<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
          "<|message|>{\"city\":\"Paris\"}<|call|>" in p, "tool call rendered: " + p)
    check("<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
          "{\"sunny\":true}<|end|>" in p, "tool result rendered")
    check(p.endswith("<|start|>user<|message|>Thanks!<|end|><|start|>assistant"), "prompt end")
    rc, ids, err = twain(["render"] + t, json.dumps(conv))
    rc, out, err = twain(["parse", "--conversation"] + t, ids)
    check(rc == 0, "parse tiny: " + err)
    parsed = json.loads(out)
    roles = [(m["role"], m["author"], m["recipient"], m["channel"]) for m in parsed["messages"]]
    check(roles == [("system", "system", None, None), ("developer", "developer", None, None),
                    ("user", "user", None, None),
                    ("assistant", "assistant", "functions.get_weather", "commentary"),
                    ("tool", "functions.get_weather", "assistant", "commentary"),
                    ("assistant", "assistant", None, "final"), ("user", "user", None, None)],
          "parse round trip: %r" % roles)
    check(parsed["tool_calls"] == [{"recipient": "functions.get_weather", "name": "get_weather",
                                    "channel": "commentary", "content_type": "<|constrain|>json",
                                    "arguments": "{\"city\":\"Paris\"}"}],
          "tool call parsed: %r" % parsed["tool_calls"])
    check(parsed["errors"] == [], "no parse errors: %r" % parsed["errors"])

    # bad input: each a clear error
    expect_error(["render"] + t, json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
                 'messages[0].role "robot" is unknown', "unknown role")
    bad_tool = {"messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": [1, 2]}}]}
    expect_error(["render"] + t, json.dumps(bad_tool),
                 "tools[0].function.parameters must be a JSON Schema object", "schema not object")
    bad_tool["tools"][0]["function"]["parameters"] = "{\"type\":\"object\"}"
    expect_error(["render"] + t, json.dumps(bad_tool), "must be a JSON Schema object",
                 "schema given as a string")
    raw = b'{"messages":[{"role":"user","content":"caf\xc3 au lait"}]}'
    expect_error(["render"] + t, raw, "messages[0].content is not valid UTF-8", "not UTF-8")
    long_conv = {"messages": [{"role": "user", "content": "word " * 500}]}
    expect_error(["render", "--max-prompt-tokens", "100"] + t, json.dumps(long_conv),
                 "over the limit of 100", "over the context limit")
    expect_error(["render"] + t, "{\"messages\": [", "not valid JSON", "truncated JSON")
    expect_error(["render"] + t, json.dumps({"messages": [{"role": "tool", "content": "r"}]}),
                 "needs \"name\" or a \"tool_call_id\"", "tool result without a tool")
    expect_error(["render"] + t, json.dumps({"messages": [], "reasoning_effort": "max"}),
                 'reasoning_effort "max"', "bad effort")
    expect_error(["tokenize"] + t, b"abc\xff", "bad byte 0xff at offset 3", "tokenize bad UTF-8")
    expect_error(["detokenize"] + t, "[1, 99999999]", "id 99999999", "detokenize unknown id")
    expect_error(["parse"] + t, "[1, \"x\"]", "not a non-negative integer", "parse bad ids")
    rc, out, err = twain(["render", "--tokenizer", "/nonexistent/tokenizer.json"], "{}")
    check(rc == 1 and "cannot open tokenizer /nonexistent/tokenizer.json" in err,
          "missing tokenizer file: " + err)
    rc, out, err = twain(["render", "--bogus"], "{}")
    check(rc == 2, "unknown option exits 2")


def main():
    tiny_cases()
    if os.path.exists(REAL):
        real_tokenizer_cases()
    else:
        # a skipped part: exit 77, or fail under TWAIN_REQUIRE_ALL=1 (CI)
        print("SKIP (part): real tokenizer missing (setup.sh could not fetch it): its cases")
        if os.environ.get("TWAIN_REQUIRE_ALL", "") not in ("", "0"):
            failures.append("real tokenizer cases skipped under TWAIN_REQUIRE_ALL=1")
        elif not failures:
            print("cli: checks passed, real tokenizer cases skipped")
            return 77
    print("cli: %s" % ("all checks passed" if not failures else "%d FAILED" % len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
