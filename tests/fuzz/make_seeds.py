"""Writes the seed corpora of the fuzz harnesses (tests/fuzz/corpus/NAME/*),
small and deterministic. Run from the repository root after a build:
    TW_PROTO_DESC=build/tests/service/twain.desc python3 tests/fuzz/make_seeds.py
(run.sh never rewrites them; new inputs libFuzzer finds stay in its OUT)."""
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "service"))
os.environ.setdefault("TW_BUILD_DIR", "")  # svc: no key set needed here
import svc  # noqa: E402

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
fixture = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures",
                       "tiny-gptoss-wordnet-mxfp4")


def put(name, i, data):
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-%02d" % i), "wb") as f:
        f.write(data)


for i, t in enumerate([b"What does the word 'dog' mean?", b"  spaces\t\ttabs\n\nnewlines  ",
                       "caf\u00e9 \u4e2d\u6587 \U0001f600 123,456.78".encode(),
                       b"<|start|>user<|message|>hi<|end|>", b"\xff\xfe invalid", b""]):
    put("fuzz_tokenizer", i, t)


def ids3(first, ids):
    return bytes([first]) + b"".join(struct.pack("<I", v + 32)[:3] for v in ids)


# o200k_harmony ids (<|channel|> 200005, <|message|> 200008, <|return|> 200002...); the
# harness maps them into the fixture vocabulary (modulo its size)
put("fuzz_harmony_parse", 0, ids3(1, [200005, 17196, 200008, 9906, 11, 2375, 200002]))
put("fuzz_harmony_parse", 1, ids3(0, [200006, 173781, 200005, 35644, 200008, 1313, 200007]))
put("fuzz_harmony_parse", 2, ids3(1, [200005, 12606, 815, 316, 28, 17147, 200003, 4108, 200008, 90, 200012]))

with open(os.path.join(fixture, "config.json"), "rb") as f:
    put("fuzz_checkpoint", 0, b"\x01" + f.read())
hdr = b'{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}}'
put("fuzz_checkpoint", 1, b"\x00" + struct.pack("<Q", len(hdr)) + hdr + bytes(range(8)))

P, E = svc.P, svc.E
g = svc.generate([1, 2, 3, 4], 8, stop_ids=[5])
g.request_id = 1
put("fuzz_router_client", 0, g.SerializeToString())
put("fuzz_router_client", 1, svc.chat("hi", max_tokens=4).SerializeToString())
c = svc.chat("what is 2+2?", reasoning="high")
t = c.chat.tools.add()
t.name = "calc"
t.description = "adds"
t.parameters_json = '{"type":"object","properties":{"a":{"type":"number"}}}'
c.chat.sampling.stop.append("END")
put("fuzz_router_client", 2, c.SerializeToString())
x = svc.ClientRequest()
x.cancel.target_request_id = 1
put("fuzz_router_client", 3, x.SerializeToString())

Env = svc.Envelope
e = Env()
e.tokens.request_id = 1
e.tokens.tokens.extend([5, 6])
e.tokens.finished = True
e.tokens.finish_reason = 2
put("fuzz_router_worker", 0, b"\x00" + e.SerializeToString())
e = Env()
e.reserved.request_id = 1
e.reserved.handoff.block_ids.extend([0, 1])
e.reserved.handoff.ucx_address = b"\x01\x02\x03"
put("fuzz_router_worker", 1, b"\x00" + e.SerializeToString())
e = Env()
e.prefill_done.request_id = 1
e.prefill_done.first_token = 7
put("fuzz_router_worker", 2, b"\x01" + e.SerializeToString())
e = Env()
e.heartbeat.worker = "fuzz-decode"
e.heartbeat.draining = True
put("fuzz_router_worker", 3, b"\x02" + e.SerializeToString())
e = Env()
e.reject.request_id = 1
e.reject.status.code = 14
e.reject.status.message = "draining"
put("fuzz_router_worker", 4, b"\x00" + e.SerializeToString())

