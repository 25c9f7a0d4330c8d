#!/usr/bin/env python3
"""The HF transformers baseline of bench_prefill: the same model shape with random bf16 weights on
the same GPU, attention through PyTorch SDPA, timed the same way.

  python3 benchmarks/prefill/hf_prefill.py --shape qwen2.5-7b --tokens 1024,2048,4096 \
      [--reps 10] [--warmup 3] [--decode 64] [--decode-context 1024] [--json out.jsonl] [--gap-ms G]

TTFT: wall time of model(input_ids, use_cache=True, logits_to_keep=1) -- what generate() runs for
the prompt -- plus the logits copy to the host (torch.cuda.synchronize() via .cpu()); median of
--reps after --warmup; --gap-ms G leaves the GPU idle for G ms before each run (as bench_prefill).
Decode: a plain greedy loop over the model with its DynamicCache (no
generate() overhead), per token, after a --decode-context prompt.
"""
import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

SHAPES = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                         tie_word_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944),
    "qwen2.5-14b": dict(vocab_size=152064, hidden_size=5120, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, intermediate_size=13824,
                        rms_norm_eps=1e-5),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, intermediate_size=27648,
                        rms_norm_eps=1e-5),
}


def build(shape):
    kw = dict(SHAPES[shape])
    kw.setdefault("rms_norm_eps", 1e-6)
    cfg = Qwen2Config(rope_theta=1000000.0, max_position_embeddings=32768, use_sliding_window=False,
                      **kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = Qwen2ForCausalLM._from_config(cfg, dtype=torch.bfloat16,
                                                  attn_implementation="sdpa")
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = Qwen2ForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16,
                                                  attn_implementation="sdpa")
    # Never time on zeros: HF zero-initialises biases; give every parameter random values.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.uniform_(-0.02, 0.02)
    model.eval()
    return model, cfg


def flops(cfg, n):
    C, L, I = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    hd = C // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    linear = 2.0 * n * L * (C * (q + 2 * kv) + q * C + 3.0 * C * I)
    attention = 4.0 * hd * cfg.num_attention_heads * L * (n * (n + 1) / 2)
    return linear + attention + 2.0 * C * cfg.vocab_size


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--json")
    ap.add_argument("--gap-ms", type=int, default=0)
    a = ap.parse_args()
    lens = [int(x) for x in a.tokens.split(",")]
    t0 = time.perf_counter()
    model, cfg = build(a.shape)
    print(f"# {a.shape} | HF transformers {transformers.__version__} sdpa bf16, torch "
          f"{torch.__version__}, {torch.cuda.get_device_name()} | built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, max(lens + [a.decode_context])), generator=g).cuda()
    out = open(a.json, "a") if a.json else None
    print(f"{'shape':14s} {'tokens':>7s} {'ttft_ms':>10s} {'min_ms':>10s} {'tok/s':>10s} "
          f"{'TFLOP/s':>9s}")
    with torch.inference_mode():
        for n in lens:
            x = ids[:, :n]
            ms = []
            for r in range(a.warmup + a.reps):
                torch.cuda.synchronize()
                if a.gap_ms > 0:
                    time.sleep(a.gap_ms / 1000.0)
                t = time.perf_counter()
                o = model(x, use_cache=True, logits_to_keep=1)
                o.logits.float().cpu()
                ms_r = (time.perf_counter() - t) * 1e3
                del o
                if r >= a.warmup:
                    ms.append(ms_r)
            med = statistics.median(ms)
            tf = flops(cfg, n) / (med * 1e-3) / 1e12
            print(f"{a.shape:14s} {n:7d} {med:10.2f} {min(ms):10.2f} {n / (med * 1e-3):10.0f} "
                  f"{tf:9.1f}", flush=True)
            if out:
                out.write(json.dumps(dict(engine="hf", shape=a.shape, tokens=n, ttft_ms=med,
                                          tflops=tf)) + "\n")
        if a.decode > 0:
            x = ids[:, :a.decode_context]
            per = []
            for r in range(3):
                o = model(x, use_cache=True, logits_to_keep=1)
                past = o.past_key_values
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(a.decode):
                    o = model(nxt, past_key_values=past, use_cache=True, logits_to_keep=1)
                    past = o.past_key_values
                    nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                    nxt.cpu()  # the token goes back to the host each step, as a server's would
                per.append((time.perf_counter() - t) * 1e3 / a.decode)
                del o, past
            pt = statistics.median(per)
            print(f"{a.shape:14s} decode after {a.decode_context} tokens: {pt:.3f} ms/token, "
                  f"{1000.0 / pt:.1f} tokens/s", flush=True)
            if out:
                out.write(json.dumps(dict(engine="hf", shape=a.shape,
                                          decode_context=a.decode_context,
                                          decode_ms_per_token=pt)) + "\n")
    if out:
        out.close()


if __name__ == "__main__":
    main()
