#!/usr/bin/env python3
"""Writes the LLM engine's committed test fixtures under tests/fixtures/engine/.

Sections (each a subcommand; no argument runs all that the environment supports):
  tiny-qwen2   a random-weight Qwen2 HF directory (config.json with q/k/v bias, bf16
               model.safetensors, a 512-token tokenizer.json cut from the Qwen2.5 tokenizer and
               tokenizer_config.json with a ChatML template): tests/fixtures/engine/tiny-qwen2/
  gguf-ref     what HF transformers loads from models/SmolLM2-135M-Instruct.Q4_1.gguf: config,
               checksums and slices of named tensors, tokenizer ids:
               tests/fixtures/engine/smollm2_gguf_reference.json
Needs: torch, transformers, safetensors, gguf (pip install torch transformers gguf), and the
models of deploy/fetch-models.sh. Deterministic (fixed seeds).

The reference logits and greedy continuations (for tiny-qwen2 and SmolLM2) are written by
scripts/make_engine_reference.py, which reads the directory this script writes.
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "engine")
TINY_DIR = os.path.join(FIX, "tiny-qwen2")
QWEN_TOKENIZER = os.path.join(ROOT, "models", "qwen2.5-tokenizer", "tokenizer.json")
SMOL_GGUF_DIR = os.path.join(ROOT, "models")
SMOL_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_VOCAB = 512
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ---------------------------------------------------------------------------------------------
# tiny-qwen2 (owner: model loading)
# ---------------------------------------------------------------------------------------------
def tiny_tokenizer_json():
    """The Qwen2.5 tokenizer cut to TINY_VOCAB ids: the first TINY_VOCAB-3 vocabulary entries
    (256 byte tokens, then the earliest merges), the merges among them, and <|endoftext|>,
    <|im_start|>, <|im_end|> renumbered to the last three ids."""
    with open(QWEN_TOKENIZER, encoding="utf-8") as f:
        t = json.load(f)
    n_plain = TINY_VOCAB - 3
    vocab = {tok: i for tok, i in t["model"]["vocab"].items() if i < n_plain}
    merges = []
    for m in t["model"]["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and (a + b) in vocab:
            merges.append(f"{a} {b}")
    t["model"]["vocab"] = vocab
    t["model"]["merges"] = merges
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = {a["content"]: a for a in t["added_tokens"]}
    t["added_tokens"] = []
    for k, content in enumerate(specials):
        a = dict(added[content])
        a["id"] = n_plain + k
        t["added_tokens"].append(a)
    return t


def make_tiny_qwen2():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1234)
    cfg = Qwen2Config(
        vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        initializer_range=0.08, bos_token_id=TINY_VOCAB - 3, eos_token_id=TINY_VOCAB - 1,
        use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg).eval()
    # HF initialises biases to 0 and norms to 1; make them random so those paths are exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    os.makedirs(TINY_DIR, exist_ok=True)
    model.save_pretrained(TINY_DIR, safe_serialization=True)
    for extra in ("generation_config.json",):
        p = os.path.join(TINY_DIR, extra)
        if os.path.exists(p):
            os.remove(p)
    with open(os.path.join(TINY_DIR, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tiny_tokenizer_json(), f, ensure_ascii=False, separators=(",", ":"))
    with open(os.path.join(TINY_DIR, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>",
                   "bos_token": None, "model_max_length": 256}, f, indent=1)
    # Self-check: HF can read the tokenizer back and the ids stay below the vocabulary.
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(TINY_DIR, "tokenizer.json"))
    ids = tok.encode("<|im_start|>user\nHello there<|im_end|>").ids
    assert max(ids) < TINY_VOCAB, ids
    for n in os.listdir(TINY_DIR):
        os.chmod(os.path.join(TINY_DIR, n), 0o644)
    size = sum(os.path.getsize(os.path.join(TINY_DIR, n)) for n in os.listdir(TINY_DIR))
    print(f"wrote {TINY_DIR} ({size} bytes); sample ids {ids}")


# ---------------------------------------------------------------------------------------------
# gguf-ref (owner: model loading)
# ---------------------------------------------------------------------------------------------
# HF name -> (the slices we record: rows to copy the first 8 columns of)
GGUF_REF_TENSORS = {
    "model.embed_tokens.weight": [0, 1, 49151],
    "model.layers.0.self_attn.q_proj.weight": [0, 1, 31, 32, 33, 575],
    "model.layers.0.self_attn.k_proj.weight": [0, 1, 32, 64, 191],
    "model.layers.0.self_attn.v_proj.weight": [0, 191],
    "model.layers.0.self_attn.o_proj.weight": [0, 575],
    "model.layers.0.mlp.gate_proj.weight": [0, 1535],
    "model.layers.0.mlp.up_proj.weight": [7],
    "model.layers.0.mlp.down_proj.weight": [0, 575],
    "model.layers.0.input_layernorm.weight": [],
    "model.layers.0.post_attention_layernorm.weight": [],
    "model.layers.29.self_attn.q_proj.weight": [5, 40],
    "model.layers.29.self_attn.k_proj.weight": [3, 100],
    "model.norm.weight": [],
}
TOKENIZER_STRINGS = [
    "Hello world",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Pick up the apple and put it in the fridge.",
    "  spaces\tand\nnewlines 12345",
    "naïve café — ünïcödé",
]


def checksums(x):
    import torch
    x = x.detach().to(torch.float64).reshape(-1)
    idx = torch.arange(x.numel(), dtype=torch.float64)
    w = (idx % 97.0) + 1.0
    return {"sum": float(x.sum()), "abs_sum": float(x.abs().sum()),
            "weighted_sum": float((x * w).sum())}


def make_gguf_reference():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(SMOL_GGUF_DIR, gguf_file=SMOL_GGUF_NAME,
                                                 torch_dtype=torch.float32)
    sd = model.state_dict()
    c = model.config
    out = {
        "source": f"transformers {__import__('transformers').__version__} from_pretrained("
                  f"gguf_file={SMOL_GGUF_NAME}), torch float32",
        "config": {
            "architecture": c.architectures[0] if c.architectures else c.model_type,
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"],
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": bool(c.tie_word_embeddings),
            "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
        },
        "tensors": {},
    }
    for name, rows in GGUF_REF_TENSORS.items():
        t = sd[name]
        entry = {"shape": list(t.shape), **checksums(t)}
        if t.dim() == 1:
            entry["slices"] = {"0": [float(v) for v in t[:8]]}
        else:
            entry["slices"] = {str(r): [float(v) for v in t[r, :8]] for r in rows}
        out["tensors"][name] = entry
    tok = AutoTokenizer.from_pretrained(SMOL_GGUF_DIR, gguf_file=SMOL_GGUF_NAME)
    out["tokenizer"] = [{"text": s, "ids": tok.encode(s, add_special_tokens=False)}
                        for s in TOKENIZER_STRINGS]
    path = os.path.join(FIX, "smollm2_gguf_reference.json")
    os.makedirs(FIX, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sections", nargs="*", default=["tiny-qwen2", "gguf-ref"])
    args = ap.parse_args()
    for s in args.sections:
        if s == "tiny-qwen2":
            make_tiny_qwen2()
        elif s == "gguf-ref":
            make_gguf_reference()
        else:
            sys.exit(f"unknown section {s}")


if __name__ == "__main__":
    main()