# fuzz_http_request: byte 0 = endpoint (bits 0-1: chat, responses, completions) + the number
# of generated tokens (bits 2-7), then the JSON body, then the tokens (2 bytes each, little
# endian) in the fixture's own vocabulary (byte-level BPE: greedy longest match here)
with open(os.path.join(fixture, "tokenizer.json"), encoding="utf-8") as f:
    tokj = __import__("json").load(f)
vocab = tokj["model"]["vocab"]
special = {a["content"]: a["id"] for a in tokj["added_tokens"]}
b2u = {}
n = 0
for b in range(256):  # GPT-2's byte -> unicode map
    if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
        b2u[b] = chr(b)
    else:
        b2u[b] = chr(256 + n)
        n += 1


def toks(*parts):
    out = []
    for p in parts:
        if p in special:
            out.append(special[p])
            continue
        s = "".join(b2u[b] for b in p.encode())
        while s:
            k = max(k for k in range(1, len(s) + 1) if s[:k] in vocab)
            out.append(vocab[s[:k]])
            s = s[k:]
    return out


def http_seed(i, kind, body, ids):
    assert len(ids) < 64
    put("fuzz_http_request", i, bytes([kind | len(ids) << 2]) + body.encode() +
        b"".join(struct.pack("<H", v) for v in ids))


final = toks("<|channel|>", "final", "<|message|>", " the dog ran", "<|return|>")
think = toks("<|channel|>", "analysis", "<|message|>", "a dog is an animal", "<|end|>", "<|start|>",
             "assistant") + final
call = toks("<|channel|>", "commentary to=functions.calc ", "<|constrain|>", "json", "<|message|>",
            '{"a":1}', "<|call|>")
http_seed(0, 0, '{"messages":[{"role":"user","content":"What is a dog?"}],"max_tokens":40}', think)
http_seed(1, 0, '{"model":"tiny-gptoss-wordnet-mxfp4","messages":[{"role":"system","content":"Be '
          'brief."},{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage"'
          ':true},"temperature":0.5,"top_p":0.9,"seed":7,"stop":["ran"]}', final)
http_seed(2, 0, '{"messages":[{"role":"user","content":"add 1"}],"tools":[{"type":"function",'
          '"function":{"name":"calc","description":"adds","parameters":{"type":"object",'
          '"properties":{"a":{"type":"number"}}}}}],"tool_choice":"required","reasoning_effort":'
          '"high"}', call)
http_seed(3, 0, '{"messages":[{"role":"user","content":"add"},{"role":"assistant","content":"",'
          '"tool_calls":[{"id":"c1","type":"function","function":{"name":"calc","arguments":'
          '"{\\"a\\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"2"}],"tools":[{"type":'
          '"function","function":{"name":"calc","parameters":{}}}],"stream":true}', final)
http_seed(4, 1, '{"input":"What is a dog?","instructions":"Be brief.","reasoning":{"effort":"low"},'
          '"max_output_tokens":30,"stream":true}', think)
http_seed(5, 1, '{"input":[{"type":"message","role":"user","content":[{"type":"input_text","text":'
          '"add"}]},{"type":"function_call","call_id":"c1","name":"calc","arguments":"{}"},{"type":'
          '"function_call_output","call_id":"c1","output":"2"},{"type":"reasoning","summary":[{'
          '"text":"done"}]}],"tools":[{"type":"function","name":"calc","parameters":{}}],'
          '"tool_choice":{"type":"function","name":"calc"}}', call)
http_seed(6, 2, '{"prompt":"the dog","max_tokens":8,"stop":["\\n","ran"],"stream":true}',
          toks(" ran and", " ran\n"))
http_seed(7, 2, '{"prompt":[[1,2,3,4]],"max_tokens":4,"best_of":1}', toks(" dog cat"))
http_seed(8, 0, '{"messages":[{"role":"user","content":"x"}],"n":2}', [])
http_seed(9, 2, '{"prompt":"caf\\u00e9 \\u4e2d","echo":true}', [])
