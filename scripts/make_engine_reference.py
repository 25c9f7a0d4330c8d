#!/usr/bin/env python3
"""Reference outputs of HF transformers (fp32, CPU) for the C++ engine's accuracy test.

For each model: >= 10 chat-templated household-planning prompts, tokenized here (the token ids are
stored, so the C++ test needs no tokenizer), and for each prompt:
  - the next-token logits after the prompt: top-50 (ids, fp32 values), the full-vector sum and sum
    of squares (float64), and the full vector as float16 in a side file <name>_logits.f16
    (prompts x vocab, little-endian), small enough to commit;
  - the greedy 32-token continuation (argmax each step, EOS not special) and, per step, the margin
    between the best and second-best logit (a near-tie may legitimately flip between fp32
    implementations; the test reports it instead of failing on it).
Models: SmolLM2-135M-Instruct from models/SmolLM2-135M-Instruct.Q4_1.gguf (HF dequantizes Q4_1 to
fp32 exactly as our GGUF loader does) and the random tiny Qwen2 of tests/fixtures/engine/tiny-qwen2.

Writes tests/fixtures/engine/{smollm2,tiny_qwen2}_reference.json and *_logits.f16.
Needs torch, transformers, gguf. Usage: python3 scripts/make_engine_reference.py [--only smollm2]
"""
import argparse
import json
import os

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "engine")
GGUF_DIR = os.path.join(ROOT, "models")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_DIR = os.path.join(FIX, "tiny-qwen2")
STEPS = 32
TOPK = 50

SYSTEM = "You are a household robot's planner. Answer with a short numbered plan."
PROMPTS = [
    "The red cup is on the kitchen counter. Put the red cup in the sink.",
    "Task: make coffee. The mug is in cabinet 2, the coffee machine is on the counter.",
    "The apple is in the fridge. Slice the apple and put the slices on a plate.",
    "Clean the dining table: the sponge is next to the sink, the table has two dirty plates.",
    "Turn off the lamp in the bedroom and close the curtains.",
    "The laptop is on the sofa. Move it to the desk and plug it in.",
    "Water the plants in the living room. The watering can is in the hallway closet.",
    "Put the milk bottle back in the fridge and throw the empty box in the recycling bin.",
    "Find the remote control. Last seen: under a pillow on the sofa, or on the TV stand.",
    "Prepare the table for dinner for two people: plates, forks, knives, and glasses.",
    "Wash the knife, dry it with the towel, and put it in drawer 2.",
    "Take the book from the bedroom shelf to the reading chair and turn on the reading lamp.",
]


def chat_ids(tok, text):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


@torch.no_grad()
def reference(model, prompts_ids):
    out = []
    logits_f16 = []
    for ids in prompts_ids:
        x = torch.tensor([ids])
        res = model(input_ids=x, use_cache=True)
        logits = res.logits[0, -1].float()
        past = res.past_key_values
        vals, idx = torch.topk(logits, TOPK)
        lg64 = logits.double()
        entry = {
            "ids": ids,
            "top_ids": [int(i) for i in idx],
            "top_logits": [float(v) for v in vals],
            "logits_sum": float(lg64.sum()),
            "logits_sum_sq": float((lg64 * lg64).sum()),
        }
        logits_f16.append(logits.numpy().astype("<f2"))
        greedy, margins = [], []
        cur = logits
        for _ in range(STEPS):
            top2 = torch.topk(cur, 2).values
            margins.append(float(top2[0] - top2[1]))
            nxt = int(torch.argmax(cur))
            greedy.append(nxt)
            res = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            cur = res.logits[0, -1].float()
        entry["greedy"] = greedy
        entry["greedy_margins"] = margins
        out.append(entry)
    return out, np.stack(logits_f16)


def write(name, source, model, prompts, entries, logits_f16):
    cfg = model.config
    doc = {
        "generator": "scripts/make_engine_reference.py",
        "source": source,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "vocab_size": int(logits_f16.shape[1]),
        "num_layers": int(cfg.num_hidden_layers),
        "steps": STEPS,
        "logits_file": f"{name}_logits.f16",
        "prompts": [dict(text=t, **e) for t, e in zip(prompts, entries)],
    }
    with open(os.path.join(FIX, f"{name}_reference.json"), "w") as f:
        json.dump(doc, f, indent=1)
    logits_f16.tofile(os.path.join(FIX, f"{name}_logits.f16"))
    print(f"wrote {name}: {len(entries)} prompts, vocab {logits_f16.shape[1]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["smollm2", "tiny_qwen2"])
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    os.makedirs(FIX, exist_ok=True)
    if args.only in (None, "smollm2"):
        tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
        model = AutoModelForCausalLM.from_pretrained(
            GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        ids = [chat_ids(tok, p) for p in PROMPTS]
        entries, lg = reference(model, ids)
        write("smollm2", f"models/{GGUF_NAME}", model, PROMPTS, entries, lg)
    if args.only in (None, "tiny_qwen2"):
        tok = AutoTokenizer.from_pretrained(TINY_DIR)
        model = AutoModelForCausalLM.from_pretrained(
            TINY_DIR, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        ids = [chat_ids(tok, p) for p in PROMPTS]
        entries, lg = reference(model, ids)
        write("tiny_qwen2", "tests/fixtures/engine/tiny-qwen2", model, PROMPTS, entries, lg)


if __name__ == "__main__":
    main()
