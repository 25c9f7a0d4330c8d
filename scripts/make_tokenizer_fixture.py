#!/usr/bin/env python3
"""Writes the committed tokenizer fixtures under tests/fixtures/tokenizer/ from HF references.

  pip install tokenizers gguf jinja2
  python3 scripts/make_tokenizer_fixture.py [--models models] [--out tests/fixtures/tokenizer]

Outputs:
  qwen2_encode.json   {"strings": [{"text", "ids", "decoded", "nfc"}]}: HF `tokenizers` encoding
                      of >= 200 varied strings with models/qwen2.5-tokenizer/tokenizer.json.
  pretokenize.json    {"strings": [{"text", "<name>": [pieces]}]}: HF splits for qwen2, llama3,
                      gpt2 (ByteLevel use_regex) and smollm (Digits + ByteLevel) on the same strings.
  smollm2_encode.json {"strings": [{"text", "ids"}]}: the same strings through an HF `tokenizers`
                      BPE built from the SmolLM2 GGUF's tokenizer.ggml.tokens / merges / token_type
                      (CONTROL = special) with SmolLM2's pre-tokenizer (Digits + ByteLevel): the
                      reference for the GGUF ("gpt2" model, "smollm" pre) path.
  chat_templates.json {"jinja": {name: template}, "renderings": {"qwen2.5"|"smollm2":
                      [{"messages", "add_generation_prompt", "rendered"}]}}:
                      jinja2 renderings of the exact templates (tokenizer_config.json for Qwen2.5,
                      GGUF tokenizer.chat_template for SmolLM2), plus Qwen2.5 ids of each rendering.
"""
import argparse
import json
import os
import random
import unicodedata

import jinja2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
from tokenizers import pre_tokenizers as pt

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
                 r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN = QWEN2_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

HANDWRITTEN = [
    "", " ", "a", "Hello world", "Hello, world!", "  leading spaces", "trailing spaces   ",
    "multiple   spaces   inside", "tab\tseparated\tvalues", "\t\tindented", "line1\nline2",
    "windows\r\nline\r\nends", "mixed \r\n \n\r  \n", "\n\n\n", "   \n   ", "a\n\n\nb", " \t \n",
    "x\u3000\u3000y", "nbsp\u00a0here", "a\u2028b\u2029c", "\u0085next line", "vertical\x0btab",
    # contractions in various cases
    "I'm here, you're there, he's gone, we've won, they'll come, I'd go, don't.",
    "I'M HERE, YOU'RE THERE, HE'S GONE, WE'VE WON, THEY'LL COME, I'D GO, DON'T.",
    "It'S a Mix'Ll 'Re 'vE 'D 'T", "'s", "'S'", "''s", "rock'n'roll", "o'clock", "'sam",
    # digits
    "0", "42", "3.14159", "1234567890", "123456789012345678901234567890", "-17 + 25 = 8",
    "2024-11-29T18:17:47Z", "$1,234,567.89", "phone: +1 (555) 123-4567", "v1.2.3-rc4",
    "\uff11\uff12\uff13 fullwidth digits", "\u0661\u0662\u0663 arabic-indic", "\u2460\u2461 circled",
    "room 101, shelf 3, slot 7", "x=1;y=22;z=333",
    # unicode
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01", "\u6211\u7684\u673a\u5668\u4eba\u5728\u53a8\u623f\u91cc\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059", "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!", "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd", "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
    "Stra\u00dfe und \u00c4pfel", "na\u00efve caf\u00e9 r\u00e9sum\u00e9",
    # combining accents (NFC changes these)
    "cafe\u0301", "e\u0301e\u0300e\u0302", "A\u030angstr\u00f6m", "\u212b unit", "n\u0303o",
    "Zu\u0308rich", "\u1e9b\u0323", "\u0041\u0301\u0327", "\uf900 compat ideograph",
    # emoji
    "\U0001F600", "I \u2764\ufe0f robots \U0001F916", "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 family",
    "\U0001F44D\U0001F3FD thumbs", "\U0001F1EF\U0001F1F5 flag", "\U0001F3F3\ufe0f\u200d\U0001F308",
    "keycap 1\ufe0f\u20e3", "zwj\u200djoiner", "zw\u200bspace", "bom\ufeffin",
    # code
    "def f(x):\n    return x * 2\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "if (a && b || !c) {\n\treturn;\n}", "#include <vector>\nint main() { return 0; }",
    "SELECT * FROM memories WHERE agent = 'r1' AND step > 10;", "x = {'a': [1, 2], \"b\": None}",
    "    // indented comment\n        nested", "<html><body class=\"x\">Hi</body></html>",
    "path/to/file.cpp:123:45: error: expected ';'", "a->b.c::d<e>(f)", "!!!???...,,,;;;",
    "((((((((((", "==========", "----------------------------------------", "__init__",
    "https://example.com/a?b=c&d=e#f", "user@example.com",
    # special tokens inline
    "<|im_start|>user\nhello<|im_end|>", "<|im_start|>system\nYou are a robot.<|im_end|>\n",
    "text<|endoftext|>more", "<|endoftext|><|endoftext|>", " <|endoftext|> ", "<|im_end|>x<|im_start|>",
    "<|im_start|", "<|im_star", "<<|im_start|>>", "<tool_call>{\"name\": \"pick\"}</tool_call>",
    "<|fim_prefix|>def<|fim_suffix|>pass<|fim_middle|>", "<|vision_start|><|image_pad|><|vision_end|>",
    "<|object_ref_start|>mug<|object_ref_end|><|box_start|>(1,2),(3,4)<|box_end|>",
    # household-robot memory lines
    "The red mug is on the kitchen counter, next to the sink.",
    "Step 12: picked up the apple from the fridge (shelf 2).",
    "Task: put a washed apple in the fridge. Plan: 1. go to countertop 2. pick apple 3. wash apple",
    "Object state: fridge=closed, microwave=open, light_switch=on, cup_3=dirty",
    "I saw the keys under the sofa cushion in the living room at step 47.",
    "User prefers coffee without sugar; tea at 17:00.",
    "Example plan: find(\"Knife\"); pick(\"Knife\"); find(\"Bread\"); slice(\"Bread\"); put(\"Knife\", \"Drawer\")",
    "GoToLocation[CounterTop] -> PickupObject[Mug] -> GoToLocation[CoffeeMachine] -> ToggleObjectOn",
    "The robot's battery is at 23%; return to dock before step 200.",
    "Agent r2 can't reach the top shelf; ask r1 (it's taller).",
    "The bathroom towel is WET and should be hung on the rack.",
    "Kitchen: plate\u00d73, bowl\u00d72, fork\u00d74 — all in the dishwasher.",
    "Temperature of the oven: 180\u00b0C; timer 00:25:00.",
    "\u673a\u5668\u4eba\u8bb0\u5fc6\uff1a\u82f9\u679c\u5728\u51b0\u7bb1\u91cc\u3002",
    # long pieces (heap merge path)
    "a" * 300, " " * 200, "\n" * 150, "ab" * 120, "\u4e00" * 100, "9" * 80, "-" * 100,
    "supercalifragilisticexpialidocious" * 4, "\U0001F600" * 40, "xy " * 60,
]


