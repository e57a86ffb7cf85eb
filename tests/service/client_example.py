#!/usr/bin/env python3
"""client_example.py: a minimal twain.v1 client in Python (docs/api.md), with
python3-zmq and python3-protobuf only, on the twain_client module.

    python3 client_example.py [--endpoint tcp://127.0.0.1:7400] [--desc twain.desc] "question"

From the relocatable bundle it runs as is (share/twain/python/ holds this file
and twain_client.py, share/twain/proto/ the .proto files and twain.desc); from
the source tree it finds proto/python/twain_client.py and the build's
twain.desc (or $TW_PROTO_DESC). It sends one streaming chat request, prints the
final-channel text as it arrives, then the usage line."""
import argparse
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
for d in (here, os.path.join(here, "..", "..", "proto", "python")):  # bundle, source tree
    if os.path.isfile(os.path.join(d, "twain_client.py")):
        sys.path.insert(0, d)
        break
import twain_client  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default=twain_client.DEFAULT_ENDPOINT)
    ap.add_argument("--desc", default=None, help="twain.desc (default: found by twain_client)")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("question")
    args = ap.parse_args()
    c = twain_client.Client(args.endpoint, desc=args.desc, timeout_s=args.timeout)
    try:
        for text in c.chat(args.question, max_tokens=256):
            print(text, end="", flush=True)
    except (twain_client.TwainError, TimeoutError) as e:
        print("\nerror %s" % e, file=sys.stderr)
        return 1
    finally:
        c.close()
    print()
    print("usage: prompt %d, completion %d tokens, ttft %.1f ms" % (
        c.last.usage.prompt_tokens, c.last.usage.completion_tokens, c.last.timings.ttft_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
