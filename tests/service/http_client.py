"""http_client.py: a small HTTP client for the router's OpenAI-compatible API
in the service tests (the standard library's http.client): JSON requests,
Server-Sent Events read event by event. Every call is bounded by a timeout."""
import http.client
import json
import urllib.parse


class Api:
    def __init__(self, base, key=None, timeout=30):
        u = urllib.parse.urlparse(base)
        self.host, self.port = u.hostname, u.port
        self.key = key
        self.timeout = timeout

    def _conn(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _headers(self, key):
        h = {"Content-Type": "application/json"}
        key = self.key if key is None else key
        if key:
            h["Authorization"] = "Bearer " + key
        return h

    def request(self, method, path, body=None, raw=None, key=None):
        """(status, parsed JSON or the raw text when it is not JSON)."""
        c = self._conn()
        try:
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            c.request(method, path, body=data, headers=self._headers(key))
            r = c.getresponse()
            text = r.read().decode()
            try:
                return r.status, json.loads(text)
            except ValueError:
                return r.status, text
        finally:
            c.close()

    def post(self, path, body=None, **kw):
        return self.request("POST", path, body, **kw)

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def stream(self, path, body, key=None, on_event=None):
        """POST with stream: true. Returns (status, events): events are
        (event name or None, parsed data or "[DONE]"); for a non-200 answer,
        events is the parsed error body. on_event(i, event) may return True to
        stop reading (the connection is then closed)."""
        c = self._conn()
        try:
            c.request("POST", path, body=json.dumps(dict(body, stream=True)), headers=self._headers(key))
            r = c.getresponse()
            if r.status != 200:
                return r.status, json.loads(r.read().decode())
            ctype = r.getheader("Content-Type", "")
            assert ctype.startswith("text/event-stream"), ctype
            events, name, data = [], None, []
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.decode().rstrip("\r\n")
                if line.startswith(":"):
                    continue
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data.append(line[6:])
                elif not line and data:
                    text = "\n".join(data)
                    events.append((name, text if text == "[DONE]" else json.loads(text)))
                    name, data = None, []
                    if on_event and on_event(len(events) - 1, events[-1]):
                        break
            return r.status, events
        finally:
            c.close()


def chat_text(events):
    """From chat.completion.chunk events: (content, reasoning, {index: call})."""
    content, reasoning, calls = "", "", {}
    for _, d in events:
        if d == "[DONE]" or not d.get("choices"):
            continue
        delta = d["choices"][0]["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for tc in delta.get("tool_calls") or []:
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if tc.get("id"):
                call["id"] = tc["id"]
            fn = tc.get("function") or {}
            if fn.get("name"):
                call["name"] = fn["name"]
            call["arguments"] += fn.get("arguments") or ""
    return content, reasoning, calls


def finish_reason(events):
    for _, d in events:
        if d != "[DONE]" and d.get("choices") and d["choices"][0].get("finish_reason"):
            return d["choices"][0]["finish_reason"]
    return None
