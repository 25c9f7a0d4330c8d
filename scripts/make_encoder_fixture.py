#!/usr/bin/env python3
"""Writes tests/fixtures/encoder/minilm_reference.json: the reference the C++ encoder is tested on.

For each sentence it stores the WordPiece ids of the Hugging Face tokenizer exactly as
sentence-transformers feeds them to the model (truncated to max_seq_length, [CLS] ... [SEP]) and
the sentence-transformers embedding (mean pooling + L2 normalisation), computed by the real
library on the CPU in fp32.

Usage (needs torch + sentence-transformers; see deploy/install-deps.sh):
    HF_HUB_OFFLINE=1 python3 scripts/make_encoder_fixture.py \
        [--model models/all-MiniLM-L6-v2] [--out tests/fixtures/encoder/minilm_reference.json]

The empty string is included on purpose: sentence-transformers encodes it as [CLS] [SEP] and
returns a normal unit vector; the C++ encoder does the same (the store decides whether empty
memories are allowed).
"""
import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCES = [
    # household robot memory: object states
    "The apple is in the fridge.",
    "The mug on the kitchen counter is dirty.",
    "The living room lights are switched off.",
    "Bedroom window: OPEN; curtains: closed.",
    "The dishwasher finished its cycle at 14:35 and the plates are clean.",
    "Knife #3 is in drawer 2 (top-left), next to the forks.",
    # task records
    "Task 17 done: put the washed tomato on the dining table.",
    "Failed to pick up the glass: gripper slipped twice, retried at step 42.",
    "User asked me to water the plants every Monday & Thursday.",
    "I heated the coffee in the microwave for 90 seconds, then served it.",
    # example plans
    "Plan: 1) walk to kitchen 2) open fridge 3) grab milk 4) close fridge 5) pour milk into cup",
    "To make toast: find bread, put bread in toaster, switch on toaster, wait, take out toast.",
    "pick_up(sponge) -> go_to(sink) -> scrub(pan) -> rinse(pan) -> place(pan, drying_rack)",
    # edge cases
    "",
    "   ",
    "Crème brûlée for café guests; jalapeño sauce in the pantry. Ñandú, Übermaß, naïve façade.",
    "İstanbul ΟΔΥΣΣΕΥΣ Ελληνικά Straße",
    "冰箱里有三个苹果和一瓶牛奶。",
    "テーブルの上にコップがあります。 냉장고에 우유가 있어요.",
    "The cat 🐱 knocked the vase 🏺 off the shelf!!! 😱👍",
    "Price: $12.50 (-15%) => 10.63 USD; temp=21.5°C; 3/4 cup; 1,000,000 grains; v2.0.1",
    "What?! No... wait -- \"really\"? [yes] {no} <maybe> a|b ~c ^d `e` @home",
    "hello [SEP] world [MASK] and [CLS]",
    "Tabs\tand\nnewlines\r\nand\u00a0non-breaking\u2003spaces\u200bzero-width\u00adsoft-hyphen",
    "supercalifragilisticexpialidociousantidisestablishmentarianismfloccinaucinihilipilificationpneumonoultramicroscopicsilicovolcanoconiosis is long",
    "unbelievably unaffordable microwaveable dishwashers were overcooked",
    "ROBOT-7 LOGGED: MOVED CHAIR FROM ROOM_12 TO ROOM_3 AT 2024-05-17T08:30:00Z",
    # long text: well over 256 tokens, so truncation is exercised
    " ".join(
        f"Step {i}: the robot moved the {obj} from the {src} to the {dst} and checked that it was stable."
        for i, (obj, src, dst) in enumerate(
            [("red cup", "sink", "shelf"), ("blue plate", "table", "cupboard"),
             ("book", "sofa", "bookcase"), ("towel", "floor", "hamper"),
             ("remote control", "armchair", "coffee table"), ("keys", "door", "bowl"),
             ("laptop", "desk", "charging station"), ("pillow", "bed", "closet"),
             ("shoes", "hallway", "rack"), ("bottle", "counter", "recycling bin"),
             ("pan", "stove", "sink"), ("spoon", "drawer", "table"),
             ("lamp", "corner", "nightstand"), ("plant", "window", "balcony"),
             ("basket", "garage", "laundry room")] * 2)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/all-MiniLM-L6-v2")
    ap.add_argument("--out", default="tests/fixtures/encoder/minilm_reference.json")
    args = ap.parse_args()

    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    model = SentenceTransformer(args.model, device="cpu")
    model.eval()
    max_len = model.max_seq_length

    items = []
    with torch.no_grad():
        for s in SENTENCES:
            # Exactly what SentenceTransformer.encode feeds the transformer for this sentence.
            prep = getattr(model, "preprocess", None) or model.tokenize  # tokenize() before v6
            features = prep([s])
            ids = features["input_ids"][0].tolist()
            emb = model.encode([s], batch_size=1, convert_to_numpy=True,
                               normalize_embeddings=False)[0]
            items.append({
                "text": s,
                "ids": ids,
                "embedding": [float(f"{x:.6g}") for x in emb.tolist()],
            })

    fixture = {
        "model": os.path.basename(os.path.normpath(args.model)),
        "generator": "scripts/make_encoder_fixture.py",
        "sentence_transformers_version": sentence_transformers.__version__,
        "torch_version": torch.__version__,
        "max_seq_length": max_len,
        "dim": len(items[0]["embedding"]),
        "sentences": items,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=None, separators=(",", ":"))
        f.write("\n")
    longest = max(len(it["ids"]) for it in items)
    print(f"wrote {args.out}: {len(items)} sentences, dim {fixture['dim']}, longest {longest} ids")


if __name__ == "__main__":
    main()