def random_strings(n, seed=20261129):
    rng = random.Random(seed)
    alphabet = (list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") * 3 + list("0123456789") * 2
                + list(" " * 20) + list("\t\n\r") + list("'.,;:!?-_()[]{}<>/\\\"@#$%^&*+=|~`")
                + list("\u4e00\u4e8c\u4e09\u4eba\u5927\u4e2d\u56fd\u6c34\u706b\u3042\u3044\u30a2\u30a4\uac00\ub098")
                + list("\u0627\u0644\u0645\u0639\u0928\u092e\u0938\u094d\u0915\u0430\u0431\u0432\u0433\u03b1\u03b2\u03b3")
                + list("\u00e9\u00fc\u00f1\u00e7\u00df\u00c5\u0301\u0308\u0303\u00a0\u3000\u2014\u2026\u00b0\u20ac")
                + ["\U0001F600", "\U0001F916", "\u200d", "\ufe0f", "\U0001F3FD", "\uff11", "\u0661", "\u2460"])
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "'s", "'LL", "'Re", "\r\n", "  "]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 60)):
            parts.append(rng.choice(specials) if rng.random() < 0.04 else rng.choice(alphabet))
        out.append("".join(parts))
    return out


def byte_level_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def dump_rows(path, header, key, rows):
    """Writes {header..., key: rows} with one row per line (diff-friendly, compact)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(header, ensure_ascii=False)[:-1] + f', "{key}": [\n')
        f.write(",\n".join(json.dumps(r, ensure_ascii=False) for r in rows))
        f.write("\n]}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", default="models")
    ap.add_argument("--out", default="tests/fixtures/tokenizer")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    tok = Tokenizer.from_file(os.path.join(args.models, "qwen2.5-tokenizer", "tokenizer.json"))
    strings = HANDWRITTEN + random_strings(120)
    assert len(strings) >= 200, len(strings)

    encoded = []
    for s in strings:
        ids = tok.encode(s, add_special_tokens=False).ids
        encoded.append({"text": s, "ids": ids,
                        "decoded": tok.decode(ids, skip_special_tokens=False),
                        "nfc": unicodedata.normalize("NFC", s) == s})
    dump_rows(os.path.join(args.out, "qwen2_encode.json"),
              {"source": "HF tokenizers on models/qwen2.5-tokenizer/tokenizer.json"}, "strings",
              encoded)

    unmap = byte_level_decoder()

    def unbyte(piece):
        return bytes(unmap[c] for c in piece).decode("utf-8")

    splitters = {
        "qwen2": (pt.Split(Regex(QWEN2_PATTERN), behavior="isolated"), False),
        "llama3": (pt.Split(Regex(LLAMA3_PATTERN), behavior="isolated"), False),
        "gpt2": (pt.ByteLevel(add_prefix_space=False, use_regex=True), True),
        "smollm": (pt.Sequence([pt.Digits(individual_digits=True),
                                pt.ByteLevel(add_prefix_space=False, use_regex=True)]), True),
    }
    # Pre-tokenizers see normalized text in the pipeline; the fixture feeds NFC text.
    split_inputs = [unicodedata.normalize("NFC", s) for s in strings if s]
    rows = []
    for s in split_inputs:
        row = {"text": s}
        for name, (splitter, byte_level) in splitters.items():
            ps = [p for p, _ in splitter.pre_tokenize_str(s)]
            row[name] = [unbyte(p) if byte_level else p for p in ps]
        rows.append(row)
    dump_rows(os.path.join(args.out, "pretokenize.json"),
              {"source": "HF tokenizers pre-tokenizers", "names": list(splitters)}, "strings", rows)

    # SmolLM2 from its GGUF vocabulary.
    from gguf import GGUFReader
    reader = GGUFReader(os.path.join(args.models, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    field = reader.fields
    assert field["tokenizer.ggml.model"].contents() == "gpt2"
    assert field["tokenizer.ggml.pre"].contents() == "smollm"
    gguf_tokens = field["tokenizer.ggml.tokens"].contents()
    gguf_types = field["tokenizer.ggml.token_type"].contents()
    gguf_merges = [tuple(m.split(" ")) for m in field["tokenizer.ggml.merges"].contents()]
    smol = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(gguf_tokens)}, merges=gguf_merges))
    smol.pre_tokenizer = pt.Sequence([pt.Digits(individual_digits=True),
                                      pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    smol.decoder = decoders.ByteLevel()
    smol.add_special_tokens([AddedToken(gguf_tokens[i], special=True, normalized=False)
                             for i, t in enumerate(gguf_types) if t == 3])
    dump_rows(os.path.join(args.out, "smollm2_encode.json"),
              {"source": "HF tokenizers BPE from models/SmolLM2-135M-Instruct.Q4_1.gguf"}, "strings",
              [{"text": s, "ids": smol.encode(s, add_special_tokens=False).ids} for s in strings])

    # Chat templates, rendered by jinja2 as transformers does (trim_blocks, lstrip_blocks).
    with open(os.path.join(args.models, "qwen2.5-tokenizer", "tokenizer_config.json")) as f:
        qwen_template = json.load(f)["chat_template"]
    smol_template = reader.fields["tokenizer.chat_template"].contents()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    conversations = [
        [{"role": "user", "content": "Where is the mug?"}],
        [{"role": "system", "content": "You are a household robot."},
         {"role": "user", "content": "Put the apple in the fridge."}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
         {"role": "user", "content": "Open the door.\nThen close it."}],
        [{"role": "system", "content": ""}, {"role": "user", "content": ""}],
        [{"role": "user", "content": "\u4f60\u597d \U0001F916"},
         {"role": "system", "content": "Late system note."},
         {"role": "assistant", "content": "ok"}],
        [{"role": "assistant", "content": "I start."}],
    ]
    qwen_extra = [
        [{"role": "user", "content": "What is on the table?"},
         {"role": "tool", "content": "{\"objects\": [\"mug\"]}"},
         {"role": "tool", "content": "second"},
         {"role": "assistant", "content": "A mug."}],
    ]
    chats = {}
    for name, template, convs in [("qwen2.5", qwen_template, conversations + qwen_extra),
                                  ("smollm2", smol_template, conversations)]:
        compiled = env.from_string(template)
        rows = []
        for msgs in convs:
            for gen in (False, True):
                rendered = compiled.render(messages=msgs, add_generation_prompt=gen, tools=None)
                row = {"messages": msgs, "add_generation_prompt": gen, "rendered": rendered}
                if name == "qwen2.5":
                    row["ids"] = tok.encode(rendered, add_special_tokens=False).ids
                rows.append(row)
        chats[name] = rows
    with open(os.path.join(args.out, "chat_templates.json"), "w", encoding="utf-8") as f:
        json.dump({"jinja": {"qwen2.5": qwen_template, "smollm2": smol_template},
                   "renderings": chats}, f, ensure_ascii=False, indent=1)
    print(f"wrote {len(encoded)} encodings, {len(split_inputs)} x {len(splitters)} splits, "
          f"{sum(len(r) for r in chats.values())} chat renderings to {args.out}")


if __name__ == "__main__":
    main()
