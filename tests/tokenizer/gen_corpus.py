#!/usr/bin/env python3
"""gen_corpus.py: the tokenizer test corpus, generated deterministically (seeded).

    python3 gen_corpus.py OUT_DIR [MEGABYTES]

Writes OUT_DIR/corpus.bin (documents back to back, UTF-8) and OUT_DIR/corpus.idx
(one "offset length kind" line per document). The kinds cover what breaks
tokenizers: English prose with contractions in any case, source code, CJK,
Arabic and Hebrew with marks, Devanagari, emoji with skin-tone modifiers, ZWJ
sequences, flags and keycaps, long digit runs, whitespace and newline runs,
\\r\\n, very long words, special-token strings, mixed scripts. Only characters
assigned by Unicode 13 are used, so PCRE2's and the reference's Unicode tables
agree on their properties.
"""
import os
import random
import sys

WORDS = """the of and to in is was that for it with as his on be at by had not are but from or
have an they which one you were her all she there would their we him been has when who will
more no if out so said what up its about into than them can only other new some could time these
two may then do first any my now such like our over man me even most made after also did many
before must through back years where much your way well down should because each just those people
mr how too little state good very make world still own see men work long get here between both life
being under never day same another know while last might us great old year off come since against
go came right used take three states himself few house use during without again place american
around however home small found mrs thought went say part once general high upon school every
don't does got united left number course war until always away something fact though water less
public put think almost hand enough far took head yet government system better set told nothing
night end why called didn't eyes find going look asked later knew point next program city business
give group toward young days let room president side social present given several order national
possible rather second face per among form important often things looked early white case john
become large big need four within felt along children saw best church ever least power development
light thing seemed family interest want members mind country area others done turned although open
god service certain kind problem began different door thus help sense means whole matter perhaps
itself york it's times law human line above name example action company hands local show whether
five history gave today either act feet across taken past quite anything seen having death experience
body word half really week free car field information money body'll we're they've I'm you'd she'll""".split()

CODE_WORDS = """int char void return if else for while struct static const size_t uint32_t
def class import from self None True False lambda yield async await function let var const
=> == != <= >= && || ++ -- += -= ->""".split()

IDENTS = """buffer count index value result status config tokenizer encoder decoder stream
parser message header channel recipient content offset length capacity request response
handle_error parseHeader HTTPServer XMLHttpRequest getValue setValue __init__ _private
kMaxSize MAX_TOKENS tw_status_t snake_case_name camelCaseName PascalCaseName i j k n x y""".split()


def prose(r, n):
    out = []
    size = 0
    while size < n:
        sent = [r.choice(WORDS) for _ in range(r.randint(3, 25))]
        sent[0] = sent[0].capitalize()
        for i in range(len(sent)):
            x = r.random()
            if x < 0.03:
                sent[i] = sent[i].upper()
            elif x < 0.05:
                sent[i] += r.choice(["'s", "'S", "'t", "'T", "'re", "'RE", "'ve", "'m", "'ll",
                                     "'LL", "'d", "'D", "'Re", "'x"])
            elif x < 0.08:
                sent[i] += r.choice([",", ";", ":", " --", " -", "...", ")", "\""])
            elif x < 0.1:
                sent[i] = str(r.randint(0, 10 ** r.randint(1, 9)))
            elif x < 0.11:
                sent[i] = r.choice(["(", "\"", "'", "[", "“", "‘"]) + sent[i]
        s = " ".join(sent) + r.choice([".", ".", ".", "?", "!", "...", ".\"", "?!"])
        s += r.choice([" ", " ", " ", "  ", "\n", "\n\n", "\r\n", " \n", "\t"])
        out.append(s)
        size += len(s)
    return "".join(out)


def code(r, n):
    out = []
    size = 0
    indent = 0
    while size < n:
        kind = r.random()
        pad = (" " * 4 * indent) if r.random() < 0.8 else ("\t" * indent)
        if kind < 0.2:
            line = "%sif (%s %s %d) {" % (pad, r.choice(IDENTS), r.choice(["==", "<", ">=", "!="]),
                                          r.randint(0, 4096))
            indent = min(indent + 1, 6)
        elif kind < 0.3 and indent:
            indent -= 1
            line = " " * 4 * indent + "}"
        elif kind < 0.45:
            line = "%s%s = %s(%s, %s);" % (pad, r.choice(IDENTS), r.choice(IDENTS),
                                           r.choice(IDENTS), hex(r.randint(0, 1 << 32)))
        elif kind < 0.55:
            line = "%s// %s" % (pad, prose(r, 40).strip().split("\n")[0][:70])
        elif kind < 0.62:
            line = "%sdef %s(self, %s=None, *args, **kwargs):" % (pad, r.choice(IDENTS),
                                                                    r.choice(IDENTS))
        elif kind < 0.7:
            line = '%sprintf("%%s: %%d\\n", "%s", %s->%s[%d]);' % (
                pad, r.choice(WORDS), r.choice(IDENTS), r.choice(IDENTS), r.randint(0, 99))
        elif kind < 0.78:
            line = "%s%s" % (pad, " ".join(r.choice(CODE_WORDS + IDENTS) for _ in range(6)))
        elif kind < 0.84:
            line = '%s{"key": "%s", "n": %d, "ok": true, "list": [1, 2.5, -3e10]},' % (
                pad, r.choice(IDENTS), r.randint(-999, 999))
        elif kind < 0.9:
            line = "%s#include <%s/%s.h>" % (pad, r.choice(IDENTS), r.choice(IDENTS))
        else:
            line = pad + "".join(r.choice("{}[]()<>;:,./\\|!@#$%^&*-_=+~`'\"?") for _ in
                                 range(r.randint(1, 12)))
        if r.random() < 0.05:
            line += " " * r.randint(1, 5)  # trailing blanks
        nl = "\r\n" if r.random() < 0.1 else "\n"
        out.append(line + nl + ("\n" if r.random() < 0.1 else ""))
        size += len(line) + 1
    return "".join(out)


