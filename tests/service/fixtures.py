"""fixtures.py: prompts for the service tests, built only from the token ids
of tests/fixtures/tiny-gptoss-wordnet/prompts.json (produced by the Hugging
Face tokenizer), and the Harmony stop ids looked up by content in the
model's tokenizer.json."""
import json
import os

FIX = os.environ.get("TW_FIXTURES_DIR", os.path.join(os.path.dirname(__file__), "..", "fixtures"))
PROMPTS = json.load(open(os.path.join(FIX, "tiny-gptoss-wordnet", "prompts.json")))
_TOK = json.load(open(os.path.join(FIX, "tiny-gptoss-wordnet-mxfp4", "tokenizer.json")))
SPECIAL = {a["content"]: a["id"] for a in _TOK["added_tokens"]}
START, RETURN, CALL = SPECIAL["<|start|>"], SPECIAL["<|return|>"], SPECIAL["<|call|>"]
STOPS = [RETURN, CALL]


def ids(name):
    return list(PROMPTS[name]["ids"])


def system_prefix():
    """The system message of system_water: everything before its user turn.
    It is exactly what the router renders for reasoning low, date 2025-06-01."""
    w = ids("system_water")
    second_start = [i for i, t in enumerate(w) if t == START][1]
    return w[:second_start]


def chat_prompt(short_name):
    """System message + the user turn of a short fixture (short_dog, short_book)."""
    return system_prefix() + ids(short_name)


def long_prompt():
    """Longer than several blocks and the 32-token window: system + 3 questions."""
    return (system_prefix() + ids("short_book")[:-2] + ids("short_dog")[:-2] + ids("short_book")[:-2]
            + ids("system_water")[-15:])
