#!/usr/bin/env python3
"""The HF transformers baseline of bench_prefill: the same model shape with random bf16 weights on
the same GPU, attention through PyTorch SDPA, timed the same way.

  python3 benchmarks/prefill/hf_prefill.py --shape qwen2.5-7b --tokens 1024,2048,4096 \
      [--reps 10] [--warmup 3] [--decode 64] [--decode-context 1024] [--json out.jsonl] [--gap-ms G]
  python3 benchmarks/prefill/hf_prefill.py --check-shapes

The shapes come from benchmarks/model_shapes.json, as bench_prefill's do.

TTFT: wall time of model(input_ids, use_cache=True, logits_to_keep=1) -- what generate() runs for
the prompt -- plus the logits copy to the host (torch.cuda.synchronize() via .cpu()); median of
--reps after --warmup; --gap-ms G leaves the GPU idle for G ms before each run (as bench_prefill).
Decode: a plain greedy loop over the model with its DynamicCache (no
generate() overhead), per token, after a --decode-context prompt.
"""
import argparse
import json
import pathlib
import statistics
import sys
import time

# The shapes bench_prefill times too: each model's config.json from the Hugging Face hub.
SHAPES = json.loads((pathlib.Path(__file__).resolve().parent.parent / "model_shapes.json")
                    .read_text())
QWEN2_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_theta",
              "max_position_embeddings", "tie_word_embeddings")


def qwen2_shapes():
    return sorted(n for n, s in SHAPES.items() if s.get("architectures") == ["Qwen2ForCausalLM"])


def qwen2_kwargs(shape):
    """Qwen2Config's arguments for `shape` (KeyError names a missing field)."""
    return {k: SHAPES[shape][k] for k in QWEN2_KEYS}


def build(shape):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(use_sliding_window=False, **qwen2_kwargs(shape))
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


def check_shapes():
    """--check-shapes: every Qwen2 shape of model_shapes.json gives Qwen2Config a full set of
    arguments (needs neither torch nor a GPU; a CI test)."""
    shapes = qwen2_shapes()
    if not shapes:
        sys.exit("hf_prefill: no Qwen2ForCausalLM shape in model_shapes.json")
    for name in shapes:
        try:
            kw = qwen2_kwargs(name)
        except KeyError as e:
            sys.exit(f"hf_prefill: shape {name} lacks {e}")
        if kw["hidden_size"] % kw["num_attention_heads"] != 0:
            sys.exit(f"hf_prefill: shape {name}: hidden_size not a multiple of the heads")
        print(f"{name}: {json.dumps(kw)}")


class GpuEnergy:
    """The GPU's energy counter (NVML's total energy since the driver loaded, mJ) through the
    driver's libnvidia-ml, as bench_prefill reads it; millijoules() is None where it cannot."""

    def __init__(self, torch):
        import ctypes
        self.read = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            bus = torch.cuda.get_device_properties(torch.cuda.current_device())
            bus_id = f"{bus.pci_domain_id:08x}:{bus.pci_bus_id:02x}:{bus.pci_device_id:02x}.0"
            dev = ctypes.c_void_p()
            if lib.nvmlInit_v2() != 0 or lib.nvmlDeviceGetHandleByPciBusId_v2(
                    bus_id.encode(), ctypes.byref(dev)) != 0:
                return
            mj = ctypes.c_ulonglong()

            def read():
                ok = lib.nvmlDeviceGetTotalEnergyConsumption(dev, ctypes.byref(mj)) == 0
                return float(mj.value) if ok else None
            self.read = read
        except (OSError, AttributeError):
            self.read = None

    def millijoules(self):
        return self.read() if self.read else None


def main():
    if "--check-shapes" in sys.argv[1:]:
        check_shapes()
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-7b", choices=qwen2_shapes())
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--decode-context", type=int, default=1024)
    ap.add_argument("--json")
    ap.add_argument("--gap-ms", type=int, default=0)
    a = ap.parse_args()
    lens = [int(x) for x in a.tokens.split(",")]
    # The results file first: a path that cannot be written fails in one line, before minutes of
    # model building (and before torch, so that this check runs where torch is not installed).
    try:
        out = open(a.json, "a") if a.json else None
    except OSError as e:
        sys.exit(f"hf_prefill: cannot open --json {a.json}: {e.strerror}")
    import torch
    import transformers
    t0 = time.perf_counter()
    model, cfg = build(a.shape)
    print(f"# {a.shape} | HF transformers {transformers.__version__} sdpa bf16, torch "
          f"{torch.__version__}, {torch.cuda.get_device_name()} | built in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, max(lens + [a.decode_context])), generator=g).cuda()
    print(f"{'shape':14s} {'tokens':>7s} {'ttft_ms':>10s} {'min_ms':>10s} {'tok/s':>10s} "
          f"{'TFLOP/s':>9s}")
    energy = GpuEnergy(torch)
    with torch.inference_mode():
        for n in lens:
            x = ids[:, :n]
            ms = []
            mj0 = None
            for r in range(a.warmup + a.reps):
                torch.cuda.synchronize()
                if r == a.warmup:
                    mj0 = energy.millijoules()
                if a.gap_ms > 0:
                    time.sleep(a.gap_ms / 1000.0)
                t = time.perf_counter()
                o = model(x, use_cache=True, logits_to_keep=1)
                o.logits.float().cpu()
                ms_r = (time.perf_counter() - t) * 1e3
                del o
                if r >= a.warmup:
                    ms.append(ms_r)
            torch.cuda.synchronize()
            mj1 = energy.millijoules()
            med = statistics.median(ms)
            tf = flops(cfg, n) / (med * 1e-3) / 1e12
            print(f"{a.shape:14s} {n:7d} {med:10.2f} {min(ms):10.2f} {n / (med * 1e-3):10.0f} "
                  f"{tf:9.1f}", flush=True)
            rec = dict(engine="hf", shape=a.shape, tokens=n, ttft_ms=med, min_ms=min(ms), tflops=tf)
            if a.gap_ms == 0 and mj0 is not None and mj1 is not None and mj1 >= mj0:
                j = (mj1 - mj0) / 1000.0 / a.reps  # back to back: the energy of a prefill
                rec["joules"] = j
                print(f"{a.shape:14s} {n:7d} energy {j:.2f} J a prefill back to back (NVML), "
                      f"{j / (med * 1e-3):.0f} W", flush=True)
            if out:
                out.write(json.dumps(rec) + "\n")
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