def chars(r, ranges, n, seps=" ", marks=None, mark_p=0.0, punct=""):
    out = []
    size = 0
    while size < n:
        w = []
        for _ in range(r.randint(1, 8)):
            lo, hi = r.choice(ranges)
            w.append(chr(r.randint(lo, hi)))
            if marks and r.random() < mark_p:
                lo, hi = r.choice(marks)
                w.append(chr(r.randint(lo, hi)))
        s = "".join(w)
        if punct and r.random() < 0.15:
            s += r.choice(punct)
        s += r.choice(seps)
        out.append(s)
        size += len(s.encode())
    return "".join(out)


def cjk(r, n):
    return chars(r, [(0x4E00, 0x9FA5), (0x4E00, 0x9FA5), (0x3041, 0x3093), (0x30A1, 0x30F6),
                     (0xAC00, 0xD7A3), (0xFF10, 0xFF19), (0xFF21, 0xFF3A)], n,
                 seps=["", "", "", " ", "\n"], punct="、。「」！？（）：・ー")


def arabic(r, n):
    return chars(r, [(0x0621, 0x063A), (0x0641, 0x064A), (0x0660, 0x0669)], n,
                 seps=[" ", " ", "\n"], marks=[(0x064B, 0x0652)], mark_p=0.3, punct="،؛؟.")


def hebrew(r, n):
    return chars(r, [(0x05D0, 0x05EA)], n, seps=[" ", " ", "\n"], marks=[(0x05B0, 0x05BC)],
                 mark_p=0.3, punct=".,-״׳")


def devanagari(r, n):
    return chars(r, [(0x0915, 0x0939), (0x0905, 0x0914), (0x0966, 0x096F)], n,
                 seps=[" ", " ", "\n"], marks=[(0x093E, 0x094D), (0x0901, 0x0903)], mark_p=0.5,
                 punct="।॥,")


EMOJI = [0x1F600, 0x1F602, 0x1F60D, 0x1F44D, 0x1F44B, 0x1F468, 0x1F469, 0x1F466, 0x1F467, 0x2764,
         0x1F525, 0x1F680, 0x1F389, 0x1F308, 0x1F3F3, 0x1F4A9, 0x1F9D1, 0x270B, 0x1F64F, 0x1F937]


def emoji(r, n):
    out = []
    size = 0
    while size < n:
        x = r.random()
        if x < 0.3:
            s = chr(r.choice(EMOJI))
        elif x < 0.5:
            s = chr(r.choice([0x1F44D, 0x1F44B, 0x270B, 0x1F64F, 0x1F937])) + chr(r.randint(0x1F3FB,
                                                                                              0x1F3FF))
        elif x < 0.65:  # family / couple ZWJ sequences, some with skin tones
            parts = [chr(r.choice([0x1F468, 0x1F469, 0x1F466, 0x1F467])) for _ in range(r.randint(2,
                                                                                                  4))]
            if r.random() < 0.3:
                parts[0] += chr(r.randint(0x1F3FB, 0x1F3FF))
            s = "\u200d".join(parts)
        elif x < 0.72:
            s = "\u2764\ufe0f" if r.random() < 0.5 else "\U0001F3F3\ufe0f\u200d\U0001F308"
        elif x < 0.8:
            s = chr(0x1F1E6 + r.randint(0, 25)) + chr(0x1F1E6 + r.randint(0, 25))  # flags
        elif x < 0.86:
            s = r.choice("0123456789#*") + "\ufe0f\u20e3"  # keycaps
        else:
            s = r.choice(WORDS)
        s += r.choice(["", "", " ", " ", "\n", "!"])
        out.append(s)
        size += len(s.encode())
    return "".join(out)


def digits(r, n):
    out = []
    size = 0
    while size < n:
        d = "".join(r.choice("0123456789") for _ in range(r.randint(1, 200)))
        if r.random() < 0.3:
            d = r.choice(["$", "-", "+", "#", "v", "x", "€", "№"]) + d
        if r.random() < 0.2:
            d += "." + "".join(r.choice("0123456789") for _ in range(r.randint(1, 9)))
        if r.random() < 0.1:
            d += chr(r.choice([0x0660, 0x06F0, 0x0966, 0xFF10, 0x2460, 0x00B2, 0x2155])
                     + r.randint(0, 9))
        d += r.choice([" ", ", ", "\n", "", "abc", "th "])
        out.append(d)
        size += len(d)
    return "".join(out)


