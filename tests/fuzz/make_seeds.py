#!/usr/bin/env python3
"""Writes the small seed files of the fuzz targets, derived from the real model files.

    tests/fuzz/make_seeds.py [--models DIR] [--out tests/fuzz/corpus]

Every seed stays small (the real files are tens of MB): tokenizer vocabularies are cut to their
first few hundred entries, tensors shrunk to a block or two, and data sections dropped or zeroed.
The snapshot and KV region seeds come from keep_fuzz_seeds (make_seeds.cpp) instead.
"""
import argparse
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# ---- GGUF ------------------------------------------------------------------------------------
# Scalar value types: struct format by GGUF type id (8 string, 9 array are handled apart).
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# ggml types the SmolLM2 Q4_1 file uses: (block elements, block bytes).
GGML_BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 14: (256, 210)}


class Reader:
    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt):
        v = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return v[0]

    def string(self):
        n = self.take("Q")
        s = self.data[self.pos:self.pos + n]
        self.pos += n
        return s

    def value(self, t):
        if t == 8:
            return self.string()
        if t == 9:
            et, n = self.take("I"), self.take("Q")
            return (et, [self.value(et) for _ in range(n)])
        return self.take(SCALAR[t])


def w_string(s):
    return struct.pack("<Q", len(s)) + s


def w_value(t, v):
    if t == 8:
        return w_string(v)
    if t == 9:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(w_value(et, x) for x in items)
    return struct.pack("<" + SCALAR[t], v)


def read_gguf_head(path):
    """Metadata and tensor infos of a GGUF file (reads only the head)."""
    with open(path, "rb") as f:
        data = f.read(8 << 20)  # SmolLM2's metadata (vocabulary included) is about 2 MB
    r = Reader(data)
    assert r.take("I") == 0x46554747
    version, n_tensors, n_kv = r.take("I"), r.take("Q"), r.take("Q")
    kv = []
    for _ in range(n_kv):
        key, t = r.string(), r.take("I")
        kv.append((key, t, r.value(t)))
    tensors = []
    for _ in range(n_tensors):
        name, nd = r.string(), r.take("I")
        ne = [r.take("Q") for _ in range(nd)]
        tensors.append((name, ne, r.take("I"), r.take("Q")))
    return version, kv, tensors


def trim_vocab(kv, keep):
    """Keeps the first `keep` tokens and the merges among them."""
    out = []
    tokens = None
    for key, t, v in kv:
        if key in (b"tokenizer.ggml.tokens", b"tokenizer.ggml.token_type", b"tokenizer.ggml.scores"):
            v = (v[0], v[1][:keep])
            if key == b"tokenizer.ggml.tokens":
                tokens = set(v[1])
        out.append([key, t, v])
    for item in out:
        if item[0].endswith(b".vocab_size"):
            item[2] = keep
        if item[0] == b"tokenizer.ggml.merges":
            merges = []
            for m in item[2][1]:
                a, _, b = m.partition(b" ")
                if a in tokens and b in tokens and a + b in tokens:
                    merges.append(m)
            item[2] = (item[2][0], merges)
    return [tuple(i) for i in out]


def write_gguf(path, version, kv, tensors, with_data, vocab=0):
    """tensors: (name, ne, type, offset); offsets are recomputed when with_data, and the token
    embedding keeps `vocab` rows (the loader checks them against the vocabulary)."""
    align = 32
    head = struct.pack("<IIQQ", 0x46554747, version, len(tensors), len(kv))
    head += b"".join(w_string(k) + struct.pack("<I", t) + w_value(t, v) for k, t, v in kv)
    data = b""
    infos = b""
    for i, (name, ne, ty, off) in enumerate(tensors):
        if with_data:
            elems, nbytes = GGML_BLOCK[ty]
            ne = [elems] + [1] * (len(ne) - 1)  # one block (one row) keeps name, type and rank
            if name == b"token_embd.weight":
                ne[1] = vocab
                nbytes *= vocab
            off = len(data)
            # Deterministic, finite content; fp16 scales of the quantised blocks stay small.
            data += bytes((i * 7 + j * 13) % 61 for j in range(nbytes))
            data += b"\0" * (-len(data) % align)
        infos += w_string(name) + struct.pack("<I", len(ne))
        infos += b"".join(struct.pack("<Q", d) for d in ne) + struct.pack("<IQ", ty, off)
    out = head + infos
    if with_data:
        out += b"\0" * (-len(out) % align) + data
    with open(path, "wb") as f:
        f.write(out)
    print(f"{path}: {len(out)} bytes")


# ---- safetensors -----------------------------------------------------------------------------
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1}


def read_safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), f.read(1 << 16)


def write_safetensors(path, header, data):
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    out = struct.pack("<Q", len(h)) + h + data
    with open(path, "wb") as f:
        f.write(out)
    print(f"{path}: {len(out)} bytes")