WS = [" ", "  ", "   ", "\t", "\n", "\r\n", "\r", "\n\n", "\u00a0", "\u3000", "\u2003", "\u2028",
      "\u0085", "\u000b", "\u000c", " \n", "\n ", "\t\n", "\u200b", "\ufeff"]


def whitespace(r, n):
    out = []
    size = 0
    while size < n:
        s = "".join(r.choice(WS) * r.randint(1, 30) for _ in range(r.randint(1, 4)))
        s += r.choice(WORDS) if r.random() < 0.7 else r.choice(["!", "123", "é", "中", ".", ""])
        out.append(s)
        size += len(s.encode())
    return "".join(out)


def longwords(r, n):
    out = []
    size = 0
    while size < n:
        x = r.random()
        ln = r.choice([50, 300, 1000, 5000, 20000])
        if x < 0.3:
            w = "".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(ln))
        elif x < 0.45:
            w = r.choice(WORDS) * (ln // 5)
        elif x < 0.6:
            w = "".join(chr(r.randint(0x4E00, 0x9FA5)) for _ in range(ln // 3))
        elif x < 0.7:
            w = "a" * ln
        elif x < 0.8:
            w = "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(ln))
        elif x < 0.9:
            w = "http://example.com/" + "/".join(r.choice(IDENTS) for _ in range(ln // 10))
        else:
            w = "".join(r.choice("=-_*#~.") for _ in range(ln // 4))
        w += r.choice([" ", "\n", ". "])
        out.append(w)
        size += len(w.encode())
    return "".join(out)


SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
            "<|call|>", "<|endoftext|>", "<|startoftext|>", "<|endofprompt|>", "<|reserved_200000|>",
            "<|reserved_200019|>", "<|start", "|>", "<|", "<||>", "<|end|", "<|START|>",
            "<|start|><|start|>", "<|reserved_8002|>"]


def special(r, n):
    out = []
    size = 0
    while size < n:
        if r.random() < 0.4:
            s = r.choice(SPECIALS)
        elif r.random() < 0.5:
            s = r.choice(["assistant", "user", "system", "analysis", "final", "commentary",
                          " to=functions.get_weather", "json", '{"a": 1}'])
        else:
            s = prose(r, 30)
        s += r.choice(["", "", " ", "\n"])
        out.append(s)
        size += len(s)
    return "".join(out)


def mixed(r, n):
    parts = [prose, cjk, arabic, hebrew, devanagari, emoji, digits, code, special]
    out = []
    size = 0
    while size < n:
        s = r.choice(parts)(r, r.randint(5, 200))
        if r.random() < 0.2:
            s += r.choice(["ǅungla", "ʰello", "e\u0301te\u0301", "İstanbul ıi", "Straße",
                           "ΑΒΓ αβγ ΣΊΣΥΦΟΣ", "Привет, МИР", "Ǉ", "ﬁne", "ⅫⅣ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
                           "a\u0308\u0308b", "\u0301\u0301x"])
        out.append(s)
        size += len(s.encode())
    return "".join(out)


KINDS = [("prose", prose, 0.22), ("code", code, 0.16), ("cjk", cjk, 0.08), ("arabic", arabic, 0.06),
         ("hebrew", hebrew, 0.05), ("devanagari", devanagari, 0.05), ("emoji", emoji, 0.06),
         ("digits", digits, 0.06), ("whitespace", whitespace, 0.06), ("longwords", longwords, 0.08),
         ("special", special, 0.04), ("mixed", mixed, 0.08)]


def main():
    out_dir = sys.argv[1]
    megabytes = float(sys.argv[2]) if len(sys.argv) > 2 else 5.5
    r = random.Random(20261129)
    total = int(megabytes * 1024 * 1024)
    docs = []
    for name, fn, share in KINDS:
        want = int(total * share)
        got = 0
        while got < want:
            d = fn(r, r.choice([200, 2000, 8000, 30000])).encode("utf-8")
            docs.append((name, d))
            got += len(d)
    os.makedirs(out_dir, exist_ok=True)
    off = 0
    with open(os.path.join(out_dir, "corpus.bin.tmp"), "wb") as f, \
            open(os.path.join(out_dir, "corpus.idx.tmp"), "w") as idx:
        for name, d in docs:
            f.write(d)
            idx.write("%d %d %s\n" % (off, len(d), name))
            off += len(d)
    os.replace(os.path.join(out_dir, "corpus.bin.tmp"), os.path.join(out_dir, "corpus.bin"))
    os.replace(os.path.join(out_dir, "corpus.idx.tmp"), os.path.join(out_dir, "corpus.idx"))
    print("gen_corpus: %d documents, %d bytes" % (len(docs), off))


if __name__ == "__main__":
    main()