def shrink_safetensors(header, data_prefix):
    """Same names and dtypes, every dimension cut to 2 at most, offsets recomputed."""
    out, data = {}, b""
    for name, e in header.items():
        if name == "__metadata__":
            out[name] = e
            continue
        shape = [min(d, 2) for d in e["shape"]]
        n = DTYPE_BYTES[e["dtype"]]
        for d in shape:
            n *= d
        begin = e["data_offsets"][0]
        chunk = data_prefix[begin:begin + n] if begin + n <= len(data_prefix) else b"\0" * n
        out[name] = {"dtype": e["dtype"], "shape": shape,
                     "data_offsets": [len(data), len(data) + n]}
        data += chunk
    return out, data


# ---- tokenizer.json --------------------------------------------------------------------------
def trim_bpe_tokenizer(j, keep):
    """First `keep` vocabulary ids, the merges among them, added tokens renumbered after them."""
    vocab = {t: i for t, i in j["model"]["vocab"].items() if i < keep}
    merges = []
    for m in j["model"]["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    j["model"]["vocab"], j["model"]["merges"] = vocab, merges
    for k, a in enumerate(j.get("added_tokens", [])):
        a["id"] = keep + k
    return j


def trim_wordpiece_tokenizer(j, keep):
    j["model"]["vocab"] = {t: i for t, i in j["model"]["vocab"].items() if i < keep}
    return j


def write_json(path, j):
    text = json.dumps(j, ensure_ascii=False, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(text)
    print(f"{path}: {len(text)} bytes")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=os.path.join(REPO, "models"))
    ap.add_argument("--out", default=os.path.join(HERE, "corpus"))
    args = ap.parse_args()
    m, out = args.models, args.out

    def target(name):
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        return d

    # GGUF: SmolLM2's real metadata with the vocabulary cut to 400 tokens; once with every tensor
    # info and no data (parsing stops at the data section), once with every tensor shrunk to one
    # block of its real type, which parses, loads a config and a tokenizer and dequantises.
    d = target("fuzz_gguf_reader")
    version, kv, tensors = read_gguf_head(os.path.join(m, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    kv = trim_vocab(kv, 400)
    write_gguf(os.path.join(d, "smollm2-head-no-data.gguf"), version, kv, tensors, False)
    write_gguf(os.path.join(d, "smollm2-one-block-tensors.gguf"), version, kv, tensors, True, 400)

    # safetensors: MiniLM's real header with the data cut off, and the same tensors shrunk to at
    # most 2 per dimension with their first real bytes; the tiny-qwen2 fixture shrunk likewise.
    d = target("fuzz_safetensors_reader")
    header, prefix = read_safetensors_header(os.path.join(m, "all-MiniLM-L6-v2/model.safetensors"))
    write_safetensors(os.path.join(d, "minilm-header-no-data.safetensors"), header, b"")
    write_safetensors(os.path.join(d, "minilm-shrunk.safetensors"),
                      *shrink_safetensors(header, prefix))
    header, prefix = read_safetensors_header(
        os.path.join(REPO, "tests/fixtures/engine/tiny-qwen2/model.safetensors"))
    header["__metadata__"] = {"format": "pt"}
    write_safetensors(os.path.join(d, "tiny-qwen2-shrunk.safetensors"),
                      *shrink_safetensors(header, prefix))

    # config.json: the real files as they are, plus SmolLM2's (from its GGUF metadata, as HF
    # publishes it) with a llama3 rope_scaling added to reach that branch.
    d = target("fuzz_model_config")
    for src, name in [("all-MiniLM-L6-v2/config.json", "minilm-config.json")]:
        with open(os.path.join(m, src), "rb") as f:
            write_bytes = f.read()
        with open(os.path.join(d, name), "wb") as f:
            f.write(write_bytes)
    with open(os.path.join(REPO, "tests/fixtures/engine/tiny-qwen2/config.json"), "rb") as f:
        text = f.read()
    with open(os.path.join(d, "tiny-qwen2-config.json"), "wb") as f:
        f.write(text)
    write_json(os.path.join(d, "smollm2-llama3-rope-config.json"), {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": [2, 0], "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})

    # tokenizer.json: Qwen2.5's cut to 400 ids (added tokens renumbered after them), MiniLM's
    # WordPiece one cut to 1000 ids (its specials are below that), the tiny-qwen2 fixture as is.
    d = target("fuzz_tokenizer_json")
    with open(os.path.join(m, "qwen2.5-tokenizer/tokenizer.json"), encoding="utf-8") as f:
        write_json(os.path.join(d, "qwen2.5-trimmed.json"), trim_bpe_tokenizer(json.load(f), 400))
    with open(os.path.join(m, "all-MiniLM-L6-v2/tokenizer.json"), encoding="utf-8") as f:
        write_json(os.path.join(d, "minilm-trimmed.json"),
                   trim_wordpiece_tokenizer(json.load(f), 1000))
    with open(os.path.join(REPO, "tests/fixtures/engine/tiny-qwen2/tokenizer.json"), "rb") as f:
        text = f.read()
    with open(os.path.join(d, "tiny-qwen2.json"), "wb") as f:
        f.write(text)


if __name__ == "__main__":
    main()
